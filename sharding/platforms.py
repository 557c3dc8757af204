"""Which JAX platforms a process starts, and how one compiles for TPUs it does not have.

With libtpu installed (`jax[tpu]`, in the dev extras), JAX's default start-up on a machine
without TPU chips still loads the TPU plugin (~1.4 s), and the plugin holds the machine's
libtpu lock (/tmp/libtpu_lockfile) for the life of the process: another process that
needs libtpu (`jaxserve plan`, the TPU-compile tests) then fails with "Internal error
when accessing libtpu multi-process lockfile". An engine calls
`skip_absent_accelerators()` before JAX picks its platforms, so on a machine with no
accelerator at all it starts the CPU platform alone; compiling for a TPU topology
(`allow_shared_libtpu`) takes libtpu's own switch that leaves the lock alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax

GOOGLE_PCI_VENDOR = "0x1ae0"
# Google PCI devices that are not TPUs: the gVNIC network card and the NVMe controller.
# Any other Google device counts as a TPU chip (TPU generations keep adding ids).
GOOGLE_NON_TPU_DEVICES = frozenset({"0x0042", "0x001f"})
# Device files of GPUs: NVIDIA's (and NVIDIA under WSL2), AMD's compute driver.
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def tpu_chips_present(pci: Path = Path("/sys/bus/pci/devices")) -> bool:
    for device in pci.glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            ident = (device / "device").read_text().strip()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and ident not in GOOGLE_NON_TPU_DEVICES:
            return True
    return False


def accelerators_present() -> bool:
    """Whether this machine may have a TPU or a GPU (on Linux; elsewhere, assumed)."""
    if not sys.platform.startswith("linux"):
        return True
    return tpu_chips_present() or any(os.path.exists(f) for f in GPU_DEVICE_FILES)


def skip_absent_accelerators() -> None:
    """Start only the CPU platform when nothing chose the platforms (JAX_PLATFORMS, or
    the jax_platforms setting) and the machine has no accelerator: JAX would fall back to
    the CPU anyway, after loading libtpu and taking its lock. A no-op once JAX has
    started its platforms."""
    if jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS"):
        return
    if not accelerators_present():
        jax.config.update("jax_platforms", "cpu")


def allow_shared_libtpu() -> None:
    """Let libtpu load in this process while another holds it (its own switch, read when
    it loads): compiling for a TPU topology needs no TPU, so no exclusive lock."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
