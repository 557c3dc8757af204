"""The compiled-program cache (jaxserve/engine/executable_cache.py): what it keys on,
that a loaded program computes what the jitted function does, that programs JAX's cache
gave back are not kept, and that a damaged file is compiled again rather than run. A
whole engine's second start is in test_cli_and_config.py."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.compile_cache import counting_hits
from jaxserve.engine.executable_cache import ExecutableCache


def _program(c: float):
    """A new jitted function (nothing cached in memory); each test has its own constant
    `c`, so its first compile is fresh and later ones come from JAX's per-run cache."""
    return jax.jit(lambda x, y: {"sum": x @ y + c, "scaled": x * c}, donate_argnums=0)


def _args(rows=8):
    x = jax.random.normal(jax.random.key(0), (rows, 16), jnp.float32)
    return x, jnp.ones((16, 4), jnp.float32)


def test_a_second_cache_loads_the_program_and_it_computes_the_same(tmp_path):
    x, y = map(np.asarray, _args())
    want = {"sum": x @ y + 1.0, "scaled": x * 1.0}
    _, cached = ExecutableCache(tmp_path, "model").compile("p", _program(1.0), _args())
    assert not cached and len(list(tmp_path.glob("p-*.bin"))) == 1
    with counting_hits() as jax_hits:
        loaded, cached = ExecutableCache(tmp_path, "model").compile("p", _program(1.0),
                                                                     _args())
    assert cached and jax_hits.hits == 0  # from this cache, not JAX's
    args = _args()
    got = loaded(*args)
    assert args[0].is_deleted()  # donation survives the round trip
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-6)


def test_the_key_follows_shapes_and_the_model(tmp_path):
    ExecutableCache(tmp_path, "model").compile("p", _program(2.0), _args(8))
    _, cached = ExecutableCache(tmp_path, "model").compile("p", _program(2.0), _args(9))
    assert not cached  # other shapes: another program, compiled
    assert len(list(tmp_path.glob("p-*.bin"))) == 2
    with counting_hits() as jax_hits:
        _, cached = ExecutableCache(tmp_path, "other model").compile("p", _program(2.0),
                                                                      _args(8))
    assert cached and jax_hits.hits == 1  # another model misses here; JAX's cache has it ...
    assert len(list(tmp_path.glob("p-*.bin"))) == 2  # ... and what it gives is not kept


def test_a_damaged_file_is_compiled_again_and_removed(tmp_path, caplog):
    ExecutableCache(tmp_path, "model").compile("p", _program(3.0), _args())
    (path,) = tmp_path.glob("p-*.bin")
    path.write_bytes(path.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        compiled, _ = ExecutableCache(tmp_path, "model").compile("p", _program(3.0),
                                                                  _args())
    assert "does not load" in caplog.text
    assert not path.exists()
    x, y = map(np.asarray, _args())
    np.testing.assert_allclose(np.asarray(compiled(*_args())["sum"]), x @ y + 3.0, rtol=1e-6)


def test_off_without_a_folder(tmp_path):
    _, cached = ExecutableCache(None, "model").compile("p", _program(4.0), _args())
    assert not cached and not list(tmp_path.iterdir())
    assert ExecutableCache.for_process("model").folder is not None  # JAX's cache is on
