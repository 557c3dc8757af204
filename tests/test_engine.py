"""The engine and offline API on a tiny Llama with a byte-level tokenizer."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.engine import engine as engine_module

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))


@pytest.fixture(scope="module")
def llm(checkpoints):
    path, _ = checkpoints("llama")
    return LLM(str(path), **ENGINE)


@pytest.fixture(scope="module")
def hf_model(checkpoints):
    return checkpoints("llama")[1]


def tokens(out):
    return out.outputs[0].token_ids


def test_seed_gives_same_tokens_whatever_the_batch(llm, prompts):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                       ignore_eos=True)
    alone = tokens(llm.generate([prompts[1]], p)[0])
    others = [SamplingParams(temperature=t, seed=s, max_tokens=m, ignore_eos=True)
              for t, s, m in ((0.0, None, 5), (1.3, 7, 30), (0.5, None, 12))]
    mixed = llm.generate([prompts[3], prompts[1], prompts[0], prompts[2]],
                         [others[0], p, others[1], others[2]])
    assert tokens(mixed[1]) == alone
    again = llm.generate([prompts[2], prompts[1]], [others[2], p])
    assert tokens(again[1]) == alone
    unseeded = llm.generate([prompts[1]] * 2, SamplingParams(temperature=1.0, max_tokens=24,
                                                             ignore_eos=True))
    assert tokens(unseeded[0]) != tokens(unseeded[1])


def test_stop_conditions(llm, prompts):
    base = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 40 and base.finish_reason == "length"

    stop_id = base.token_ids[6]
    first = base.token_ids.index(stop_id)
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                   stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    # min_tokens forbids the stop token until 8 tokens exist.
    out = llm.generate([prompts[2]], SamplingParams(
        temperature=0.0, max_tokens=40, min_tokens=8, stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in out.token_ids[:8] and len(out.token_ids) >= 8

    text = base.text
    assert len(text) > 12
    stop = text[8:11]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                   stop=[stop]))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_include_stop_str_in_output(llm, prompts):
    """vLLM's include_stop_str_in_output: the stop string, or the stop token's text, stays
    in the output; the tokens are the same."""
    tokenizer = llm.get_tokenizer()
    base = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                    ignore_eos=True))[0].outputs[0]
    text, stop = base.text, base.text[8:11]
    kept, dropped = (llm.generate([prompts[2]], SamplingParams(
        temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=include))[0]
        .outputs[0] for include in (True, False))
    assert kept.text == text[:text.index(stop) + len(stop)] == dropped.text + stop
    assert kept.token_ids == dropped.token_ids and kept.stop_reason == stop
    stop_id = base.token_ids[6]
    first = base.token_ids.index(stop_id)
    kept = llm.generate([prompts[2]], SamplingParams(
        temperature=0.0, max_tokens=40, stop_token_ids=[stop_id],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == base.token_ids[:first + 1]
    assert kept.text == tokenizer.decode(base.token_ids[:first + 1])
    assert kept.text != tokenizer.decode(base.token_ids[:first])


def test_allowed_token_ids_and_bad_words_match_transformers(llm, hf_model, prompts):
    """vLLM's allowed_token_ids and bad_words against transformers' own logits processors
    (prefix_allowed_tokens_fn, bad_words_ids), greedy; a logit bias (transformers'
    sequence_bias) makes the words likely. A two-token bad word bans its second token
    after its first only."""
    tok = llm.get_tokenizer()
    a, b, c = (tok.encode(x, add_special_tokens=False)[0] for x in "abc")
    bias = {a: 6.0, b: 6.0, c: 3.0}
    prompt = prompts[1]
    assert prompt[-1] not in (a, b)  # (transformers matches a word's start in the prompt)

    def ours(**kwargs):
        return tokens(llm.generate([prompt], SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=bias, **kwargs))[0])

    def theirs(**kwargs):
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                do_sample=False, pad_token_id=0,
                                sequence_bias={(t,): v for t, v in bias.items()}, **kwargs)
        return out[0, len(prompt):].tolist()

    free = ours()
    assert free == theirs() and free[:2] == [a, b]
    banned = ours(bad_words=["ab", " bb"])
    assert banned == theirs(bad_words_ids=[[a, b], [b, b]]) != free
    pairs = set(zip(banned, banned[1:]))
    assert (a, b) not in pairs and (b, b) not in pairs and a in banned
    assert ours(bad_words=["a"]) == theirs(bad_words_ids=[[a]]) != free
    allowed = [50, 60, 70, 80, 90]
    assert ours(allowed_token_ids=allowed) == theirs(
        prefix_allowed_tokens_fn=lambda *_: allowed)
    # With a grammar: both masks hold (its choice whose first letter is not allowed never
    # comes).
    from jaxserve.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["ab", "cd"])
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4,
                                                 structured_outputs=choice))[0].outputs[0].text
    other = ({"ab", "cd"} - {free}).pop()
    first = tok.encode(free[0], add_special_tokens=False)[0]
    kept = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=choice,
        allowed_token_ids=[t for t in range(320) if t != first]))[0].outputs[0].text
    assert kept == other
    both = ours(allowed_token_ids=[a, b, c, 50], bad_words=["bb"])
    assert both == theirs(prefix_allowed_tokens_fn=lambda *_: [a, b, c, 50],
                          bad_words_ids=[[b, b]])
    assert set(both) <= {a, b, c, 50} and (b, b) not in set(zip(both, both[1:]))


def test_cache_salt_shares_pages_only_within_a_salt(llm):
    """A salted request hits the prefix cache only on pages computed under its own salt;
    its tokens are the unsalted ones."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(200, 240))  # 10 full pages no other test's prompt starts with
    runs = [llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}
                          if salt else prompt], params)[0]
            for salt in ("tenant-a", None, "tenant-b", "tenant-a", None)]
    assert [r.num_cached_tokens for r in runs[:3]] == [0, 0, 0]
    assert runs[3].num_cached_tokens > 0 and runs[4].num_cached_tokens > 0
    assert len({tuple(tokens(r)) for r in runs}) == 1


