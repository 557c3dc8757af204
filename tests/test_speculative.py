"""Speculative decoding: drafts verified inside the ragged step give the tokens of no
speculation (greedy, and seeded sampling), and sampled outputs follow the target
model's distribution (transformers' probabilities, a chi-square test)."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine import broadcast
from jaxserve.engine.batch import CarryLayout
from jaxserve.engine.speculative import drafts as trees
from jaxserve.engine.speculative.device import move_slots, record_acceptance
from jaxserve.engine.speculative.drafts import accepted_path
from jaxserve.engine.speculative.proposers import MedusaProposer, NgramProposer, TokenProposer
from jaxserve.engine.speculative.speculator import SpeculativeDecoding
from jaxserve.engine.speculative.stats import SpeculationStats
from oracle_proposer import OracleProposer, OracleTreeProposer
from published_heads import medusa_heads, write_medusa

from conftest import VOCAB

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def base(checkpoints):
    return LLM(str(checkpoints("llama")[0]), **ENGINE)


@pytest.fixture(scope="module")
def spec(checkpoints):
    return LLM(str(checkpoints("llama")[0]), **ENGINE, speculative_config=SPEC)


@pytest.fixture(scope="module")
def want(base, prompts):
    return tokens(base.generate(prompts, GREEDY))


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def speculating(llm: LLM, proposer=None, **config) -> SpeculationStats:
    """Give `llm` a fresh speculator (its counters at zero), with `proposer` in place of
    its n-gram one and `config` changed from SPEC."""
    engine = llm.engine
    engine.speculator = SpeculativeDecoding(SpeculativeConfig(**{**SPEC, **config}),
                                            engine.runner, engine.scheduler,
                                            engine.max_model_len, engine.running_requests,
                                            proposer)
    return engine.speculator.stats


def check_clean(llm: LLM) -> None:
    """No program compiled while serving; every page back in the pool."""
    engine = llm.engine
    assert engine.runner.compiles_after_warmup == 0
    assert engine.scheduler.num_used_pages == 0
    for allocator in engine.scheduler.allocators:
        allocator.check_invariants()


def test_ngram_proposer_takes_the_longest_latest_match():
    propose = NgramProposer(2, 3).propose
    # [9, 5, 6] never came before; [5, 6] did, twice: the latest is followed by 8, 9, 9.
    assert propose([5, 6, 7, 5, 6, 8, 9, 9, 5, 6], 3) == [8, 9, 9]
    # [7, 5, 6] came before (followed by 8): preferred to the later [5, 6].
    assert propose([7, 5, 6, 8, 1, 5, 6, 2, 7, 5, 6], 2) == [8, 1]
    assert propose([1, 2, 1, 2], 4) == [1, 2]  # as many as follow the match
    # The latest [1, 2] has two tokens after it; the one before has three.
    assert propose([1, 2, 3, 4, 5, 1, 2, 1, 2], 3) == [3, 4, 5]
    assert propose([1, 2, 1, 2, 1, 2, 1, 2], 3) == [1, 2, 1]
    assert propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert NgramProposer(3, 3).propose([5, 6, 7, 5, 6], 2) == []  # too short a match
    assert propose([5, 6, 5, 6], 0) == []


def test_greedy_ngram_speculation_gives_the_tokens_without_it(spec, want, prompts):
    stats = speculating(spec)
    assert tokens(spec.generate(prompts, GREEDY)) == want
    # The tiny model's greedy output repeats itself here and there: some drafts are
    # accepted, some not, so both paths ran.
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(spec)


def test_drafts_equal_to_the_target_are_all_accepted(spec, want, prompts):
    """An off-by-one in the rows, the positions or the KV rollback would reject some."""
    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB))
    assert tokens(spec.generate(prompts, GREEDY)) == want
    assert stats.accepted == stats.proposed
    # Per sequence: 1 token from the prompt's step, then 9 steps of 3 drafts + 1, then 2
    # drafts (no more fit the 40 tokens); 4 sequences.
    assert stats.proposed == [40, 40, 36]
    check_clean(spec)


def test_rejected_drafts_leave_the_tokens_unchanged(spec, want, prompts):
    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB, spoil=2))
    assert tokens(spec.generate(prompts, GREEDY)) == want
    assert 0 < stats.num_accepted < stats.num_proposed
    assert stats.accepted[0] > stats.accepted[-1]  # spoiled drafts are last ones
    check_clean(spec)


def test_preemption_chunked_prefill_and_prefix_hits(checkpoints, want, prompts):
    """A pool too small for the four sequences (preemption and recompute), prompts cut
    into chunks, and a second run that finds the prompts cached."""
    llm = LLM(str(checkpoints("llama")[0]), **{**ENGINE, "max_num_batched_tokens": 16,
                                               "token_buckets": (16,)},
              num_pages=40, speculative_config=SPEC)
    stats = speculating(llm, OracleProposer(list(zip(prompts, want)), VOCAB, spoil=3))
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == want
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(llm)


def test_seeded_sampling_gives_the_tokens_without_speculation(base, spec, prompts):
    """Output j is drawn with the same key from the same distribution with or without
    drafts: seeded requests give the very same tokens (penalties, min_tokens and
    logprobs included)."""
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1, max_tokens=30,
                             ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.2, min_p=0.05, seed=2, max_tokens=25, min_tokens=20,
                             stop_token_ids=[7, 8]),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)]
    runs = base.generate(prompts, params)
    stats = speculating(spec, OracleProposer(list(zip(prompts, tokens(runs))), VOCAB, spoil=3))
    got = spec.generate(prompts, params)
    assert tokens(got) == tokens(runs)
    for a, b in zip(got, runs):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([v.logprob for v in x.values()],
                                       [v.logprob for v in y.values()], rtol=1e-5, atol=1e-5)
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(spec)


def test_a_grammar_request_beside_speculating_ones(base, spec, want, prompts):
    """A regex-constrained request in the batch (sampled apart, its mask on its row of a
    verifying step's rows) gets the text it gets without speculation; the others speculate
    and keep their tokens."""
    from jaxserve.sampling_params import StructuredOutputsParams

    shaped = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"))
    params = [shaped, GREEDY, GREEDY, GREEDY]
    expected = base.generate(prompts, params)
    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB, spoil=3))
    got = spec.generate(prompts, params)
    assert got[0].outputs[0].text == expected[0].outputs[0].text
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", got[0].outputs[0].text)
    assert tokens(got)[1:] == want[1:]
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(spec)


def test_status_and_metrics_report_the_counters(base, spec, want, prompts):
    """GetServerStatus's Speculation and the /metrics counters after a run whose
    counts are known: every second proposal has its last draft spoiled."""
    from server.engine_core import EngineSnapshot
    from server.metrics import Metrics
    from server.servicer import speculation_status

    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB, spoil=2))
    spec.generate(prompts, GREEDY)
    status = speculation_status(spec.engine.status().speculation)
    assert (status.method, status.num_speculative_tokens, status.active) == ("ngram", 3, True)
    assert status.proposed_tokens == stats.num_proposed > status.accepted_tokens > 0
    assert status.accepted_tokens == stats.num_accepted
    assert status.acceptance_rate == pytest.approx(stats.num_accepted / stats.num_proposed)
    rates = [a / p for a, p in zip(stats.accepted, stats.proposed)]
    assert list(status.acceptance_by_position) == pytest.approx(rates)
    assert rates[0] == 1.0 and rates[2] < 0.75  # only last drafts are spoiled
    metrics = {}
    for line in Metrics("m").scrape(EngineSnapshot.of(spec.engine)).decode().splitlines():
        if line.startswith("jaxserve:spec_decode"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    assert metrics['jaxserve:spec_decode_num_draft_tokens_total{model_name="m"}'] == \
        stats.num_proposed
    assert metrics['jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"}'] == \
        stats.num_accepted
    assert metrics['jaxserve:spec_decode_num_drafts_total{model_name="m"}'] == stats.proposed[0]
    for position, accepted in enumerate(stats.accepted):
        key = ('jaxserve:spec_decode_num_accepted_tokens_per_pos_total'
               f'{{model_name="m",position="{position}"}}')
        assert metrics[key] == accepted
    assert metrics['jaxserve:spec_decode_active{model_name="m"}'] == 1.0
    assert speculation_status(base.engine.status().speculation) is None  # off: no message


def test_a_request_can_turn_speculation_off(spec, want, prompts):
    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB))
    off = dataclasses.replace(GREEDY, speculative=False)
    assert tokens(spec.generate(prompts, [GREEDY, off, GREEDY, off])) == want
    assert stats.proposed == [20, 20, 18]  # two sequences' drafts (see above)
    check_clean(spec)


def test_the_speculative_field_over_grpc_and_http():
    from server.openai_protocol import CompletionRequest
    from server.protos.jaxserve.v1 import inference_pb2 as pb
    from server.servicer import sampling_from_proto

    assert sampling_from_proto(pb.SamplingParams()).speculative is True
    assert sampling_from_proto(pb.SamplingParams(speculative=False)).speculative is False
    request = CompletionRequest(prompt="x", speculative=False)
    assert request.sampling_params(4, None, 0).speculative is False
    assert CompletionRequest(prompt="x").sampling_params(4, None, 0).speculative is True
    with pytest.raises(ValueError, match="speculative must be true or false"):
        SamplingParams(speculative="no")


def test_large_batches_do_not_speculate(spec, want, prompts):
    stats = speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB),
                        disable_by_batch_size=3)
    assert tokens(spec.generate(prompts, GREEDY)) == want
    # Four sequences run together until the last step (the longest prompt is cut in
    # two, so it runs one step behind and alone at the end).
    assert stats.num_proposed <= 3
    assert tokens(spec.generate(prompts[:3], GREEDY)) == want[:3]
    assert stats.num_proposed > 3 * 20 and stats.active
    check_clean(spec)


def test_steps_that_compute_prompts_do_not_speculate(spec, base, want, prompts):
    """Under a batch limit, a step that computes prompt tokens (a request admitted, or a
    prompt's next chunk) is compute-bound: it verifies no drafts and the status says so;
    the decode-only steps around it speculate."""
    # Over a step's budget of 64 (and in no prefix cache): prefilled in two chunks.
    long = np.random.default_rng(7).integers(3, VOCAB, 80).tolist()
    long_want = tokens(base.generate([long], GREEDY))[0]
    stats = speculating(spec, OracleProposer([(prompts[0], want[0]), (long, long_want)],
                                             VOCAB), disable_by_batch_size=8)
    engine, outs = spec.engine, {"a": [], "b": []}

    def step():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids

    engine.add_request("a", prompts[0], GREEDY)
    for _ in range(3):
        step()
    assert stats.num_proposed > 0 and stats.active  # "a" alone, decoding
    engine.add_request("b", long, GREEDY)
    prefilling_steps = 0
    while engine.has_unfinished():
        prefills, before = engine.scheduler.prefills_next, stats.num_proposed
        step()
        if prefills:
            prefilling_steps += 1
            assert stats.num_proposed == before and not stats.active
    assert prefilling_steps == 2 and stats.active
    assert stats.num_proposed > 30  # both decode speculating once "b" is in
    assert [outs["a"], outs["b"]] == [want[0], long_want]
    check_clean(spec)


def test_abort_while_speculating_frees_every_page(spec, want, prompts):
    engine = spec.engine
    speculating(spec, OracleProposer(list(zip(prompts, want)), VOCAB))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.speculator.stats.num_proposed > 0
    for i in range(len(prompts)):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished()
    check_clean(spec)


# ---------------------------------------------------------------- draft models

def draft_llm(checkpoints, draft_arch: str, sampled_drafts: bool = True, **engine) -> LLM:
    return LLM(str(checkpoints("llama")[0]), **{**ENGINE, **engine}, speculative_config={
        "model": str(checkpoints(draft_arch)[0]), "num_speculative_tokens": 3,
        "disable_by_batch_size": None, "sampled_drafts": sampled_drafts})


@pytest.fixture(scope="module")
def self_drafted(checkpoints):
    """The target drafting for itself."""
    return draft_llm(checkpoints, "llama")


def fresh_counters(llm: LLM) -> SpeculationStats:
    return speculating(llm, llm.engine.speculator.proposer)


def test_a_draft_equal_to_the_target_accepts_every_token(self_drafted, want, prompts):
    """An off-by-one in the draft's positions, its K/V bookkeeping or the rollback would
    make it guess wrong somewhere."""
    stats = fresh_counters(self_drafted)
    assert tokens(self_drafted.generate(prompts, GREEDY)) == want
    assert stats.accepted == stats.proposed == [40, 40, 36]
    check_clean(self_drafted)


@pytest.mark.slow  # ~22 s: another model compiled
def test_a_draft_of_another_architecture_gives_the_target_tokens(checkpoints, base, want,
                                                                  prompts):
    """A Qwen3 draft for the Llama target (same vocabulary): most guesses are wrong; the
    tokens, greedy and seeded sampled (greedy guesses), are the target's."""
    llm = draft_llm(checkpoints, "qwen3", sampled_drafts=False)
    stats = fresh_counters(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert stats.num_proposed > 100 and stats.num_accepted < stats.num_proposed
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30,
                             ignore_eos=True)
    assert tokens(llm.generate(prompts, sampled)) == tokens(base.generate(prompts, sampled))
    check_clean(llm)


def test_draft_model_steps_run_async(checkpoints, base, want, prompts):
    """With async scheduling (the default) a draft model's chains are verified in steps
    dispatched while the step before is still in flight: the host counts every draft of
    that step as kept, and the device moves each sequence back by its drafts rejected.
    Seeded sampled requests with greedy guesses (the target's own draws keep or reject
    them: from its top two tokens, over half kept) get speculation off's tokens, as
    greedy ones do."""
    llm = draft_llm(checkpoints, "llama", sampled_drafts=False)
    stats = fresh_counters(llm)
    sampled = [SamplingParams(temperature=1.0, top_k=2, seed=i, max_tokens=30,
                              ignore_eos=True) for i in range(len(prompts))]
    assert tokens(llm.generate(prompts, sampled)) == tokens(base.generate(prompts, sampled))
    assert stats.async_steps > 0.8 * stats.steps and stats.steps > 10
    assert 0.2 * stats.num_proposed < stats.num_accepted < 0.9 * stats.num_proposed
    assert tokens(llm.generate(prompts, GREEDY)) == want
    check_clean(llm)


@pytest.mark.slow  # ~19 s: two draft engines compiled
def test_sampled_drafts_async_and_stepwise_agree(checkpoints, prompts):
    """Guesses drawn from a Qwen3 draft's distribution (its keys: each row's output
    number, moved back with the rows by the drafts rejected) give the same seeded tokens
    whether the steps run async or one after another, but for the last 2k + 1: there an
    async step's room for drafts is cut by the pending step's drafts (counted as kept),
    and other guesses take other draws."""
    llm, sync = draft_llm(checkpoints, "qwen3"), draft_llm(checkpoints, "qwen3",
                                                          async_scheduling=False)
    stats, sync_stats = fresh_counters(llm), fresh_counters(sync)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
               for i in range(len(prompts))]
    ours, theirs = tokens(llm.generate(prompts, sampled)), tokens(sync.generate(prompts, sampled))
    assert [t[:-7] for t in ours] == [t[:-7] for t in theirs]
    assert 0 < stats.num_accepted < stats.num_proposed
    assert stats.async_steps > 0.8 * stats.steps and sync_stats.async_steps == 0
    check_clean(llm)
    check_clean(sync)


def test_acceptance_left_on_the_device_is_the_hosts():
    """The acceptance a step leaves for the next (device.record_acceptance) against the
    host's rule (drafts.accepted_path) on random chains: drafts kept, the token emitted
    last and the one before it."""
    rng = np.random.default_rng(0)
    layout = CarryLayout(max_num_seqs=8, k=3, rows=32)
    for _ in range(20):
        groups = rng.integers(0, 4, size=6)  # each sequence's drafts
        starts = np.concatenate([[0], np.cumsum(groups + 1)[:-1]])
        rows = int(np.sum(groups + 1))
        samples = rng.integers(0, 3, size=rows)  # few values: drafts often match
        row_tokens = rng.integers(0, 3, size=rows)
        group_drafts = np.zeros(rows, np.int32)
        group_drafts[starts] = groups
        out = np.asarray(record_acceptance(jnp.zeros(layout.size, jnp.int32),
                                           jnp.asarray(samples), jnp.asarray(row_tokens),
                                           jnp.asarray(group_drafts), layout))
        for r, k in zip(starts, groups):
            drafts = row_tokens[r + 1:r + 1 + k].tolist()
            a = len(accepted_path(drafts, trees.chain(k), samples[r:].tolist()))
            assert out[layout.rejected + r] == k - a
            assert out[layout.bonus + r] == samples[r + a]
            assert out[layout.last + r] == row_tokens[r + a]


def test_sampled_drafts_of_a_draft_equal_to_the_target(self_drafted, checkpoints, prompts):
    """The target drafting for itself draws its guesses from the target's own
    distribution (temperature 1, top-k 3): every guess is kept (a guess verified against
    another position's distribution would not always be), and four tokens over 2000
    seeds fit transformers' probabilities."""
    dist, _ = _target_distribution(checkpoints("llama")[1], prompts[0], 3, 4)
    stats = fresh_counters(self_drafted)
    counts = _sample_sequences(self_drafted, prompts[0], 2000, 3, 4)
    # Two guesses for each request's last three tokens, both kept: one step.
    assert stats.accepted[:2] == stats.proposed[:2] == [2000, 2000]
    assert _chi_square_p(counts, dist, 2000) > 1e-3
    check_clean(self_drafted)


def test_sampled_drafts_take_the_requests_logit_bias(self_drafted, prompts):
    """With a logit bias the target's distribution is the biased one, and so is the
    draft's, which is the target: every sampled guess is still kept (drawn without the
    bias, a good share of them would not be)."""
    stats = fresh_counters(self_drafted)
    bias = {7: 4.0, 11: 4.0, 23: -5.0}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True,
                             logit_bias=bias) for i in range(200)]
    outs = self_drafted.generate([prompts[0]] * 200, params)
    biased = sum(t in (7, 11) for o in outs for t in o.outputs[0].token_ids)
    assert biased > 200  # the bias holds sway
    assert stats.num_proposed >= 400 and stats.accepted == stats.proposed
    check_clean(self_drafted)


