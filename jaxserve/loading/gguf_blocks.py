"""GGUF's quantized blocks as integers and group scales: the linear layers of a GGUF file
kept as stored, in the formats of pallas_kernels/quantized_matmul.

Every type below stores, per group of g consecutive weights of a row, small integers u and
a float scale s (products of float16 block scales and the K-quants' small integer
sub-block scales: exact in float32), and for some an offset b per group:
w = s * u + b, or w = s * (u - c) for a fixed centre c. `decode` reads a tensor's blocks
into signed integers q = u - c that fit 4 or 8 bits, the group scales and, for the types
with offsets, zero points z = -c - b / s, so that w = (q - z) * s, our zero-point form:

| type | bits kept | g  | offset | w                                   |
|------|-----------|----|--------|-------------------------------------|
| Q4_0 | 4         | 32 | no     | d (u - 8)                           |
| Q4_1 | 4         | 32 | yes    | d u + m                             |
| Q5_0 | 8         | 32 | no     | d (u - 16)                          |
| Q5_1 | 8         | 32 | yes    | d u + m                             |
| Q8_0 | 8         | 32 | no     | d q                                 |
| Q2_K | 4         | 16 | yes    | d sc u - dmin m (u in 0..3)         |
| Q3_K | 4         | 16 | no     | d (sc - 32) q (q in -4..3)          |
| Q4_K | 4         | 32 | yes    | d sc u - dmin m (u in 0..15)        |
| Q5_K | 8         | 32 | yes    | d sc u - dmin m (u in 0..31)        |
| Q6_K | 8         | 16 | no     | d sc q (sc int8, q in -32..31)      |
| IQ4_NL | 8       | 32 | no     | d L[u] (u in 0..15)                 |
| IQ4_XS | 8       | 32 | no     | d (sc - 32) L[u] (u in 0..15)       |

MXFP4 (gpt-oss's experts) is held as our fp4 in groups of 32 (`mxfp4_as_ours`): its blocks'
bytes as they are and its e8m0 scales as bfloat16 powers of two, not through `decode`.

IQ4_NL and IQ4_XS store 4-bit indices into a fixed table L of 16 non-uniform levels
(integers from -127 to 113, ggml's kvalues_iq4nl): no 4-bit affine format holds them, so
they are held as int8, the levels themselves (exact; 8 bits a weight where the file
spends 4.25-4.5).

The lattice types store each 4 or 8 weights as an index into a codebook of points with
small integer coordinates (ggml's iq2xxs_grid ...: 8, 25, 43 for IQ2; up to 62 for
IQ3_XXS; odd 1-15 for IQ3_S), signs, and a scale per group: w = db * grid * sign, with db
from the block's float16 d and a 4-bit sub-scale ls (IQ2_XXS, IQ2_XS, IQ2_S: d (0.5 + ls)
/ 4; IQ3_XXS: d (0.5 + ls) / 2; IQ3_S: d (1 + 2 ls)). Each product is exact in float32, so
the integers grid * sign are recovered from the `gguf` package's dequantization divided by
db (and checked) and held as int8 in groups of 32 (IQ2_XS and IQ2_S: 16): exact, 8 bits a
weight where the file spends 2.06-3.44. IQ1_S and IQ1_M's points have coordinates -1, 0, 1
and an offset of +-1/8 per 8 points: w = d (1 + 2 ls) (grid +- 1/8), so db = d (1 + 2 ls)
/ 8 and the integers are 8 grid +- 1 (+-1, +-7, +-9), held as int8 in groups of 32 (IQ1_M:
16; its d spread over its scales' top nibbles): 8 bits a weight where the file spends
1.56-1.75.

The symmetric types are held exactly; the offsets' zero points are exact up to float32's
rounding of b / s (w differs from the `gguf` package's s u + b by a few units in the last
place of the group's largest |w|). A group with s = 0 and b != 0 (every weight b) is held as
q = 0, z = -1, s = b.

A file mixes types across its layers (Q4_K_M: Q4_K, Q6_K, and where a layer's rows are not a
multiple of 256, Q5_0 or Q8_0); each layer is held in its own type's format (`stored_format`:
int4 or int8 as the table says, the type's group, zero points where it has offsets), and
`as_ours` puts a tensor in a format (a wider one too: a group of 32's scale repeated over two
groups of 16, zero points of 0 for a symmetric type).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# GGMLQuantizationType values.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, IQ2_S = 16, 17, 18, 21, 22
IQ1_S, IQ1_M = 19, 29
MXFP4 = 39  # gpt-oss's experts: e2m1 codes in blocks of 32 with an e8m0 scale
# IQ4_NL's and IQ4_XS's levels (ggml-common.h's kvalues_iq4nl).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                       113], np.int8)


@dataclasses.dataclass(frozen=True)
class BlockType:
    name: str
    block: int  # weights per block
    size: int  # bytes per block
    bits: int  # 4 or 8: the integer format of ours that holds its values
    group: int  # weights per scale
    offsets: bool  # whether it stores an offset per group


TYPES = {t: BlockType(*spec) for t, spec in {
    Q4_0: ("Q4_0", 32, 18, 4, 32, False), Q4_1: ("Q4_1", 32, 20, 4, 32, True),
    Q5_0: ("Q5_0", 32, 22, 8, 32, False), Q5_1: ("Q5_1", 32, 24, 8, 32, True),
    Q8_0: ("Q8_0", 32, 34, 8, 32, False),
    Q2_K: ("Q2_K", 256, 84, 4, 16, True), Q3_K: ("Q3_K", 256, 110, 4, 16, False),
    Q4_K: ("Q4_K", 256, 144, 4, 32, True), Q5_K: ("Q5_K", 256, 176, 8, 32, True),
    Q6_K: ("Q6_K", 256, 210, 8, 16, False),
    IQ4_NL: ("IQ4_NL", 32, 18, 8, 32, False), IQ4_XS: ("IQ4_XS", 256, 136, 8, 32, False),
    IQ2_XXS: ("IQ2_XXS", 256, 66, 8, 32, False), IQ2_XS: ("IQ2_XS", 256, 74, 8, 16, False),
    IQ2_S: ("IQ2_S", 256, 82, 8, 16, False), IQ3_XXS: ("IQ3_XXS", 256, 98, 8, 32, False),
    IQ3_S: ("IQ3_S", 256, 110, 8, 32, False), IQ1_S: ("IQ1_S", 256, 50, 8, 32, False),
    IQ1_M: ("IQ1_M", 256, 56, 8, 16, False)}.items()}


@dataclasses.dataclass(frozen=True)
class Format:
    """Our format for a file's linear layers (EngineConfig's quantization fields)."""
    kind: str  # "int4" | "int8" | "fp4"
    group: int
    zero_points: bool


def stored_format(kind: int) -> Format | None:
    """The format that holds a tensor of GGML type `kind` as stored; None when it is not a
    type this module reads (floats): the tensor is dequantized."""
    if kind == MXFP4:
        return Format("fp4", 32, False)
    if kind not in TYPES:
        return None
    spec = TYPES[kind]
    return Format("int4" if spec.bits == 4 else "int8", spec.group, spec.offsets)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (the last axis) as the float16 they hold, in float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes `[..., R * run]` -> 4-bit values: for each run of `run` bytes, their low
    nibbles, then their high ones."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, run) >> np.array([0, 4], np.uint8)[:, None]
    return (qs & 0xF).reshape(*qs.shape[:-3], -1)


def _bits(packed: np.ndarray, width: int, run: int) -> np.ndarray:
    """Bytes `[..., R * run]` -> `width`-bit fields: for each run of `run` bytes, their
    lowest fields, then the next ones up (the K-quants' layout of their high bits)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    fields = packed.reshape(*packed.shape[:-1], -1, 1, run) >> shifts
    return (fields & ((1 << width) - 1)).reshape(*packed.shape[:-1], -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml's
    get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def _q3_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> sixteen 6-bit scales minus 32: low nibbles from the first 8
    bytes (low then high nibbles), 2 high bits from the last 4 (four fields each)."""
    low = _nibbles(scales[..., :8], 8)
    high = _bits(scales[..., 8:], 2, 4)
    return (low | (high << 4)).astype(np.int8) - 32


def _read(data: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                int]:
    """Blocks `[B, size]` -> (u [B, block] int, s [B, block / g], b or None, centre c):
    w = s * u + b for the types with offsets b, else s * (u - c); q = u - c fits the bits
    we keep."""
    f = np.float32
    if kind in (Q4_0, Q4_1, Q5_0, Q5_1):
        d = _f16(data[:, 0:2])[:, None]
        b = _f16(data[:, 2:4])[:, None] if kind in (Q4_1, Q5_1) else None
        at = 4 if b is not None else 2
        u = _nibbles(data[:, -16:], 16)
        if kind in (Q5_0, Q5_1):  # bit i of the 32-bit word before qs is element i's 5th
            u = u | (_bits(data[:, at:at + 4], 1, 4).reshape(-1, 8, 4).swapaxes(1, 2)
                     .reshape(-1, 32) << 4)
        return u, d, b, 8 if kind in (Q4_0, Q4_1) else 16
    if kind == Q8_0:
        return data[:, 2:].view(np.int8), _f16(data[:, 0:2])[:, None], None, 0
    if kind == Q2_K:
        sc, qs, d, dmin = data[:, :16], data[:, 16:80], _f16(data[:, 80:82]), \
            _f16(data[:, 82:84])
        u = _bits(qs, 2, 32)
        return u, d[:, None] * (sc & 0xF).astype(f), -(dmin[:, None] * (sc >> 4).astype(f)), 2
    if kind == Q3_K:
        hmask, qs, d = data[:, :32], data[:, 32:96], _f16(data[:, 108:110])
        q = _bits(qs, 2, 32).astype(np.int8) - ((_bits(hmask, 1, 32) ^ 1) << 2).astype(np.int8)
        return q, d[:, None] * _q3_scales(data[:, 96:108]).astype(f), None, 0
    if kind in (Q4_K, Q5_K):
        d, dmin = _f16(data[:, 0:2]), _f16(data[:, 2:4])
        sc, mins = _k_scales(data[:, 4:16])
        u = _nibbles(data[:, -128:], 32)
        if kind == Q5_K:
            u = u | (_bits(data[:, 16:48], 1, 32) << 4)
        return (u, d[:, None] * sc.astype(f), -(dmin[:, None] * mins.astype(f)),
                8 if kind == Q4_K else 16)
    if kind == Q6_K:
        ql, qh, d = data[:, :128], data[:, 128:192], _f16(data[:, 208:210])
        q = (_nibbles(ql, 64) | (_bits(qh, 2, 32) << 4)).astype(np.int8) - 32
        return q, d[:, None] * data[:, 192:208].view(np.int8).astype(f), None, 0
    if kind == IQ4_NL:
        return IQ4_LEVELS[_nibbles(data[:, 2:], 16)], _f16(data[:, 0:2])[:, None], None, 0
    if kind == IQ4_XS:  # 8 groups' 6-bit scales: 4 low bits a nibble, 2 high bits a field
        ls = _nibbles(data[:, 4:8], 1) | (_bits(data[:, 2:4], 2, 1) << 4)
        d = _f16(data[:, 0:2])[:, None]
        return (IQ4_LEVELS[_nibbles(data[:, 8:], 16)],
                d * (ls.astype(np.int8) - np.int8(32)).astype(f), None, 0)
    if kind in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M):
        scales = _lattice_scales(data, kind)
        return _lattice(data, kind, scales), scales, None, 0
    raise ValueError(f"GGML type {kind} is not one gguf_blocks reads")


def _lattice_scales(data: np.ndarray, kind: int) -> np.ndarray:
    """The group scales db `[B, 256 / g]` of lattice-type blocks (module doc), computed in
    float32 as ggml does."""
    f = np.float32
    d = _f16(data[:, 0:2])[:, None]
    if kind == IQ2_XXS:  # the top nibble of each group's second 32-bit word
        return d * (f(0.5) + (data[:, 2:66].reshape(-1, 8, 8)[:, :, 7] >> 4).astype(f)) * f(0.25)
    if kind == IQ3_XXS:  # the top nibble of each group's word after the 64 index bytes
        return d * (f(0.5) + (data[:, 66:98].reshape(-1, 8, 4)[:, :, 3] >> 4).astype(f)) \
            * f(0.5)
    if kind == IQ3_S:  # the last 4 bytes: a nibble a group, low first
        return d * (1 + 2 * _nibbles(data[:, -4:], 1)).astype(f)
    if kind == IQ1_S:  # bits 12-14 of each group's 16-bit word after the index bytes
        ls = (np.ascontiguousarray(data[:, 34:50]).view("<u2") >> 12) & 7
        return d * (1 + 2 * ls).astype(f) * f(0.125)
    if kind == IQ1_M:  # four 16-bit words: 3 bits a group of 16, d in their top nibbles
        sc = np.ascontiguousarray(data[:, 48:56]).view("<u2")
        top = (sc & 0xF000) >> np.array([12, 8, 4, 0], np.uint16)
        d = np.bitwise_or.reduce(top, axis=1).view(np.float16).astype(f)
        ls = (sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
        return d[:, None] * (1 + 2 * ls.reshape(len(data), 16)).astype(f) * f(0.125)
    return d * (f(0.5) + _nibbles(data[:, -8:], 1).astype(f)) * f(0.25)  # IQ2_XS, IQ2_S


def _lattice(data: np.ndarray, kind: int, scales: np.ndarray) -> np.ndarray:
    """The signed integer coordinates `[B, 256]` of lattice-type blocks: the `gguf`
    package's dequantization over each group's db (`scales`), which must come out whole."""
    from gguf.quants import dequantize

    w = np.asarray(dequantize(data, kind), np.float32).reshape(len(data), -1)
    s = np.repeat(scales, TYPES[kind].group, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, np.float32(0), np.rint(w / s))
    if not np.array_equal(q * s, w):
        raise ValueError(f"{TYPES[kind].name} blocks whose weights are not whole multiples "
                         "of their group scales: not a layout gguf_blocks knows")
    return q.astype(np.int8)


@dataclasses.dataclass
class Decoded:
    """A tensor's weights `[N, K]` as w = (q - z) * s per group of `group` along K."""
    q: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # float32 [N, K / group]
    zeros: np.ndarray | None  # float32 [N, K / group]; None: symmetric
    group: int


def decode(data: np.ndarray, kind: int, n: int, k: int) -> Decoded:
    """A tensor's raw bytes (`[N, K / block * size]`, as the `gguf` package reads them)."""
    spec = TYPES[kind]
    u, s, b, c = _read(np.asarray(data).reshape(-1, spec.size), kind)
    q = (u.astype(np.int16) - c).reshape(n, k // spec.group, spec.group)
    s = s.reshape(n, k // spec.group)
    z = None
    if b is not None:
        b = b.reshape(s.shape)
        flat = s == 0  # every weight of the group is b: q = 0, z = -1, s = b
        q[flat] = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(flat, np.float32(-1), -np.float32(c) - b / s).astype(np.float32)
        s = np.where(flat, b, s)
    return Decoded(q.reshape(n, k).astype(np.int8), s.astype(np.float32), z, spec.group)


def split(t: Decoded, parts: int) -> list[Decoded]:
    """A stack's rows (`[E * N, K]`, the experts' weights one after another) per expert."""
    zeros = [None] * parts if t.zeros is None else np.split(t.zeros, parts)
    return [Decoded(q, s, z, t.group) for q, s, z in
            zip(np.split(t.q, parts), np.split(t.scales, parts), zeros)]


def as_ours(t: Decoded, fmt: Format):
    """`t` in `fmt`: values `[K', N]` and scales `[K / G, N]` (`[2, K / G, N]` with zero
    points) as pallas_kernels/quantized_matmul reads them."""
    from jaxserve.loading.prequantized import Prequantized

    repeat = t.group // fmt.group
    scales = np.repeat(t.scales, repeat, axis=1).T
    if fmt.zero_points:
        zeros = (np.zeros_like(t.scales) if t.zeros is None else t.zeros)
        scales = np.stack([scales, np.repeat(zeros, repeat, axis=1).T])
    q = t.q.T  # [K, N]
    if fmt.kind == "int4":  # a group's row j in the low nibble, row j + G/2 in the high
        k, n = q.shape
        halves = q.reshape(k // fmt.group, 2, fmt.group // 2, n).astype(np.uint8) & 0xF
        q = (halves[:, 0] | (halves[:, 1] << 4)).reshape(k // 2, n)
    return Prequantized(np.ascontiguousarray(q), np.ascontiguousarray(scales, np.float32))


def mxfp4_as_ours(data: np.ndarray, shape: tuple[int, ...]):
    """An MXFP4 tensor (`shape` [..., N, K]; ggml's block_mxfp4 per 32 weights of a row:
    an e8m0 byte e, then 16 bytes whose low nibbles are the block's e2m1 codes 0-15 and
    high nibbles 16-31, with w = e2m1(code) 2^(e - 127)) as our fp4 in groups of 32:
    values `[..., K / 2, N]` (those bytes are our packing of a group already: its row j in
    the low nibble, row j + 16 in the high one), bfloat16 scales `[..., K / 32, N]`."""
    from jaxserve.loading.prequantized import Prequantized, e8m0_as_bfloat16

    *lead, n, k = shape
    blocks = np.asarray(data, np.uint8).reshape(*lead, n, k // 32, 17)
    values = np.moveaxis(blocks[..., 1:].reshape(*lead, n, k // 2), -1, -2)
    scales = np.moveaxis(e8m0_as_bfloat16(blocks[..., 0]), -1, -2)
    return Prequantized(np.ascontiguousarray(values), np.ascontiguousarray(scales))
