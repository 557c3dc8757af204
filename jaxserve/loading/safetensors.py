"""Load Hugging Face safetensors checkpoints into the model's parameters, one tensor at a time.

Files are memory-mapped and parsed here (the format is an 8-byte header length, a JSON
header and raw little-endian data), so bf16 needs no torch. Each tensor goes straight to
its device shards (`jax.make_array_from_callback`: every shard is sliced from the mapped
file and converted on its own) before the next is read, so the host never holds a second
full copy of the weights, nor of any one tensor. Weights quantized at load are the
exception: one tensor (of an expert stack, one expert) at a time is quantized on a device
from float32.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.loading.prequantized import Prequantized
from jaxserve.models.transformer import Transformer
from pallas_kernels.quantized_matmul import quantize
from pallas_kernels.quantized_matmul.formats import dequantize, kind_of
from sharding.rules import ShardingContext

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
# Buffers some checkpoints carry that the model recomputes, and a sequence classifier's
# head (read apart: loading/classifier.py).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|score\.weight$")
# Phi-3's fused projections: q, k and v's rows in one; the MLP's gate's then up's.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_NAME = re.compile(r"(model\.layers\.\d+\.\w+\.)(qkv_proj|gate_up_proj)\.(weight|bias)$")
# gpt-oss's experts: every expert's gate and up columns interleaved in one stack
# `[E, hidden, 2I]` (gate the even columns, up the odd), and their biases `[E, 2I]`.
_GPT_OSS_GATE_UP = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)gate_up_proj(_bias)?$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, from the index when the checkpoint is sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, memory-mapped array) for every tensor of the checkpoint, file by file (the
    files are looked for when the first is asked for: `jaxserve plan` opens a config-only
    directory of a quantized checkpoint for its settings alone)."""
    for file in checkpoint_files(model_dir):
        yield from read_tensors(file)