@pytest.mark.slow  # a branch-free engine of its own (~25 s)
def test_branch_free_drafts_are_drawn_as_the_target_samples(self_drafted, checkpoints,
                                                             prompts, monkeypatch):
    """Where the programs are branch-free (a GPU's; forced here), the host picks the
    draft's program with top-k and top-p's sort for a batch whose rows ask for them and
    without for one that does not: the target drafting for itself keeps every guess (a
    guess drawn without the request's top-k or top-p would not always be), and the
    outputs are those of the branching programs."""
    from jaxserve.engine import runner as runner_module

    kinds = [{"top_k": 3}, {"top_p": 0.6}, {}, {"temperature": 0.0}]
    params = [SamplingParams(**{"temperature": 1.0, **kinds[i % 4]}, seed=i, max_tokens=12,
                             ignore_eos=True) for i in range(12)]
    plain = [p for p in params if p.top_k <= 0 and p.top_p == 1.0]  # no sort asked
    batches = [([prompts[0]] * 12, params), ([prompts[1]] * len(plain), plain)]
    want = [tokens(self_drafted.generate(*batch)) for batch in batches]
    monkeypatch.setattr(runner_module, "branch_free", lambda: True)
    llm = draft_llm(checkpoints, "llama")
    ran = collections.Counter()
    programs = llm.engine.speculator.proposer._rounds
    for sorts, fn in list(programs.items()):
        programs[sorts] = lambda *a, fn=fn, sorts=sorts: (ran.update([sorts]), fn(*a))[1]
    stats = fresh_counters(llm)
    got = [tokens(llm.generate(*batch)) for batch in batches]
    assert len(batches[1][1]) == 6 and got == want
    assert ran[True] > 0 and ran[False] > 0
    assert stats.num_proposed > 100 and stats.accepted == stats.proposed
    check_clean(llm)


