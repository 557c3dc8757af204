"""Speculative decoding: acceptance and output tokens/s with and without it, in one run.

Random weights predict nothing, so drafts would be rejected for no reason of ours. This
benchmark first trains a small Llama target and a one-layer draft (character tokens, the
demo model's tokenizer) on Python's own standard library source, then an EAGLE-1 and an
EAGLE-3 head on the target's features of the same text (`trained_eagle`) and Medusa heads
on its final hidden states (`trained_medusa`), with transformers and torch on the CPU
(minutes, once; cached under ~/.cache/jaxserve). Half the training
samples are a piece of code followed by "# edited:" and the same code again, so the models
learn to copy, as a real model copies code it is asked to edit.

Workloads, each request `--tokens` greedy output tokens:
  edit:  held-out code (files not trained on) then "# edited:": the output repeats its
         prompt, where n-gram lookup should pay.
  write: held-out code cut mid-file: the output continues it, little to look up.
Each at batch 1 (one request at a time, --requests of them) and batch 16 (4 x 16 at
once), speculation off, n-gram (k = --k, prompt_lookup 2..4), the draft model, the
EAGLE heads and the Medusa heads (k = --k; Medusa and EAGLE-1 also with TREE, a tree of
candidates); at batch 16 n-gram and the draft model with the default
disable_by_batch_size (8: no speculation at 16) and with it off (speculating anyway), and
EAGLE-1 with the default (what the target's feature writes cost when nobody speculates).
Every speculative run's tokens are checked equal to speculation off. Then sampled
requests (temperature 0.7 and 1, batch 1): the draft model and EAGLE-1 with their guesses
drawn from their own distributions (rejection sampling, the default) and greedy guesses.
Then (--repeats)
the batch-1 runs and the batch-16 runs with the default policy again, the configurations
taking turns every 16 requests, against this VM's drift.

    python benchmarks/speculative.py [--tokens 128] [--k 4] [--train-steps 500] [--train-only]
                                     [--repeats 3] [--only-repeats] [--only NAME ...]

`--only` times those speculation rows (and off) and trains only the models they need.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from http_vs_grpc import cpu_name  # noqa: E402
from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.demo import CHARS, SPECIALS, cache_root, write_char_tokenizer  # noqa: E402

MODEL_VERSION = 2
CONTEXT = 384
EDIT_MARK = "\n# edited:\n"
# A target whose step reads enough weights (45 MB in float32) to cost more than a step's
# fixed host and dispatch time on a CPU, which a draft model's steps pay too.
TARGET = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
              num_attention_heads=6, num_key_value_heads=2)
DRAFT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2)
# The speculation timed at batch 1.
BATCH_1 = ["n-gram", "draft model", "EAGLE-1", "EAGLE-1 tree", "EAGLE-3", "Medusa",
           "Medusa tree"]
# The trees: the top guesses, and the top two of the first two tokens (10 nodes).
TREE = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 1], [0, 1], [0, 1, 0], [1], [1, 0],
               [1, 0, 0]]


# ------------------------------------------------------------------- the text

def stdlib_files() -> tuple[list[str], list[str]]:
    """The standard library's Python sources as text in the model's characters: (train,
    held out), split by file so held-out prompts are code the model never saw."""
    allowed = set(CHARS)
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="ignore").replace("\t", "    ")
        text = "".join(c for c in text if c in allowed)
        if len(text) > 2000:
            texts.append(text)
    held_out = texts[::20]
    return [t for i, t in enumerate(texts) if i % 20], held_out


def training_sample(texts: list[str], rng: random.Random) -> str:
    """CONTEXT characters: plain code, or (half the time) code, EDIT_MARK, the same code."""
    text = rng.choice(texts)
    if rng.random() < 0.5:
        start = rng.randrange(len(text) - CONTEXT)
        return text[start:start + CONTEXT]
    n = rng.randrange(60, (CONTEXT - len(EDIT_MARK)) // 2)
    start = rng.randrange(len(text) - CONTEXT - n)  # room for the tail after it
    piece = text[start:start + n]
    sample = piece + EDIT_MARK + piece
    rest = CONTEXT - len(sample)
    tail_start = start + n
    return sample + text[tail_start:tail_start + rest]


# --------------------------------------------------------------- the training

def train_steps(what: str, module, loss_of, steps: int, rng: random.Random) -> None:
    """`steps` AdamW steps (one-cycle schedule) of `module` on batches of 16 training
    samples, `loss_of(token ids)` each."""
    import torch

    vocab = {c: i for i, c in enumerate(SPECIALS + CHARS)}
    train, _ = stdlib_files()
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-3, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps,
                                                   pct_start=0.05)
    started = time.perf_counter()
    for step in range(steps):
        ids = torch.tensor([[0] + [vocab[c] for c in training_sample(train, rng)]
                            for _ in range(16)])
        loss = loss_of(ids)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  training {what}, step {step}: loss {loss.item():.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)


def trained_model(name: str, shape: dict, steps: int) -> Path:
    """The trained checkpoint directory (trained and written on first use)."""
    target = cache_root() / f"bench-speculative-v{MODEL_VERSION}-{name}-{steps}"
    if (target / "model.safetensors").exists():
        return target
    import torch
    import transformers

    torch.manual_seed(0)
    rng = random.Random(0)
    vocab = {c: i for i, c in enumerate(SPECIALS + CHARS)}
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), max_position_embeddings=1024, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **shape)
    model = transformers.LlamaForCausalLM(config)
    train_steps(f"the {name}", model, lambda ids: model(ids, labels=ids).loss, steps, rng)
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0,
                                                            "eos_token_id": 1}))
    write_char_tokenizer(tmp)
    tmp.rename(target)
    return target


def trained_eagle(version: int, target_dir: Path, steps: int) -> Path:
    """An EAGLE-1 or EAGLE-3 head for the trained target, trained on its features of the
    same text (and written in the published layout) on first use.

    EAGLE-1 as published: the head's output regresses the target's next feature (smooth
    L1) and its token loss (weight 0.1) goes through the target's LM head. EAGLE-3: token
    loss only, over its own LM head (full vocabulary: d2t all zero) and, as a short form of
    its "training-time test", a second pass whose every pair reads the first pass's output
    at the position before in place of the target's features (the chain's inputs)."""
    out = cache_root() / f"bench-speculative-v{MODEL_VERSION}-eagle{version}-{steps}"
    if (out / "model.safetensors").exists():
        return out
    import torch
    import torch.nn.functional as F
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from eagle_reference import Eagle1, Eagle3, write_head

    torch.manual_seed(0)
    rng = random.Random(version)
    vocab = {c: i for i, c in enumerate(SPECIALS + CHARS)}
    target = transformers.LlamaForCausalLM.from_pretrained(target_dir).eval()
    target.requires_grad_(False)
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    layers = target.config.num_hidden_layers
    aux = (layers,) if version == 1 else (2, layers // 2, layers - 3)
    if version == 1:
        head = Eagle1(cfg)
    else:
        head = Eagle3(cfg, len(vocab), torch.zeros(len(vocab), dtype=torch.long))
        with torch.no_grad():  # start from the target's output layer
            head.lm_head.weight.copy_(target.lm_head.weight)
            head.norm.weight.copy_(target.model.norm.weight)

    def loss_of(ids):
        with torch.no_grad():
            states = target(ids, output_hidden_states=True).hidden_states
            feats = torch.cat([states[i] for i in aux], dim=-1)
            embeds = target.get_input_embeddings()(ids[:, 1:])
        # Pair p: token p + 1 and the features at p; it predicts token p + 2.
        x, labels = feats[:, :-1], ids[:, 2:]
        x = x + (torch.rand_like(x) - 0.5) * 0.2  # EAGLE's noise on the features
        if version == 1:
            h = head(embeds, x)
            return F.smooth_l1_loss(h[:, :-1], states[layers][:, 1:-1]) + 0.1 * F.cross_entropy(
                target.lm_head(h[:, :-1]).flatten(0, 1), labels.flatten())
        h = head(embeds, head.fc(x))
        h2 = head(embeds[:, 1:], h[:, :-1])  # pair p + 1 reads pair p's output
        return (F.cross_entropy(head.logits(h[:, :-1], target).flatten(0, 1), labels.flatten())
                + F.cross_entropy(head.logits(h2[:, :-1], target).flatten(0, 1),
                                  labels[:, 1:].flatten()))

    train_steps(f"the EAGLE-{version} head", head, loss_of, steps, rng)
    tmp = out.with_name(out.name + ".tmp")
    write_head(head, cfg, tmp, torch_file=False,
               **({"eagle_aux_hidden_state_layer_ids": list(aux)} if version == 3 else {}))
    tmp.rename(out)
    return out


def trained_medusa(target_dir: Path, heads: int, steps: int) -> Path:
    """Medusa heads (one residual block each) for the trained target, trained on its
    final hidden states of the same text as Medusa-1 trains them (the target frozen,
    each head from the target's LM head, head h's loss weighted 0.8^h), written in the
    published layout on first use."""
    out = cache_root() / f"bench-speculative-v{MODEL_VERSION}-medusa{heads}-{steps}"
    if (out / "medusa_lm_head.safetensors").exists():
        return out
    import torch
    import torch.nn.functional as F
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from published_heads import medusa_heads, write_medusa

    target = transformers.LlamaForCausalLM.from_pretrained(target_dir).eval()
    target.requires_grad_(False)
    module = medusa_heads(target, heads, layers=1, seed=0, copy_lm_head=True)

    def loss_of(ids):
        with torch.no_grad():
            hidden = target.model(ids).last_hidden_state  # after the final norm
        # Head h at position p guesses token p + h + 2.
        return sum(0.8 ** h * F.cross_entropy(head(hidden[:, :-(h + 2)]).flatten(0, 1),
                                              ids[:, h + 2:].flatten())
                   for h, head in enumerate(module))

    train_steps(f"{heads} Medusa heads", module, loss_of, steps, random.Random(5))
    tmp = out.with_name(out.name + ".tmp")
    write_medusa(tmp, module, layers=1)
    tmp.rename(out)
    return out


# ------------------------------------------------------------------ the runs

def workloads(num: int, rng: random.Random) -> dict[str, list[str]]:
    _, held_out = stdlib_files()
    edit, write = [], []
    for i in range(num):
        text = held_out[i % len(held_out)]
        start = rng.randrange(len(text) - 400)
        edit.append(text[start:start + 160] + EDIT_MARK)
        write.append(text[start:start + 200])
    return {"edit": edit, "write": write}


def run(llm: LLM, prompts: list[str], batch: int, tokens: int, temperature: float = 0.0
        ) -> dict:
    """Output tokens/s of `prompts`, `batch` at a time (request i seeded i); the tokens;
    speculation counters."""
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=tokens,
                             ignore_eos=True) for i in range(len(prompts))]
    speculator = llm.engine.speculator
    counters = (lambda s: (s.num_proposed, s.num_accepted, s.proposed[0]))  # noqa: E731
    before = counters(speculator.stats) if speculator else (0, 0, 0)
    steps_before = llm.engine.num_steps
    out, started = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += llm.generate(prompts[i:i + batch], params[i:i + batch])
    wall = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in out)
    after = counters(speculator.stats) if speculator else (0, 0, 0)
    proposed, accepted, drafting = (a - b for a, b in zip(after, before))
    return {"tok_s": generated / wall, "wall": wall, "generated": generated,
            "tokens": [o.outputs[0].token_ids for o in out],
            "proposed": proposed, "accepted": accepted, "drafting": drafting,
            "steps": llm.engine.num_steps - steps_before}


def speculative_configs(k: int, draft_dir, eagle_dirs: dict, medusa_dir) -> dict[str, dict]:
    """Every speculation the benchmark times, by name, as `speculative_config`s."""
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    tree = {"speculative_token_tree": [p for p in TREE if len(p) <= k]}
    draft = {"model": str(draft_dir), "num_speculative_tokens": k}
    eagle = {v: {"method": "eagle" if v == 1 else "eagle3", "model": str(path),
                 "num_speculative_tokens": k} for v, path in eagle_dirs.items()}
    medusa = {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": k}
    return {"n-gram": ngram, "n-gram, never disabled": {**ngram, "disable_by_batch_size": None},
            "draft model": draft,
            "draft model, never disabled": {**draft, "disable_by_batch_size": None},
            "draft model, greedy drafts": {**draft, "sampled_drafts": False},
            "EAGLE-1": eagle.get(1), "EAGLE-1 tree": {**eagle.get(1, {}), **tree},
            "EAGLE-1, greedy drafts": {**eagle.get(1, {}), "sampled_drafts": False},
            "EAGLE-3": eagle.get(3), "Medusa": medusa, "Medusa tree": {**medusa, **tree}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=500)
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--requests", type=int, default=32, help="requests per batch-1 run "
                    "(batch-16 runs take 4 batches)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats of the "
                    "batch-1 runs and the batch-16 runs with the default policy, after the "
                    "table (0: none)")
    ap.add_argument("--only-repeats", action="store_true", help="skip the table")
    ap.add_argument("--only", nargs="+", choices=BATCH_1, default=BATCH_1,
                    help="the speculation to time (default: all)")
    args = ap.parse_args()

    wanted = lambda *names: any(n in args.only for n in names)  # noqa: E731
    model_dir = trained_model("target", TARGET, args.train_steps)
    draft_dir = trained_model("draft", DRAFT, args.train_steps) if wanted("draft model") else None
    eagle_dirs = {v: trained_eagle(v, model_dir, args.train_steps) for v in (1, 3)
                  if wanted(f"EAGLE-{v}", f"EAGLE-{v} tree")}
    medusa_dir = (trained_medusa(model_dir, args.k, args.train_steps)
                  if wanted("Medusa", "Medusa tree") else None)
    if args.train_only:
        return
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, trained target {TARGET}, draft "
          f"{DRAFT} ({args.train_steps} steps each), float32, greedy, {args.tokens} output "
          f"tokens per request, k = {args.k}\n")
    engine = dict(dtype="float32", max_model_len=1024, page_size=16, max_num_seqs=16,
                  max_num_batched_tokens=512, kv_cache_memory_gib=0.5)
    configs = speculative_configs(args.k, draft_dir, eagle_dirs, medusa_dir)
    rng = random.Random(1)
    loads = workloads(max(args.requests, 64), rng)
    builds = {"off": functools.partial(LLM, str(model_dir), **engine)}
    for name, config in configs.items():
        if wanted(name.split(",")[0]):
            builds[name] = functools.partial(LLM, str(model_dir), **engine,
                                             speculative_config=config)
    llms = Engines(builds, warm=lambda llm: run(llm, loads["write"][:2], 2, 8))
    for name in builds:
        if "," not in name:
            llms[name]

    if not args.only_repeats:
        table(llms, loads, args)
        sampled(llms, loads, args)
    if args.repeats:
        alternate(llms, loads, args)


class Engines:
    """The benchmark's engines by name, each built (and its host paths warmed) when first
    asked for. A variant (a name with a comma: "draft model, never disabled") is dropped
    when another is built: XLA:CPU maps ~200 memory regions of JIT code per compiled
    program (7-10k per engine here), and a process past Linux's vm.max_map_count (65530
    by default) dies in LLVM ("Cannot allocate memory", then a segfault), which the whole
    benchmark's engines at once would."""

    def __init__(self, builds: dict, warm) -> None:
        self.builds, self.warm, self.alive = builds, warm, {}

    def __contains__(self, name: str) -> bool:
        return name in self.builds

    def __getitem__(self, name: str) -> LLM:
        if name not in self.alive:
            if "," in name:
                for other in [n for n in self.alive if "," in n]:
                    del self.alive[other]
                gc.collect()
            maps, limit = memory_maps()
            if limit and maps + 12_000 > limit:
                sys.exit(f"{maps} memory maps of {limit} (vm.max_map_count) in use: another "
                         f"engine may not fit; time fewer with --only, or raise the limit "
                         f"(sysctl -w vm.max_map_count=262144)")
            self.alive[name] = self.builds[name]()
            self.warm(self.alive[name])
        return self.alive[name]


