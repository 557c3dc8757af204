"""Multi-host start-up: every process of a job joins it before building its engine.

After `initialize`, `jax.devices()` lists every process's devices, so each process builds
the same mesh over all of them (jaxserve/engine/broadcast.py runs the steps together).
On CPU the collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

log = logging.getLogger(__name__)


# JAX's: a process that has sent no heartbeat for this long is dead to the coordination
# service, which then ends every process of the job (process 0 aborts; the followers exit).
HEARTBEAT_TIMEOUT_S = 100


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

    @classmethod
    def from_args(cls, coordinator: str | None, num_processes: int | None,
                  process_id: int | None, heartbeat_timeout_s: int | None = None
                  ) -> "DistributedConfig | None":
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
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        if heartbeat_timeout_s < 2:
            raise ValueError(f"--distributed-heartbeat-timeout {heartbeat_timeout_s}: give at "
                             "least 2 seconds")
        return cls(coordinator, num_processes, process_id, heartbeat_timeout_s)


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
    jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id,
                               heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    log.info("process %d of %d joined %s: %d devices, %d local", jax.process_index(),
             jax.process_count(), config.coordinator, jax.device_count(),
             jax.local_device_count())