def test_draft_model_with_preemption_chunks_and_prefix_hits(checkpoints, want, prompts):
    llm = draft_llm(checkpoints, "llama", max_num_batched_tokens=16, token_buckets=(16,),
                    num_pages=40)
    stats = fresh_counters(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == want and sum(o.num_cached_tokens for o in outs) > 0
    assert stats.num_proposed > 100 and stats.accepted == stats.proposed
    check_clean(llm)


def test_draft_model_must_share_the_vocabulary(checkpoints, tmp_path):
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(checkpoints("llama")[0], draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(ValueError, match="the draft model's vocabulary has 300 tokens"):
        LLM(str(checkpoints("llama")[0]), **ENGINE, warmup=False,
            speculative_config={"model": str(draft)})


# ---------------------------------------------------------------------- Medusa

@pytest.mark.parametrize("torch_file", [False, True])
def test_medusa_heads_compute_as_the_published_modules(checkpoints, tmp_path, torch_file):
    """Both published files (safetensors; torch's, read with weights_only): each head's
    top 3 guesses, in order, are those of the torch module on the same hidden states."""
    import jax.numpy as jnp

    from jaxserve.loading.medusa import load_medusa
    from jaxserve.models.medusa import MedusaHeads, medusa_tokens

    hf = checkpoints("llama")[1]
    module = medusa_heads(hf, heads=3, layers=2, seed=0)
    path = write_medusa(tmp_path / "medusa", module, layers=2, torch_file=torch_file)
    loaded = load_medusa(path, hf.config.hidden_size, hf.config.vocab_size)
    x = torch.randn(7, hf.config.hidden_size)
    ours = medusa_tokens(jnp.asarray(x.numpy()), MedusaHeads(
        *(jnp.asarray(a) for a in (loaded.block_weights, loaded.block_biases,
                                   loaded.lm_heads)), top=3))
    with torch.no_grad():
        want = torch.stack([torch.topk(head(x), 3).indices for head in module], dim=1)
    assert np.asarray(ours).tolist() == want.tolist()


@pytest.fixture(scope="module")
def medusa_llm(checkpoints, tmp_path_factory):
    """Heads whose blocks are the identity and whose LM heads are the target's: each
    guesses the token just sampled again, right wherever the output repeats a token."""
    hf = checkpoints("llama")[1]
    path = write_medusa(tmp_path_factory.mktemp("medusa"),
                        medusa_heads(hf, heads=3, layers=1, seed=1, copy_lm_head=True), 1)
    return LLM(str(checkpoints("llama")[0]), **ENGINE, speculative_config={
        "method": "medusa", "model": str(path), "num_speculative_tokens": 3,
        "disable_by_batch_size": None})


@pytest.mark.parametrize("method", ["ngram", "draft_model", "medusa"])
def test_a_decode_engine_speculates_on_prefilled_requests(checkpoints, want, prompts,
                                                           tmp_path, method):
    """Prefill/decode disaggregation with speculation on the decode engine: it has the
    prompts' K/V but never ran them, so a draft model catches up over each prompt itself
    (the target drafting for itself: every guess right, which wrong draft K/V would
    break) and Medusa heads wait for the first decode step's hidden state. Greedy tokens
    are those of no speculation. A prefill engine with a speculative_config, or an EAGLE
    head on a decode engine, is refused with the reason."""
    config = {**SPEC, "method": method}
    if method == "draft_model":
        config["model"] = str(checkpoints("llama")[0])
    if method == "medusa":
        hf = checkpoints("llama")[1]
        config["model"] = str(write_medusa(tmp_path, medusa_heads(
            hf, heads=3, layers=1, seed=1, copy_lm_head=True), 1))
    llm = LLM(str(checkpoints("llama")[0]), **ENGINE, prefill={},
              decode={"speculative_config": config})
    decode = llm.engine.decode
    assert tokens(llm.generate(prompts, GREEDY)) == want
    stats = decode.speculator.stats
    assert llm.engine.num_handoffs == len(prompts) and stats.num_accepted > 0
    if method == "draft_model":
        assert stats.num_accepted == stats.num_proposed
    for side in (llm.engine.prefill, decode):
        assert side.runner.compiles_after_warmup == 0 and side.scheduler.num_used_pages == 0
    if method != "ngram":
        return
    with pytest.raises(ValueError, match="give speculative_config to the decode side"):
        LLM(str(checkpoints("llama")[0]), **ENGINE, prefill={"speculative_config": SPEC},
            decode={}, warmup=False)
    with pytest.raises(ValueError, match="eagle speculative decoding is not supported"):
        LLM(str(checkpoints("llama")[0]), **ENGINE, prefill={}, warmup=False, decode={
            "speculative_config": {**SPEC, "method": "eagle", "model": "unused"}})


@pytest.mark.parametrize("heads", ["medusa_llm", "tree_llm"])
def test_medusa_gives_the_target_tokens(request, heads, base, want, prompts):
    """The heads' own guesses, a chain of each head's top one or a tree of each head's top
    two: greedy and seeded sampling give the tokens of no speculation."""
    llm = request.getfixturevalue(heads)
    stats = medusa_speculating(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    # Prompt 2's output opens with five 17s: after the first, all three guesses hit.
    assert 0 < stats.num_accepted < stats.num_proposed and stats.accepted[2] > 0
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=30,
                              ignore_eos=True) for s in range(4)]
    assert tokens(llm.generate(prompts, sampled)) == tokens(base.generate(prompts, sampled))
    check_clean(llm)


@pytest.mark.slow  # a branch-free engine of its own (~25 s)
def test_medusa_on_a_gpu_runs_its_heads_in_the_steps_that_propose(
        checkpoints, monkeypatch, medusa_llm, want, prompts):
    """Where the runner is branch-free (as on a GPU; forced here), the host picks the
    forward pass with Medusa's heads for a step that proposes and the one without for a
    step that does not (a prefill), where a CPU or TPU skips them by a lax.cond: the
    target's tokens, guesses accepted (prompt 2 repeats a token, as in
    test_medusa_gives_the_target_tokens). Traced as a GPU compiles them, no program
    holds a branch on the device."""
    from jaxserve.engine import runner as runner_module
    from device_branches import gpu_programs

    config = {**dataclasses.asdict(medusa_llm.engine.speculator.config),
              "disable_by_batch_size": 8}  # prefill steps do not speculate
    monkeypatch.setattr(runner_module, "branch_free", lambda: True)
    llm = LLM(str(checkpoints("llama")[0]), **ENGINE, speculative_config=config)
    heads = collections.Counter()
    original = llm.engine.runner._run
    llm.engine.runner._run = lambda program, fn, args: (
        heads.update([program[-2]]) if program[0] in ("forward", "step") else None,
        original(program, fn, args))[1]
    stats = medusa_speculating(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert 0 < stats.num_accepted < stats.num_proposed and stats.accepted[2] > 0
    assert heads[True] > 0 and heads[False] > 0  # both kinds of step ran
    assert llm.engine.runner.compiles_after_warmup == 0
    found = gpu_programs(monkeypatch, True, model=str(checkpoints("llama")[0]), **ENGINE,
                         speculative_config=config)
    assert {p[-2] for p in found if p[0] == "forward"} == {False, True}
    assert sum(found.values(), collections.Counter()) == {}, found


@pytest.mark.parametrize("arch, config, message", [
    ("llama", {"num_speculative_tokens": 3}, "has 2 Medusa heads"),
    ("mistral", {"num_speculative_tokens": 2, "speculative_token_tree": [[0], [0, 0]]},
     "without sliding-window attention"),
])
def test_medusa_heads_that_cannot_serve_the_target(checkpoints, tmp_path, arch, config,
                                                   message):
    """Two heads asked for three tokens; a tree on a sliding-window model (Mistral)."""
    hf = checkpoints(arch)[1]
    path = write_medusa(tmp_path / "m", medusa_heads(hf, heads=2, layers=1, seed=2), 1)
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoints(arch)[0]), **ENGINE, warmup=False, speculative_config={
            "method": "medusa", "model": str(path), **config})


