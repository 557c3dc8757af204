"""The host loop: nothing in a step waits for the device by accident, and the offline LLM's
text, decoded once per request, is the text streamed step by step."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import engine as engine_module
from jaxserve.engine import runner as runner_module
from jaxserve.engine.request import Request
from jaxserve.sampling_params import StructuredOutputsParams
from device_branches import check_drawing_proposer, gpu_programs

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))


@pytest.fixture(scope="module")
def path(checkpoints):
    return str(checkpoints("llama")[0])


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded with logprobs, penalties (sampled apart), min_tokens with stop ids,
    a stop string, a grammar."""
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=20, logprobs=2),
            SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5, max_tokens=16),
            SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8, stop_token_ids=[5, 9]),
            SamplingParams(temperature=0.0, max_tokens=30, stop=["e", "t"], ignore_eos=True),
            SamplingParams(temperature=0.7, seed=5, max_tokens=20, structured_outputs=(
                StructuredOutputsParams(regex="[a-c]{3,9}x")))]


# A request whose prompt is scored (prompt logprobs: its steps run the `score` programs).
SCORED = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)


def summary(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outs]


def with_logprobs(outs) -> list:
    """`summary`, then each request's logprobs."""
    return summary(outs) + [o.outputs[0].logprobs for o in outs]


def assert_same_outputs(got: list, want: list, n: int) -> None:
    """Two `with_logprobs` of n requests: the same tokens, text and finish, and logprobs
    for the same tokens, equal to float32 rounding."""
    assert got[:n] == want[:n]
    for g, w in zip(got[n:], want[n:]):
        assert (g is None) == (w is None)
        for a, b in zip(g or [], w or []):
            assert a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-5)


# What reads a device array's value on the host (each waits for the device to compute it).
READS = ("__array__", "__int__", "__float__", "__bool__", "__index__", "__complex__", "item",
         "tolist", "block_until_ready")


