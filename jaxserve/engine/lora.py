"""Which LoRA adapters are where: up to `max_cpu_loras` read from disk and kept in host
memory (least recently used dropped first), and `max_loras` slots on the device
(ModelRunner.lora), each holding one adapter while a running sequence uses it and until
its slot is needed (least recently used first). Loading an adapter into a slot changes
arrays, not programs: nothing recompiles.

The scheduler admits a waiting sequence only if its adapter has a slot or can get one
(`can_acquire`), so one step never needs more than `max_loras` adapters; the engine copies
the adapters newly given slots to the device before the step that first reads them
(`take_uploads`). Plain Python, no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

from jaxserve.config import ModelConfig
from jaxserve.engine.request import Sequence
from jaxserve.loading.peft import Adapter, load_adapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, as vLLM names it: `LoRARequest(lora_name, lora_int_id,
    lora_path)`. The name identifies the adapter (the OpenAI API's `model`); the path is
    a PEFT directory (loading/peft.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def cache_root(self) -> bytes:
        """The prefix cache's root for its sequences' pages (page_allocator.py)."""
        key = f"lora\0{self.lora_name}\0{self.lora_int_id}\0{self.lora_path}".encode()
        return hashlib.blake2b(key, digest_size=16).digest()


class LoraManager:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._known: dict[str, LoRARequest] = {}  # registered adapters, by name
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self._slot_of: dict[str, int] = {}  # adapter name -> its slot (1..max_loras)
        self._holder: list[str | None] = [None] * (max_loras + 1)  # [0] unused
        self._users = [0] * (max_loras + 1)  # running sequences per slot
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(1, max_loras + 1))  # slots nobody uses, LRU first
        self._uploads: dict[int, Adapter] = {}
        self._acquired: set[Sequence] = set()
        self.num_loads = 0  # adapters copied to the device

    # ------------------------------------------------------------- adapters

    def read(self, req: LoRARequest) -> Adapter:
        """The adapter of `req` read from disk and checked against the model and the rank
        limit (ValueError). Touches no state: any thread may call it (a server reads
        adapters off the engine's thread, then `register`s them)."""
        adapter = load_adapter(req.lora_path, self.cfg)
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {req.lora_name!r} has rank {adapter.rank} > "
                             f"max_lora_rank ({self.max_rank}); raise max_lora_rank")
        return adapter

    def register(self, req: LoRARequest, adapter: Adapter | None = None) -> Adapter:
        """Serve the adapter of `req`: `adapter` (`read` already) into host memory, else
        read there (or found there); ValueError if it cannot be."""
        known = self._known.get(req.lora_name)
        if known is not None and known != req:
            raise ValueError(f"adapter {req.lora_name!r} is already loaded as "
                             f"{known}; unload it first or use another name")
        if adapter is not None and req.lora_name not in self._host:
            self._keep(req.lora_name, adapter)
        adapter = self._adapter(req)
        self._known[req.lora_name] = req
        return adapter

    def unregister(self, name: str) -> bool:
        """Forget an adapter (a running request keeps its slot until it ends); False if
        unknown."""
        if self._known.pop(name, None) is None:
            return False
        self._host.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:  # no new sequence finds it there; its weights are overwritten
            self._holder[slot] = None  # when the slot is next given out
        return True

    @property
    def names(self) -> list[str]:
        return list(self._known)

    def get(self, name: str) -> LoRARequest | None:
        return self._known.get(name)

    # ---------------------------------------------------------------- slots

    def can_acquire(self, seq: Sequence) -> bool:
        """Whether `seq` could run now: no adapter, its adapter in a slot, or a slot free."""
        return seq.lora is None or seq.lora.lora_name in self._slot_of or bool(self._idle)

    def ready(self, seq: Sequence) -> None:
        """Have `seq`'s adapter in host memory for `acquire` (read from disk again if it
        was dropped; ValueError or OSError if that fails: the file changed or is gone)."""
        if seq.lora is not None and seq.lora.lora_name not in self._slot_of:
            self._adapter(seq.lora)

    def acquire(self, seq: Sequence) -> None:
        """Give a sequence being admitted its adapter's slot (`seq.lora_slot`), loading the
        adapter (in host memory: `ready`) into the least recently used idle slot if it has
        none."""
        if seq.lora is None:
            seq.lora_slot = 0
            return
        name = seq.lora.lora_name
        slot = self._slot_of.get(name)
        if slot is None:
            slot, _ = self._idle.popitem(last=False)
            old = self._holder[slot]
            if old is not None:
                del self._slot_of[old]
            self._holder[slot], self._slot_of[name] = name, slot
            self._uploads[slot] = self._adapter(seq.lora)
        elif self._users[slot] == 0:
            del self._idle[slot]
        self._users[slot] += 1
        self._acquired.add(seq)
        seq.lora_slot = slot

    def release(self, seq: Sequence) -> None:
        """A sequence stopped running (finished, aborted, preempted): its slot is idle
        once no other sequence uses it."""
        if seq not in self._acquired:
            return
        self._acquired.discard(seq)
        slot = seq.lora_slot
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None  # most recently used: evicted last

    def take_uploads(self) -> list[tuple[int, Adapter]]:
        """The (slot, adapter) pairs to copy to the device before the next step."""
        uploads, self._uploads = list(self._uploads.items()), {}
        self.num_loads += len(uploads)
        return uploads

    def _adapter(self, req: LoRARequest) -> Adapter:
        """The adapter from host memory, or read (and checked) from disk into it, the least
        recently used dropped past max_cpu_loras."""
        adapter = self._host.get(req.lora_name)
        if adapter is None:
            adapter = self.read(req)
            self._keep(req.lora_name, adapter)
        self._host.move_to_end(req.lora_name)
        return adapter

    def _keep(self, name: str, adapter: Adapter) -> None:
        self._host[name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def running(self) -> dict[str, int]:
        """Running sequences per adapter name (metrics; any thread may call it: it reads
        copies)."""
        return {name: n for name, n in zip(list(self._holder), list(self._users))
                if n and name is not None}