# ------------------------------------------------------------------- trees

# Ranks 0 and 1 of each of three heads: 14 nodes, in depth-first order.
TREE = [[a] for a in (0, 1)] + [[a, b] for a in (0, 1) for b in (0, 1)] + [
    [a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)]


def test_tree_masks_paths_and_acceptance():
    """Masks against each node's ancestors found by walking up its parents' path ranks;
    the accepted path follows the samples down the tree."""
    paths = SpeculativeConfig(method="medusa", model="m", num_speculative_tokens=3,
                              speculative_token_tree=str(TREE)).speculative_token_tree
    assert paths[:3] == ((0,), (0, 0), (0, 0, 0)) and len(paths) == 14
    parents = trees.paths_parents(paths)
    masks = trees.masks(parents).view(np.uint32)
    for j, p in enumerate(paths):
        seen = {i for i in range(len(paths)) if masks[j] >> i & 1}
        assert seen == {paths.index(p[:n]) for n in range(1, len(p) + 1)}
    assert trees.depths(parents) == list(map(len, paths))
    tokens = [10 + j for j in range(14)]
    # The root samples node 7's token ((1,)), node 7 samples node 8's ((1, 0)), node 8's
    # sample matches no child of it: accepted [7, 8], the third token is node 8's sample.
    samples = [0] * 15
    samples[0], samples[1 + 7], samples[1 + 8] = 17, 18, 99
    assert trees.accepted_path(tokens, parents, samples) == [7, 8]
    assert trees.accepted_path(tokens, parents, [10, 11, 12] + [0] * 12) == [0, 1, 2]


