"""packing.py: a pytree's numpy leaves through one int32 and one float32 buffer and back,
inside a jitted program, bit for bit; device arrays and None pass through."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.packing import pack, unpack


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Inputs:
    ids: np.ndarray
    seeds: np.ndarray
    mask: np.ndarray
    scale: np.ndarray
    half: np.ndarray
    flag: np.ndarray
    on_device: jax.Array
    nothing: np.ndarray | None = None


def random_inputs(rng: np.random.Generator) -> Inputs:
    return Inputs(
        ids=rng.integers(-2**31, 2**31, (5, 3), dtype=np.int64).astype(np.int32),
        seeds=rng.integers(0, 2**32, 7, dtype=np.uint64).astype(np.uint32),
        mask=rng.random((2, 4)) < 0.5,
        scale=rng.standard_normal(6).astype(np.float32),
        half=rng.standard_normal((3, 2)).astype(jnp.bfloat16),
        flag=np.array(True),
        on_device=jnp.arange(4, dtype=jnp.int32))


def test_a_packed_tree_comes_back_whole_in_a_jitted_program():
    rng = np.random.default_rng(0)
    inputs = random_inputs(rng)
    packed = pack((inputs, np.int32(3)))
    numpy_leaves = [x for x in jax.tree.leaves(packed) if isinstance(x, np.ndarray)]
    assert [x.dtype for x in numpy_leaves] == [np.int32, np.float32]
    assert numpy_leaves[0].size == 15 + 7 + 8 + 1 + 1 and numpy_leaves[1].size == 6 + 6
    got, steps = jax.jit(unpack)(packed)
    assert int(steps) == 3 and got.nothing is None
    for name in ("ids", "seeds", "mask", "scale", "half", "flag", "on_device"):
        want, have = getattr(inputs, name), getattr(got, name)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want), err_msg=name)


def test_a_new_layout_is_a_new_program_and_the_same_one_reuses_it():
    traces = []

    @jax.jit
    def total(packed):
        traces.append(1)
        tree = unpack(packed)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))

    a = {"x": np.arange(4, dtype=np.int32), "y": np.ones(2, np.float32)}
    assert float(total(pack(a))) == 8.0
    assert float(total(pack({"x": a["x"] + 1, "y": a["y"]}))) == 12.0
    assert len(traces) == 1  # same shapes and dtypes: the same program
    assert float(total(pack({"x": a["x"], "y": None}))) == 6.0
    assert len(traces) == 2


def test_what_cannot_be_packed_is_refused():
    with pytest.raises(TypeError, match="int64"):
        pack({"x": np.arange(3, dtype=np.int64)})
