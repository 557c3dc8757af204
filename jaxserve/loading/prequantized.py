"""Checkpoints quantized by their makers: AWQ, GPTQ, compressed-tensors, block-wise FP8 and
gpt-oss's MXFP4, served as stored.

`config.json`'s `quantization_config` says which; `read` turns it into a
`CheckpointQuantization` (or refuses, naming the field it cannot serve), and `tensors`
turns the checkpoint's tensors into the layouts of pallas_kernels/quantized_matmul, one
linear layer at a time, with the same integers and scales: nothing is dequantized and
quantized again, and no float copy of a weight is made.

What each becomes (K = in-features, N = out-features, G = the group size):

- AWQ (AutoAWQ's GEMM layout, `version: gemm`, 4 bits, zero points): `qweight` int32
  `[K, N / 8]` (eight columns per word in the order 0 2 4 6 1 3 5 7), `qzeros` int32
  `[K / G, N / 8]` packed the same way, `scales` `[K / G, N]`; w = (u - u0) * scale with
  unsigned u, u0 in [0, 15] -> int4 with zero points (q = u - 8, z = u0 - 8).
- GPTQ (4 or 8 bits; `checkpoint_format` gptq or gptq_v2): `qweight` int32 `[K / P, N]`
  (P = 32 / bits rows per word, row P i + j in bits `bits * j`), `qzeros` int32
  `[K / G, N / P]` (columns likewise), `scales` `[K / G, N]`, `g_idx` `[K]`. gptq (v1)
  stores each zero point minus one. `sym` checkpoints (every zero point 2^(bits-1)) ->
  symmetric int4 / int8; the others -> int4 / int8 with zero points.
  `desc_act` (act-order) checkpoints, whose `g_idx` groups rows in another order: the rows
  sorted by group (stable), so that each group is contiguous as our int4 holds it, and the
  permutation kept (`perm`): the layer computes x[..., perm] @ W[perm] = x @ W, a gather
  of x's features before the matmul (vLLM's GPTQ kernels do the same). `lm_head: true`
  (GPTQModel's, AutoRound's): the LM head quantized likewise, held as stored
  (`lm_head_quantization` and its group and zero points set to the layers'; an act-order
  one is refused).
- compressed-tensors, `pack-quantized` int weights (`weight_packed` int32 `[N, K * bits /
  32]`, values offset by 2^(bits-1); `weight_scale` `[N, K / G]` or `[N, 1]`;
  `weight_zero_point` packed along N when asymmetric): 4 bits -> int4, 8 bits -> int8
  (group or channel, with zero points when asymmetric). `naive-quantized` /
  `int-quantized` int8 (`weight` int8 `[N, K]`, `weight_zero_point` int8 `[N, K / G]`)
  -> int8 likewise.
  `float-quantized` FP8 (e4m3) weights with channel, tensor or block scales -> fp8 (a
  tensor scale repeated per column; a `[bn, bk]` block's scale repeated over its bn
  columns, groups of bk rows: the same products). Activations are not quantized: a W8A8
  checkpoint runs as W8A16 here, its weights exactly as stored.
- FP8 (`quant_method: fp8`, transformers' FineGrainedFP8: DeepSeek-V3, Qwen3-FP8): `weight`
  float8_e4m3fn `[N, K]`, `weight_scale_inv` float32 `[N / bn, K / bk]` for
  `weight_block_size` `[bn, bk]` (w = q * weight_scale_inv) -> fp8 in groups of bk rows,
  as the compressed-tensors blocks.
- MXFP4 (`quant_method: mxfp4`, gpt-oss's experts only; attention, routers, embedding and
  head stay float): `*_blocks` uint8 `[E, N, K / 32, 16]` (two e2m1 codes a byte, the low
  nibble first) and `*_scales` uint8 `[E, N, K / 32]` (e8m0: 2^(s - 127)) per expert
  stack -> fp4 in groups of 32 (pallas_kernels/quantized_matmul: the same e2m1 codes,
  each group's repacked as its halves in the low / high nibbles, the scales 2^(s - 127)
  in bfloat16: exact), 4.5 bits a weight where the file spends 4.25. The attention
  projections are `quant_overrides` held in the dtype.

Otherwise only the decoder's linear layers are quantized in our models (embeddings, norms,
MoE routers and the LM head stay in the model's dtype), so a checkpoint that leaves one of
them unquantized (`modules_to_not_convert`, `ignore`) or quantizes the LM head (but GPTQ's)
or the embedding is refused. A MoE layer's experts are read one by one and stacked as our
grouped matmul's format (the same per-expert layouts; act-order experts are refused).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from pallas_kernels.quantized_matmul.formats import pack_int4

METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
_MXFP4_PART = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_"
                         r"(blocks|scales)$")
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # column of each nibble within a word
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv_proj", "gate_up_proj",  # Phi-3's fused ones
                "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's
# The decoder's linear layers: attention, the MLP, a MoE layer's experts (Mixtral's w1 / w3 /
# w2) and shared expert(s); not the router (`mlp.gate`), which stays float.
_LINEAR = re.compile(
    r"(model\.layers\.\d+\.(?:self_attn|mlp|mlp\.shared_experts?|"
    r"(?:mlp|block_sparse_moe)\.experts\.\d+)\.(?:%s|w1|w2|w3))\.(\w+)$" % "|".join(LINEAR_NAMES))
# What a checkpoint may leave unquantized: the LM head and a MoE layer's routers.
_FLOAT_OK = re.compile(r"(?:re:)?(?:\.\*)?(?:.*\.)?(?:lm_head|gate|shared_expert_gate)\$?")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's own quantization, as this loader serves it."""

    method: str  # "awq" | "gptq" | "compressed-tensors" | "fp8" | "mxfp4"
    kind: str  # what it becomes: "int4" | "int8" | "fp8" | "fp4"
    group_size: int | None  # rows per group; None: one group per column (all of K)
    zero_points: bool  # asymmetric: with zero points
    block_columns: int | None = None  # block-wise FP8: output columns sharing a scale
    gptq_v1: bool = False  # GPTQ zero points stored minus one
    act_order: bool = False  # GPTQ desc_act: rows grouped by g_idx, not k // G
    lm_head: bool = False  # GPTQ `lm_head`: the LM head quantized like the layers

    def settings(self, quantization: str | None, cfg: ModelConfig) -> dict:
        """The engine settings (EngineConfig / ModelOptions fields) that serve it; asking
        for another `quantization` is refused."""
        if quantization not in (None, self.kind):
            raise ValueError(
                f"this checkpoint is quantized ({self.method}, {self.kind}); it is served as "
                f"stored, so quantization={quantization!r} cannot apply: leave "
                "--quantization unset")
        group = self.group_size
        if group is None and self.kind == "int4":
            # One group over all of K: a group size no layer's K exceeds (group_rows takes
            # min(group, K)), rounded up to even. (int8's unset group is per channel.)
            k = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
            group = k + k % 2
        settings = dict(quantization=self.kind, quant_group_size=group,
                        quant_zero_points=self.zero_points, quant_act_order=self.act_order)
        if self.lm_head:
            settings.update(lm_head_quantization=self.kind, lm_head_group_size=group,
                            lm_head_zero_points=self.zero_points)
        if self.method == "mxfp4":  # the experts only: every attention projection in float
            settings["quant_overrides"] = tuple(
                (f"layers.{i}.attn.{p}_proj", None, None, False)
                for i in range(cfg.num_layers) for p in "qkvo")
        return settings

    @property
    def bits(self) -> int:
        return 4 if self.kind in ("int4", "fp4") else 8