def decoder_tensors(model_dir: str | Path, cfg: ModelConfig
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """`checkpoint_tensors` less DeepSeek-V3's multi-token-prediction module (the layers
    past num_hidden_layers, `num_nextn_predict_layers` of them), which generation does not
    run; every tensor of any other checkpoint."""
    tensors = checkpoint_tensors(model_dir)
    if not cfg.kv_lora_rank:
        return tensors
    past = re.compile(r"model\.layers\.(\d+)\.")
    return ((name, x) for name, x in tensors
            if not ((m := past.match(name)) and int(m.group(1)) >= cfg.num_layers))


def read_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, read-only memory-mapped array) for every tensor of one file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        yield name, data[begin:end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_torch_file(path: Path, what: str) -> dict[str, np.ndarray]:
    """The tensors of a torch file (`.bin`, `.pt`) as float32 or integer arrays, read only
    through torch's `weights_only` loader (never plain pickle). `what` names the file's
    role in the error when torch is missing."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"{what}: {path} is a torch file and torch is not installed; "
                         "convert it to safetensors") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {name: (t.float() if t.is_floating_point() else t).numpy()
            for name, t in state.items()}


_KV_PARAMS = ("k_proj", "v_proj", "k_bias", "v_bias", "k_proj_scales", "v_proj_scales")


def is_kv_param(path: tuple) -> bool:
    """A k/v projection's weight, scales or bias: its heads are stored kv_head_replicas
    times (transformer.Attention)."""
    return len(path) >= 2 and path[-2] == "attn" and path[-1] in _KV_PARAMS


def _head_dim_axis(path: tuple, ndim: int) -> int:
    """The axis that carries the heads: the first of a bias `[H, D]`, the last of quantized
    scales (`[..., H * D]`), else the second (`[E, H, D]` float weights; quantized
    `[K', H * D]` values)."""
    if path[-1].endswith("bias"):
        return 0
    return ndim - 1 if path[-1].endswith("_scales") else 1


def kv_heads_shape(shape: tuple, path: tuple, num: int, den: int = 1) -> tuple:
    """`shape` of a k/v parameter with its head count times num / den."""
    shape = list(shape)
    axis = _head_dim_axis(path, len(shape))
    shape[axis] = shape[axis] * num // den
    return tuple(shape)


def _by_head(x, path: tuple, head_dim: int):
    """x as `[lead, heads, head_dim]`."""
    return x.reshape(math.prod(x.shape[:_head_dim_axis(path, x.ndim)]), -1, head_dim)


def repeat_kv_heads(x, path: tuple, replicas: int, head_dim: int, xp=jnp):
    """Each KV head of a k/v parameter repeated `replicas` times, in place order
    (head h becomes heads h*r .. h*r + r - 1, as device m reads head m // r)."""
    if replicas == 1:
        return x
    return xp.repeat(_by_head(x, path, head_dim), replicas, axis=1).reshape(
        kv_heads_shape(x.shape, path, replicas))


def unrepeat_kv_heads(x, path: tuple, replicas: int, head_dim: int):
    """Inverse of repeat_kv_heads: one copy of each head."""
    if replicas == 1:
        return x
    return _by_head(x, path, head_dim)[:, ::replicas].reshape(
        kv_heads_shape(x.shape, path, 1, replicas))


def split_fused(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig
                ) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors with each fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) given as
    the separate ones the other families store: views of its rows (a quantized one's
    columns), nothing copied."""
    sizes = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
             "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
             "up_proj": cfg.intermediate_size}
    for name, x in tensors:
        if cfg.kv_lora_rank and name.endswith("self_attn.kv_b_proj.weight"):
            yield from _split_kv_b_proj(name, x, cfg)
            continue
        m = _GPT_OSS_GATE_UP.match(name) if cfg.model_type == "gpt_oss" else None
        if m is not None:
            prefix, bias = m.group(1), m.group(2) is not None
            if isinstance(x, Prequantized):  # MXFP4 (loading/prequantized.py): columns too
                yield f"{prefix}gate_proj", Prequantized(x.values[..., ::2], x.scales[..., ::2])
                yield f"{prefix}up_proj", Prequantized(x.values[..., 1::2], x.scales[..., 1::2])
            else:
                yield f"{prefix}{'gate_bias' if bias else 'gate_proj'}", x[..., ::2]
                yield f"{prefix}{'up_bias' if bias else 'up_proj'}", x[..., 1::2]
            continue
        m = _FUSED_NAME.match(name)
        if m is None:
            yield name, x
            continue
        prefix, fused, part = m.groups()
        pieces = [(piece, sizes[piece]) for piece in FUSED[fused]]
        total = sum(n for _, n in pieces)
        quantized = isinstance(x, Prequantized)
        outputs = (x.values.shape[-1], x.scales.shape[-1]) if quantized else (x.shape[0],)
        if any(n != total for n in outputs):
            raise ValueError(f"tensor {name!r} ({outputs[0]} outputs) does not fit this model "
                             f"config: {' + '.join(str(n) for _, n in pieces)}")
        start = 0
        for piece, n in pieces:
            if quantized:
                yield f"{prefix}{piece}.{part}", Prequantized(
                    x.values[..., start:start + n], x.scales[..., start:start + n], x.perm)
            else:
                yield f"{prefix}{piece}.{part}", x[start:start + n]
            start += n


def _split_kv_b_proj(name: str, x, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """DeepSeek's kv_b_proj `[heads x (nope + v), kv_lora_rank]` as latent attention holds
    it: `k_up` `[heads, nope, rank]` (queries into the latent) and `v_up` `[heads, rank, v]`
    (the latent into values), dequantized when the checkpoint stores it quantized."""
    base = name.removesuffix(".weight")
    if isinstance(x, Prequantized):  # DeepSeek-V3's FP8 checkpoint: absorbed in float
        w = np.asarray(dequantize(x.values, x.scales, kind_of(x.values, x.scales)))  # [K, N]
        if x.perm is not None:  # rows stored in act order: back to the input's
            w = w[np.argsort(x.perm)]
        x = w.T
    h, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    if x.shape != (h * (nope + v), cfg.kv_lora_rank):
        raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}; the config expects "
                         f"{(h * (nope + v), cfg.kv_lora_rank)}")
    w = x.reshape(h, nope + v, cfg.kv_lora_rank)
    yield f"{base}.k_up", w[:, :nope]
    yield f"{base}.v_up", w[:, nope:].transpose(0, 2, 1)


def _hf_to_ours(name: str, x: np.ndarray, cfg: ModelConfig, kv_replicas: int = 1
                ) -> tuple[tuple, np.ndarray, int | None] | None:
    """Map a Hugging Face tensor to (our parameter path, array in our layout, expert),
    k/v heads repeated `kv_replicas` times. `expert` is the index of an expert's weight
    in a stacked parameter (moe.MoE), else None."""
    e, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if name == "model.embed_tokens.weight":  # quantized: held by rows (quantized_table)
        if isinstance(x, Prequantized):
            x = Prequantized(x.values.T, np.swapaxes(x.scales, -1, -2))
        return _EMBED, x, None
    if name == "model.norm.weight":
        return ("norm",), x, None
    if name == "lm_head.weight":  # a tied head: ours only when the checkpoint's is quantized
        if isinstance(x, Prequantized):
            return ("lm_head",), x, None
        return None if cfg.tie_word_embeddings else (("lm_head",), x.T, None)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    i, rest = int(m.group(1)), m.group(2)
    if cfg.kv_lora_rank and rest.startswith("self_attn."):
        return _latent_attention(i, rest, x, cfg)
    heads = {"q": hq, "k": hkv, "v": hkv}
    table = {
        "input_layernorm.weight": (("input_norm",), lambda: x),
        "post_attention_layernorm.weight": (("post_attn_norm",), lambda: x),
        "pre_feedforward_layernorm.weight": (("pre_mlp_norm",), lambda: x),
        "post_feedforward_layernorm.weight": (("post_mlp_norm",), lambda: x),
        "self_attn.o_proj.weight": (("attn", "o_proj"), lambda: x.T.reshape(hq, d, e)),
        "self_attn.o_proj.bias": (("attn", "o_bias"), lambda: x),
        "self_attn.q_norm.weight": (("attn", "q_norm"), lambda: x),
        "self_attn.k_norm.weight": (("attn", "k_norm"), lambda: x),
        "mlp.gate_proj.weight": (("mlp", "gate_proj"), lambda: x.T),
        "mlp.up_proj.weight": (("mlp", "up_proj"), lambda: x.T),
        "mlp.down_proj.weight": (("mlp", "down_proj"), lambda: x.T),
    }
    for p, h in heads.items():
        table[f"self_attn.{p}_proj.weight"] = (("attn", f"{p}_proj"), lambda h=h: x.T.reshape(e, h, d))
        table[f"self_attn.{p}_proj.bias"] = (("attn", f"{p}_bias"), lambda h=h: x.reshape(h, d))
    table["mlp.gate.e_score_correction_bias"] = (("mlp", "router_bias"), lambda: x)
    # gpt-oss: sinks, the router's bias, the experts' stacks `[E, in, out]` (split_fused
    # took its gate / up columns apart) and biases.
    table["self_attn.sinks"] = (("attn", "sinks"), lambda: x)
    table["mlp.router.weight"] = (("mlp", "router"), lambda: x.T)
    table["mlp.router.bias"] = (("mlp", "router_logit_bias"), lambda: x)
    for hf_name, ours in (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                          ("down_proj", "down_proj"), ("gate_bias", "gate_bias"),
                          ("up_bias", "up_bias"), ("down_proj_bias", "down_bias")):
        table[f"mlp.experts.{hf_name}"] = (("mlp", ours), lambda: x)
    for hf_name, ours in (("block_sparse_moe.gate", "router"), ("mlp.gate", "router"),
                          ("mlp.shared_expert_gate", "shared_expert_gate"),
                          *((f"mlp.{s}.{p}", f"shared_expert.{p}")  # Qwen2-MoE's, DeepSeek's
                            for s in ("shared_expert", "shared_experts")
                            for p in ("gate_proj", "up_proj", "down_proj"))):
        table[f"{hf_name}.weight"] = (("mlp", *ours.split(".")), lambda: x.T)
    expert = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", rest)
    if expert and expert.group(2) in _EXPERT_WEIGHTS:
        # One expert's [out, in] weight: row `j` of our stacked [E, in, out] parameter (a
        # checkpoint's quantized one is already [in, out]).
        one = x if isinstance(x, Prequantized) else x.T
        return ("layers", i, "mlp", _EXPERT_WEIGHTS[expert.group(2)]), one, int(expert.group(1))
    if rest not in table:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    path, convert = table[rest]
    path = ("layers", i) + path
    if isinstance(x, Prequantized):
        if is_kv_param(path):
            x = Prequantized(repeat_kv_heads(x.values, path, kv_replicas, d, xp=np),
                             repeat_kv_heads(x.scales, _scales_path(path), kv_replicas, d,
                                             xp=np), x.perm)
        return path, x, None
    array = convert()
    if is_kv_param(path):
        array = repeat_kv_heads(array, path, kv_replicas, d, xp=np)
    return path, array, None


def _latent_attention(i: int, rest: str, x, cfg: ModelConfig) -> tuple[tuple, object, None]:
    """(our path, array in our layout, None) of a DeepSeek attention tensor
    (latent_attention.py); kv_b_proj comes split in two, in float, by `split_fused`."""
    e, h = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    table = {
        "q_proj.weight": ("q_proj", lambda: x.T.reshape(e, h, qk)),
        "q_a_proj.weight": ("q_a_proj", lambda: x.T),
        "q_a_layernorm.weight": ("q_a_norm", lambda: x),
        "q_b_proj.weight": ("q_b_proj", lambda: x.T.reshape(-1, h, qk)),
        "kv_a_proj_with_mqa.weight": ("kv_a_proj", lambda: x.T),
        "kv_a_layernorm.weight": ("kv_a_norm", lambda: x),
        "kv_b_proj.k_up": ("k_up", lambda: x),
        "kv_b_proj.v_up": ("v_up", lambda: x),
        "o_proj.weight": ("o_proj", lambda: x.T.reshape(h, cfg.v_head_dim, e)),
    }
    part = rest.removeprefix("self_attn.")
    if part not in table:
        raise ValueError(f"unexpected tensor model.layers.{i}.{rest!r} in checkpoint")
    ours, convert = table[part]
    if isinstance(x, Prequantized):
        return ("layers", i, "attn", ours), x, None
    return ("layers", i, "attn", ours), convert(), None


# Expert weight names (Mixtral's w1/w3/w2, the Qwen MoE models' own) -> moe.MoE's.
_EXPERT_WEIGHTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                   "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class _Stacked:
    """Per-expert arrays (memory-mapped views) seen as one `[E, ...]` array, sliced per
    device shard without stacking the whole."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)
        self.size = int(np.prod(self.shape))

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first, rest = index[0], index[1:]
        return np.stack([part[rest] for part in self.parts[first]])


def abstract_model(cfg: ModelConfig, dtype, shard: ShardingContext,
                   options: ModelOptions = ModelOptions()) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and parameter shapes, allocating nothing. Refuses
    `quant_overrides` that name no weight of this model (a quantized entry: no quantized
    one)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype, shard=shard, options=options))
    graphdef, state = nnx.split(model)
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}
    unknown = [name for name, kind, *_ in options.quant_overrides
               if (name + "_scales" if kind else name) not in names]
    if unknown:
        raise ValueError(f"quant_overrides name {unknown}, which are not linear layers of this "
                         f"model (e.g. 'layers.0.mlp.down_proj', 'embed')")
    return graphdef, state


