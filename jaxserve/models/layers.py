"""The decoder's math on one device: parameters with axis names, matmuls, RMSNorm, rotary
embeddings. How they split over a mesh is in parallel.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelOptions, RopeScaling
from pallas_kernels.matmul import default_impl as default_dense_impl
from pallas_kernels.matmul import matmul as dense_matmul
from pallas_kernels.matmul import matmuls as dense_matmuls
from pallas_kernels.matmul import packed as packed_layout
from pallas_kernels.quantized_matmul import (
    pack_strips, packable, quantized_matmul, quantized_shapes)
from pallas_kernels.quantized_matmul.formats import STRIP, dequantize_rows, kind_of
from pallas_kernels.rows import ACTIVATIONS, rms_norm_reference


def param(shape: tuple[int, ...], axes: tuple[str, ...], dtype,
          n_in: int | None = None, tied_head: bool = False) -> nnx.Param:
    """A parameter tagged with logical axis names (read by sharding.rules).

    Models are built under `nnx.eval_shape` for their structure only (loading/safetensors.py
    fills in a checkpoint's or random values), so the value is zeros: drawing random ones
    there cost a warm start 1.2 s of tracing. A float weight of a matmul is tagged with
    `n_in`, its number of input dims (its shape is in + out), which
    `weights_for_native_matmul` uses to lay it out as out + in; an embedding that is also
    the LM head with `tied_head` (already `[N, K]`; it may be packed too).
    """
    tags = {} if n_in is None else {"n_in": n_in}
    if tied_head:
        tags["tied_head"] = True
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes, **tags)


def linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...],
           in_axes: tuple[str, ...], out_axes: tuple[str, ...], dtype,
           options: ModelOptions) -> tuple[nnx.Param, nnx.Param | None]:
    """(weight, scales) of a linear layer `y = x · W`.

    Unquantized: a float weight of shape `in_shape + out_shape` and no scales. Quantized
    (`options.quantization`): the 2-D `[K, N]` values and the scales of
    pallas_kernels/quantized_matmul (K and N the flattened in and out dims; int4 with zero
    points `[2, K / G, N]`), each tagged with the logical axis of its leading in / out
    dim, which keeps whole heads on one shard; checkpoints overwrite the zeros at load.
    int8 / int4 / fp4 values are tagged `quantized` and their scales `quantized_scales`
    (`weights_for_native_matmul` packs both on a CPU; the native kernel takes no others).
    """
    if options.quantization is None:
        return param(in_shape + out_shape, in_axes + out_axes, dtype,
                     n_in=len(in_shape)), None
    (vshape, vdtype), (sshape, sdtype) = quantized_shapes(
        math.prod(in_shape), math.prod(out_shape), options.quantization,
        options.quant_group_size, options.quant_zero_points)
    native = options.quantization in ("int8", "int4", "fp4")
    values = nnx.Param(jnp.zeros(vshape, vdtype), logical_axes=(in_axes[0], out_axes[0]),
                       quantized=native)
    scale_axes = (in_axes[0] if sshape[-2] > 1 else None, out_axes[0])
    scales = nnx.Param(jnp.ones(sshape, sdtype),
                       logical_axes=(None,) * (len(sshape) - 2) + scale_axes,
                       quantized_scales=native)
    return values, scales


def quantized_table(rows: int, width: int, dtype, options: ModelOptions
                    ) -> tuple[nnx.Param, nnx.Param]:
    """(values, scales) of an embedding table `[rows, width]` held quantized as
    `options` say, by rows: the transposes of a `[width, rows]` linear weight's
    (values `[rows, K']`, scales `[(2,) rows, width / G]`), so that a lookup reads each
    row's values and scales contiguously (`quantized_rows`)."""
    (vshape, vdtype), (sshape, sdtype) = quantized_shapes(
        width, rows, options.quantization, options.quant_group_size, options.quant_zero_points)
    values = nnx.Param(jnp.zeros(vshape[::-1], vdtype), logical_axes=("vocab", "embed"))
    scales = nnx.Param(jnp.ones((*sshape[:-2], sshape[-1], sshape[-2]), sdtype),
                       logical_axes=(None,) * (len(sshape) - 2) + ("vocab", None))
    return values, scales


def act_order_perm(in_features: int, options: ModelOptions) -> nnx.Param | None:
    """The input permutation of a quantized linear layer of an act-order checkpoint (GPTQ's
    desc_act): its rows were quantized in groups of that order, so the layer holds them
    so ordered and computes `x[..., perm] @ W[perm]` (= x @ W); None otherwise."""
    if options.quantization is None or not options.quant_act_order:
        return None
    return nnx.Param(jnp.arange(in_features, dtype=jnp.int32), logical_axes=(None,))


def matmul(x: jax.Array, w: jax.Array, scales: jax.Array | None, n_in: int,
           out_shape: tuple[int, ...], options: ModelOptions, impl: str | None = None,
           rows: jax.Array | None = None, transposed: bool = False,
           packed: bool = False) -> jax.Array:
    """Contract the last `n_in` dims of x with a weight made by `linear` (its values).

    A quantized weight (its kind read from its values: a model may hold layers in several
    formats, ModelOptions.quant_overrides) runs the quantized-matmul kernel of `impl`
    (default: the options' choice) on x flattened to `[tokens, K]` (on a CPU, the native
    kernel); `packed`: its values and scales in that kernel's strips. A float weight is
    one XLA dot, or on a CPU the native matmul (pallas_kernels/matmul), which computes
    only the first `rows` tokens (the real ones of a bucket-padded batch) and zeros the
    rest. A `transposed` float weight is laid out out + in, and a `packed` one also packed
    (`weights_for_native_matmul`).
    """
    lead = x.shape[: x.ndim - n_in]
    x2 = x.reshape(math.prod(lead), -1)
    if scales is None:
        if dense_impl(options, impl) == "reference":  # w's in dims lead, or end if transposed
            if packed:
                w = packed_layout.unpack(w.reshape(-1, x2.shape[1])).reshape(w.shape)
            w_in = range(w.ndim - n_in, w.ndim) if transposed else range(n_in)
            return jnp.tensordot(x, w, axes=(tuple(range(x.ndim - n_in, x.ndim)), tuple(w_in)))
        y = dense_matmul(x2, _flat(w, x2.shape[1], transposed), rows, transpose_w=transposed,
                         packed_w=packed)
    else:
        impl = impl or options.kernel_impl
        y = quantized_matmul(x2, w, scales, kind=kind_of(w, scales), impl=impl,
                             interpret=options.interpret and impl not in (None, "reference",
                                                                           "cpu"),
                             rows=rows, packed=packed)
    return y.reshape(lead + out_shape)


def matmul_group(x: jax.Array, ws: list[jax.Array], out_shapes: list[tuple[int, ...]],
                 rows: jax.Array | None = None, transposed: bool = False,
                 packed: bool = False) -> list[jax.Array]:
    """Several float weights against the same x (last dim contracted) in one native CPU
    matmul call (see `matmul`), which streams them together for a few tokens."""
    x2 = x.reshape(-1, x.shape[-1])
    ys = dense_matmuls(x2, [_flat(w, x2.shape[1], transposed) for w in ws], rows,
                       transpose_w=transposed, packed_w=packed)
    return [y.reshape(x.shape[:-1] + shape) for y, shape in zip(ys, out_shapes)]


def _flat(w: jax.Array, k: int, transposed: bool) -> jax.Array:
    return w.reshape(-1, k) if transposed else w.reshape(k, -1)


def is_transposed(w: nnx.Param) -> bool:
    """Whether a float weight is laid out out + in (`weights_for_native_matmul`)."""
    return bool(w.get_metadata().get("transposed", False))


def is_packed(w: nnx.Param) -> bool:
    """Whether a float weight laid out out + in (or a tied embedding) is packed for the
    native matmul (pallas_kernels/matmul/packed.py), or a quantized weight's values (and
    scales) for the native quantized kernel (`weights_for_native_matmul`)."""
    return bool(w.get_metadata().get("packed", False))


def weights_for_native_matmul(state: nnx.State, pack: bool | None = None) -> nnx.State:
    """The float matmul weights (the parameters tagged `n_in`) laid out out + in, i.e. as
    `[N, K]`, tagged `transposed`; `matmul` and `lm_head` read them so.

    For the native CPU matmul with few rows (decode): an `[N, K]` weight is dot products
    over its rows, one sequential stream per thread, where a `[K, N]` weight streams
    several rows at once into partial sums: bf16 decode of smollm2-135m's shape 11.3 ms a
    token against 14.7 ms, and no slower with more rows (docs/kernels.md). The weights are
    replaced in `state` itself, one at a time, so the peak is one weight more than the
    model. Only for one device: the weights of a mesh are partitioned by XLA and run its
    dots.

    With `pack` (None: where this CPU has the kernel's AVX-512 panels for the dtype; below
    them the kernel reads packed weights through generic loops), a weight whose `[N, K]`
    can be packed (N a multiple of 64; bf16: K even) is also packed (tagged `packed`):
    its 64-row strips stored as the panels the kernel's tiles read, so that no call copies
    them (pallas_kernels/matmul/packed.py); so is a tied embedding (the LM head; its
    lookups read the packed rows, `embedding`). Measured on smollm2-135m's layers (Zen 5
    EPYC, bf16 / float32): 32 rows 0.79-0.80x / 0.92-0.93x the time of `[N, K]`, 5 rows
    0.84-0.85x / 0.84-0.88x, one row 0.91x / 1.01-1.02x (docs/kernels.md).

    The int8 / int4 / fp4 values and scales of quantized linear layers (N a multiple of 32) are
    packed in strips of 32 columns, the quantized kernel's layout
    (quantized_matmul.pack_strips: each of its tiles then reads sequential streams);
    `pack=False` leaves them too.
    """
    def packs(n: int, k: int, dtype) -> bool:
        return ((packed_layout.worth_packing(dtype) if pack is None else pack)
                and packed_layout.packable(n, k, dtype))

    flat = nnx.to_flat_state(state)
    for _, var in flat:
        meta = var.get_metadata()
        if meta.get("quantized") or meta.get("quantized_scales"):
            value = var.get_value()  # values and their scales share N: both or neither
            if (pack is not False and not meta.get("packed")
                    and (packable(value) if meta.get("quantized")
                         else value.shape[-1] % STRIP == 0)):
                var.set_value(pack_strips(value))
                var.set_metadata(packed=True)
            continue
        n_in = meta.get("n_in")
        if meta.get("tied_head") and not meta.get("packed"):  # [N, K] already
            value = var.get_value()
            if packs(*value.shape, value.dtype):
                var.set_value(packed_layout.pack(value))
                var.set_metadata(packed=True)
            continue
        if n_in is None or meta.get("transposed"):
            continue
        value = var.get_value()
        order = tuple(range(n_in, value.ndim)) + tuple(range(n_in))
        value = jnp.transpose(value, order)
        k = math.prod(value.shape[value.ndim - n_in:])
        n = value.size // max(k, 1)
        packed = packs(n, k, value.dtype)
        if packed:
            value = packed_layout.pack(value.reshape(n, k)).reshape(value.shape)
        var.set_value(value)
        axes = meta["logical_axes"]
        var.set_metadata(logical_axes=axes[n_in:] + axes[:n_in], transposed=True,
                         packed=packed)
    return nnx.from_flat_state(flat)


def embedding(table: nnx.Param, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an embedding table, packed (a tied LM head on a CPU) or not."""
    if is_packed(table):
        return packed_layout.take_rows(table[...], ids)
    return table[...][ids]


def quantized_embedding(values: nnx.Param, scales: nnx.Param, ids: jax.Array,
                        dtype) -> jax.Array:
    """Rows `ids` (`[T, K]` in `dtype`) of the table a quantized `[K, N]` weight holds
    transposed: a tied embedding that only its quantized LM head holds
    (ModelOptions.embed_from_lm_head), each looked-up column dequantized. Packed values
    and scales (a CPU) are read in place; unpacked ones through a gather that XLA
    partitions on a mesh (the head's vocabulary split: each device its columns)."""
    v, s = values[...], scales[...]
    if is_packed(values):
        v, s = _packed_columns(v, ids), _packed_columns(s, ids)
    else:
        v, s = jnp.take(v, ids, axis=-1), jnp.take(s, ids, axis=-1)
    # The few columns taken, transposed to rows: dequantizing by rows is the fast way
    # (a 512-token lookup of Llama 3's table took half the time of column order).
    return dequantize_rows(v.T, jnp.swapaxes(s, -1, -2), kind_of(v, s), dtype)


def quantized_rows(values: nnx.Param, scales: nnx.Param, ids: jax.Array,
                   dtype) -> jax.Array:
    """Rows `ids` (`[T, K]` in `dtype`) of a table held quantized by rows
    (`quantized_table`: an untied embedding, quant_overrides' "embed"), dequantized."""
    v, s = values[...], scales[...]
    return dequantize_rows(jnp.take(v, ids, axis=0), jnp.take(s, ids, axis=-2), kind_of(v, s),
                           dtype)


def _packed_columns(a: jax.Array, ids: jax.Array) -> jax.Array:
    """`a[..., ids]` of a `[..., K', N]` array stored in strips (pack_strips), gathered
    from its flat planes: column c of strip c // STRIP, row r at (c // STRIP) K' STRIP +
    r STRIP + c % STRIP."""
    *lead, k, n = a.shape
    offsets = ((ids // STRIP) * (k * STRIP) + ids % STRIP)[None, :] \
        + (jnp.arange(k) * STRIP)[:, None]
    return a.reshape(*lead, k * n)[..., offsets]


def dense_impl(options: ModelOptions, impl: str | None = None) -> str:
    """Who computes a float matmul: "cpu" (the native kernel) where the options and the
    platform allow it and it is available, else "reference" (XLA's dot)."""
    impl = impl or options.kernel_impl
    if impl is None:
        return default_dense_impl()
    return "cpu" if impl == "cpu" else "reference"


def lm_head(x: jax.Array, w: jax.Array, transpose_w: bool, options: ModelOptions,
            impl: str | None = None, rows: jax.Array | None = None,
            dtype=jnp.float32, packed: bool = False) -> jax.Array:
    """Logits `x @ w` (`x @ w.T` for a `[vocab, hidden]` weight: a tied embedding, or a
    transposed LM head, `packed` or not) in `dtype` (None: the matmul's); on the native path
    only the first `rows` rows are computed."""
    if dense_impl(options, impl) == "reference":
        w = packed_layout.unpack(w) if packed else w
        logits = x @ (w.T if transpose_w else w)
    else:
        logits = dense_matmul(x, w, rows, transpose_w=transpose_w, packed_w=packed)
    return logits if dtype is None else logits.astype(dtype)


rms_norm = rms_norm_reference  # the models' norm on every row (XLA; rows_impl for the kernel)


def rows_impl(options: ModelOptions, rows: jax.Array | None) -> str | None:
    """Who computes the row-wise ops (pallas_kernels/rows.py: norms, gated activations):
    where the float matmuls are native and the real row count is known (one device), the
    native kernels on the real rows when they take the operands (None: their own choice);
    else XLA on every row."""
    return None if rows is not None and dense_impl(options) == "cpu" else "reference"


def rope_attention_factor(scaling: RopeScaling) -> float:
    """What YaRN and LongRoPE multiply the rotated q and k by (1 for the other scalings;
    a partial rope's other dimensions are left as they are)."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if scaling.factor <= 1 else math.sqrt(
            1 + math.log(scaling.factor) / math.log(original))

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * scale * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


def activation(name: str):
    """The MLP's gate activation by its config name: SwiGLU's silu, GeGLU's tanh gelu."""
    return ACTIVATIONS[name]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies of the rotary embedding (`head_dim`: the dimensions it turns),
    with 'linear', 'llama3', 'yarn' or 'longrope' scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if scaling.use_long_factor else scaling.short_factor
        return (inv_freq / np.asarray(factors, np.float32)).astype(np.float32)
    if scaling.rope_type == "yarn":
        # The slowest-turning frequencies (fewer than beta_slow turns over the original
        # context) are interpolated by `factor`, those turning more than beta_fast times
        # kept, a linear ramp between.
        def dim_of(turns: float) -> float:
            return head_dim * math.log(scaling.original_max_position_embeddings
                                       / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low)
                       / ((high + 0.001 if low == high else high) - low), 0, 1)
        return (inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)).astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq
