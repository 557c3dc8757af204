"""EAGLE heads in torch, as SafeAILab/EAGLE publishes them (eagle/model/cnets.py), built
from transformers' Llama modules, and the drafts they propose with no cache at all: the
oracle for jaxserve's EAGLE proposer. Their state_dict is the published checkpoint
layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers as tf
from transformers.models.llama import modeling_llama as llama

from published_heads import save_module


class Eagle1(torch.nn.Module):
    """EAGLE-1: fc over [embedding, target feature], a Llama layer without its input norm;
    the target's LM head reads the output."""

    version = 1

    def __init__(self, cfg: tf.LlamaConfig, fc_bias: bool = True):
        super().__init__()
        cfg = eager(cfg)
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = torch.nn.ModuleList([llama.LlamaDecoderLayer(cfg, 0)])
        self.layers[0].input_layernorm = torch.nn.Identity()
        self.rotary = llama.LlamaRotaryEmbedding(cfg)

    def forward(self, embeds, hidden):
        """Output hidden states `[(B,) n, H]` for n pairs at positions 0..n-1 (causal)."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        one = x.dim() == 2
        x = x[None] if one else x
        positions, mask = _causal(x.shape[1])
        out = self.layers[0](x, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return out[0] if one else out

    def logits(self, hidden, target):
        return target.lm_head(hidden)

    def to_target(self, ids):
        return ids


class Eagle3Layer(torch.nn.Module):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding), hidden_norm(hidden)]
    (2 x hidden wide), the residual from the hidden state."""

    def __init__(self, cfg: tf.LlamaConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.self_attn = llama.LlamaAttention(cfg, 0)
        for name, heads in (("q_proj", cfg.num_attention_heads),
                            ("k_proj", cfg.num_key_value_heads),
                            ("v_proj", cfg.num_key_value_heads)):
            setattr(self.self_attn, name, torch.nn.Linear(2 * h, heads * d, bias=False))
        self.mlp = llama.LlamaMLP(cfg)
        self.input_layernorm = llama.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = llama.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = llama.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)


class Eagle3(torch.nn.Module):
    """EAGLE-3: fc over three target layers' features (the head's own outputs skip it), the
    midlayer, its own norm and LM head over a draft vocabulary, d2t mapping its ids."""

    version = 3

    def __init__(self, cfg: tf.LlamaConfig, draft_vocab: int, d2t: torch.Tensor):
        super().__init__()
        cfg = eager(cfg)
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = llama.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = llama.LlamaRotaryEmbedding(cfg)

    def forward(self, embeds, hidden):
        """Output hidden states `[(B,) n, H]` for n pairs at positions 0..n-1 (causal);
        `hidden` is fc of the target's features, or the head's own outputs."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        one = x.dim() == 2
        x = x[None] if one else x
        positions, mask = _causal(x.shape[1])
        a = layer.self_attn(x, position_embeddings=self.rotary(x, positions),
                            attention_mask=mask)[0]
        h = hidden + (a[0] if one else a)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden, target):
        return self.lm_head(self.norm(hidden))

    def to_target(self, ids):
        return ids + self.d2t[ids]


class DeepSeekMtp(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction layer as vLLM and SGLang run it: eh_proj over
    [enorm(embedding), hnorm(hidden)], a transformers DeepseekV3DecoderLayer (`block`),
    shared_head.norm; the target's LM head reads that, and the next round reads it as
    its hidden state (SGLang's NextN). `hidden` is the target's final normed hidden
    state, as an EAGLE-1 head's."""

    version = 1  # the features as they are (no fc)

    def __init__(self, cfg, block: torch.nn.Module, rotary: torch.nn.Module):
        super().__init__()
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        h = cfg.hidden_size
        self.enorm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.head_norm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.rotary = rotary

    def forward(self, embeds, hidden):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        one = x.dim() == 2
        x = x[None] if one else x
        positions, mask = _causal(x.shape[1])
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        out = self.head_norm(out[0] if isinstance(out, tuple) else out)
        return out[0] if one else out

    def logits(self, hidden, target):
        return target.lm_head(hidden)

    def to_target(self, ids):
        return ids


def eager(cfg: tf.LlamaConfig) -> tf.LlamaConfig:
    """A copy of `cfg` naming transformers' plain attention (the modules stand alone)."""
    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = "eager"
    return cfg


def _causal(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions 0..n-1 and the additive causal mask of n tokens."""
    return torch.arange(n)[None], torch.full((n, n), float("-inf")).triu(1)[None, None]


def write_head(head: torch.nn.Module, cfg: tf.LlamaConfig, path: Path, torch_file: bool,
               **extra) -> Path:
    """The published layout: config.json and model.safetensors (or pytorch_model.bin)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), **extra}))
    save_module(head, path, "model.safetensors", "pytorch_model.bin", torch_file)
    return path


def features(target, tokens: list[int], aux_layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features of every token: EAGLE-1 the final hidden states after the
    norm, EAGLE-3 the inputs of `aux_layers` side by side."""
    out = target(torch.tensor([tokens]), output_hidden_states=True)
    states = out.hidden_states  # [embeddings = layer 0's input, ..., after the final norm]
    return torch.cat([states[i][0] for i in aux_layers], dim=-1)


def _logits_after(head, target, feats: torch.Tensor, tokens: list[int], guessed: list[int]
                  ) -> torch.Tensor:
    """The head's logits for the token after `tokens` (the target's `feats` of them) and
    then `guessed`, recomputing every pair: a guessed token's pair reads the head's own
    output at the pair before as its features."""
    embed = target.get_input_embeddings()
    ids = list(tokens[1:])  # pair p: token p + 1, the target's features at p
    hidden = list(feats[:len(tokens) - 1])
    own = [False] * len(hidden)
    for guess in [*guessed, None]:
        # EAGLE-3: the target's features through fc, the head's own outputs as they are.
        x = torch.stack(hidden if head.version == 1 else
                        [v if o else head.fc(v) for v, o in zip(hidden, own)])
        h = head(embed(torch.tensor(ids)), x)
        if guess is None:
            return head.logits(h[-1], target)
        ids.append(guess)
        hidden.append(h[-1])
        own.append(True)


@torch.no_grad()
def drafts(head, target, tokens: list[int], k: int, aux_layers: tuple[int, ...]
           ) -> tuple[list[int], list[float]]:
    """The head's k greedy drafts after `tokens`, recomputing every pair each round, and
    each draft's margin (top logit minus the next) to tell a near tie."""
    feats = features(target, tokens, aux_layers)
    out, margins = [], []
    for _ in range(k):
        logits = _logits_after(head, target, feats, tokens, out)
        top = torch.topk(logits, 2).values
        out.append(int(head.to_target(torch.argmax(logits))))
        margins.append(float(top[0] - top[1]))
    return out, margins


@torch.no_grad()
def tree_drafts(head, target, tokens: list[int], paths: list[tuple[int, ...]],
                aux_layers: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The tokens of a tree of drafts after `tokens` (`paths` of ranks, parents first):
    node p is the head's p[-1]-th most likely token after `tokens` and p's ancestors'
    tokens, with its margin to the ranks beside it (to tell a near tie)."""
    feats = features(target, tokens, aux_layers)
    out, margins = [], []
    for p in paths:
        ancestors = [out[paths.index(p[:i])] for i in range(1, len(p))]
        values, ids = torch.topk(_logits_after(head, target, feats, tokens, ancestors),
                                 p[-1] + 2)
        r = p[-1]
        out.append(int(head.to_target(ids[r])))
        margins.append(min(float(values[r] - values[r + 1]),
                           float(values[r - 1] - values[r]) if r else float("inf")))
    return out, margins
