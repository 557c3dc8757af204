"""CPU buffers backed by transparent huge pages (jaxserve/engine/huge_pages.py), checked in
the kernel's own accounting (/proc/<pid>/smaps) in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.engine.huge_pages import HUGE_PAGE

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

CHECK = r"""
import ctypes, json, mmap, sys
import jax, numpy as np
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.huge_pages import (HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE,
                                        back_with_huge_pages)

def huge_bytes(x):
    # AnonHugePages of the mappings overlapping x's memory, and the bytes of the huge
    # pages that lie wholly inside it.
    start = x.unsafe_buffer_pointer(); end = start + x.nbytes
    total, overlaps = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            overlaps = lo < end and start < hi
        elif head == "AnonHugePages:" and overlaps:
            total += int(line.split()[1]) * 1024
    inside = max(0, end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    return total, inside

out = {}
# Whether this kernel collapses at all: an anonymous mapping of our own.
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
own = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
own.write(b"x" * len(own))
start = -(-ctypes.addressof(ctypes.c_char.from_buffer(own)) // HUGE_PAGE) * HUGE_PAGE
out["supported"] = (libc.madvise(start, HUGE_PAGE, MADV_HUGEPAGE) == 0
                    and libc.madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0)
mesh = jax.make_mesh((8,), ("x",))  # 8 CPU devices: one 6 MiB shard each
x = jax.device_put(np.random.default_rng(0).standard_normal((8, 3 << 19), np.float32),
                   jax.NamedSharding(mesh, jax.P("x")))
shards = [s.data for s in x.addressable_shards]
copy = np.asarray(x).copy()
out["before"] = [huge_bytes(s) for s in shards]
back_with_huge_pages([x], "test").join()
out["after"] = [huge_bytes(s) for s in shards]
out["unchanged"] = bool(np.array_equal(np.asarray(x), copy))

config = EngineConfig(model=sys.argv[1], dtype="float32", max_model_len=128, page_size=16,
                      num_pages=8192, max_num_seqs=4, max_num_batched_tokens=16,
                      token_buckets=(16,))
engine = Engine.from_config(config)
engine.runner.huge_pages.join()
out["kv"] = [huge_bytes(x) for layer in engine.runner.kv_caches for x in layer]
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_buffers_and_kv_pages_collapsed_in_place(checkpoints):
    path, _ = checkpoints("llama")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    run = subprocess.run([sys.executable, "-c", CHECK, str(path)], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    if not out["supported"]:
        pytest.skip("this kernel collapses nothing (no MADV_COLLAPSE: Linux before 6.1)")
    if "[madvise]" in THP.read_text():  # XLA does not ask: 4 KiB pages until collapsed
        assert all(total == 0 for total, _ in out["before"])
    for total, inside in out["after"] + out["kv"]:
        assert inside >= 2 * HUGE_PAGE and total >= inside
    assert len(out["after"]) == 8 and len(out["kv"]) == 4
    assert out["unchanged"]
