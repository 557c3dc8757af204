"""EAGLE-1 and EAGLE-3 heads: the drafts jaxserve's proposer makes at every step are the
ones the published torch heads (eagle_reference.py) make from transformers' own features
of the same tokens, and the output is the target's whatever they guess."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers as tf

from device_branches import check_drawing_proposer, gpu_programs
from eagle_reference import Eagle1, Eagle3, drafts, tree_drafts, write_head
from jaxserve import LLM
from test_speculative import (  # noqa: F401 - base, target and want are fixtures
    ENGINE, GREEDY, _chi_square_p, _sample_sequences, _target_distribution, base,
    check_clean, fresh_counters, tokens, want)

AUX = [0, 1, 1]  # the 2-layer target's layers an EAGLE-3 head reads here
K = 3
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def head_config(target) -> tf.LlamaConfig:
    """A head's config: the target's, one layer."""
    return tf.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})


def make_head(target, version: int, seed: int):
    """A random head whose attention is sharp enough that a position or a K/V entry out
    of place changes its guesses."""
    torch.manual_seed(seed)
    cfg = head_config(target)
    if version == 1:
        head = Eagle1(cfg).eval()
        attn = head.layers[0].self_attn
    else:
        kept = torch.sort(torch.randperm(cfg.vocab_size)[:200]).values  # the draft vocabulary
        head = Eagle3(cfg, 200, kept - torch.arange(200)).eval()
        attn = head.midlayer.self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(8)
        attn.k_proj.weight.mul_(8)
    return head


def write(head, target, path, torch_file: bool):
    extra = ({"draft_vocab_size": 200, "eagle_aux_hidden_state_layer_ids": AUX}
             if head.version == 3 else {})
    return write_head(head, head_config(target), path, torch_file, **extra)


def eagle_llm(checkpoints, path, version: int, tree=None, target=None, sampled_drafts=True,
              **engine) -> LLM:
    return LLM(str(target or checkpoints("llama")[0]), **{**ENGINE, **engine},
               speculative_config={
                   "method": "eagle3" if version == 3 else "eagle", "model": str(path),
                   "num_speculative_tokens": K, "disable_by_batch_size": None,
                   "speculative_token_tree": tree, "sampled_drafts": sampled_drafts})


def record(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every (sequence's tokens, drafts the step after them verified) from here on, as
    the engine reads the drafts back from the device and verifies them."""
    speculator, seen = llm.engine.speculator, []
    accepted_rows = speculator.accepted_rows

    def recording(s, token_ids):  # the tokens before the step's samples (PLACEHOLDERs)
        seen.append((list(s.seq.token_ids[:s.seq.num_known_tokens]), list(s.drafts.tokens)))
        return accepted_rows(s, token_ids)

    speculator.accepted_rows = recording
    return seen


def check_against_reference(seen, head, target, aux) -> None:
    """Each step's drafts equal the torch head's on the same tokens, up to a near tie of
    its logits (after which the drafts may part)."""
    compared = total = 0
    for tokens_so_far, ours in seen:
        theirs, margins = drafts(head, target, tokens_so_far, len(ours), aux)
        for j, (a, b) in enumerate(zip(ours, theirs)):
            total += 1
            if margins[j] < 1e-3:
                break
            assert a == b, (len(tokens_so_far), j, ours, theirs)
            compared += 1
    assert total > 100 and compared > 0.9 * total


# EAGLE-1 runs with the slow tests (~65 s here): EAGLE-3 covers the engine's paths; EAGLE-1
# adds its file format (torch's file, fc with a bias) and head shape.
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 3],
                ids=["eagle1", "eagle3"])
def version(request):
    return request.param


@pytest.fixture(scope="module")
def head(checkpoints, version, tmp_path_factory):
    target = checkpoints("llama")[1]
    head = make_head(target, version, seed=version)
    # EAGLE-1 as the first checkpoints ship it (torch's file, fc with a bias); EAGLE-3's
    # in safetensors.
    path = write(head, target, tmp_path_factory.mktemp(f"eagle{version}"),
                 torch_file=version == 1)
    return head, path