def memory_maps() -> tuple[int, int | None]:
    """This process's memory maps and the most Linux allows (None elsewhere)."""
    try:
        with open("/proc/self/maps") as f, open("/proc/sys/vm/max_map_count") as g:
            return sum(1 for _ in f), int(g.read())
    except OSError:
        return 0, None


def alternate(llms: Engines, loads: dict, args) -> None:
    """Batch 1, and batch 16 with the default policy: each configuration in turn
    `--repeats` times, so the machine's drift reaches them all alike; summed tok/s against
    off's. Within a repeat the configurations take turns every 16 requests (one batch of
    16, or 16 at batch 1), in an order reversed each turn: this VM's speed drifts by 10%
    and more within the seconds one configuration's 64 requests take."""
    got = {}
    for _ in range(args.repeats):
        for batch, count, names in ((1, args.requests, ["off"] + BATCH_1),
                                    (16, 64, ["off", "n-gram", "draft model", "EAGLE-1"])):
            names = [n for n in names if n in llms]
            for workload, prompts in loads.items():
                totals = {name: [0, 0.0] for name in names}  # tokens, seconds
                for turn, start in enumerate(range(0, count, 16)):
                    for name in names if turn % 2 == 0 else names[::-1]:
                        out = run(llms[name], prompts[start:min(start + 16, count)], batch,
                                  args.tokens)
                        totals[name][0] += out["generated"]
                        totals[name][1] += out["wall"]
                for name, (generated, wall) in totals.items():
                    got.setdefault((batch, workload, name), []).append(generated / wall)
    print(f"\n{args.repeats} alternating repeats (batch 16: default policy)\n")
    print("| batch | workload | speculation | output tok/s, each repeat | vs off (sums) |")
    print("|---|---|---|---|---|")
    for (batch, workload, name), values in got.items():
        ratio = sum(values) / sum(got[(batch, workload, "off")])
        print(f"| {batch} | {workload} | {name} | {', '.join(f'{v:.0f}' for v in values)} | "
              f"{ratio:.2f}x |")