@contextlib.contextmanager
def only_explicit_fetches():
    """Refuse every read of a device array's value except inside the engine's `fetch` (its
    one explicit copy of a step's samples) and `fetch_scores` (a scoring step's prompt
    scores): jax's transfer guard does that on an accelerator, but on the CPU platform
    device arrays are host memory and it lets every read through, so the reads are refused
    here by hand as well."""
    array_type = type(jax.numpy.zeros(1))
    fetching = threading.local()
    originals = {name: getattr(array_type, name) for name in READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            if not getattr(fetching, "on", False):
                raise RuntimeError(f"hidden wait for the device: jax.Array.{name}")
            return originals[name](self, *args, **kwargs)
        return read

    fetches = {name: getattr(engine_module, name) for name in ("fetch", "fetch_scores")}

    def explicit(fetch):
        def explicit_fetch(*args):
            fetching.on = True
            try:
                return fetch(*args)
            finally:
                fetching.on = False
        return explicit_fetch

    try:
        for name in READS:
            setattr(array_type, name, refuse(name))
        for name, fetch in fetches.items():
            setattr(engine_module, name, explicit(fetch))
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    finally:
        for name, fn in originals.items():
            setattr(array_type, name, fn)
        for name, fetch in fetches.items():
            setattr(engine_module, name, fetch)


def watch_programs(runner, record) -> None:
    """Call `record(program, args)` for every step program the runner runs."""
    run = runner._run

    def recording_run(program, fn, args):
        record(program, args)
        return run(program, fn, args)

    runner._run = recording_run


@pytest.mark.parametrize("steps", [1, 4])
def test_steps_never_wait_for_the_device_implicitly(path, prompts, steps):
    """Steps (one per program and four per program) of every kind of request where only
    the engine's explicit fetches of a step's samples (and prompt scores) read device data
    on the host. Same outputs as without the check."""
    llm = LLM(path, num_scheduler_steps=steps, **ENGINE)
    params = mixed_params() + [SCORED]
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    want = summary(llm.generate(batch, params))
    with only_explicit_fetches():
        got = summary(llm.generate(batch, params))
    assert got == want
    assert all(tokens for tokens, *_ in got)


def test_packed_inputs_give_the_same_tokens_in_two_arrays_a_call(path, prompts,
                                                                  monkeypatch):
    """As on an accelerator (packing forced on this CPU): every step program's host
    inputs go as two arrays (packing.py), and every kind of request gets the tokens and
    text the runner passing them as they are gives, one and four steps per program."""
    params = mixed_params()
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    plain = [summary(LLM(path, num_scheduler_steps=s, **ENGINE).generate(batch, params))
             for s in (1, 4)]
    monkeypatch.setattr(runner_module, "packs_inputs", lambda: True)
    for steps, want in zip((1, 4), plain):
        llm = LLM(path, num_scheduler_steps=steps, **ENGINE)
        host_arrays = collections.Counter()

        def record(program, args):
            host_arrays[program[0]] += 1
            host_arrays[program[0], "arrays"] += sum(isinstance(x, np.ndarray)
                                                     for x in jax.tree.leaves(args))

        watch_programs(llm.engine.runner, record)
        assert summary(llm.generate(batch, params)) == want
        for program in ("forward", "sample", "step") + (("steps",) if steps > 1 else ()):
            assert host_arrays[program] > 0, program
            assert host_arrays[program, "arrays"] == 2 * host_arrays[program], program


def test_a_decode_step_is_one_program_with_the_two_programs_tokens(path, prompts,
                                                                   monkeypatch):
    """Without penalties or a grammar, every step of a bucket that decodes (up to the one
    holding a token per sequence) is one program, its forward pass and sampling fused,
    and every kind of request gets the tokens, text and logprobs of the two programs."""
    params = [p for p in mixed_params() if not p.needs_history]
    batch = [prompts[i % len(prompts)] for i in range(len(params))]

    def run() -> tuple[list, collections.Counter]:
        llm = LLM(path, **ENGINE)
        programs = collections.Counter()
        decode_tokens = llm.engine.builder.bucket(ENGINE["max_num_seqs"], False).tokens

        def record(program, args):
            # forward and step programs: whether their bucket holds a step of decodes
            programs[program[0], program[0] != "sample" and program[1] <= decode_tokens] += 1

        watch_programs(llm.engine.runner, record)
        return with_logprobs(llm.generate(batch, params)), programs

    fused, programs = run()
    assert programs["step", True] > 0 and programs["forward", True] == 0
    assert programs["forward", False] == programs["sample", False] > 0  # prefills alone
    monkeypatch.setattr(runner_module.ModelRunner, "fuses", lambda self, key: False)
    two, programs = run()
    assert programs["step", False] == 0 and programs["forward", True] > 0
    assert_same_outputs(fused, two, len(params))


def test_plain_tokens_collected_as_append_collects_them(path, prompts, monkeypatch):
    """`Engine._collect` hands most tokens of requests with nothing but their tokens to
    look at (no logprobs, grammar or streamed text: `Request.plain`) to their requests
    without `_append`: every step's outputs are those `_append` makes of every token."""
    params = mixed_params() + [SamplingParams(temperature=1.0, seed=11, max_tokens=40),
                               SamplingParams(temperature=0.0, max_tokens=1)]
    batch = [prompts[i % len(prompts)] for i in range(len(params) + 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    stop_id = []

    def run() -> tuple[list, list, int]:
        llm = LLM(path, **ENGINE)
        llm.engine.stream_interval = 1  # every token in the step that makes it
        # A greedy request that ends at a stop token id: its 7th output (both runs ask
        # first, so that request ids and cached prefixes match).
        first = llm.generate([batch[-1]], greedy)[0].outputs[0].token_ids
        stop_id[:] = stop_id or [first[6]]
        stopping = dataclasses.replace(greedy, stop_token_ids=stop_id)
        engine, steps, appended = llm.engine, [], collections.Counter()
        collect, append = engine._collect, engine._append

        def recording_collect(step, later=None):
            outs = collect(step, later)
            steps.append([dataclasses.replace(o, first_scheduled_at=None) for o in outs])
            return outs

        def counting_append(*args):
            appended["calls"] += 1
            return append(*args)

        monkeypatch.setattr(engine, "_collect", recording_collect)
        monkeypatch.setattr(engine, "_append", counting_append)
        return summary(llm.generate(batch, params + [stopping])), steps, appended["calls"]

    plain, plain_steps, plain_appends = run()
    assert plain[-1][2:] == ("stop", stop_id[0])
    post_init = Request.__post_init__

    def never_plain(self):
        post_init(self)
        self.plain = False

    monkeypatch.setattr(Request, "__post_init__", never_plain)
    every, every_steps, every_appends = run()
    assert plain == every and plain_steps == every_steps
    assert every_appends == sum(map(len, every_steps))
    assert plain_appends < every_appends - 60  # the plain requests' tokens but their last


@pytest.mark.parametrize("interval", [1, 5])
def test_plain_tokens_held_back_go_out_in_groups(path, prompts, monkeypatch, interval):
    """`Engine.stream_interval` k: a plain request's tokens go out with its first output,
    then k at a time, the rest with its last; `held_tokens` are exactly those not out yet;
    other requests' go out each step. Outputs joined, every request gets the tokens and
    results of an engine handing out every token (the offline LLM holds all to the end)."""
    params = mixed_params() + [SamplingParams(temperature=1.0, seed=11, max_tokens=40),
                               SamplingParams(temperature=0.0, max_tokens=1)]
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    llm = LLM(path, **ENGINE)
    want = summary(llm.generate(batch, params))  # (the LLM's own: held to the end)
    engine = llm.engine
    engine.stream_interval = interval
    got: dict[str, list] = collections.defaultdict(list)
    step = engine.step

    def recording_step():
        outs = step()
        for o in outs:
            got[o.request_id].append(o)
        for req in engine.running_requests():  # held: known outputs not out yet
            out = [t for o in got[req.seq.request_id] for t in o.new_token_ids]
            assert out + engine.held_tokens(req.seq.request_id) == \
                req.seq.output_token_ids[:req.seq.num_known_outputs]
        return outs

    monkeypatch.setattr(engine, "step", recording_step)
    assert summary(llm.generate(batch, params)) == want
    plain = [not p.logprobs and p.structured_outputs is None and not p.stop for p in params]
    held = 0
    in_order = [got[rid] for rid in sorted(got, key=int)]  # (the LLM numbers its requests)
    for (tokens, *_), outs, is_plain in zip(want, in_order, plain, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == tokens
        sizes = [len(o.new_token_ids) for o in outs]
        if is_plain and len(tokens) > 1:
            assert sizes[0] == 1 and all(n == interval for n in sizes[1:-1])
            assert 0 < sizes[-1] <= interval
            held += len(tokens) - len(sizes)
        else:  # a token a step (a stop string's text may wait for more)
            assert all(n <= 1 for n in sizes) and sum(sizes) == len(tokens)
    assert (held > 40) == (interval > 1)


def test_the_check_catches_a_hidden_wait(path, monkeypatch):
    """The check above can fail: a step that reads a device value on the host is refused."""
    llm = LLM(path, **ENGINE)
    collect = llm.engine._collect

    def collect_and_peek(step, later=None):
        int(llm.engine.runner.carry[0])  # a hidden sync, as a careless edit might add
        return collect(step, later)

    monkeypatch.setattr(llm.engine, "_collect", collect_and_peek)
    with only_explicit_fetches(), pytest.raises(RuntimeError, match="hidden wait"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4))


def test_whole_output_text_is_the_streamed_text(path, prompts):
    """The offline LLM decodes a request without stop strings once, at its end; an engine
    streaming text step by step gives the same text, and so does the tokenizer's decode."""
    llm = LLM(path, **ENGINE)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True,
                             skip_special_tokens=skip)
              for s, skip in zip(range(4), (True, False, True, False))]
    batch = [prompts[i] for i in range(4)]
    whole = summary(llm.generate(batch, params))
    llm.engine.stream_text = True
    try:
        streamed = summary(llm.generate(batch, params))
    finally:
        llm.engine.stream_text = False
    assert whole == streamed
    tok = llm.get_tokenizer()
    for (tokens, text, *_), p in zip(whole, params):
        if p.skip_special_tokens:
            assert text == tok.decode(tokens, skip_special_tokens=True)


def test_branch_free_programs_give_the_tokens_of_the_branching_ones(path, prompts,
                                                                   monkeypatch):
    """Where the host settles the sampling's branches (ModelRunner.branch_free, as on a
    GPU, where XLA waits on the host for each lax.cond and for each round of a loop of
    unknown count): every kind of request gets the tokens, text and logprobs of the
    branching programs, at one and four decode steps per program. The compiled programs
    (XLA's HLO) hold no conditional and only loops of a known count; the steps whose rows
    ask for top-k, top-p or logprobs run the FULL sampling program."""
    params = [
        SamplingParams(temperature=0.6, top_p=0.8, seed=1, max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=19, logprobs=0, ignore_eos=True),
        *mixed_params(), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SCORED]
    batch = [prompts[i % len(prompts)] for i in range(len(params))]

    def run(steps: int) -> tuple[list, collections.Counter, LLM]:
        llm = LLM(path, num_scheduler_steps=steps, **ENGINE)
        programs = collections.Counter()
        watch_programs(llm.engine.runner, lambda program, args: programs.update(
            [program[0] if program[0] != "sample" else ("sample", program[-1])]))
        return with_logprobs(llm.generate(batch, params)), programs, llm

    want = [run(steps)[0] for steps in (1, 4)]
    monkeypatch.setattr(runner_module, "branch_free", lambda: True)
    for steps, expected in zip((1, 4), want):
        got, programs, llm = run(steps)
        assert_same_outputs(got, expected, len(params))
        assert programs["sample", True] > 0 and programs["sample", False] > 0
        assert programs["step"] > 0 and programs["steps" if steps > 1 else "step"] > 0
        for program, executable in llm.engine.runner._executables.items():
            text = executable.as_text()
            assert " conditional(" not in text, program
            loops = [line for line in text.splitlines() if " while(" in line]
            assert all("known_trip_count" in line for line in loops), program


@pytest.mark.parametrize("branch_free", [False, True])
def test_a_gpus_step_programs_hold_no_branch_on_device_data(path, monkeypatch, branch_free):
    """The step programs a GPU runs, GPU attention kernels and all, traced on this CPU
    (never compiled): where the runner is branch_free (as on a GPU) none holds a lax.cond
    or a loop of a traced count, each of which XLA:GPU runs by waiting on the host for a
    predicate; the branching programs (a CPU's, a TPU's) do hold them."""
    found = gpu_programs(monkeypatch, branch_free, model=path, num_scheduler_steps=4, **ENGINE)
    kinds = {program[0] for program in found}
    assert kinds == {"forward", "sample", "step", "steps"}
    if branch_free:
        assert sum(found.values(), collections.Counter()) == {}, found
        assert {program[-1] for program in found if program[0] == "sample"} == {False, True}
    else:
        for kind in ("sample", "step", "steps"):  # the sampler's conds
            assert all(found[p]["cond"] for p in found if p[0] == kind), kind
        assert all(found[p]["while"] for p in found if p[0] == "steps")


@pytest.mark.parametrize("arch, lora", [("mixtral", False), ("gemma2", False),
                                        ("llama", True)])
def test_a_gpus_moe_soft_cap_and_lora_programs_hold_no_branch(checkpoints, monkeypatch,
                                                               arch, lora):
    """Experts, soft-capped attention and LoRA adapters (their deltas by the GPU's grouped
    matmul, which a GPU picks by platform: forced here) as a GPU compiles them: no
    program holds a lax.cond or a loop of a traced count. (The CPU's grouped matmul
    skips idle adapter groups by a cond per group: 28 in each LoRA step program.)"""
    import pallas_kernels.grouped_matmul as grouped

    if lora:
        monkeypatch.setattr(grouped, "choose_impl", lambda kind, group=1: "gpu")
    found = gpu_programs(monkeypatch, True, model=str(checkpoints(arch)[0]), **ENGINE,
                         enable_lora=lora)
    assert found and sum(found.values(), collections.Counter()) == {}, found


@pytest.mark.parametrize("branch_free", [False, True])
def test_a_gpus_draft_model_programs_hold_no_branch_on_device_data(path, monkeypatch,
                                                                   branch_free):
    """A draft model's rounds that draw sampled requests' guesses: where branch_free, the
    host picks the program with top-k and top-p's sort or without (sampler.draw_drafts),
    and none holds a branch; else each round's draw is a lax.cond on the rows'
    temperatures."""
    found = gpu_programs(monkeypatch, branch_free, model=path, **ENGINE, speculative_config={
        "model": path, "num_speculative_tokens": 3, "disable_by_batch_size": None})
    check_drawing_proposer(found, branch_free)
