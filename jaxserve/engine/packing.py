"""A step's host inputs as one transfer: `pack` lays a pytree's numpy leaves end to end in
one int32 and one float32 buffer, and a jitted program's `unpack` slices them back out.

A jitted call places each numpy argument on the device apart (~2 µs each on a CPU, a copy
each on an accelerator): a step batch has ~30 (token ids, positions, attention metadata,
sampling parameters). Packed, it has two. Leaves that are device arrays already (a
grammar mask kept on the device) pass through as they are.
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


def pack(tree: Any) -> Packed:
    """`tree` with its numpy leaves in two buffers (host side)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts: tuple[list, list] = ([], [])
    sizes, places, others = [0, 0], [], []
    for x in leaves:
        if not isinstance(x, (np.ndarray, np.generic)):
            places.append(Leaf(-1, len(others)))
            others.append(x)
            continue
        x = np.asarray(x)
        kind = _kind(x.dtype)
        places.append(Leaf(kind, sizes[kind], x.shape, x.dtype.name))
        if kind == 0 and x.dtype.itemsize == 4:
            x = x.view(np.int32)  # uint32 seeds keep their bits
        parts[kind].append(x.reshape(-1))
        sizes[kind] += x.size
    buffers = tuple(np.concatenate(p, dtype=dtype) if p else np.zeros(0, dtype)
                    for p, dtype in zip(parts, (np.int32, np.float32)))
    return Packed(buffers, tuple(others), (treedef, tuple(places)))


def unpack(packed: Packed) -> Any:
    """The tree `pack` packed, its numpy leaves now slices of the buffers (in a jitted
    program: device arrays)."""
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
