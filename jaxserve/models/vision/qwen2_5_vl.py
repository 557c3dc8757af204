"""Qwen2.5-VL's vision transformer and patch merger, over one image's patches laid out by
the host (engine/multimodal/qwen_inputs.py): in window order, each window padded to
`window_patches` rows, so that window attention is attention within blocks of that size
and the layers of `fullatt_block_indexes` attend over all of the image's real patches.

Per patch: a linear patch embedding (HF's Conv3d with stride = kernel), RMSNorm'd
pre-norm layers of attention (q/k/v and output with biases, 2-D rotary positions: the
first half of each head's frequencies turned by the patch's row, the second by its
column) and a SwiGLU MLP with biases; then every 2 x 2 patches (consecutive in this
order) are merged: RMSNorm, concatenated, Linear-GELU-Linear into the language model's
width. Norms and softmax in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import QwenVisionConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QwenVisionLayer:
    norm1: jax.Array  # [D]
    qkv_w: jax.Array  # [D, 3, D]
    qkv_b: jax.Array  # [3, D]
    proj_w: jax.Array  # [D, D]
    proj_b: jax.Array
    norm2: jax.Array
    gate_w: jax.Array  # [D, M]
    gate_b: jax.Array
    up_w: jax.Array
    up_b: jax.Array
    down_w: jax.Array  # [M, D]
    down_b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QwenVisionParams:
    patch_w: jax.Array  # [patch_dim, D]
    layers: list[QwenVisionLayer]
    merger_norm: jax.Array  # [D]
    merger_1_w: jax.Array  # [4D, 4D]
    merger_1_b: jax.Array
    merger_2_w: jax.Array  # [4D, T]
    merger_2_b: jax.Array


def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps)
    return w * h.astype(x.dtype)


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half rotary on `[N, H, d]`, in float32."""
    h = x.astype(jnp.float32)
    half = h.shape[-1] // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def attention(x: jax.Array, layer: QwenVisionLayer, heads: int, cos: jax.Array,
              sin: jax.Array, valid: jax.Array, blocks: int) -> jax.Array:
    """Attention within each of `blocks` equal blocks of rows (1: the whole image), to the
    `valid` (real) patches only."""
    n, d = x.shape
    qkv = jnp.einsum("nd,dke->nke", x, layer.qkv_w) + layer.qkv_b
    q, k, v = (qkv[:, i].reshape(n, heads, d // heads) for i in range(3))
    q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    q, k, v = (a.reshape(blocks, n // blocks, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * (d // heads) ** -0.5
    scores = jnp.where(valid.reshape(blocks, 1, 1, -1), scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(n, d)
    return out @ layer.proj_w + layer.proj_b


def embed_image(params: QwenVisionParams, patches: jax.Array, positions: jax.Array,
                valid: jax.Array, cfg: QwenVisionConfig) -> jax.Array:
    """`[N, patch_dim]` patches (N = windows x window_patches, in window order), their
    (row, column) `[N, 2]` and whether each is real `[N]` -> `[N / 4, text hidden]`, one
    row per merged 2 x 2 (padding's rows are garbage, for the caller to drop)."""
    dtype = params.patch_w.dtype
    n, heads, d = patches.shape[0], cfg.num_heads, cfg.hidden_size
    x = patches.astype(dtype) @ params.patch_w
    half = d // heads // 2
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)
    freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [N, 2, half / 2]
    freqs = freqs.reshape(n, -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    windows = n // cfg.window_patches
    for i, layer in enumerate(params.layers):
        blocks = 1 if i in cfg.fullatt_block_indexes else windows
        x = x + attention(rms_norm(x, layer.norm1), layer, heads, cos, sin, valid, blocks)
        h = rms_norm(x, layer.norm2)
        gate = jax.nn.silu(h @ layer.gate_w + layer.gate_b)
        x = x + (gate * (h @ layer.up_w + layer.up_b)) @ layer.down_w + layer.down_b
    unit = cfg.spatial_merge_size ** 2
    h = rms_norm(x, params.merger_norm).reshape(n // unit, unit * d)
    h = jax.nn.gelu(h @ params.merger_1_w + params.merger_1_b, approximate=False)
    return h @ params.merger_2_w + params.merger_2_b


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where an image's patches go in `embed_image`'s input (host arrays): the processor's
    patch at each row (`patch`, -1 for padding), each row's (row, column) `positions`
    and `valid`, and for each merged output row the image token it is (`token`, -1 for
    padding)."""

    patch: np.ndarray  # [N]
    positions: np.ndarray  # [N, 2]
    valid: np.ndarray  # [N]
    token: np.ndarray  # [N / merge^2]

    def num_windows(self, cfg: QwenVisionConfig) -> int:
        return len(self.patch) // cfg.window_patches



def window_side(cfg: QwenVisionConfig) -> int:
    """Merged tokens per side of a window."""
    return cfg.window_size // cfg.patch_size // cfg.spatial_merge_size


def count_windows(grid_h: int, grid_w: int, cfg: QwenVisionConfig) -> int:
    """The windows an image of `grid_h` x `grid_w` patches is cut into."""
    m, side = cfg.spatial_merge_size, window_side(cfg)
    return -(-(grid_h // m) // side) * -(-(grid_w // m) // side)


def layout(grid_h: int, grid_w: int, cfg: QwenVisionConfig, num_windows: int | None = None
           ) -> Layout:
    """The layout of an image of `grid_h` x `grid_w` patches (the processor's order: 2 x 2
    merge units row-major, each unit's patches row-major), its windows (of
    `window_size` pixels, row-major, each unit once, row-major within) padded to
    `window_patches` rows each, then to `num_windows` windows (default: as many as it
    has). HF's window index, position ids and their reverse permutation, as arrays."""
    m = cfg.spatial_merge_size
    side = window_side(cfg)
    lh, lw = grid_h // m, grid_w // m
    units = np.arange(lh * lw).reshape(lh, lw)
    nh, nw = -(-lh // side), -(-lw // side)
    padded = np.full((nh * side, nw * side), -1)
    padded[:lh, :lw] = units
    windows = padded.reshape(nh, side, nw, side).transpose(0, 2, 1, 3).reshape(nh * nw, -1)
    total = num_windows or len(windows)
    if total < len(windows):
        raise ValueError(f"an image of {len(windows)} windows does not fit {total}")
    unit = m * m
    token = np.full((total, side * side), -1, np.int64)
    for w, row in enumerate(windows):
        real = row[row >= 0]
        token[w, :len(real)] = real
    token = token.reshape(-1)
    j = np.arange(unit)
    patch = np.where(token[:, None] >= 0, token[:, None] * unit + j, -1).reshape(-1)
    u = np.repeat(token, unit)
    rows = (u // lw) * m + np.tile(j // m, len(token))
    cols = (u % lw) * m + np.tile(j % m, len(token))
    valid = patch >= 0
    positions = np.where(valid[:, None], np.stack([rows, cols], -1), 0).astype(np.int32)
    return Layout(patch.astype(np.int64), positions, valid, token)


def rope_offsets(num_tokens: int, images: list[tuple[int, tuple[int, int]]],
                 cfg: QwenVisionConfig) -> tuple[np.ndarray, int]:
    """M-RoPE's positions for a prompt of `num_tokens` with images at (first token,
    (rows, columns) of patches), as offsets from each token's position: `[3, num_tokens]`,
    and the offset of every token after the prompt (HF's get_rope_index and rope_deltas).
    Text counts on from the last position; an image's tokens sit at (t, t + row, t + col)
    from the position t where it starts, and the text after it starts at t + max(rows,
    columns) (in merged tokens)."""
    m = cfg.spatial_merge_size
    positions = np.zeros((3, num_tokens), np.int64)
    at = last = 0  # the next token, and its position
    for start, (gh, gw) in images:
        positions[:, at:start] = last + np.arange(start - at)
        last += start - at
        lh, lw = gh // m, gw // m
        rows, cols = np.divmod(np.arange(lh * lw), lw)
        positions[0, start:start + lh * lw] = last
        positions[1, start:start + lh * lw] = last + rows
        positions[2, start:start + lh * lw] = last + cols
        last += max(lh, lw)
        at = start + lh * lw
    positions[:, at:] = last + np.arange(num_tokens - at)
    offsets = positions - np.arange(num_tokens)
    return offsets.astype(np.int32), int(positions.max()) + 1 - num_tokens