def test_eos_stops_unless_ignored(llm, prompts):
    """Make EOS certain by banning nothing and forcing it: stop_token_ids vs eos handled alike."""
    eos = llm.engine.eos_token_ids
    assert eos == (1,)  # config.json, generation_config.json and the tokenizer agree
    base = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=30,
                                                    ignore_eos=True))[0].outputs[0]
    if 1 in base.token_ids:
        cut = base.token_ids.index(1)
        out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=30))[0]
        assert tokens(out) == base.token_ids[:cut + 1]
        assert out.outputs[0].finish_reason == "stop"
    else:
        out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=30))[0]
        assert tokens(out) == base.token_ids


def test_logprobs_match_transformers(llm, hf_model, prompts):
    out = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=4,
                                                   logprobs=3, ignore_eos=True))[0].outputs[0]
    ids = prompts[1] + out.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1).numpy()
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(prompts[1]) - 1 + i]
        top3 = np.argsort(-row)[:3].tolist()
        assert list(lp)[:3] == top3 and tok == top3[0]
        for t, entry in lp.items():
            assert abs(entry.logprob - row[t]) < 1e-4
        assert lp[tok].rank == 1


def test_beam_search_matches_transformers(llm, hf_model, prompts):
    """LLM.beam_search (vLLM's) is transformers' beam search with EOS out of play
    (ignore_eos here, no eos_token_id there): the same beam_width sequences, best first,
    with transformers' scores (its sum of log-probabilities over the generated length **
    length_penalty)."""
    import copy

    from jaxserve import BeamSearchParams

    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id = None
    for width, penalty in ((3, 1.0), (4, 0.5)):
        got = llm.beam_search([prompts[0], prompts[2]], BeamSearchParams(
            beam_width=width, max_tokens=6, ignore_eos=True, length_penalty=penalty))
        for prompt, out in zip([prompts[0], prompts[2]], got):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = hf_model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=config,
                    num_beams=width,
                    num_return_sequences=width, do_sample=False, max_new_tokens=6,
                    length_penalty=penalty, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0)
            assert [b.tokens for b in out.sequences] == want.sequences.tolist()
            np.testing.assert_allclose([b.cum_logprob / 6 ** penalty for b in out.sequences],
                                       want.sequences_scores.numpy(), atol=1e-4)
            assert all(b.finish_reason == "length" for b in out.sequences)
            tok = llm.get_tokenizer()
            assert out.sequences[0].text == tok.decode(out.sequences[0].tokens,
                                                       skip_special_tokens=True)


