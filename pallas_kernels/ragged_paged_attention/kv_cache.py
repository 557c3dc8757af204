"""The paged KV cache every attention backend reads, and the writer every backend shares.

Page layout: per layer, K and V are each `[num_kv_heads, num_pages, page_size, head_dim]`,
head-major, so one head's page is a contiguous `[page_size, head_dim]` tile: a TPU pads
only the last two dimensions to its (8|16|32) x 128 tiles, so a token-major layout with
1-2 KV heads per chip would waste up to 16x HBM, and a per-head kernel would need strided
copies. Token `j` of a sequence lives in page `page_indices[s, j // page_size]` at row
`j % page_size` (flat slot `page * page_size + row`). A quantized cache (int8 or fp8
values) has float32 scales `[num_kv_heads, num_pages, page_size]`, one per token and head:
the stored value times its scale is the K or V element.

On a CPU the reference and the CPU kernel keep a bfloat16 pool as its uint16 bits
(`pool_dtype`): XLA:CPU has no bf16 scatter or gather and converts the whole operand to
float32 around one, a pass over every page of the pool per layer and step; on integers it
writes in place. Readers view the bits as bf16 (`logical_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native
from pallas_kernels.platform import current_platform

WRITE_IMPLS = ("xla", "cpu")
QUANTIZED_KV_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
BITS = jnp.dtype(jnp.uint16)  # a bf16 pool stored as its bits


def pool_dtype(kv_dtype, impl: str) -> jnp.dtype:
    """The dtype a pool of `kv_dtype` K/V is stored in for attention backend `impl`: bf16 as
    uint16 bits where XLA:CPU runs the reads and writes (see the module docstring)."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype == jnp.bfloat16 and impl in ("reference", "cpu") and current_platform() == "cpu":
        return BITS
    return kv_dtype


def logical_dtype(pages: jax.Array) -> jnp.dtype:
    """The dtype of the K/V values a pool holds (bf16 for a pool of bits)."""
    return jnp.dtype(jnp.bfloat16) if pages.dtype == BITS else pages.dtype


def as_bits(x: jax.Array) -> jax.Array:
    """A bf16 array as uint16, bit for bit; other dtypes unchanged."""
    return jax.lax.bitcast_convert_type(x, BITS) if x.dtype == jnp.bfloat16 else x


def as_values(pages: jax.Array) -> jax.Array:
    """The K/V values of a pool (or of pages gathered from it): bits viewed as bf16."""
    return jax.lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == BITS else pages


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`x[..., head_dim]` → (values in `dtype`, float32 scales `[...]`), symmetric per
    token and head: amax maps to the format's largest value (127 for int8, 448 for e4m3)."""
    x = x.astype(jnp.float32)
    top = QUANTIZED_KV_MAX[jnp.dtype(dtype).name]
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    scale = jnp.where(scale > 0, scale, 1.0)
    y = x / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.clip(jnp.round(y), -top, top)
    return y.astype(dtype), scale


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
    k_scales: jax.Array | None = None, v_scales: jax.Array | None = None, *,
    impl: str | None = None,
) -> tuple[jax.Array, ...]:
    """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at flat slots `page * page_size + row`.

    Slots outside the pool (padding tokens use `num_pages * page_size`) are dropped. With
    scales (a quantized cache) the tokens are quantized first and the result is
    `(k_pages, v_pages, k_scales, v_scales)`, else `(k_pages, v_pages)`.

    `impl`: "xla" (a scatter; what every accelerator runs) or "cpu" (the native writer,
    `jaxserve_write_kv`: a copy of each new row into its slot, in place when the caller
    donates the pages). None: "cpu" for an unquantized cache on a CPU where the native
    kernels run. XLA:CPU makes one token's scatter a read of the old row, a select and a
    dynamic-update-slice per pool, six small programs per layer where the native writer is
    one call.
    """
    if impl is None:
        impl = "cpu" if k_scales is None and current_platform() == "cpu" and native.available() else "xla"
    if impl not in WRITE_IMPLS:
        raise ValueError(f"write_kv impl must be one of {WRITE_IMPLS}, got {impl!r}")
    if impl == "cpu" and k_scales is not None:
        raise ValueError("the native K/V writer takes unquantized caches only (impl='xla')")
    if impl == "cpu" and not native.available():
        raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    if impl == "cpu":  # takes bf16 rows into a pool of bits as they are (no copy to bits)
        out = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
        call = jax.ffi.ffi_call("jaxserve_write_kv", (out, out), input_output_aliases={0: 0, 1: 1})
        return tuple(call(k_pages, v_pages, k.astype(logical_dtype(k_pages)),
                          v.astype(logical_dtype(v_pages)), slot_mapping.astype(jnp.int32)))
    if k_scales is None:
        return _put(k_pages, k, slot_mapping), _put(v_pages, v, slot_mapping)
    (kq, ks), (vq, vs) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    return (_put(k_pages, kq, slot_mapping), _put(v_pages, vq, slot_mapping),
            _put_scales(k_scales, ks, slot_mapping), _put_scales(v_scales, vs, slot_mapping))


def write_latent(pages: jax.Array, x: jax.Array, slot_mapping: jax.Array,
                 scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Store new tokens' rows `[T, heads, width]` in a pool that is both K and V (DeepSeek's
    latent attention: its values are the first columns of its keys), as `write_kv` does
    with impl "xla": `(pages,)`, or `(pages, scales)` quantized."""
    if scales is None:
        return (_put(pages, x, slot_mapping),)
    xq, xs = quantize_kv(x, pages.dtype)
    return _put(pages, xq, slot_mapping), _put_scales(scales, xs, slot_mapping)


def _put(pages: jax.Array, x: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Rows `x[T, heads, D]` scattered into `pages` at their flat slots (out of range: dropped),
    in the pool's dtype (its bits for a pool of bits)."""
    shape = pages.shape
    x = x.astype(logical_dtype(pages))
    x = (as_bits(x) if pages.dtype == BITS else x).transpose(1, 0, 2)  # [Hkv, T, D]
    flat = pages.reshape(shape[0], shape[1] * shape[2], shape[3])
    return flat.at[:, slot_mapping].set(x, mode="drop").reshape(shape)


def _put_scales(scales: jax.Array, s: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    shape = scales.shape
    flat = scales.reshape(shape[0], shape[1] * shape[2])
    return flat.at[:, slot_mapping].set(s.T, mode="drop").reshape(shape)