def test_drafts_are_the_published_heads_and_tokens_the_targets(checkpoints, head, version,
                                                               want, prompts):
    module, path = head
    llm = eagle_llm(checkpoints, path, version)
    seen = record(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    check_against_reference(seen, module, checkpoints("llama")[1],
                            (2,) if version == 1 else tuple(AUX))
    check_clean(llm)


@pytest.mark.parametrize("branch_free", [False, True])
def test_a_gpus_eagle_programs_hold_no_branch_on_device_data(checkpoints, head, version,
                                                            branch_free, monkeypatch):
    """EAGLE's rounds, drawing sampled requests' guesses, traced as a GPU compiles them:
    where branch_free, the host picks the program with top-k and top-p's sort or without
    and none holds a branch; else each round's draw is a lax.cond."""
    found = gpu_programs(monkeypatch, branch_free, model=str(checkpoints("llama")[0]),
                         **ENGINE, speculative_config={
                             "method": "eagle3" if version == 3 else "eagle",
                             "model": str(head[1]), "num_speculative_tokens": K,
                             "disable_by_batch_size": None})
    check_drawing_proposer(found, branch_free)


@pytest.mark.slow  # ~60 s: EAGLE-3's chains run in the default suite, its trees here
def test_trees_are_the_published_heads_top_guesses(checkpoints, head, version, want,
                                                  prompts):
    """Every node of every whole tree is the torch head's guess of its rank after its
    ancestors (each of a depth's nodes in a slot of its own, seeing its ancestors only),
    up to near ties; the output is the target's."""
    module, path = head
    llm = eagle_llm(checkpoints, path, version, tree=TREE)
    seen, stats = record(llm), llm.engine.speculator.stats
    assert tokens(llm.generate(prompts, GREEDY)) == want
    paths = list(llm.engine.speculator.config.speculative_token_tree)
    aux = (2,) if version == 1 else tuple(AUX)
    compared = total = 0
    for tokens_so_far, tree in seen:
        if len(tree) < len(paths):
            continue  # cut near the end
        theirs, margins = tree_drafts(module, checkpoints("llama")[1], tokens_so_far, paths,
                                      aux)
        for j, p in enumerate(paths):
            total += 1
            if min(margins[paths.index(p[:i])] for i in range(1, len(p) + 1)) < 1e-3:
                continue  # a near tie on its path
            assert tree[j] == theirs[j], (len(tokens_so_far), p, tree, theirs)
            compared += 1
    assert total > 300 and compared > 0.9 * total
    assert stats.proposed[2] > 0
    check_clean(llm)


@pytest.mark.slow  # ~55 s
def test_preemption_chunks_and_prefix_hits(checkpoints, head, version, want, prompts):
    """A pool too small for the four (preemption and recompute), prompts cut in chunks,
    then a second run on cached prompts: the features of cached pages are the ones
    their first computation wrote."""
    module, path = head
    llm = eagle_llm(checkpoints, path, version, max_num_batched_tokens=16,
                    token_buckets=(16,), num_pages=40)
    seen = record(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == want and sum(o.num_cached_tokens for o in outs) > 0
    check_against_reference(seen, module, checkpoints("llama")[1],
                            (2,) if version == 1 else tuple(AUX))
    check_clean(llm)


def repeat_head(target) -> Eagle1:
    """An EAGLE-1 head that passes the target's final hidden state through (fc picks the
    features, the layer adds zeros): the target's LM head on it guesses the token the
    target just chose, again. Right only if the features of the right position are read."""
    head = make_head(target, 1, seed=0)
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
        head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return head


def test_a_head_reading_the_features_guesses_the_last_token_again(checkpoints, want, prompts,
                                                                   tmp_path):
    target = checkpoints("llama")[1]
    path = write(repeat_head(target), target, tmp_path / "repeat", torch_file=False)
    llm = eagle_llm(checkpoints, path, 1, max_num_batched_tokens=16, token_buckets=(16,),
                    num_pages=40)
    stats = fresh_counters(llm)
    seen = record(llm)
    for _ in range(2):  # the second run on cached prompts
        assert tokens(llm.generate(prompts, GREEDY)) == want
    assert all(d == [t[-1]] * len(d) for t, d in seen)
    # Accepted exactly where the output repeats its last token.
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(llm)


def last_token_target(model, path):
    """A copy of the tiny Llama `model` whose layers add nothing (attention and MLP
    outputs zero), saved at `path`: its next token's distribution depends on the last
    token only. Its embeddings have RMS 1 and its final norm weights 1, so the norm
    leaves them as they are (an EAGLE-1 head's output goes to the LM head unnormed)."""
    from jaxserve.demo import write_byte_tokenizer

    model = copy.deepcopy(model)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


def embedding_head(target) -> Eagle1:
    """An EAGLE-1 head whose output is its input token's embedding (fc picks it, the
    layer adds zeros): over `last_token_target`'s LM head, the target's own
    distribution after that token, in every round."""
    head = repeat_head(target)
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    return head


@pytest.mark.slow  # ~30-60 s on a 2-core machine
def test_sampled_drafts_follow_the_target_distribution(checkpoints, prompts, tmp_path):
    """Sampled requests' drafts are drawn from the head's distribution (temperature 1 and
    top-k 3 applied to it) and verified by rejection sampling. A head whose distribution
    is the target's in every round has all its drafts kept (a round's guess verified
    against another round's distribution would not be), where greedy drafts are kept at
    the rate of the target's top tokens; four tokens over 2000 seeds fit transformers'
    probabilities (chi-square); the same seeds give the same tokens again."""
    model = last_token_target(checkpoints("llama")[1], tmp_path / "target")
    head = write(embedding_head(model), model, tmp_path / "head", torch_file=False)
    dist, _ = _target_distribution(model, prompts[0], 3, 4)
    runs = {}
    for sampled in (True, False):
        llm = eagle_llm(checkpoints, head, 1, target=tmp_path / "target",
                        sampled_drafts=sampled)
        runs[sampled] = fresh_counters(llm)
        counts = _sample_sequences(llm, prompts[0], 2000, 3, 4)
        assert _chi_square_p(counts, dist, 2000) > 1e-3
        if sampled:
            again = _sample_sequences(llm, prompts[0], 50, 3, 4)
            assert again == _sample_sequences(llm, prompts[0], 50, 3, 4)
        check_clean(llm)
    # Two drafts for each request's last three tokens: all kept, one step each.
    assert runs[True].accepted[:2] == runs[True].proposed[:2] == [2000 + 50 * 2] * 2
    assert runs[False].acceptance_rate < 0.5  # about the top token's probability


def test_feature_layers():
    from jaxserve.models.eagle import feature_layers

    assert feature_layers(1, 32) == (32,)
    assert feature_layers(3, 32) == (2, 16, 29)
    assert feature_layers(3, 4, (0, 1, 3)) == (0, 1, 3)
    with pytest.raises(ValueError, match="the target has 2 layers"):
        feature_layers(3, 2)


def test_bad_heads_say_what_is_wrong(checkpoints, head, version, tmp_path):
    from safetensors.numpy import load_file, save_file

    module, path = head
    target = checkpoints("llama")[1]
    bad = write(module, target, tmp_path / "bad", torch_file=False)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(ValueError, match="is for hidden size 32"):
        eagle_llm(checkpoints, bad, version, warmup=False)
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors for \\['fc'\\]"):
        eagle_llm(checkpoints, bad, version, warmup=False)
    tensors["fc.weight"] = np.zeros((64, 64), np.float32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="EAGLE tensor 'fc.weight' has shape"):
        eagle_llm(checkpoints, bad, version, warmup=False)
