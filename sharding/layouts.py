"""The order an expert stack's elements lie in a device's memory: the one its kernel reads.

A TPU compiler gives each array shape a default layout of its own choosing, not always
row-major: gpt-oss-120b's fp4 expert stack u8[128, 1440, 2880] gets its 128 experts as
the minor dimension (less tile padding than 2880 columns), gpt-oss-20b's bf16 group
scales [32, 90, 2880] their 90 groups as the major one. The grouped-matmul Pallas kernel
takes its operands row-major, so XLA copied such a stack into row-major order in every
call of the step (120b: 526 MB of temp for a layer's stacks; 20b: 16.6 MB of scales).
The experts' stacks (a parameter whose first logical axis is "experts", of three or
more dimensions: values, scales, zero points) are therefore placed row-major on a TPU,
and programs compiled for them take them so (a committed argument's layout is the one
jax.jit compiles for). Other parameters keep the compiler's choice; on CPUs and GPUs
every default layout is row-major already.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.experimental.layout import Format, Layout


def is_expert_stack(var) -> bool:
    """Whether a parameter (an nnx variable, abstract or placed) is a stack of the
    experts' weights (values, scales or zero points) that the grouped kernel reads."""
    return len(var.shape) >= 3 and var.get_metadata()["logical_axes"][0] == "experts"


def kernel_format(var, sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | Format:
    """Where a parameter goes: its sharding, with the row-major layout for an expert
    stack on a TPU."""
    if not is_expert_stack(var) or next(iter(sharding.device_set)).platform != "tpu":
        return sharding
    return Format(Layout(major_to_minor=tuple(range(len(var.shape)))), sharding)


def lay_out_for_kernels(params: nnx.State) -> nnx.State:
    """Loaded parameters moved into kernel_format's layout where they are not in it, one
    at a time (each old buffer is freed as its copy replaces it: the peak is one stack)."""
    for _, var in nnx.to_flat_state(params):
        x = var.get_value() if hasattr(var, "get_value") else var.value
        want = kernel_format(var, x.sharding)
        if isinstance(want, Format) and x.format.layout.major_to_minor != \
                want.layout.major_to_minor:
            moved = jax.device_put(x, want)
            var.set_value(moved) if hasattr(var, "set_value") else setattr(var, "value", moved)
    return params
