"""Multi-host serving: process 0 schedules and broadcasts each step; the others run it too.

Every process calls `jax.distributed.initialize` and builds the same Engine over the
global mesh (every process's devices), loading its own shards of the weights. Process 0
owns the scheduler and the gRPC port. Before it runs a step it broadcasts a small header
(command, bucket) and then the step's batch arrays; the followers run the same compiled
step on them, so every process joins the step's collectives. While idle, process 0
broadcasts a ping every `PING_INTERVAL_S`: a follower that died makes that collective (or
the next step's) fail at once ("connection closed by peer"), the engine loop stops, and
the server turns NOT_SERVING with the error in its log instead of hanging. A follower
whose leader is gone exits the same way. On CPU the collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.engine.batch import BucketKey, StepBatch

log = logging.getLogger(__name__)

STOP, STEP, PING = 0, 1, 2
PING_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int

    @classmethod
    def from_args(cls, coordinator: str | None, num_processes: int | None,
                  process_id: int | None) -> "DistributedConfig | None":
        """From the flags, else JAX's usual environment variables; None for one process."""
        coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
        num_processes = num_processes or _env_int("JAX_NUM_PROCESSES")
        process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
        if coordinator is None and num_processes in (None, 1):
            return None
        if coordinator is None or num_processes is None or process_id is None:
            raise ValueError("multi-host serving needs --coordinator HOST:PORT, --num-processes "
                             "and --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                             "JAX_PROCESS_ID)")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must be in [0, {num_processes})")
        return cls(coordinator, num_processes, process_id)


def exit_now(code: int) -> None:
    """Leave a broken job at once: JAX's exit-time shutdown would wait forever at a barrier
    for the process that is gone."""
    log.error("exiting with code %d without the distributed shutdown barrier", code)
    logging.shutdown()
    os._exit(code)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def initialize(config: DistributedConfig) -> None:
    """Join the job; after this jax.devices() lists every process's devices."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU meshes only
    jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id)
    log.info("process %d of %d joined %s: %d devices, %d local", jax.process_index(),
             jax.process_count(), config.coordinator, jax.device_count(),
             jax.local_device_count())


def _header(command: int, key: BucketKey = (0, 0, False)) -> np.ndarray:
    return np.array([command, key[0], key[1], int(key[2])], np.int32)


class StepBroadcaster:
    """Process 0's side: tells the followers what to run (ModelRunner.dispatch calls send)."""

    def send(self, batch: StepBatch, key: BucketKey) -> None:
        multihost_utils.broadcast_one_to_all(_header(STEP, key))
        multihost_utils.broadcast_one_to_all(batch)

    def ping(self) -> None:
        multihost_utils.broadcast_one_to_all(_header(PING))

    def stop(self) -> None:
        multihost_utils.broadcast_one_to_all(_header(STOP))


def follow(engine) -> None:
    """A follower's loop: run every step process 0 broadcasts, until it says stop."""
    while True:
        command, t, s, history = (int(x) for x in
                                  multihost_utils.broadcast_one_to_all(_header(STOP)))
        if command == STOP:
            log.info("process 0 said stop")
            return
        if command == STEP:
            key = (t, s, bool(history))
            batch = multihost_utils.broadcast_one_to_all(engine.builder.empty(key))
            engine.runner.dispatch(batch, key)
