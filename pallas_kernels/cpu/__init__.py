"""Native CPU kernels: `kernels.cc` (the FFI handlers) with a header per kernel
(`matmul.h`, `rows.h`, `attention.h`, `lora.h`, `quantized.h`, `sampling.h`) and what they
share (`common.h`), built on first use and called through the XLA FFI.

FFI targets for platform "cpu": `jaxserve_matmul` (float matmul, f32 or bf16),
`jaxserve_ragged_paged_attention`, `jaxserve_write_kv` (new K/V into the paged cache, in
place), `jaxserve_rms_norm`, `jaxserve_gated_act` and `jaxserve_rope` (row-wise ops on the
real rows), `jaxserve_lora` (LoRA adapters' deltas, in place), `jaxserve_top_k_top_p_cut`
(each row's top-k / top-p threshold for the sampler, `sampling.h`, without a sort),
`jaxserve_argmax` (each row's greedy pick, `sampling.h`), `jaxserve_draw` (each sampled
row's draw from its weights, `sampling.h`);
their Python faces are `pallas_kernels/matmul/cpu.py`,
`pallas_kernels/ragged_paged_attention/cpu.py`, `.../kv_cache.py`,
`pallas_kernels/rows.py`, `pallas_kernels/lora/cpu.py` and `jaxserve/engine/sampler.py`'s
`filter_logits`, `first_argmax` and `draw_from`.

The shared library is compiled with the system C++ compiler (`$CXX`, else g++, else c++)
into `<cache root>/cpu_kernels/<key>/`, where the cache root is `$JAXSERVE_CACHE` (default
~/.cache/jaxserve) and the key hashes the source, the flags, the jaxlib version and the
compiler's version. The build writes a temporary file and renames it into place, so
processes building at once never load a partial library. It compiles portable code: the
AVX-512 / AVX2 paths are picked at run time, per call, from what the CPU reports.

`available()` says whether the kernels can run here; it is False, with one logged warning
saying why, when `JAXSERVE_CPU_KERNELS=0`, when there is no compiler, or when the build or
the load fails. Nothing here raises into the caller. The kernels split their work over
XLA's intra-op threads; `JAXSERVE_CPU_THREADS=N` caps how many they use.
`JAXSERVE_CPU_ISA=avx512|avx2|scalar` caps the instruction set (to measure what a CPU
without AVX512_BF16, or without AVX-512, would get).
`round_trip_ns()` times a cache line's trip between two threads and `pair_flops_ratio()`
compares two threads' floating-point rate with one's, diagnostics the benchmarks record
beside their bandwidth probes (where a VM's vCPUs sit). They are a library of their own
(`diagnostics.cc`), built the first time a benchmark asks, not part of the serving build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent
SOURCE = FOLDER / "kernels.cc"  # one translation unit: it includes the headers
HEADERS = ("common.h", "simd.h", "matmul.h", "rows.h", "attention.h", "attention_tiles.inc",
           "lora.h", "quantized.h", "sampling.h")
DIAGNOSTICS = FOLDER / "diagnostics.cc"
# Functions and loops on 64-byte boundaries: without, adding a kernel moved the others' code
# and smollm2-135m's batch-1 decode went 21.0-21.8 -> 23.4-24.5 ms a token with its code
# unchanged (2-core Xeon, offline_throughput.py float32, old and new library alternated);
# aligned, both libraries ran 19.7-21.3.
FLAGS = ("-O3", "-falign-functions=64", "-falign-loops=64", "-std=c++17", "-shared", "-fPIC",
         "-w")
TARGETS = {"jaxserve_matmul": "JaxserveMatmul",
           "jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
           "jaxserve_write_kv": "JaxserveWriteKv",
           "jaxserve_rms_norm": "JaxserveRmsNorm",
           "jaxserve_gated_act": "JaxserveGatedAct",
           "jaxserve_rope": "JaxserveRope",
           "jaxserve_lora": "JaxserveLora",
           "jaxserve_quantized_matmul": "JaxserveQuantizedMatmul",
           "jaxserve_top_k_top_p_cut": "JaxserveTopKTopPCut",
           "jaxserve_argmax": "JaxserveArgmax",
           "jaxserve_draw": "JaxserveDraw"}
ISA_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_state: dict = {}  # "lib": ctypes.CDLL, or "error": why not
_diagnostics: dict = {}  # "lib" or "error", as _state


def cache_root() -> Path:
    # The same default as jaxserve.demo.cache_root (the kernels may not import jaxserve).
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))


def available() -> bool:
    """Whether the native kernels are built, loaded and registered with XLA (builds them on
    the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True or has not been asked yet)."""
    return _state.get("error")


def library_path() -> Path | None:
    """Where the loaded library lives (None when not loaded)."""
    return _state.get("path")


def _load() -> ctypes.CDLL | None:
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"], _state["path"] = _build_and_register()
            except Exception as e:  # noqa: BLE001 -- building must never raise into the caller
                _state["error"] = str(e) or type(e).__name__
                log.warning("jaxserve native CPU kernels unavailable (the pure-JAX references "
                            "run instead): %s", _state["error"])
    return _state.get("lib")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX unset, no g++ or c++ on PATH)")
    return cxx


def _build(source: Path, parts: list[Path], name: str, include: list[str]) -> Path:
    """The shared library of `source` (which includes `parts`), compiled into the cache under
    a key of every file's text, the flags, the jaxlib version and the compiler's."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        raise RuntimeError(f"{cxx} --version failed: {version.stderr.strip()}")
    import jaxlib

    key = hashlib.sha256(b"\0".join([
        *(p.read_bytes() for p in [source, *parts]), " ".join(FLAGS).encode(),
        jaxlib.__version__.encode(), cxx.encode(), version.stdout.encode()])).hexdigest()[:20]
    folder = cache_root() / "cpu_kernels" / key
    path = folder / name
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            cmd = [cxx, *FLAGS, *include, str(source), "-o", tmp]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
            os.replace(tmp, path)  # atomic: other processes see the whole file or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _build_and_register() -> tuple[ctypes.CDLL, Path]:
    if os.environ.get("JAXSERVE_CPU_KERNELS", "1") == "0":
        raise RuntimeError("disabled by JAXSERVE_CPU_KERNELS=0")
    path = _build(SOURCE, [FOLDER / h for h in HEADERS], "jaxserve_cpu_kernels.so",
                  [f"-I{jax.ffi.include_dir()}"])
    lib = ctypes.CDLL(str(path))
    lib.jaxserve_cpu_set_max_isa.argtypes = [ctypes.c_int]
    lib.jaxserve_cpu_set_max_isa.restype = ctypes.c_int
    lib.jaxserve_cpu_isa.restype = ctypes.c_int
    cap = os.environ.get("JAXSERVE_CPU_ISA")
    if cap:
        if cap not in ISA_LEVELS:
            raise RuntimeError(f"JAXSERVE_CPU_ISA must be one of {list(ISA_LEVELS)}, got {cap!r}")
        lib.jaxserve_cpu_set_max_isa(ISA_LEVELS[cap])
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib, path