def test_moving_slots_reads_every_source_before_writing_any():
    """Every layer's K/V (int8 pages and their scales too) and the EAGLE feature rows move
    from `src` to `dst` slots, a chain of moves (6 -> 5 -> 4) read before written; a dst
    past the pool moves nothing."""
    rng = np.random.default_rng(0)
    heads, pages, size, dim = 2, 3, 4, 8

    def layer():
        return (rng.normal(size=(heads, pages, size, dim)).astype(np.float32),
                rng.integers(-127, 127, (heads, pages, size, dim)).astype(np.int8),
                rng.random((heads, pages, size)).astype(np.float32))

    kv = [layer(), layer()]
    features = rng.normal(size=(pages * size, 5)).astype(np.float32)
    src, dst = np.array([5, 6, 0], np.int32), np.array([4, 5, pages * size], np.int32)
    moved, moved_features = jax.jit(move_slots)(kv, features, src, dst)

    def want(x):  # slots are the flattened (page, row) axes
        flat = x.reshape(heads, pages * size, *x.shape[3:]).copy()
        flat[:, 4], flat[:, 5] = flat[:, 5].copy(), flat[:, 6].copy()
        return flat.reshape(x.shape)

    for ours, theirs in zip(moved, kv):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.asarray(a), want(b))
    rows = features.copy()
    rows[4], rows[5] = features[5], features[6]
    np.testing.assert_array_equal(np.asarray(moved_features), rows)


