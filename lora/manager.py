"""Adapter registry, CPU tier (max_cpu_loras, LRU) and device slots (max_loras, LRU, pin).

Three places an adapter can be:

    registry   name -> (path, digest): every adapter a request may name
    CPU tier   validated weights in host memory, LRU over max_cpu_loras entries
    slots      max_loras device slots; a slot is evictable only when no running request
               uses it and it is not pinned

The engine thread owns the tier and slot state. Reading adapters from disk happens on a
loader thread, off the step loop: a request whose adapter is still loading waits while the
others run. A failed reload is recorded in load_errors (the requests waiting for it fail)
until the adapter's files change on disk: then it is tried again, so a repaired directory
serves again without being registered anew. Slot assignment is bookkeeping only; the copies
into the slot buffers are done by the model runner from SchedulerOutput.lora_loads.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from lora.adapter import LoraAdapter, load_adapter
from lora.adapter_info import AdapterInfo
from lora.targets import LoraTargets

_Stamp = tuple[tuple[int, int, int] | None, ...] | None
"""What _stamp() returns: the state of an adapter's files on disk."""


@dataclass(frozen=True)
class _Record:
    path: str
    digest: str
    rank: int


class LoraManager:
    """See the module docstring. Methods other than register()/identity() must be called
    from the engine thread."""

    def __init__(self, targets: LoraTargets, max_loras: int, max_cpu_loras: int, max_rank: int,
                 error_recheck_s: float = 1.0) -> None:
        self.targets = targets
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self._lock = threading.Lock()  # guards _registry (read by request validation)
        self._registry: dict[str, _Record] = {}
        self._cpu: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._loading: dict[str, concurrent.futures.Future[LoraAdapter]] = {}
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._slot_names: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))
        self._running: Counter[str] = Counter()
        self._pinned: set[str] = set()
        self.load_errors: dict[str, str] = {}
        self._load_stamps: dict[str, _Stamp] = {}
        """The files' stamp as each disk load started (before the read, so an edit during
        the read is not missed)."""
        self._error_stamps: dict[str, _Stamp] = {}
        """The stamp a failed load started from: a different stamp now clears the error."""
        self.error_recheck_s = error_recheck_s
        """How often poll() stats the files of failed adapters (off every step's path)."""
        self._next_recheck = 0.0
        self.num_slot_loads = 0

    # ---------------------------------------------------------------- any thread
    def validate(self, name: str, path: str) -> LoraAdapter:
        """Load and validate a PEFT directory (slow: reads the weights)."""
        return load_adapter(name, path, self.targets, self.max_rank)

    def identity(self, name: str) -> tuple[str, str]:
        """(name, digest) of a registered adapter; ValueError if unknown."""
        with self._lock:
            record = self._registry.get(name)
        if record is None:
            raise ValueError(f"unknown adapter {name!r}")
        return (name, record.digest)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registry)

    # --------------------------------------------------------------- engine thread
    def add(self, adapter: LoraAdapter) -> None:
        """Register a validated adapter (replacing a same-named idle one) into the CPU tier."""
        old = self._registry.get(adapter.name)
        if old is not None and old.digest != adapter.digest:
            self.remove(adapter.name)
        with self._lock:
            self._registry[adapter.name] = _Record(adapter.path, adapter.digest, adapter.rank)
        self._clear_error(adapter.name)
        self._put_cpu(adapter)

    def remove(self, name: str) -> None:
        """Forget an adapter; refused while running requests use it."""
        if name not in self._registry:
            raise ValueError(f"unknown adapter {name!r}")
        if self._running[name]:
            raise ValueError(f"adapter {name!r} is in use by {self._running[name]} running "
                             f"request(s)")
        with self._lock:
            del self._registry[name]
        self._clear_error(name)
        self._cpu.pop(name, None)
        self._pinned.discard(name)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._slot_names[slot] = None
            self._slot_lru.move_to_end(slot, last=False)  # reuse the emptied slot first

    def pin(self, name: str, pinned: bool = True) -> None:
        if name not in self._registry:
            raise ValueError(f"unknown adapter {name!r}")
        if pinned and name not in self._pinned and len(self._pinned) >= self.max_loras:
            raise ValueError(f"cannot pin {name!r}: all {self.max_loras} slots are pinned")
        (self._pinned.add if pinned else self._pinned.discard)(name)

    def poll(self) -> None:
        """Move finished background loads into the CPU tier; forget the load errors of
        adapters whose files changed since (checked every error_recheck_s)."""
        for name, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            stamp = self._load_stamps.pop(name, None)
            record = self._registry.get(name)
            try:
                adapter = future.result()
            except ValueError as exc:
                self._record_error(name, str(exc), stamp)
                continue
            if record is None or adapter.digest != record.digest:
                self._record_error(name, f"adapter {name!r} changed on disk since it was "
                                         f"registered; restore its files or register it again",
                                   stamp)
                continue
            self._put_cpu(adapter)
        if self.load_errors and time.monotonic() >= self._next_recheck:
            self._next_recheck = time.monotonic() + self.error_recheck_s
            for name in list(self.load_errors):
                record = self._registry.get(name)
                if record is None or _stamp(record.path) != self._error_stamps.get(name):
                    self._clear_error(name)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until the disk loads started so far are done (tests, drain)."""
        concurrent.futures.wait(list(self._loading.values()), timeout=timeout)

    def acquire(self, name: str) -> tuple[int, LoraAdapter | None] | None:
        """A slot for one more running request of ``name``: (slot, adapter to copy into the
        slot, or None if it is already there), or None when the request must wait (weights
        still loading, or every slot busy or pinned)."""
        slot = self._slot_of.get(name)
        if slot is not None:
            self._running[name] += 1
            self._slot_lru.move_to_end(slot)
            return (slot, None)
        adapter = self._cpu.get(name)
        if adapter is None:
            self._start_load(name)
            return None
        slot = self._free_slot()
        if slot is None:
            return None
        old = self._slot_names[slot]
        if old is not None:
            del self._slot_of[old]
        self._slot_names[slot] = name
        self._slot_of[name] = slot
        self._slot_lru.move_to_end(slot)
        self._cpu.move_to_end(name)
        self._running[name] += 1
        self.num_slot_loads += 1
        return (slot, adapter)

    def release(self, name: str) -> None:
        """One running request of ``name`` ended or was preempted."""
        assert self._running[name] > 0, f"release of {name!r} without acquire"
        self._running[name] -= 1

    def vacate(self, slot: int) -> None:
        """Forget which adapter a slot holds (its weights may not have been copied in), so
        the next request of that adapter loads it again; no-op while requests run on it."""
        name = self._slot_names[slot]
        if name is None or self._running[name]:
            return
        self._slot_names[slot] = None
        del self._slot_of[name]
        self._slot_lru.move_to_end(slot, last=False)

    def is_resident(self, name: str) -> bool:
        return name in self._slot_of

    def infos(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(name=name, path=r.path, digest=r.digest, rank=r.rank,
                        in_cpu=name in self._cpu, slot=self._slot_of.get(name),
                        pinned=name in self._pinned, running_requests=self._running[name])
            for name, r in sorted(self._registry.items())
        ]

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------- helpers
    def _free_slot(self) -> int | None:
        for slot in self._slot_lru:  # least recently used first
            name = self._slot_names[slot]
            if name is None or (not self._running[name] and name not in self._pinned):
                return slot
        return None

    def _start_load(self, name: str) -> None:
        record = self._registry.get(name)
        if record is None or name in self._loading or name in self.load_errors:
            return
        self._load_stamps[name] = _stamp(record.path)
        self._loading[name] = self._loader.submit(load_adapter, name, record.path, self.targets,
                                                  self.max_rank)

    def _record_error(self, name: str, message: str, stamp: _Stamp) -> None:
        self.load_errors[name] = message
        self._error_stamps[name] = stamp

    def _clear_error(self, name: str) -> None:
        self.load_errors.pop(name, None)
        self._error_stamps.pop(name, None)

    def _put_cpu(self, adapter: LoraAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)  # the device slot, if any, keeps its own copy


def _stamp(path: str) -> _Stamp:
    """(inode, size, mtime) of the directory and the two PEFT files, None where missing:
    any edit, copy or rename-over of the adapter's files changes it."""
    stamps: list[tuple[int, int, int] | None] = []
    for item in (Path(path), Path(path) / "adapter_config.json",
                 Path(path) / "adapter_model.safetensors"):
        try:
            st = os.stat(item)
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)
