"""JAX's persistent compilation cache for the step programs, so a restart loads them.

Every step bucket is compiled at start-up (runner.warmup). With the cache on, a second
start of the same model and settings reads the compiled programs from disk instead. JAX
keys each entry by the program, its compile options, the JAX/jaxlib version and the
devices; the default folder adds a subfolder per jaxserve and JAX version and device kind,
so upgrades start clean and old entries are easy to delete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.demo import cache_root


OFF = "off"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


@dataclasses.dataclass
class CacheEvents:
    """What the persistent cache saw inside a `counting_hits()` block."""

    hits: int = 0  # programs read from it
    lookups: int = 0  # compiles that looked there (a program JAX holds in memory looks nowhere)


@contextlib.contextmanager
def counting_hits() -> Iterator[CacheEvents]:
    """`with counting_hits() as events:` the persistent cache's hits and lookups inside
    the block."""
    events = CacheEvents()

    def listener(event: str, **_) -> None:
        events.hits += event == _CACHE_HIT
        events.lookups += event == _CACHE_REQUEST

    jax.monitoring.register_event_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listener)


def default_dir() -> Path:
    """`<cache root>/xla/jaxserve-V_jax-V_<platform>-<device kind>`."""
    try:
        version = importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    device = jax.devices()[0]
    kind = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device.platform}-{device.device_kind}")
    return cache_root() / "xla" / f"jaxserve-{version}_jax-{jax.__version__}_{kind}"


def enable(directory: str | None) -> Path | None:
    """Use the persistent cache in `directory` (None: `default_dir()`, unless JAX already
    has a cache folder, set by the user's JAX_COMPILATION_CACHE_DIR or by tests; "off":
    turn it off, even where JAX_COMPILATION_CACHE_DIR set one). Returns the folder in use,
    or None."""
    configured = jax.config.jax_compilation_cache_dir
    if directory == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if directory is None and configured:
        return Path(configured)
    path = Path(directory) if directory else default_dir()
    if configured != str(path):
        path.mkdir(parents=True, exist_ok=True)
        compilation_cache.set_cache_dir(str(path))
        compilation_cache.reset_cache()  # in case something compiled before this
    # Every step program is worth keeping, however fast it compiled.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