def test_a_follower_moves_the_slots_process_0_moves(monkeypatch):
    """Multi-host: process 0's moves go to the followers (broadcast.py), which run them on
    their own devices."""
    sent = []
    monkeypatch.setattr(broadcast.multihost_utils, "broadcast_one_to_all",
                        lambda x: sent.append(x) or x)
    src, dst = np.array([5, 9], np.int32), np.array([4, 5], np.int32)
    broadcast.StepBroadcaster().send_moves(src, dst)
    broadcast.StepBroadcaster().stop()
    moved = []

    class Runner:  # a follower's
        moves = staticmethod(lambda todo: (np.zeros(2, np.int32), np.zeros(2, np.int32)))
        move = staticmethod(lambda *arrays: moved.append(arrays))

    received = iter(sent)
    monkeypatch.setattr(broadcast.multihost_utils, "broadcast_one_to_all",
                        lambda x: next(received))
    broadcast.follow(dataclasses.make_dataclass("Engine", ["runner"])(Runner()))
    assert len(moved) == 1 and [a.tolist() for a in moved[0]] == [[5, 9], [4, 5]]


@pytest.fixture(scope="module")
def tree_llm(checkpoints, tmp_path_factory):
    """Medusa heads like medusa_llm's (identity blocks, the target's LM head) verifying a
    tree of each head's top two guesses. The token budget holds four sequences' trees
    (1 + 14 each), so no tree is cut."""
    hf = checkpoints("llama")[1]
    path = write_medusa(tmp_path_factory.mktemp("medusa"),
                        medusa_heads(hf, heads=3, layers=1, seed=1, copy_lm_head=True), 1)
    engine = {**ENGINE, "max_num_batched_tokens": 80, "token_buckets": (16, 80)}
    return LLM(str(checkpoints("llama")[0]), **engine, speculative_config={
        "method": "medusa", "model": str(path), "num_speculative_tokens": 3,
        "disable_by_batch_size": None, "speculative_token_tree": TREE})