def test_text_prompt_and_detokenized_output(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("Hello, world", SamplingParams(temperature=0.0, max_tokens=10,
                                                      ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("Hello, world")
    assert out.prompt_token_ids[0] == tok.bos_token_id
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_no_compile_after_warmup(llm, prompts):
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if "compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=9),
                  SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, max_tokens=15),
                  SamplingParams(logprobs=5, min_p=0.1, max_tokens=7, stop=["ab"])]
        llm.generate(prompts * 2, params * 2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert llm.engine.runner.compiles_after_warmup == 0


def test_bad_arguments_raise_value_error(llm):
    too_long = list(range(3, 3 + 128))
    cases = [
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(logprobs=50), "logprobs"),
        (lambda: llm.generate([[]]), "empty"),
        (lambda: llm.generate([[5, 10**6]]), "vocabulary"),
        (lambda: llm.generate([too_long]), "max_model_len"),
        (lambda: llm.generate([[5, 6]], SamplingParams(max_tokens=127)), "max_tokens"),
        (lambda: SamplingParams(logit_bias={5: 101}), "logit_bias"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature"),
        (lambda: SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (lambda: SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
        (lambda: SamplingParams(logit_bias={5: float("inf")}), "logit_bias"),
        (lambda: SamplingParams(logit_bias={i: 1.0 for i in range(33)}), "logit_bias"),
        (lambda: llm.generate([[5, 6]], SamplingParams(logit_bias={10**6: 1})), "logit_bias"),
        (lambda: llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10**6])),
         "stop_token_ids"),
        (lambda: llm.chat([{"role": "user"}], chat_template="{{ messages[0].content + 1 }}"),
         "chat template"),
        (lambda: llm.generate([[5, 6]], priority=[1]), "scheduling_policy 'priority'"),
        (lambda: llm.generate([{"prompt_token_ids": [5, 6], "cache_salt": ""}]),
         "cache_salt"),
        (lambda: SamplingParams(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (lambda: SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
        (lambda: llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[10**6])),
         "allowed_token_ids"),
        (lambda: SamplingParams(bad_words=[" "]), "bad_words"),
        (lambda: SamplingParams(bad_words=[{"a": 1}]), "bad_words"),
        (lambda: SamplingParams(allowed_token_ids=5), "allowed_token_ids"),
        (lambda: llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[67],
                                                       bad_words=["a"])), "bad_words"),
        (lambda: LLM("/nonexistent/dir", warmup=False), "not a directory"),
        (lambda: LLM(None, warmup=False, bogus=1), "unknown LLM arguments"),
    ]
    for make, needle in cases:
        with pytest.raises(ValueError, match=needle):
            make()
    assert not llm.engine.has_unfinished()  # a bad prompt left nothing queued


def test_chat_renders_as_transformers_and_generates(llm, checkpoints):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoints("llama")[0])
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    second = [{"role": "user", "content": "Count to three"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = llm.chat([first, second], params)
    for conversation, result in zip((first, second), results):
        want = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert result.prompt_token_ids == want
        assert result.prompt == hf.apply_chat_template(conversation, add_generation_prompt=True,
                                                       tokenize=False)
        assert result.outputs[0].token_ids == llm.generate([want], params)[0].outputs[0].token_ids
    cont = llm.chat(first + [{"role": "assistant", "content": "Hel"}], params,
                    continue_final_message=True)[0]
    assert cont.prompt.endswith("assistant: Hel")


def test_logit_bias_forces_a_token(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate([prompts[1]], params)[0].outputs[0].token_ids
    target = next(t for t in range(3, 300) if t not in plain)
    biased = llm.generate([prompts[1]], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={target: 100.0}))
    assert biased[0].outputs[0].token_ids == [target] * 6
    banned = llm.generate([prompts[1]], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0}))
    assert banned[0].outputs[0].token_ids[0] != plain[0]


def test_stop_strings_need_a_tokenizer(llm):
    engine = llm.engine
    tokenizer, engine.tokenizer = engine.tokenizer, None
    try:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.add_request("no-tok", [5, 6, 7], SamplingParams(stop=["ab"]))
    finally:
        engine.tokenizer = tokenizer
    assert not engine.has_unfinished()


def test_abort_frees_pages(llm, prompts):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.allocator.num_used_pages > 0
    for i in range(len(prompts)):
        assert engine.abort_request(f"abort-{i}")
    assert not engine.abort_request("abort-0")
    assert engine.scheduler.allocator.num_used_pages == 0
    assert not engine.has_unfinished()


