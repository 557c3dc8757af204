"""The lax.conds and loops of a traced count in the programs a GPU engine runs, traced on
this CPU (never compiled): XLA:GPU runs each by copying a predicate to the host and
waiting for it (jaxserve/engine/runner.py, branch_free)."""

from __future__ import annotations

import collections

import jax

from jaxserve.engine import runner as runner_module


def device_branches(jaxpr) -> collections.Counter:
    """The lax.conds and loops of a traced count (`while`; a loop of a static count is a
    `scan`) in a program, not counting a kernel's own (its pallas_call runs on the
    device)."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("cond", "while"):
            found[eqn.primitive.name] += 1
        if eqn.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += device_branches(sub)
    return found


def _traced(fn, found: dict, program: tuple):
    """`fn` (a jitted program) traced, not run: its branches recorded under `program`,
    zeros of its outputs' shapes returned."""
    def run(*args):
        traced = fn.trace(*args)
        found[program] = found.get(program, collections.Counter()) + device_branches(
            traced.jaxpr.jaxpr)
        return jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), traced.out_info)
    return run


def gpu_programs(monkeypatch, branch_free: bool, **config) -> dict[tuple, collections.Counter]:
    """The branches in every program an Engine of `config` with the GPU kernels compiles
    at warm-up, by program (the runner's keys; a proposer's as ("propose", sorts)), with
    the runner `branch_free` or not."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine

    monkeypatch.setattr(runner_module, "branch_free", lambda: branch_free)
    engine = Engine.from_config(EngineConfig(kernel_impl="gpu", **config))
    found: dict[tuple, collections.Counter] = {}
    engine.runner._run = lambda program, fn, args: _traced(fn, found, program)(*args)
    proposer = getattr(engine.speculator, "proposer", None)
    for programs in (getattr(proposer, "_rounds", None), getattr(proposer, "_draft", None)):
        for sorts, fn in (programs or {}).items():
            programs[sorts] = _traced(fn, found, ("propose", sorts))
    engine.warmup(progress=False)
    return found


def check_drawing_proposer(found: dict[tuple, collections.Counter], branch_free: bool) -> None:
    """`gpu_programs`' findings for an engine whose proposer draws sampled requests'
    guesses: where branch_free, two proposer programs the host picks between (with top-k
    and top-p's sort, and without) and no branch in any program; else one, each round's
    draw a lax.cond on the rows' temperatures."""
    proposals = {p: n for p, n in found.items() if p[0] == "propose"}
    if branch_free:
        assert sum(found.values(), collections.Counter()) == {}, found
        assert set(proposals) == {("propose", False), ("propose", True)}
    else:
        assert set(proposals) == {("propose", None)} and proposals["propose", None]["cond"]
