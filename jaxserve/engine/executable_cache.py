"""Compiled step programs kept whole on disk, so a warm start skips tracing and lowering.

JAX's persistent cache (compile_cache.py) keys a program by its lowered HLO, so even a hit
pays for tracing and lowering every step program: 3 s of a 10 s warm start of
smollm2-135m on a 2-core CPU, against 0.1 s to load one of these. This cache keys each
compiled program by what it is built from instead: jaxserve's source (every Python
module and kernel source of the packages below), the JAX and jaxlib versions, JAX's
settings and the environment's (XLA_FLAGS, JAXSERVE_*, ...), the devices (and on a CPU
the instruction sets XLA compiles for and the native kernels' build), the model's
structure (its graphdef, with every static setting of its layers) and the shapes, dtypes,
shardings and layouts of the program's arguments. Anything else a program depends on must be
one of those; a change to any of them misses and compiles anew (through JAX's cache,
which still hits when the HLO is unchanged).

Only programs compiled here are kept: an XLA:CPU program read from JAX's cache
serializes again without some of its functions (a sampling program came back 222 KB
instead of 331 and failed at run time, "Function wrapped_convert not found"), and so may
one that JAX hands back from memory, which may have come from its cache earlier in the
process ("Function clamp_bitcast_fusion not found" in the multi-host tests). So after a
change that leaves the HLO as it was, starts read JAX's cache as before, until its
folder is cleared.

It lives in JAX's cache folder (`jaxserve-executables/`), is on when that cache is, and
serves processes with one device (a CPU, one GPU, one TPU chip); with more devices the
runner calls its jitted programs and JAX's cache serves them alone. A file that fails
to load is removed and the program compiled again. Like JAX's cache, its files are
programs to run: keep the folder as private as the model.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Callable

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve.engine.compile_cache import counting_hits
from pallas_kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)

FOLDER = "jaxserve-executables"
_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# Settings read from the environment (jaxserve's, JAX's, XLA's, libtpu's, the compiler).
_ENV = ("JAXSERVE_", "JAX_", "XLA_", "LIBTPU_", "TPU_", "CXX")


@functools.cache
def environment_digest() -> str:
    """What every program of this process is built from, besides its model and arguments."""
    h = hashlib.sha256(b"jaxserve-executable-v1")
    root = Path(__file__).resolve().parents[2]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    h.update(repr((jax.__version__, jaxlib.__version__, sys.version,
                   sorted((k, repr(v)) for k, v in jax.config.values.items()),
                   sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV)),
                   jax.process_count(),
                   [(d.id, d.platform, d.device_kind, d.process_index)
                    for d in jax.devices()])).encode())
    if jax.default_backend() == "cpu":
        # The native kernels' FFI targets: registered here, since a loaded program is
        # never traced (tracing is what registers them otherwise).
        h.update(repr((_cpu_flags(), cpu_kernels.available(), cpu_kernels.isa())).encode())
    return h.hexdigest()


def _cpu_flags() -> bytes:
    """The CPU's feature flags (XLA:CPU compiles for the host's instruction sets)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    import platform
    return repr(platform.uname()).encode()


def signature(args) -> str:
    """The pytree structure and every leaf's shape, dtype and sharding of `args` (with
    its layout where it has one: a program takes its arguments as they lie)."""
    leaves, treedef = jax.tree.flatten(args)
    return repr((str(treedef), [
        (getattr(x, "shape", ()), str(getattr(x, "dtype", type(x).__name__)),
         getattr(x, "weak_type", False),
         str(getattr(x, "format", None) or getattr(x, "sharding", None)))
        for x in leaves]))


def one_device() -> bool:
    """Whether this process runs its programs on one device of one process: where a
    compiled program may be called with host arrays, and where this cache serves."""
    return jax.device_count() == 1 and jax.process_count() == 1


class ExecutableCache:
    """Compiles jitted programs for given arguments, through the folder when there is one
    (`folder` None: compile every time). `context`: what the programs are built from
    beyond the environment and their arguments (the model's structure)."""

    def __init__(self, folder: Path | None, context: str):
        self.folder = folder
        self._context = context

    @classmethod
    def for_process(cls, context: str) -> "ExecutableCache":
        """The cache in JAX's cache folder when it is on and `one_device()` (a CPU, one GPU
        or TPU chip); else one that always compiles."""
        directory = jax.config.jax_compilation_cache_dir
        on = jax.config.jax_enable_compilation_cache and directory and one_device()
        return cls(Path(directory) / FOLDER if on else None, context)

    def compile(self, name: str, fn: Callable, args: tuple) -> tuple[Callable, bool]:
        """(`fn` compiled for `args`, whether it came from a cache: this one or JAX's)."""
        path = None
        if self.folder is not None:
            digest = hashlib.sha256("\0".join(
                (environment_digest(), self._context, name, signature(args))).encode())
            path = self.folder / f"{name}-{digest.hexdigest()[:32]}.bin"
            loaded = self._load(path)
            if loaded is not None:
                return loaded, True
        with counting_hits() as events:
            compiled = fn.lower(*args).compile()
        if path is not None and events.lookups and not events.hits:  # compiled here
            self._store(path, compiled)
        return compiled, events.hits > 0

    @staticmethod
    def _load(path: Path) -> Callable | None:
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("compiled program %s unreadable (%s); compiling it", path, e)
            return None
        try:
            return serialize_executable.deserialize_and_load(*pickle.loads(payload))
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile instead
            log.warning("compiled program %s does not load (%s); removed, compiling it",
                        path, e)
            path.unlink(missing_ok=True)
            return None

    @staticmethod
    def _store(path: Path, compiled) -> None:
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - e.g. XLA:CPU "`LessThan` is not serializable"
            log.debug("compiled program %s not kept: %s", path.name, e)
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(payload)
            tmp.replace(path)  # whole or not at all, for processes starting side by side
        except OSError as e:
            log.warning("compiled program %s not kept: %s", path, e)
