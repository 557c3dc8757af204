"""Which JAX platforms a process starts (sharding/platforms.py): a CPU engine on a machine
without accelerators never loads libtpu, and compiling for a TPU topology works while
another process holds libtpu's lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import pytest

from sharding.platforms import GOOGLE_PCI_VENDOR, accelerators_present, tpu_chips_present

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, **env) -> subprocess.Popen:
    """A Python process on this checkout with JAX's own platform choice (no JAX_PLATFORMS)."""
    # Nor libtpu's shared-load switch, which this process sets once it has compiled for a
    # TPU (sharding/planner.py): a child would inherit it.
    environ = {k: v for k, v in os.environ.items()
               if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_tpu_chips_are_read_off_the_pci_bus(tmp_path):
    def device(name: str, vendor: str, ident: str) -> None:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(ident + "\n")

    device("0000:00:04.0", "0x1af4", "0x1000")  # a virtio disk
    device("0000:00:05.0", GOOGLE_PCI_VENDOR, "0x0042")  # Google's gVNIC: not a TPU
    assert not tpu_chips_present(tmp_path)
    device("0000:00:06.0", GOOGLE_PCI_VENDOR, "0x0063")  # a TPU v5e chip
    assert tpu_chips_present(tmp_path)


LIBTPU_MAPPED = """
    import jax
    {before}
    jax.devices()
    print(jax.default_backend(), open("/proc/self/maps").read().count("libtpu"))
    """


@pytest.mark.skipif(accelerators_present(), reason="this machine has an accelerator")
def test_a_cpu_engine_never_loads_libtpu():
    """Without an accelerator the engine's start (Engine.from_config calls it) leaves the
    TPU plugin unloaded; JAX's own choice loads it (and takes its lock) when installed."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    ours = python(LIBTPU_MAPPED.format(before="from sharding.platforms import "
                                       "skip_absent_accelerators; skip_absent_accelerators()"))
    jax_own = python(LIBTPU_MAPPED.format(before=""))
    out, err = ours.communicate(timeout=300)
    assert ours.returncode == 0, err
    assert out.split() == ["cpu", "0"]
    out, err = jax_own.communicate(timeout=300)
    assert jax_own.returncode == 0, err
    platform, mapped = out.split()
    assert platform == "cpu" and int(mapped) > 0  # the case the switch is for


def test_compiling_for_a_tpu_while_another_process_holds_libtpu():
    """`jaxserve plan` and the TPU-compile tests beside a process that holds libtpu's lock
    (JAX's default start on a machine with libtpu): planner.tpu_devices takes libtpu's
    switch for a shared load, where a plain topology request fails."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    holder = python("""
        import time
        import jax
        jax.devices()
        print("holding", flush=True)
        time.sleep(600)
        """)
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        plain = python("""
            from jax.experimental import topologies
            topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
            """, JAX_PLATFORMS="cpu")
        plan = python("""
            from sharding.planner import tpu_devices
            print(len(tpu_devices("v5e:2x2")))
            """, JAX_PLATFORMS="cpu")
        _, err = plain.communicate(timeout=300)
        assert plain.returncode != 0 and "lockfile" in err  # the lock is held
        out, err = plan.communicate(timeout=300)
        assert plan.returncode == 0, err
        assert out.split()[-1] == "4"
    finally:
        holder.kill()
        holder.communicate()
