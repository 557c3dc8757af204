"""Huge pages for a CPU backend's buffers (jaxserve/huge_pages.py): the environment a
process restarts into, and XLA's buffers on huge pages in the kernel's own accounting
(/proc/<pid>/smaps) of a process that restarted into it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve import huge_pages

ON = huge_pages.huge_page_environment({}) is not None  # Linux, glibc, THP in madvise mode
HUGE_PAGE = 2 << 20

CHECK = r"""
import json, sys
from jaxserve.huge_pages import restart_with_huge_pages
restart_with_huge_pages()
import jax, numpy as np

HUGE_PAGE = 2 << 20

x = jax.device_put(np.random.default_rng(0).standard_normal(6 << 20, np.float32))
x.block_until_ready()  # copied: every page of x touched
start = x.unsafe_buffer_pointer(); end = start + x.nbytes
total, overlaps = 0, False  # AnonHugePages of the mappings that hold x
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        overlaps = lo < end and start < hi
    elif head == "AnonHugePages:" and overlaps:
        total += int(line.split()[1]) * 1024
inside = (end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE  # huge pages within x
print(json.dumps({"huge": total, "inside": inside, "argv": sys.argv[1:]}))
"""


@pytest.mark.parametrize("mode,env,want", [
    ("always [madvise] never", {}, "glibc.malloc.hugetlb=1"),
    ("always [madvise] never", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("always [madvise] never", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, None),
    ("[always] madvise never", {}, None),
    ("always madvise [never]", {}, None),
])
def test_environment_asks_only_where_it_changes_something(tmp_path, monkeypatch, mode, env,
                                                          want):
    if sys.platform != "linux" or huge_pages.platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc on Linux only")
    (tmp_path / "enabled").write_text(mode + "\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "enabled")
    got = huge_pages.huge_page_environment({"PATH": "/bin", **env})
    assert (got and got["GLIBC_TUNABLES"]) == want
    assert got is None or got["PATH"] == "/bin"


@pytest.mark.skipif(not ON, reason="needs Linux, glibc and THP in madvise mode")
def test_restarted_process_puts_buffers_on_huge_pages():
    def run(tunables):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("GLIBC_TUNABLES", None)
        env.update(tunables)
        out = subprocess.run([sys.executable, "-c", CHECK, "same", "args"], env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    restarted = run({})
    assert restarted["argv"] == ["same", "args"]  # the command line survives the restart
    assert restarted["inside"] >= 2 * HUGE_PAGE
    assert restarted["huge"] >= restarted["inside"]
    kept_off = run({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # an explicit setting
    assert kept_off["huge"] == 0