def isa() -> str | None:
    """The instruction-set level the kernels run at now ("scalar", "avx2", "avx512",
    "avx512_bf16"), or None when they are unavailable."""
    lib = _load()
    if lib is None:
        return None
    level = lib.jaxserve_cpu_isa()
    return next(name for name, value in ISA_LEVELS.items() if value == level)


def set_max_isa(name: str) -> str:
    """Cap the instruction-set level (tests run the AVX2 and scalar paths on an AVX-512
    machine with this); returns the level now in force. Process-wide; takes effect on the
    next kernel call, compiled or not."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {unavailable_reason()}")
    lib.jaxserve_cpu_set_max_isa(ISA_LEVELS[name])
    return isa()


def _two_cpu_lib() -> ctypes.CDLL | None:
    """The diagnostics' library (built on first use): None without the kernels (disabled,
    no compiler) or a build, or with fewer than two CPUs to run on, where the two threads
    would take turns."""
    if _load() is None or len(os.sched_getaffinity(0)) < 2:
        return None
    with _lock:
        if "lib" not in _diagnostics and "error" not in _diagnostics:
            try:
                lib = ctypes.CDLL(str(_build(DIAGNOSTICS, [], "jaxserve_cpu_diagnostics.so",
                                             ["-pthread"])))
                for fn in (lib.jaxserve_cpu_round_trip_ns, lib.jaxserve_cpu_pair_flops_ratio):
                    fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_double
                _diagnostics["lib"] = lib
            except Exception as e:  # noqa: BLE001 -- a diagnostic must never raise
                _diagnostics["error"] = str(e) or type(e).__name__
                log.warning("jaxserve CPU diagnostics unavailable: %s", _diagnostics["error"])
    return _diagnostics.get("lib")


def round_trip_ns(trips: int = 20000, rounds: int = 5) -> float | None:
    """Nanoseconds for a cache line to go from this thread to another and back (the median
    of `rounds` timings of `trips` trips; both threads spin, so it takes two cores for a few
    milliseconds), or None when the kernels are unavailable. A diagnostic for benchmarks:
    on a VM it says whether two vCPUs share a last-level cache (tens of ns) or not
    (hundreds), which moves how fast memory reads and how much threads' hand-offs cost.
    None too with fewer than two CPUs to run on, where the two threads would take turns."""
    lib = _two_cpu_lib()
    return None if lib is None else lib.jaxserve_cpu_round_trip_ns(trips, rounds)


def pair_flops_ratio(iters: int = 500_000, rounds: int = 3) -> float | None:
    """The floating-point rate of two threads running at once over one thread's alone (the
    largest of `rounds` pairs of timings, each ~20 ms on a 3.6 GHz Zen 4 core; alone: the
    shortest of a timing before each pair and one after the last): about 2 on two cores, about 1 on
    one core's two SMT threads, where compute-bound work gets no more from two threads
    than from one. On a VM whose vCPUs move, it says which placement a
    measurement ran in. None where round_trip_ns is None."""
    lib = _two_cpu_lib()
    return None if lib is None else lib.jaxserve_cpu_pair_flops_ratio(iters, rounds)


__all__ = ["available", "cache_root", "isa", "library_path", "pair_flops_ratio", "round_trip_ns",
           "set_max_isa", "unavailable_reason"]
