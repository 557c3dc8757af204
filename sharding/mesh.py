"""Device meshes from a {axis: size} mapping."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from sharding.strategies import MESH_AXES


def make_mesh(shape: dict[str, int] | None = None, devices: list | None = None) -> Mesh:
    """A mesh with axes ('data', 'model'); default: one device.

    `mesh_utils.create_device_mesh` orders devices to follow the physical topology.
    """
    shape = dict(shape or {"data": 1, "model": 1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {MESH_AXES}")
    sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
    devices = devices if devices is not None else jax.devices()
    need = math.prod(sizes)
    if need > len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {need} devices, have {len(devices)}")
    if need == 1:
        return Mesh(np.array(devices[:1]).reshape(sizes), MESH_AXES)
    return Mesh(mesh_utils.create_device_mesh(sizes, devices[:need]), MESH_AXES)
