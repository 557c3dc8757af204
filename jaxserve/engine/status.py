"""What the servers report of an engine: its counters read at one moment (Engine.status),
so they never reach into the scheduler, the runner or the speculator."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.engine.speculative.stats import SpeculationStats


@dataclasses.dataclass(frozen=True)
class EngineStatus:
    num_running: int
    num_waiting: int
    num_used_pages: int
    num_pages: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int  # of those, found
    num_preemptions: int
    num_steps: int  # steps dispatched
    num_overlapped_steps: int  # of those, dispatched while the one before still ran
    steps_in_flight: int  # dispatched and not yet collected (0 or 1)
    speculation: SpeculationStats | None  # None without speculative decoding
    lora_running: dict[str, int] | None = None  # running requests per LoRA adapter; None: off
    images: Any = None  # a vision-language model's ImageStats (multimodal/images.py); else None
    # The prefix cache's host tier (kv_offloading_size; 0 without one): the pages it
    # holds at most and now, those copied out to it and prompt tokens found in it (within
    # prefix_hits), since start.
    host_capacity: int = 0
    host_pages: int = 0
    pages_offloaded: int = 0
    host_hits: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV pages in use (0-1)."""
        return self.num_used_pages / max(self.num_pages, 1)