def medusa_speculating(llm: LLM, oracle: dict | None = None) -> SpeculationStats:
    """Fresh counters for `llm`'s Medusa config (chain or tree), with the heads proposing,
    or with `oracle` an OracleTreeProposer of those arguments."""
    config = llm.engine.speculator.config
    paths = config.speculative_token_tree
    proposer = (OracleTreeProposer(paths=paths, **oracle) if oracle is not None
                else MedusaProposer(paths))
    return speculating(llm, proposer, **dataclasses.asdict(config))


def test_a_tree_accepts_the_right_branch_wherever_it_lies(tree_llm, want, prompts):
    """Each tree holds the known tokens along a random branch, the rest wrong: a node that
    saw a sibling or a cousin (mask), sat at a wrong rope position, or a path accepted out
    of its slots and kept (K/V fix-up) would change the greedy tokens or reject some."""
    stats = medusa_speculating(tree_llm, dict(runs=list(zip(prompts, want)), vocab=VOCAB))
    assert tokens(tree_llm.generate(prompts, GREEDY)) == want
    assert stats.accepted == stats.proposed and stats.proposed[2] > 20
    oracle = tree_llm.engine.speculator.proposer
    assert oracle.out_of_place > oracle.calls // 2  # most branches lie outside the slots
    check_clean(tree_llm)


def test_trees_with_preemption_chunked_prefill_and_prefix_hits(checkpoints, want, prompts,
                                                               tree_llm):
    """Trees of 14 nodes in a budget of 32 tokens (cut to fit) with a pool too small for
    the four sequences, prompts cut into chunks, then the prompts cached."""
    llm = LLM(str(checkpoints("llama")[0]), **{**ENGINE, "max_num_batched_tokens": 32,
                                               "token_buckets": (32,)}, num_pages=32,
              speculative_config=tree_llm.engine.speculator.config)
    stats = medusa_speculating(llm, dict(runs=list(zip(prompts, want)), vocab=VOCAB, seed=1,
                                       spoil=3))
    assert tokens(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == want and sum(o.num_cached_tokens for o in outs) > 0
    assert 0 < stats.num_accepted < stats.num_proposed
    check_clean(llm)


def test_seeded_sampling_through_tree_branches(tree_llm, base, prompts):
    """Trees holding the seeded samples of no speculation along random branches: every
    node's row samples its own output number (its depth, not its place in the tree) with
    its path as the history of its penalties, so every branch is accepted whole and the
    tokens and logprobs are those of no speculation."""
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=30,
                              presence_penalty=0.5, repetition_penalty=1.2, logprobs=2,
                              ignore_eos=True) for s in range(4)]
    theirs = base.generate(prompts, sampled)
    stats = medusa_speculating(tree_llm, dict(runs=list(zip(prompts, tokens(theirs))),
                                            vocab=VOCAB, seed=2))
    ours = tree_llm.generate(prompts, sampled)
    assert tokens(ours) == tokens(theirs)
    assert stats.accepted == stats.proposed and stats.proposed[2] > 10
    for a, b in zip(ours, theirs):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    check_clean(tree_llm)


# ------------------------------------------------------------- the distribution

class TopDraft(TokenProposer):
    """Proposes the target's most likely next token (known from transformers)."""

    def __init__(self, prompt_len: int, argmax: dict[tuple[int, ...], int]):
        self.prompt_len, self.argmax = prompt_len, argmax

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [self.argmax[tuple(tokens[self.prompt_len:])]][:k]


def _target_distribution(model, prompt: list[int], top_k: int, steps: int):
    """Every sequence of `steps` tokens the target can sample at temperature 1 with
    top-k, with its probability, from transformers' logits; and each prefix's argmax."""
    dist, argmax = {(): 1.0}, {}
    for _ in range(steps):
        grown = {}
        for prefix, p in dist.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            top = torch.topk(logits, top_k)
            probs = torch.softmax(top.values, 0)
            argmax[prefix] = int(top.indices[0])
            for t, q in zip(top.indices.tolist(), probs.tolist()):
                grown[prefix + (t,)] = p * q
        dist = grown
    return dist, argmax