def load_checkpoint(model_dir: str | Path, cfg: ModelConfig, dtype, shard: ShardingContext,
                    options: ModelOptions = ModelOptions(),
                    tensors: Iterable[tuple[str, np.ndarray]] | None = None,
                    module: tuple[nnx.GraphDef, nnx.State] | None = None,
                    own: Callable[[str, np.ndarray], tuple | None] | None = None
                    ) -> tuple[nnx.GraphDef, nnx.State]:
    """Read every tensor of an HF checkpoint straight into sharded device arrays
    (quantizing the linear layers' weights on the way when `options.quantization`).
    `tensors`: (Hugging Face name, array) pairs to read instead of `model_dir`'s files
    (a GGUF file's, loading/gguf.py). `module`: the (graphdef, abstract state) of another
    module to fill than the decoder (DeepSeek's MTP layer: loading/mtp.py), whose
    decoder-named tensors map as a decoder's; `own(name, tensor)`: (path, array, None) of
    one of its own tensors, None for the others."""
    graphdef, abstract = module or abstract_model(cfg, dtype, shard, options)
    expected = dict(nnx.to_flat_state(abstract))
    loaded: dict[tuple, jax.Array] = {}
    experts: dict[tuple, dict[int, np.ndarray]] = {}  # stacked parameters being gathered
    # A quantized tied head: the embedding's copy, unless the checkpoint brings its own.
    tied_head = cfg.tie_word_embeddings and _HEAD in expected
    embedding = None
    if tensors is None:
        tensors = decoder_tensors(model_dir, cfg)
    for name, tensor in split_fused(tensors, cfg):
        if _IGNORED.match(name):
            continue
        if tied_head and name == "model.embed_tokens.weight":
            embedding = tensor
            if _EMBED not in expected:  # embed_from_lm_head: only the head holds it
                continue
        mapped = own(name, tensor) if own is not None else None
        if mapped is None:
            mapped = _hf_to_ours(name, tensor, cfg, shard.rules.kv_head_replicas)
        if mapped is None:
            continue
        path, array, expert = mapped
        if path not in expected:
            raise ValueError(f"tensor {name!r} does not fit this model config ({path})")
        var = expected[path]
        if isinstance(array, Prequantized) and expert is None:
            loaded.update(place_prequantized(name, path, array, expected, shard))
            continue
        if isinstance(array, Prequantized):  # one expert's, stacked once all are read
            if array.perm is not None:
                raise ValueError(f"{name}: act-order (desc_act) experts are not supported")
            parts = experts.setdefault(path, {})
            if not 0 <= expert < var.shape[0] or array.values.shape != var.shape[1:]:
                raise ValueError(f"quantized tensor {name!r} ({tuple(array.values.shape)}) "
                                 f"does not fit this model config: {var.shape[0]} experts "
                                 f"of {tuple(var.shape[1:])}")
            parts[expert] = array
            if len(parts) == var.shape[0]:
                stack = Prequantized(*(np.stack([getattr(parts[j], f) for j in sorted(parts)])
                                       for f in ("values", "scales")))
                loaded.update(place_prequantized(name, path, stack, expected, shard))
                del experts[path]
            continue
        if expert is not None:
            parts = experts.setdefault(path, {})
            one = (var.shape[1] * (2 if var.dtype == jnp.uint8 else 1), var.shape[2])
            if not 0 <= expert < var.shape[0] or array.shape != one:  # int4: 2 per byte
                raise ValueError(f"tensor {name!r} (shape {tuple(tensor.shape)}) does not "
                                 f"fit this model config: {var.shape[0]} experts of "
                                 f"{one} after conversion")
            parts[expert] = array
            if len(parts) < var.shape[0]:
                continue
            array = _Stacked([parts[j] for j in range(var.shape[0])])
            del experts[path]
        quantized = _scales_path(path) in expected
        size = int(np.prod(var.shape)) * (2 if var.dtype == jnp.uint8 else 1)  # int4: 2/byte
        if array.size != size if quantized else tuple(array.shape) != tuple(var.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}; the config expects "
                f"{tuple(var.shape)} after conversion"
            )
        loaded.update(place_weight(path, array, expected, shard, _options_for(path, options)))
    if tied_head and _HEAD not in loaded and embedding is not None:
        loaded.update(place_weight(_HEAD, embedding.T, expected, shard,
                                   options.head_options()))
    missing = sorted(".".join(map(str, p)) for p in expected if p not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
    return graphdef, fill_state(abstract, loaded)


def random_params(cfg: ModelConfig, dtype, shard: ShardingContext, seed: int = 0,
                  options: ModelOptions = ModelOptions()) -> tuple[nnx.GraphDef, nnx.State]:
    """Random weights (std 0.02) for benchmarks and planning: same structure as a checkpoint
    (random float weights, quantized like a checkpoint's when `options.quantization`)."""
    _, float_abstract = abstract_model(cfg, dtype, shard)
    graphdef, abstract = abstract_model(cfg, dtype, shard, options)
    expected = dict(nnx.to_flat_state(abstract))
    key = jax.random.key(seed)
    replicas = shard.rules.kv_head_replicas
    values = {}
    for i, (path, var) in enumerate(nnx.to_flat_state(float_abstract)):
        if path[-1].endswith("norm"):
            init = lambda k, s=var.shape, t=var.dtype: jnp.ones(s, t)
        elif is_kv_param(path) and replicas > 1:  # copies of each head, as a checkpoint's
            one = kv_heads_shape(var.shape, path, 1, replicas)
            init = lambda k, s=one, t=var.dtype, p=path: repeat_kv_heads(
                (0.02 * jax.random.normal(k, s)).astype(t), p, replicas, cfg.head_dim)
        else:
            init = lambda k, s=var.shape, t=var.dtype: (0.02 * jax.random.normal(k, s)).astype(t)
        if _scales_path(path) in expected:
            values.update(place_weight(path, init(jax.random.fold_in(key, i)), expected, shard,
                                       _options_for(path, options)))
        else:
            sharding = shard.param_sharding(var)
            values[path] = jax.jit(init, out_shardings=sharding)(jax.random.fold_in(key, i))
    if _HEAD in expected and _HEAD not in values:  # a quantized tied head
        values.update(place_weight(_HEAD, values[_EMBED].T, expected, shard,
                                   options.head_options()))
    for path, var in expected.items():  # act-order permutations: the identity
        if path[-1].endswith("_perm"):
            values[path] = jax.device_put(np.arange(var.shape[0], dtype=np.int32),
                                          shard.sharding(()))
    return graphdef, fill_state(abstract, values)


_HEAD, _EMBED = ("lm_head",), ("embed",)


def _options_for(path: tuple, options: ModelOptions) -> ModelOptions:
    """The options a weight is quantized with (ModelOptions.weight_options)."""
    return options.weight_options(".".join(map(str, path)))


def _scales_path(path: tuple) -> tuple:
    return path[:-1] + (f"{path[-1]}_scales",)


def place_weight(path: tuple, array, expected: dict, shard: ShardingContext,
                 options: ModelOptions) -> dict[tuple, jax.Array]:
    """One weight onto its devices: as is, or quantized (from float32) into values and
    scales where the model holds that layer quantized (as `options` say)."""
    var = expected[path]
    sharding = shard.param_sharding(var)
    scales_path = _scales_path(path)
    if scales_path not in expected:
        # Each device's shard is read (from the memory-mapped file, through any transpose
        # view) and converted on its own: no full converted copy on the host.
        return {path: jax.make_array_from_callback(
            tuple(var.shape), sharding, lambda index: np.asarray(array[index], dtype=var.dtype))}
    scales_var = expected[scales_path]
    scales_sharding = shard.param_sharding(scales_var)
    if var.ndim == 3:  # a stack of experts' weights: each expert quantized on its own
        quantize_one = jax.jit(lambda w: quantize(w, options.quantization,
                                                  options.quant_group_size,
                                                  options.quant_zero_points))
        parts = [jax.device_get(quantize_one(jnp.asarray(array[j:j + 1][0], jnp.float32)))
                 for j in range(var.shape[0])]
        stacked = [np.stack(p) for p in zip(*parts)]  # values, scales: quantized, on the host
        return {p: jax.make_array_from_callback(tuple(a.shape), sh, lambda i, a=a: a[i])
                for p, a, sh in zip((path, scales_path), stacked, (sharding, scales_sharding))}
    rows = path == _EMBED  # a table held by rows: a [hidden, vocab] weight's transposes
    n = scales_var.shape[-2 if rows else -1]

    def quantize_2d(w):
        out = quantize(w.T if rows else w.reshape(-1, n), options.quantization,
                       options.quant_group_size, options.quant_zero_points)
        return tuple(jnp.swapaxes(a, -1, -2) for a in out) if rows else out

    values, scales = jax.jit(quantize_2d, out_shardings=(sharding, scales_sharding))(
        jnp.asarray(array, jnp.float32))
    return {path: values, scales_path: scales}


def place_prequantized(name: str, path: tuple, weight: Prequantized, expected: dict,
                       shard: ShardingContext) -> dict[tuple, jax.Array]:
    """A checkpoint's quantized weight onto its devices as stored (loading/prequantized.py),
    each device's shard read from the host arrays on its own."""
    placed = {}
    parts = [(path, weight.values), (_scales_path(path), weight.scales)]
    perm_path = path[:-1] + (f"{path[-1]}_perm",)
    if weight.perm is not None or perm_path in expected:  # act-order: identity if none
        perm = weight.perm if weight.perm is not None else np.arange(
            expected[perm_path].shape[0], dtype=np.int32)
        parts.append((perm_path, perm))
    for p, array in parts:
        var = expected.get(p)
        if var is None or tuple(array.shape) != tuple(var.shape) or array.dtype != var.dtype:
            want = "float" if var is None else f"{tuple(var.shape)} {var.dtype}"
            raise ValueError(f"quantized tensor {name!r} ({p[-1]}: {tuple(array.shape)} "
                             f"{array.dtype}) does not fit this model config: expected {want}")
        sharding = shard.param_sharding(var)
        placed[p] = jax.make_array_from_callback(
            tuple(var.shape), sharding, lambda index, a=array: np.ascontiguousarray(a[index]))
    return placed


def fill_state(abstract: nnx.State, values: dict[tuple, jax.Array]) -> nnx.State:
    flat = nnx.to_flat_state(abstract)
    for path, var in flat:
        var.set_value(values[path]) if hasattr(var, "set_value") else setattr(var, "value", values[path])
    return nnx.from_flat_state(flat)
