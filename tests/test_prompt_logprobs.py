"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's RequestOutput.prompt_logprobs):
each prompt token's log-probability given the tokens before it, its rank and the most
likely tokens there, against transformers' log-softmax over the same prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams


def hf_logprobs(model, prompt: list[int]) -> np.ndarray:
    """transformers' `[len(prompt), vocab]` log-probabilities of each next token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def assert_prompt_logprobs(entries, prompt: list[int], want: np.ndarray, n: int) -> None:
    """`entries` (one request's prompt_logprobs) hold transformers' values: None first,
    then at each position the prompt token with its logprob and rank, and the n most
    likely tokens (ranks 1..n) with theirs (ranks and order as transformers' values give
    them, up to tokens within float32 rounding of each other)."""
    eps = 2e-5
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        lp, token, entry = want[i - 1], prompt[i], entries[i]
        assert entry[token].logprob == pytest.approx(lp[token], abs=eps), i
        assert 1 + (lp > lp[token] + eps).sum() <= entry[token].rank \
            <= 1 + (lp > lp[token] - eps).sum(), i
        top = sorted((e.rank, t) for t, e in entry.items() if e.rank <= n)
        assert [r for r, _ in top] == list(range(1, n + 1)), i
        assert len(entry) == n + (token not in [t for _, t in top])
        np.testing.assert_allclose([lp[t] for _, t in top], np.sort(lp)[::-1][:n], atol=eps)
        for _, t in top:
            assert entry[t].logprob == pytest.approx(lp[t], abs=eps)


@pytest.fixture(scope="module")
def llm(checkpoints):
    """Chunks of 16 tokens (the 30- and 43-token prompts take several steps) and the
    prefix cache on."""
    path, _ = checkpoints("llama")
    return LLM(str(path), dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
               max_num_batched_tokens=16, token_buckets=(16,), enable_prefix_caching=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_prompt_logprobs_match_transformers(llm, checkpoints, prompts, arch):
    """Every prompt scored across its chunks, beside a request that asks for none (whose
    greedy tokens are those of a batch without scoring): Llama 3, Qwen2 (its tied
    embedding as the head), Gemma 2 (the final logit soft-cap)."""
    path, model = checkpoints(arch)
    if arch != "llama":
        llm = LLM(str(path), dtype="float32", max_model_len=128, page_size=4,
                  max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, [scored, greedy, scored, scored])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert outs[1].prompt_logprobs is None
    for out, prompt in zip(outs, prompts):
        if out.prompt_logprobs is not None:
            assert_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(model, prompt), 3)
    assert llm.engine.runner.compiles_after_warmup == 0


def test_a_cached_prompt_is_scored_whole(llm, checkpoints, prompts):
    """A prompt whose pages the prefix cache holds is computed again when it asks for
    prompt logprobs (every position scored), then hits the cache when it does not."""
    _, model = checkpoints("llama")
    prompt = prompts[3]
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its pages cached
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(model, prompt), 0)
    again = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_a_one_token_prompt_and_bad_values(llm):
    out = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_scored_beside_speculation_and_preemption(checkpoints, prompts):
    """n-gram speculation and a page pool too small for the four sequences (preempted and
    computed again): the scores are transformers' and the tokens those of a plain run."""
    path, model = checkpoints("llama")
    engine = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
                  max_num_batched_tokens=16, token_buckets=(16,))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **engine).generate(prompts, greedy)]
    llm = LLM(str(path), **engine, num_pages=40, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    scored = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, scored)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(model, prompt), 2)
    assert llm.engine.scheduler.allocator.num_used_pages == 0