def _refuse(field: str, value, what: str) -> ValueError:
    return ValueError(f"quantization_config.{field} = {value!r}: {what}")


def read(model_dir: str | Path) -> CheckpointQuantization | None:
    """The checkpoint's `quantization_config` (config.json), or None when it has none."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        return _read_awq(qc)
    if method == "gptq":
        return _read_gptq(qc)
    if method == "compressed-tensors":
        return _read_compressed_tensors(qc)
    if method == "fp8":
        return _read_fp8(qc)
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4", "fp4", 32, False)
    raise _refuse("quant_method", method, f"jaxserve serves {', '.join(METHODS)} checkpoints "
                  "(and GGUF files); or give the float checkpoint with --quantization")


def _group(qc: dict, field: str = "group_size") -> int | None:
    g = qc.get(field, 128)
    if g in (-1, None):
        return None
    if not isinstance(g, int) or g < 2 or g % 2:
        raise _refuse(field, g, "an even group size (or -1: per channel) is needed")
    return g


def _check_not_converted(qc: dict, field: str) -> None:
    for name in qc.get(field) or []:
        if not _FLOAT_OK.fullmatch(name.replace("\\.", ".")):
            raise _refuse(field, qc[field], f"{name!r} is left unquantized; jaxserve "
                          "quantizes every decoder linear layer alike")


def _read_awq(qc: dict) -> CheckpointQuantization:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", qc.get("version"), "jaxserve reads AutoAWQ's GEMM layout "
                      "(gemv / marlin / exllama packings are not supported)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ checkpoints are 4-bit")
    if not qc.get("zero_point", True):
        raise _refuse("zero_point", False, "AWQ without zero points is not supported")
    _check_not_converted(qc, "modules_to_not_convert")
    return CheckpointQuantization("awq", "int4", _group(qc, "group_size" if "group_size" in qc
                                                        else "q_group_size"), True)


def _read_gptq(qc: dict) -> CheckpointQuantization:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "jaxserve serves 4- and 8-bit GPTQ")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq or gptq_v2 is needed (marlin / "
                      "bitblas packings are not supported)")
    _check_not_converted(qc, "modules_to_not_convert")
    sym = qc.get("sym", True)
    group = _group(qc)
    act_order = bool(qc.get("desc_act")) and group is not None
    lm_head = bool(qc.get("lm_head", False))
    if lm_head and act_order:
        raise _refuse("lm_head", True, "an act-order (desc_act) LM head is not supported; "
                      "a checkpoint quantized with desc_act: false or lm_head: false is")
    return CheckpointQuantization("gptq", f"int{bits}", group, not sym,
                                  gptq_v1=fmt == "gptq", act_order=act_order, lm_head=lm_head)


def _read_compressed_tensors(qc: dict) -> CheckpointQuantization:
    groups = qc.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values()]
    formats = {g.get("format") or qc.get("format") for g in groups.values()}
    if not schemes or any(s is None for s in schemes) or any(s != schemes[0] for s in schemes) \
            or len(formats) != 1:
        raise _refuse("config_groups", groups, "one weight scheme and format for every "
                      "linear layer is needed")
    for g in groups.values():
        if "Linear" not in (g.get("targets") or []):
            raise _refuse("config_groups.targets", g.get("targets"), "every Linear layer "
                          "must be targeted (targets: [Linear])")
    fmt = formats.pop()
    _check_not_converted(qc, "ignore")
    w = schemes[0]
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise _refuse("config_groups.weights.actorder", w.get("actorder"),
                      "activation-order (group) permutations are not supported")
    if w.get("dynamic"):
        raise _refuse("config_groups.weights.dynamic", True, "weights must be stored quantized")
    if strategy not in ("group", "channel", "tensor", "block"):
        raise _refuse("config_groups.weights.strategy", strategy,
                      "group, channel, tensor or (FP8) block is needed")
    group = w.get("group_size") if strategy == "group" else None
    if kind == "float":
        if fmt != "float-quantized" or bits != 8 or strategy == "group":
            raise _refuse("format", fmt, "FP8 weights are read as float-quantized e4m3 with "
                          "channel, tensor or block scales")
        if strategy == "block":
            return _fp8_blocks("compressed-tensors", "config_groups.weights.block_structure",
                               w.get("block_structure"))
        return CheckpointQuantization("compressed-tensors", "fp8", None, False)
    if kind != "int":
        raise _refuse("config_groups.weights.type", kind, "int or float is needed")
    if strategy in ("group", "channel") and (
            (bits == 4 and fmt == "pack-quantized")
            or (bits == 8 and fmt in ("pack-quantized", "naive-quantized", "int-quantized"))):
        return CheckpointQuantization("compressed-tensors", f"int{bits}",
                                      _group({"g": group}, "g"), not symmetric)
    raise _refuse("config_groups.weights", w, "jaxserve serves int4 (pack-quantized) and "
                  "int8 weights (group or channel, symmetric or not) and FP8 weights")


def _read_fp8(qc: dict) -> CheckpointQuantization:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", qc.get("fmt"), "e4m3 FP8 weights are needed")
    if qc.get("scale_fmt", "float") != "float":
        raise _refuse("scale_fmt", qc.get("scale_fmt"), "float32 block scales are needed "
                      "(ue8m0 scales are not supported)")
    _check_not_converted(qc, "modules_to_not_convert")
    blocks = qc.get("weight_block_size")
    if blocks is None:
        raise _refuse("weight_block_size", None, "block-wise scales are needed")
    return _fp8_blocks("fp8", "weight_block_size", blocks)


def _fp8_blocks(method: str, field: str, blocks) -> CheckpointQuantization:
    """Block-wise FP8: groups of bk rows, each scale shared by bn columns."""
    if not (isinstance(blocks, (list, tuple)) and len(blocks) == 2
            and all(isinstance(b, int) and b > 0 for b in blocks)):
        raise _refuse(field, blocks, "[output block, input block] sizes are needed")
    bn, bk = blocks
    return CheckpointQuantization(method, "fp8", bk, False, block_columns=bn)


@dataclasses.dataclass
class Prequantized:
    """One linear layer's weight as stored quantized, in our layout: `values` `[K', N]`,
    `scales` as pallas_kernels/quantized_matmul reads them (numpy, on the host), and for
    an act-order checkpoint the input permutation `perm` `[K]` its rows were put in
    (layers.act_order_perm)."""

    values: np.ndarray
    scales: np.ndarray
    perm: np.ndarray | None = None


def _fields(words: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """int32 words -> their 32 / bits fields (bits `bits * j` up as field j) along a new
    axis after `axis`, as unsigned values (uint8)."""
    w = np.asarray(words).view(np.uint32)
    per = 32 // bits
    shifts = (bits * np.arange(per, dtype=np.uint32)).reshape(
        (per,) + (1,) * (w.ndim - 1 - axis))
    return ((np.expand_dims(w, axis + 1) >> shifts) & ((1 << bits) - 1)).astype(np.uint8)


def unpack_rows(words: np.ndarray, bits: int = 4) -> np.ndarray:
    """`[R / P, C]` words, P = 32 / bits rows each (row P i + j in field j): `[R, C]`."""
    return _fields(words, 0, bits).reshape(-1, words.shape[1])


def unpack_columns(words: np.ndarray, order: np.ndarray | None = None,
                   bits: int = 4) -> np.ndarray:
    """`[R, C / P]` words, P = 32 / bits columns each (column P i + order[j] in field j;
    sequential when `order` is None): `[R, C]`."""
    n = _fields(words, 1, bits)  # [R, C / P, P]: field j of each word
    if order is not None:
        n = n[..., np.argsort(order)]  # field holding column j
    return n.reshape(words.shape[0], -1)


def _from_unsigned(u: np.ndarray, u0: np.ndarray | None, scale: np.ndarray, group: int,
                   bits: int) -> Prequantized:
    """Unsigned `bits`-bit `u [K, N]`, zero points `u0 [K / G, N]` (None: symmetric about
    2^(bits-1)) and scales `[K / G, N]` as our int4 / int8: q = u - 2^(bits-1), z = u0 -
    2^(bits-1)."""
    offset = 1 << (bits - 1)
    q = (u.astype(np.int16) - offset).astype(np.int8)
    values = np.asarray(pack_int4(q, group)) if bits == 4 else q
    scale = np.asarray(scale, np.float32)
    if u0 is None:
        return Prequantized(values, scale)
    return Prequantized(values, np.stack([scale, u0.astype(np.float32) - offset]))


def _awq(name: str, t: dict, q: CheckpointQuantization) -> Prequantized:
    u = unpack_columns(t["qweight"], AWQ_ORDER)
    u0 = unpack_columns(t["qzeros"], AWQ_ORDER)
    group = _checked_group(name, u.shape[0], t["scales"], q)
    return _from_unsigned(u, u0, t["scales"], group, 4)


def _gptq(name: str, t: dict, q: CheckpointQuantization) -> Prequantized:
    u = unpack_rows(t["qweight"], q.bits)
    k = u.shape[0]
    group = _checked_group(name, k, t["scales"], q)
    g_idx = np.asarray(t["g_idx"]) if "g_idx" in t else np.arange(k) // group
    perm = None
    if q.act_order:  # rows sorted by group: each group's rows contiguous, as our int4 holds
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        if not np.array_equal(g_idx[perm], np.arange(k) // group):
            raise ValueError(f"{name}.g_idx: groups of other than group_size ({group}) rows")
        u = u[perm]
    elif not np.array_equal(g_idx, np.arange(k) // group):
        raise ValueError(f"{name}.g_idx is not k // group_size, yet quantization_config."
                         "desc_act is false: the checkpoint contradicts itself")
    u0 = unpack_columns(t["qzeros"], bits=q.bits)[:, :u.shape[1]]
    if q.gptq_v1:
        u0 = (u0 + 1) & ((1 << q.bits) - 1)
    if not q.zero_points:
        if np.any(u0 != 1 << (q.bits - 1)):
            raise ValueError(f"{name}.qzeros: a sym checkpoint whose zero points are not "
                             f"all {1 << (q.bits - 1)}; its quantization_config.sym is wrong")
        u0 = None
    return dataclasses.replace(_from_unsigned(u, u0, t["scales"], group, q.bits), perm=perm)


def _compressed_tensors(name: str, t: dict, q: CheckpointQuantization) -> Prequantized:
    scale = np.asarray(t["weight_scale"], np.float32)
    if q.kind == "fp8":
        return _fp8(name, t["weight"], scale, q)
    offset = 1 << (q.bits - 1)
    if "weight_packed" not in t:  # naive- / int-quantized int8 [N, K], signed
        w = np.asarray(t["weight"])
        if w.dtype != np.int8:
            raise ValueError(f"{name}.weight: int8 values expected, got {w.dtype}")
        u = (w.astype(np.int16) + offset).T  # [K, N], unsigned like the packed formats
        n, k = w.shape
    else:
        n, k = (int(d) for d in np.asarray(t["weight_shape"]))
        u = unpack_columns(t["weight_packed"], bits=q.bits)[:, :k].T  # [K, N], offset
    group = _checked_group(name, k, scale.T, q)
    u0 = None
    if q.zero_points:
        zp = np.asarray(t["weight_zero_point"])
        if zp.dtype == np.int8:  # [N, K / G], signed
            u0 = (zp.astype(np.int16) + offset).T
        else:  # packed along N: [N / P, K / G]
            u0 = unpack_columns(zp.T, bits=q.bits)[:, :n]
    return _from_unsigned(u, u0, scale.T, group, q.bits)


def _fp8(name: str, weight: np.ndarray, scale: np.ndarray, q: CheckpointQuantization
         ) -> Prequantized:
    """float8_e4m3fn `[N, K]` with a tensor, channel `[N, 1]` or block `[N / bn, K / bk]`
    scale as our fp8: values `[K, N]`, scales `[1, N]` or `[K / bk, N]` (each block's scale
    repeated over its columns)."""
    w = np.asarray(weight)
    n, k = w.shape
    if q.block_columns:
        if scale.ndim != 2 or scale.shape[0] != -(-n // q.block_columns):
            raise ValueError(f"{name}: block scales {tuple(scale.shape)} do not fit "
                             f"[{n}, {k}] in blocks of {q.block_columns} columns")
        if k % q.group_size:
            raise ValueError(f"{name}: {k} input rows are not whole blocks of "
                             f"{q.group_size}; jaxserve needs every layer's in-features "
                             "to be a multiple of the block size")
        scale = np.repeat(scale.T, q.block_columns, axis=1)[:, :n]  # [K / bk, N]
        _checked_group(name, k, scale, q)
    else:
        scale = np.broadcast_to(scale.reshape(-1, 1), (n, 1)) if scale.size == 1 else scale
        scale = scale.reshape(1, n)
    return Prequantized(w.T, np.ascontiguousarray(scale, np.float32))


def _fp8_checkpoint(name: str, t: dict, q: CheckpointQuantization) -> Prequantized:
    return _fp8(name, t["weight"], np.asarray(t["weight_scale_inv"], np.float32), q)


def _checked_group(name: str, k: int, scales: np.ndarray, q: CheckpointQuantization) -> int:
    groups = scales.shape[0]
    group = k // groups if groups else 0
    want = q.group_size or k
    if groups * group != k or group != min(want, k):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} for {k} input rows do not "
                         f"match group_size {q.group_size or 'per channel'}")
    return group


_CONVERT = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors,
            "fp8": _fp8_checkpoint}
_NEEDED = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
           "fp8": ("weight", "weight_scale_inv")}
# The dtype a compressed-tensors `weight` is stored in when it is quantized.
_STORED = {"int8": (np.dtype(np.int8),), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn),),
           "int4": ()}
# A GPTQ checkpoint's quantized LM head (quantization_config.lm_head).
_HEAD = re.compile(r"(lm_head)\.(qweight|qzeros|scales|g_idx)$")
_QUANTIZED_PART = re.compile(r".*\.(qweight|qzeros|g_idx|weight_packed|weight_scale|"
                             r"weight_scale_inv|weight_zero_point|weight_shape)$")


def tensors(stream: Iterable[tuple[str, np.ndarray]], q: CheckpointQuantization
            ) -> Iterator[tuple[str, np.ndarray | Prequantized]]:
    """The checkpoint's (name, array) pairs with each quantized linear layer's tensors
    gathered into one `(prefix + ".weight", Prequantized)`; other tensors pass through.

    safetensors files order tensors by dtype, so a layer's parts are far apart: they are
    gathered (memory-mapped views, nothing read) over the whole stream and converted one
    layer at a time at its end. A float `.weight` of a decoder linear layer is refused (the
    checkpoint left it unquantized), as are quantized tensors of any other layer.
    """
    if q.method == "mxfp4":
        yield from _mxfp4_tensors(stream)
        return
    layers: dict[str, dict[str, np.ndarray]] = {}
    for name, array in stream:
        m = _LINEAR.match(name) or (_HEAD.match(name) if q.lm_head else None)
        if q.lm_head and name == "lm_head.weight":
            raise ValueError(f"{name}: a float LM head, yet quantization_config.lm_head is "
                             "true: the checkpoint contradicts itself")
        if m is None or m.group(2) == "bias":
            if _QUANTIZED_PART.match(name) or (
                    re.search(r"(embed_tokens|lm_head)\.weight$", name)
                    and np.asarray(array).dtype in (np.int8, ml_dtypes.float8_e4m3fn)):
                raise ValueError(f"{name}: only the decoder's linear layers may be quantized "
                                 "(the embedding, LM head and routers stay float here)")
            yield name, array
            continue
        prefix, part = m.groups()
        if part == "weight" and (q.method not in ("compressed-tensors", "fp8")
                                 or np.asarray(array).dtype not in _STORED[q.kind]):
            raise ValueError(f"{name}: a float weight in a {q.method} {q.kind} checkpoint "
                             "(left unquantized?); jaxserve serves checkpoints whose every "
                             "decoder linear layer is quantized")
        layers.setdefault(prefix, {})[part] = array
    for prefix, parts in layers.items():
        needed = _NEEDED.get(q.method) or (
            (("weight",) if "weight_packed" not in parts else ("weight_packed", "weight_shape"))
            + ("weight_scale",) + (("weight_zero_point",) if q.zero_points else ()))
        missing = [n for n in needed if n not in parts]
        if missing:
            raise ValueError(f"{prefix}: the checkpoint lacks {', '.join(missing)} for this "
                             f"{q.method} layer (it has {', '.join(sorted(parts))})")
        yield prefix + ".weight", _CONVERT[q.method](prefix, parts, q)


def _mxfp4_tensors(stream: Iterable[tuple[str, np.ndarray]]
                   ) -> Iterator[tuple[str, np.ndarray | Prequantized]]:
    """`tensors` of an MXFP4 checkpoint: each expert stack's blocks and scales gathered
    into `(prefix, Prequantized)` (fp4 `[E, K / 2, N]`, scales `[E, K / 32, N]`; module doc),
    converted once both are read; the float tensors pass through."""
    stacks: dict[str, dict[str, np.ndarray]] = {}
    for name, array in stream:
        m = _MXFP4_PART.match(name)
        if m is None:
            yield name, array
            continue
        parts = stacks.setdefault(m.group(1), {})
        parts[m.group(2)] = array
        if len(parts) == 2:
            yield m.group(1), mxfp4_as_fp4(m.group(1), parts["blocks"], parts["scales"])
            del stacks[m.group(1)]
    if stacks:
        raise ValueError(f"{sorted(stacks)[0]}: the checkpoint lacks its MXFP4 "
                         f"{'scales' if 'blocks' in stacks[sorted(stacks)[0]] else 'blocks'}")


def mxfp4_as_fp4(name: str, blocks: np.ndarray, scales: np.ndarray) -> Prequantized:
    """An MXFP4 expert stack (blocks `[E, N, G, 16]`, e8m0 scales `[E, N, G]`) as our fp4
    in groups of 32: values uint8 `[E, 16 G, N]` (group g's byte row j: its row j in the
    low nibble, row j + 16 in the high one), bfloat16 scales `[E, G, N]`."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim != 4 \
            or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {blocks.shape} {blocks.dtype} and scales "
                         f"{scales.shape} {scales.dtype} are not uint8 [E, N, K / 32, 16] and "
                         "[E, N, K / 32]")
    e, n, g, _ = blocks.shape
    # A block's byte b holds its elements 2b (low nibble) and 2b + 1 (high).
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(e, n, g, 32)
    values = (codes[..., :16] | (codes[..., 16:] << 4)).transpose(0, 2, 3, 1)
    return Prequantized(np.ascontiguousarray(values.reshape(e, g * 16, n)),
                        np.ascontiguousarray(e8m0_as_bfloat16(scales).transpose(0, 2, 1)))


def e8m0_as_bfloat16(scales: np.ndarray) -> np.ndarray:
    """MX scales (e8m0 bytes e) as the powers of two 2^(e - 127) they hold, in bfloat16
    (exact)."""
    return np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(ml_dtypes.bfloat16)