def sampled(llms: Engines, loads: dict, args) -> None:
    """Sampled requests at batch 1: the draft model's and EAGLE-1's guesses drawn from
    their own distributions and kept by rejection sampling (the default), against greedy
    guesses (kept when the target's draw equals them)."""
    names = [n for n in ("draft model", "draft model, greedy drafts", "EAGLE-1",
                         "EAGLE-1, greedy drafts") if n in llms]
    if not names:
        return
    count = args.requests // 2
    print(f"\nSampled requests (seeded), batch 1, {count} requests\n")
    print("| workload | temperature | speculation | output tok/s | vs off | acceptance | "
          "accepted per drafting seq-step |")
    print("|---|---|---|---|---|---|---|")
    for name, prompts in loads.items():
        for temperature in (0.7, 1.0):
            base = run(llms["off"], prompts[:count], 1, args.tokens, temperature)
            for label in ["off"] + names:
                r = base if label == "off" else run(llms[label], prompts[:count], 1,
                                                    args.tokens, temperature)
                rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
                per_step = r["accepted"] / r["drafting"] if r["drafting"] else 0.0
                print(f"| {name} | {temperature} | {label} | {r['tok_s']:.1f} | "
                      f"{r['tok_s'] / base['tok_s']:.2f}x | "
                      f"{rate:.0%} ({r['accepted']}/{r['proposed']}) | {per_step:.2f} |",
                      flush=True)


def table(llms: Engines, loads: dict, args) -> None:
    print("| workload | batch | speculation | output tok/s | vs off | acceptance | "
          "accepted per drafting seq-step | steps | same tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, prompts in loads.items():
        for batch, count in ((1, args.requests), (16, 64)):
            base = run(llms["off"], prompts[:count], batch, args.tokens)
            rows = [("off", base)]
            names = (BATCH_1 if batch == 1 else
                     ["n-gram", "n-gram, never disabled", "draft model",
                      "draft model, never disabled", "EAGLE-1"])
            rows += [(n, run(llms[n], prompts[:count], batch, args.tokens))
                     for n in names if n in llms]
            for label, r in rows:
                rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
                per_step = r["accepted"] / r["drafting"] if r["drafting"] else 0.0
                print(f"| {name} | {batch} | {label} | {r['tok_s']:.1f} | "
                      f"{r['tok_s'] / base['tok_s']:.2f}x | "
                      f"{rate:.0%} ({r['accepted']}/{r['proposed']}) | "
                      f"{per_step:.2f} | {r['steps']} | "
                      f"{'yes' if r['tokens'] == base['tokens'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
