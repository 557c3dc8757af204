"""A step's host inputs as one transfer: `pack` lays a pytree's numpy leaves end to end in
one int32 and one float32 buffer, and a jitted program's `unpack` slices them back out.

A jitted call places each numpy argument on the device apart, a host-to-device copy each
on an accelerator: a step batch has ~30 (token ids, positions, attention metadata,
sampling parameters). Packed, it has two. Leaves that are device arrays already (a
grammar mask kept on the device) pass through as they are. On a CPU, where a numpy
argument costs ~2 µs and the slices cost the program more than that (XLA:CPU runs them
as ops of their own: a batch-1 step's two programs took ~100 µs longer packed), the
runner passes the batch as it is (`runner.packs_inputs`); the programs take either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Leaf(NamedTuple):
    """Where a numpy leaf lies: in buffer `buffer` (0: int32, 1: float32) at `offset`, with
    its shape and dtype; `buffer` -1: the `offset`-th of the leaves passed as they are."""

    buffer: int
    offset: int
    shape: tuple[int, ...] = ()
    dtype: str = ""


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree packed by `pack`: its children are the two buffers and the leaves passed as
    they are; its layout (the tree's structure and each leaf's place) is static, part of
    the program a jitted call picks."""

    def __init__(self, buffers: tuple, others: tuple, layout: tuple):
        self.buffers, self.others, self.layout = buffers, others, layout

    def tree_flatten(self):
        return (self.buffers, self.others), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)


def _kind(dtype: np.dtype) -> int:
    if dtype == np.bool_ or (dtype.kind in "iu" and dtype.itemsize <= 4):
        return 0
    if dtype.kind == "f" and dtype.itemsize <= 4 or dtype == jnp.bfloat16:
        return 1
    raise TypeError(f"cannot pack a {dtype} array (int32 and float32 buffers)")


class _Plan(NamedTuple):
    """How a tree of one structure, shapes and dtypes packs: its leaves' indices by buffer
    (int32, float32, passed as they are) and the layout `unpack` reads."""

    parts: tuple[tuple[int, ...], tuple[int, ...]]
    others: tuple[int, ...]
    layout: tuple


_PLANS: dict[tuple, _Plan] = {}


def _plan(leaves: list, treedef) -> _Plan:
    key = (treedef, *[(x.shape, x.dtype) if isinstance(x, (np.ndarray, np.generic)) else None
                      for x in leaves])
    plan = _PLANS.get(key)
    if plan is None:
        parts: tuple[list, list] = ([], [])
        sizes, places, others = [0, 0], [], []
        for i, x in enumerate(leaves):
            if not isinstance(x, (np.ndarray, np.generic)):
                places.append(Leaf(-1, len(others)))
                others.append(i)
                continue
            kind = _kind(x.dtype)
            places.append(Leaf(kind, sizes[kind], x.shape, x.dtype.name))
            parts[kind].append(i)
            sizes[kind] += x.size
        plan = _PLANS[key] = _Plan((tuple(parts[0]), tuple(parts[1])), tuple(others),
                                   (treedef, tuple(places)))
    return plan


def pack(tree: Any) -> Packed:
    """`tree` with its numpy leaves in two buffers (host side). What goes where is worked
    out once per structure, shapes and dtypes: a call flattens, and copies each leaf once
    (converting bools, unsigned and narrower types bit for bit or exactly)."""
    leaves, treedef = jax.tree.flatten(tree)
    plan = _plan(leaves, treedef)
    buffers = tuple(
        np.concatenate([leaves[i].ravel() for i in part], dtype=dtype, casting="unsafe")
        if part else np.zeros(0, dtype)
        for part, dtype in zip(plan.parts, (np.int32, np.float32)))
    return Packed(buffers, tuple(leaves[i] for i in plan.others), plan.layout)


def unpack(packed: Packed | Any) -> Any:
    """The tree `pack` packed, its numpy leaves now slices of the buffers (in a jitted
    program: device arrays); a tree that is not packed, as it is."""
    if not isinstance(packed, Packed):
        return packed
    treedef, places = packed.layout
    leaves = []
    for place in places:
        if place.buffer < 0:
            leaves.append(packed.others[place.offset])
            continue
        size = int(np.prod(place.shape, dtype=np.int64))
        x = packed.buffers[place.buffer][place.offset:place.offset + size].reshape(place.shape)
        dtype = jnp.dtype(place.dtype)
        if dtype == jnp.bool_:
            x = x != 0
        elif place.buffer == 0 and dtype.itemsize == 4:
            x = jax.lax.bitcast_convert_type(x, dtype)
        else:
            x = x.astype(dtype)
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
