"""The LoRA delta as a native CPU kernel (pallas_kernels/cpu/lora.h, `jaxserve_lora`):
every projection sharing an input gets its delta added in place in one call, token by
token's slot, with no sort, gather or loop in the program (the plain-JAX grouped path's
`fori_loop`s cost a CPU step more than the adapters' arithmetic, and ~10x its compile
time). A batch without adapter tokens returns at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native

TARGET = "jaxserve_lora"
DTYPES = ("float32", "bfloat16")


def supports(x: jax.Array) -> bool:
    """Whether the kernel takes x's dtype and is available here."""
    return x.dtype.name in DTYPES and native.available()


def lora_add(x: jax.Array, slots: jax.Array, ys: list[jax.Array],
             stacks: list[tuple[jax.Array, jax.Array]]) -> list[jax.Array]:
    """`ys[i][t] + x[t] @ A_i[slots[t] - 1] @ B_i[slots[t] - 1]` for each token t (slot 0:
    `ys[i][t]` unchanged). x `[T, in]`; `ys[i]` `[T, ...]`, added to in x's dtype;
    `stacks[i]` = (A `[G, in, r]`, B `[G, r, out_i]`), `out_i` the size of `ys[i]` past T."""
    if not native.available():  # builds and registers the kernels on first use
        raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    t = x.shape[0]
    flat = [y.reshape(t, -1).astype(x.dtype) for y in ys]
    args = [x, slots.astype(jnp.int32)]
    for y, (a, b) in zip(flat, stacks):
        args += [y, a.astype(x.dtype), b.astype(x.dtype)]
    call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(y.shape, x.dtype) for y in flat],
                            input_output_aliases={2 + 3 * i: i for i in range(len(flat))})
    return [out.reshape(y.shape).astype(y.dtype) for out, y in zip(call(*args), ys)]


__all__ = ["lora_add", "supports"]