def _chi_square_p(counts: dict, dist: dict, n: int) -> float:
    """p-value of the observed sequences against `dist`; sequences expected fewer than 5
    times (and any outside it) are pooled into one category."""
    common = [s for s in dist if dist[s] * n >= 5]
    observed = [counts.get(s, 0) for s in common]
    expected = [dist[s] * n for s in common]
    rest_observed, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected > 1e-9:
        observed.append(rest_observed)
        expected.append(rest_expected)
    elif rest_observed:  # sequences the target never samples
        return 0.0
    return scipy.stats.chisquare(observed, expected).pvalue


def _sample_sequences(llm: LLM, prompt: list[int], n: int, top_k: int, steps: int) -> dict:
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=i, max_tokens=steps,
                             ignore_eos=True) for i in range(n)]
    counts: dict = {}
    for out in llm.generate([prompt] * n, params):
        seq = tuple(out.outputs[0].token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.fixture(scope="module")
def target(checkpoints, prompts):
    return (prompts[0], *_target_distribution(checkpoints("llama")[1], prompts[0], 3, 3))


def test_sampled_tokens_follow_the_target_distribution(spec, target):
    """Three tokens at temperature 1, top-k 3 (27 possible sequences): the second is a
    verified draft (the target's argmax), the third the row after it. Their frequencies
    over 2000 seeds fit transformers' probabilities."""
    prompt, dist, argmax = target
    stats = speculating(spec, TopDraft(len(prompt), argmax))
    counts = _sample_sequences(spec, prompt, 2000, 3, 3)
    assert stats.num_proposed == 2000
    assert 300 < stats.num_accepted < 1700  # both outcomes, often
    assert set(counts) <= set(dist)  # no token outside the top 3
    assert _chi_square_p(counts, dist, 2000) > 1e-3
    check_clean(spec)


def test_a_wrong_acceptance_rule_fails_the_distribution_test(spec, target, monkeypatch):
    """Keeping every row's sample (no verification): the third token is then drawn after
    the draft even where the second is not the draft. The same test rejects it."""
    import jaxserve.engine.speculative.speculator as speculator_module

    prompt, dist, argmax = target
    monkeypatch.setattr(speculator_module, "accepted_path",
                        lambda drafts, parents, samples: list(range(len(drafts))))
    speculating(spec, TopDraft(len(prompt), argmax))
    counts = _sample_sequences(spec, prompt, 500, 3, 3)
    assert _chi_square_p(counts, dist, 500) < 1e-6


# ---------------------------------------------------------------- configuration

MEDUSA = {"method": "medusa", "model": "heads"}


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle2"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "model": "/some/draft"}, "takes no model"),
    ({"method": "draft_model"}, "needs model"),
    ({"method": "medusa"}, "needs model"),
    ({"method": "eagle3"}, "needs model"),
    ({"speculative_token_tree": [[0]]}, "needs method 'medusa'"),
    (dict(MEDUSA, speculative_token_tree=[[0, 0]]), "has [0, 0] without its parent [0]"),
    (dict(MEDUSA, speculative_token_tree=[[0], [0]]), "lists a path twice"),
    (dict(MEDUSA, speculative_token_tree=[[0], [0, 0]], num_speculative_tokens=1),
     "deeper than num_speculative_tokens"),
    (dict(MEDUSA, speculative_token_tree=[[j] for j in range(33)]), "at most 32"),
    (dict(MEDUSA, speculative_token_tree=[[-1]]), "ranks >= 0"),
    (dict(MEDUSA, speculative_token_tree="[[0]"), "must be a list of paths"),
    ({"num_speculative_tokens": 2, "typo": 1}, "unknown keys ['typo']"),
])
def test_bad_speculative_config_says_what_to_fix(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(speculative_config=bad)


def test_speculative_config_from_yaml_and_cli(tmp_path):
    from jaxserve.cli import build_parser, engine_config_from_args

    path = tmp_path / "engine.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n")
    assert EngineConfig.from_yaml(path).speculative_config == SpeculativeConfig(
        num_speculative_tokens=5)
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--speculative-config",
         '{"method": "ngram", "prompt_lookup_max": 6, "disable_by_batch_size": null}'])
    config = engine_config_from_args(args).speculative_config
    assert config == SpeculativeConfig(prompt_lookup_max=6, disable_by_batch_size=None)
    bad = build_parser().parse_args(["generate", "--speculative-config", "[1]"])
    with pytest.raises(ValueError, match="give a JSON object"):
        engine_config_from_args(bad)
    # A tree: YAML lists, a JSON list and vLLM's string give the same depth-first paths.
    want = ((0,), (0, 0), (1,))
    path.write_text("speculative_config:\n  method: medusa\n  model: heads\n"
                    "  speculative_token_tree: [[1], [0], [0, 0]]\n")
    assert EngineConfig.from_yaml(path).speculative_config.speculative_token_tree == want
    for tree in ('[[0], [1], [0, 0]]', '"[(1,), (0, 0), (0,)]"'):
        args = build_parser().parse_args(
            ["generate", "--speculative-config",
             f'{{"method": "medusa", "model": "heads", "speculative_token_tree": {tree}}}'])
        assert engine_config_from_args(args).speculative_config.speculative_token_tree == want
