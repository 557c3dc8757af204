"""Multi-host serving: process 0 schedules and broadcasts each step; the others run it too.

Every process joins the job (sharding/multihost.py) and builds the same Engine over the
global mesh, loading its own shards of the weights. Process 0 owns the scheduler and the
servers. Before it runs a step it broadcasts a small header (command, bucket) and then
the step's batch arrays; the followers run the same compiled step on them, so every
process joins the step's collectives. While idle, process 0 broadcasts a ping every
`PING_INTERVAL_S`: a follower that died usually makes that collective (or the next
step's) fail at once ("connection closed by peer"), the engine loop stops, and the server
turns NOT_SERVING with the error in its log instead of hanging. A follower that is alive
but does not answer (a host off the network sends no FIN: the collective would wait until
JAX's coordination service kills process 0 after its 100 s heartbeat timeout) is given up
on when a ping has waited `PING_TIMEOUT_S`, the same way; so is a dead one whose closed
connection failed only one of process 0's local participants in the collective, leaving
the others waiting on it (gloo, the CPU collectives, does this about once in 15 kills).
A follower whose leader is gone exits the same way.
"""

from __future__ import annotations

import logging

import numpy as np
from jax.experimental import multihost_utils

from jaxserve.engine.batch import BucketKey, StepBatch

log = logging.getLogger(__name__)

# STEP runs a whole step (forward, then sample); a step sampled apart is FORWARD, then
# SAMPLE with the same batch (its sampling arrays filled in between:
# ModelRunner.dispatch_forward / dispatch_sample); SCORE is a FORWARD that scores its
# tokens (prompt logprobs), its targets broadcast after the batch. MOVE copies K/V between
# slots after a tree step (ModelRunner.move). PROPOSE runs a draft model's or EAGLE's
# program on the proposer's batch (proposers.DeviceProposer.run). LORA writes a LoRA
# adapter's arrays into a device slot (ModelRunner.load_lora: process 0 read the adapter).
# ENCODE runs the vision tower on an image's inputs (ImageEncoder.encode), its bucket in
# the header's token count. POOL is a FORWARD that sums pool segments' hidden states
# (embeddings), its segments broadcast after the batch; POOL_SCORE one that also scores its
# tokens (its targets, then its segments).
STOP, STEP, PING, FORWARD, SAMPLE, MOVE, PROPOSE, SCORE, LORA, ENCODE, POOL, POOL_SCORE = \
    range(12)
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 20.0


def _header(command: int, key: BucketKey = BucketKey(0, 0, False)) -> np.ndarray:
    return np.array([command, key.tokens, key.seqs, int(key.history), key.drafts,
                     int(key.tree)], np.int32)


class StepBroadcaster:
    """Process 0's side: tells the followers what to run (ModelRunner.dispatch calls send)."""

    def send(self, command: int, batch: StepBatch, key: BucketKey,
             score_targets: np.ndarray | None = None,
             pool_segments: np.ndarray | None = None) -> None:
        extras = tuple(x for x in (score_targets, pool_segments) if x is not None)
        if extras:  # a FORWARD that scores, pools or both
            command = (SCORE if pool_segments is None else POOL if score_targets is None
                       else POOL_SCORE)
        multihost_utils.broadcast_one_to_all(_header(command, key))
        multihost_utils.broadcast_one_to_all((batch, *extras) if extras else batch)

    def send_moves(self, src: np.ndarray, dst: np.ndarray) -> None:
        multihost_utils.broadcast_one_to_all(_header(MOVE))
        multihost_utils.broadcast_one_to_all((src, dst))

    def send_proposal(self, batch: StepBatch, key: BucketKey, limits: np.ndarray) -> None:
        multihost_utils.broadcast_one_to_all(_header(PROPOSE, key))
        multihost_utils.broadcast_one_to_all((batch, limits))

    def send_lora(self, slot: int, arrays) -> None:
        multihost_utils.broadcast_one_to_all(_header(LORA))
        multihost_utils.broadcast_one_to_all((np.int32(slot), arrays))

    def send_encode(self, bucket: int, args: tuple) -> None:
        multihost_utils.broadcast_one_to_all(_header(ENCODE, BucketKey(bucket, 0, False)))
        multihost_utils.broadcast_one_to_all(args)

    def ping(self) -> None:
        multihost_utils.broadcast_one_to_all(_header(PING))

    def stop(self) -> None:
        multihost_utils.broadcast_one_to_all(_header(STOP))


def follow(engine) -> None:
    """A follower's loop: run every step process 0 broadcasts, until it says stop."""
    while True:
        command, t, s, history, drafts, tree = (
            int(x) for x in multihost_utils.broadcast_one_to_all(_header(STOP)))
        if command == STOP:
            log.info("process 0 said stop")
            return
        if command in (STEP, FORWARD, SAMPLE):
            key = BucketKey(t, s, bool(history), drafts, bool(tree))
            batch = multihost_utils.broadcast_one_to_all(engine.builder.empty(key))
            run = {STEP: engine.runner.dispatch, FORWARD: engine.runner.dispatch_forward,
                   SAMPLE: engine.runner.dispatch_sample}[command]
            run(batch, key)
        elif command in (SCORE, POOL, POOL_SCORE):
            key = BucketKey(t, s, bool(history), drafts, bool(tree))
            template = np.zeros(key.tokens, np.int32)
            batch, *extras = multihost_utils.broadcast_one_to_all(
                (engine.builder.empty(key), *[template] * (1 + (command == POOL_SCORE))))
            targets = extras[0] if command != POOL else None
            segments = extras[-1] if command != SCORE else None
            engine.runner.dispatch_forward(batch, key, targets, segments)
        elif command == MOVE:
            engine.runner.move(*multihost_utils.broadcast_one_to_all(engine.runner.moves([])))
        elif command == PROPOSE:
            proposer = engine.speculator.proposer
            key = BucketKey(t, s, bool(history), drafts, bool(tree))
            template = (proposer.program_inputs(proposer.builder.empty(key)),
                        np.zeros(key.seqs, np.int32))
            batch, limits = multihost_utils.broadcast_one_to_all(template)
            proposer.run(batch, key, limits)
        elif command == ENCODE:
            encoder = engine.images.encoder
            encoder.run(t, multihost_utils.broadcast_one_to_all(encoder.empty(t)))
        elif command == LORA:
            runner = engine.runner
            slot, arrays = multihost_utils.broadcast_one_to_all(
                (np.int32(0), runner.lora_slot_arrays(None)))
            runner.write_lora_slot(int(slot), arrays)
