"""Several decode steps in one program (`num_scheduler_steps`, programs.decode_steps).

The tokens, logprobs and finish reasons are those of one step per program (and greedy
ones transformers' own), through stops mid-run, max_tokens and max_model_len, seeds,
requests that need their history on the host (which fall back to single steps), async and
synchronous scheduling, preemption, aborts and a failed run; every page comes back, and a
request of n tokens dispatches about n / steps programs instead of n.
"""

from __future__ import annotations

import math

import pytest

from conftest import hf_greedy
from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
STEPS = 4


@pytest.fixture(scope="module")
def path(checkpoints):
    return str(checkpoints("llama")[0])


@pytest.fixture(scope="module")
def multi(path):
    return LLM(path, num_scheduler_steps=STEPS, **ENGINE)


@pytest.fixture(scope="module")
def single(path):
    return LLM(path, **ENGINE)


def results(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.outputs[0].text,
             [{t: lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])])
            for o in outs]


def assert_same(got, want):
    for (tokens, reason, stop, text, logprobs), (tokens1, reason1, stop1, text1, logprobs1) in (
            zip(got, want, strict=True)):
        assert (tokens, reason, stop, text) == (tokens1, reason1, stop1, text1)
        for step, step1 in zip(logprobs, logprobs1, strict=True):
            assert step.keys() == step1.keys()
            assert all(abs(step[t] - step1[t]) < 1e-4 for t in step)


def test_greedy_tokens_are_transformers(multi, checkpoints, prompts):
    hf = checkpoints("llama")[1]
    engine = multi.engine
    before = engine.num_multi_steps
    out = multi.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=23,
                                                      ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompts[1], 23)
    assert engine.num_multi_steps - before >= 20  # all but the prefill's and the tail's


def test_same_results_as_one_step_per_program(multi, single, prompts):
    """Every sampling option through both engines: the same tokens, text, logprobs and
    finish reasons; multi-step programs ran; no program compiled after warm-up."""
    base = single.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                        ignore_eos=True))[0].outputs[0]
    stop_id, stop_text = base.token_ids[9], base.text[14:17]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=25, top_p=0.9, top_k=20),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=17, min_p=0.05,
                       logit_bias={5: 2.0}, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),  # max_model_len
    ]
    batch = [prompts[2]] * 4 + [prompts[i % len(prompts)] for i in range(4)]
    before = multi.engine.num_multi_steps
    assert_same(results(multi.generate(batch, params)), results(single.generate(batch, params)))
    assert multi.engine.num_multi_steps > before
    assert multi.engine.runner.compiles_after_warmup == 0
    assert multi.engine.scheduler.allocator.num_used_pages == 0


def test_requests_needing_their_history_run_single_steps(multi, single, prompts):
    """Penalties and min_tokens need each token on the host before the next is sampled:
    while such a request runs, every step is one program (and gives the same tokens)."""
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=20, presence_penalty=0.5,
                             repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12,
                             stop_token_ids=[7])]
    for p in params:
        before = multi.engine.num_multi_steps
        assert_same(results(multi.generate([prompts[0]], p)),
                    results(single.generate([prompts[0]], p)))
        assert multi.engine.num_multi_steps == before


def test_a_request_of_n_tokens_dispatches_about_n_over_steps_programs(multi, prompts):
    engine = multi.engine
    for n in (2, 9, 30):
        before = engine.num_steps
        out = multi.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=n,
                                                          ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == n
        # The prefill samples the first token; the other n - 1 come STEPS per program.
        assert engine.num_steps - before == 1 + math.ceil((n - 1) / STEPS)
        assert engine.status().steps_in_flight == 0


def test_a_new_request_is_prefilled_at_the_next_step(multi, prompts):
    """A request arriving while others decode is scheduled in the next program (a single
    step that prefills it), not after their runs of steps."""
    engine = multi.engine
    engine.add_request("long", prompts[1], SamplingParams(temperature=0.0, max_tokens=40,
                                                          ignore_eos=True))
    for _ in range(4):
        engine.step()
    before = engine.num_multi_steps
    engine.step()
    assert engine.num_multi_steps == before + STEPS  # decoding alone: STEPS a program
    engine.add_request("new", prompts[0], SamplingParams(temperature=0.0, max_tokens=5,
                                                         ignore_eos=True))
    before = engine.num_multi_steps
    engine.step()
    assert engine.num_multi_steps == before  # one step, which prefills the new request
    new = engine.scheduler.get("new")
    assert new.num_computed_tokens >= len(prompts[0])
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.allocator.num_used_pages == 0


def test_synchronous_preempting_and_aborted_runs(path, single, prompts):
    """Without async scheduling, and with a page pool small enough to preempt: the same
    tokens; aborting requests in the middle of their runs gives every page back."""
    settings = dict(ENGINE, num_pages=40)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=28, ignore_eos=True)]
    batch = [prompts[i % len(prompts)] for i in range(6)]
    want = results(single.generate(batch, [params[i % 2] for i in range(6)]))
    for mode in (False, True):
        llm = LLM(path, async_scheduling=mode, num_scheduler_steps=STEPS, **settings)
        assert_same(results(llm.generate(batch, [params[i % 2] for i in range(6)])), want)
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.num_multi_steps > 0
        assert engine.scheduler.allocator.num_used_pages == 0
        for i, p in enumerate(prompts):
            engine.add_request(f"abort-{i}", p, params[0])
        while engine.num_multi_steps == 0 or not any(
                len(s.output_token_ids) > STEPS for s in engine.scheduler.running):
            engine.step()
        for i in range(len(prompts)):
            assert engine.abort_request(f"abort-{i}")
        engine.step()
        assert not engine.has_unfinished()
        assert engine.scheduler.allocator.num_used_pages == 0


def test_a_failed_run_of_steps_fails_its_requests_and_the_engine_goes_on(multi, single,
                                                                          prompts):
    """A run of steps that raises after consuming the KV cache: its requests end with
    "error" and give back every page, and the engine serves the next ones correctly."""
    engine, runner = multi.engine, multi.engine.runner

    def failing(*_):  # the first run of steps; then the class's dispatch_steps again
        del runner.dispatch_steps
        for layer in runner.kv_caches:
            for x in layer:
                x.delete()
        raise RuntimeError("injected device fault")

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"fail-{i}", p, params)
    runner.dispatch_steps = failing
    errors = []
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError as e:
            errors = engine.fail_step(e)
    assert sorted(o.request_id for o in errors) == ["fail-0", "fail-1"]
    assert all(o.finish_reason == "error" and o.finished for o in errors)
    assert engine.scheduler.allocator.num_used_pages == 0
    assert_same(results(multi.generate(prompts, params)),
                results(single.generate(prompts, params)))