def test_bfloat16_engine_close_to_float32_transformers(checkpoints, hf_model, prompts):
    """bf16 weights and KV cache. bf16 keeps 8 bits of mantissa (~0.4% per rounding); over two
    layers the log-probabilities move by up to ~0.04 here, so the bound is 0.1. Top-1 must
    agree at >= 90% of positions (teacher-forced on our own output)."""
    path, _ = checkpoints("llama")
    llm = LLM(str(path), **{**ENGINE, "dtype": "bfloat16"})
    compiled = llm.engine.runner.num_compiled
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                               ignore_eos=True))
    # Warm-up compiled everything (its samples took logits of the forward pass's dtype: a
    # float32 warm-up sample would not fit the bf16 logits and fail here, not recompile).
    assert llm.engine.runner.num_compiled == compiled
    assert llm.engine.runner.compiles_after_warmup == 0
    agree = []
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1).numpy()
        for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            row = logp[len(prompt) - 1 + i]
            assert max(abs(e.logprob - row[t]) for t, e in lp.items()) < 0.1
            agree.append(int(np.argmax(row)) == tok)
    assert np.mean(agree) >= 0.9
    # The forward pass hands its logits on in bf16; the sampler widens only the rows it
    # samples, not the whole bucket's.
    runner = llm.engine.runner
    key = runner.builder.all_buckets()[-1]
    entry = runner.compiled(key).as_text().split("\nENTRY ")[1]
    root = next(line for line in entry.splitlines() if line.lstrip().startswith("ROOT"))
    assert f"bf16[{key.rows},{hf_model.config.vocab_size}]" in root
    assert f"f32[{key.rows},{hf_model.config.vocab_size}]" not in root


def test_async_scheduling_gives_the_synchronous_results(checkpoints, prompts, monkeypatch):
    """Dispatching each step before the previous one's tokens reach the host changes no
    token, logprob or finish reason, through preemption (a small page pool), penalties
    (which wait for the pending token), seeds, min/max tokens and stop ids, and leaks no
    page."""
    # Every step dispatched while the one before is not yet collected counts as overlapped,
    # whether or not that one still runs (on a loaded CPU the tiny model's step may be done
    # before the host dispatches the next: the count read 0 once in a full run).
    monkeypatch.setattr(engine_module, "_is_ready", lambda out: False)
    path, _ = checkpoints("llama")
    settings = dict(ENGINE, num_pages=40, enable_prefix_caching=True)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=25, min_tokens=5),
              SamplingParams(temperature=0.7, seed=9, max_tokens=20, presence_penalty=0.5,
                             repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11, 42])]
    batch = [prompts[i % len(prompts)] for i in range(8)]
    runs = {}
    for mode in (True, False):
        llm = LLM(str(path), async_scheduling=mode, **settings)
        outs = llm.generate(batch, [params[i % 4] for i in range(8)])
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                       [{t: lp.logprob for t, lp in step.items()}
                        for step in (o.outputs[0].logprobs or [])]) for o in outs]
        assert llm.engine.scheduler.allocator.num_used_pages == 0
        assert llm.engine.scheduler.num_preemptions > 0
        if mode:
            assert llm.engine.num_overlapped_steps > 0
    for (tokens, reason, logprobs), (tokens_sync, reason_sync, logprobs_sync) in zip(
            runs[True], runs[False]):
        assert (tokens, reason) == (tokens_sync, reason_sync)
        # Freed pages are reused a step later or sooner, so batches differ and float32
        # sums change order: 1e-4, as for sharding.
        for step, step_sync in zip(logprobs, logprobs_sync, strict=True):
            assert step.keys() == step_sync.keys()
            assert all(abs(step[t] - step_sync[t]) < 1e-4 for t in step)


def test_no_step_past_a_requests_last_token(llm, prompts):
    """With async scheduling a request whose last token (max_tokens, or the room left by
    max_model_len) is still in flight gets no further step: one request of n tokens runs n
    steps, and the next request's first step finds nothing in flight."""
    engine = llm.engine
    for n, prompt in ((1, prompts[0]), (5, prompts[1])):
        before = engine.num_steps
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                    ignore_eos=True))[0]
        assert len(tokens(out)) == n and out.outputs[0].finish_reason == "length"
        assert engine.num_steps - before == n
        assert engine.status().steps_in_flight == 0
    room = ENGINE["max_model_len"] - len(prompts[2])  # no max_tokens: stops at max_model_len
    before = engine.num_steps
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=None,
                                                    ignore_eos=True))[0]
    assert len(tokens(out)) == room and engine.num_steps - before == room
