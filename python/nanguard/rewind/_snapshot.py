"""Snapshots of a training run's state, and the ring that keeps the last few.

A snapshot is what an optimizer step changes: the model's ``state_dict``
(parameters and persistent buffers), the optimizer's (moments, step counts,
param_groups with their learning rates), the loss scaler's (scale and growth
tracker), the LR scheduler's, and the random number generators (torch's CPU
and CUDA generators, Python's ``random``, NumPy's global one when NumPy is
loaded). Tensors are copied to host memory, so a snapshot never aliases the
live run: the optimizer goes on mutating its moments in place, and
``Optimizer.load_state_dict`` would adopt the very tensors it is given.
Restoring therefore loads a fresh copy every time, and one snapshot can be
restored any number of times.

In host memory (``directory=None``) a snapshot costs one copy of every state
tensor: 12 bytes per parameter for fp32 weights and AdamW's two moments. On
disk each snapshot is one ``torch.save`` file, read back with
``weights_only=True``; the ring deletes the files it evicts.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import sys
from typing import Any, Dict, List, Optional

import torch

__all__ = ["capture", "restore", "Entry", "Ring", "nbytes"]


def _host_tensor(t: torch.Tensor, into: Any) -> torch.Tensor:
    t = t.detach()
    if isinstance(into, torch.Tensor) and into.shape == t.shape and into.dtype == t.dtype \
            and into.device.type == "cpu" and into.is_contiguous():
        return into.copy_(t, non_blocking=t.device.type == "cuda")  # a recycled slot: no allocation
    if t.device.type == "cuda":  # pinned: the copy runs at the link's speed, asynchronously
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to("cpu", copy=True, memory_format=torch.contiguous_format)


def _host_copy(obj: Any, into: Any = None) -> Any:
    """``obj`` with every tensor copied to host memory (containers rebuilt,
    other values kept: they are immutable or rebuilt by the loaders). The
    tensors of ``into`` (an older snapshot of the same structure) are reused
    where they match."""
    if isinstance(obj, torch.Tensor):
        return _host_tensor(obj, into)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        out = {k: _host_copy(v, into.get(k)) for k, v in obj.items()}
        meta = getattr(obj, "_metadata", None)  # a module state_dict's versions, read by its loaders
        if meta is not None:
            out = collections.OrderedDict(out)
            out._metadata = meta
        return out
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        out = [_host_copy(v, i) for v, i in zip(obj, into)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors of a snapshot."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def _rng_state() -> Dict[str, Any]:
    st: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return st


def _set_rng_state(st: Dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in st:
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _sync_copies() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking device-to-host copies are done


def capture(model, optimizer, scaler=None, scheduler=None, into: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One snapshot of the run's state, in host memory; ``into``: an evicted
    snapshot whose tensors are reused."""
    snap = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if scaler is not None:
        snap["scaler"] = scaler.state_dict()
    if scheduler is not None:
        snap["scheduler"] = scheduler.state_dict()
    snap = _host_copy(snap, into)
    snap["rng"] = _host_copy(_rng_state())
    _sync_copies()
    return snap


def restore(snap: Dict[str, Any], model, optimizer, scaler=None, scheduler=None) -> None:
    """Put the run back in the state of ``snap`` (which stays intact)."""
    fresh = _host_copy(snap)  # the loaders may keep the tensors they are given
    _sync_copies()
    model.load_state_dict(fresh["model"])
    optimizer.load_state_dict(fresh["optimizer"])
    if scaler is not None and "scaler" in fresh:
        scaler.load_state_dict(fresh["scaler"])
    if scheduler is not None and "scheduler" in fresh:
        scheduler.load_state_dict(fresh["scheduler"])
    _set_rng_state(fresh["rng"])


@dataclasses.dataclass
class Entry:
    """One snapshot in the ring: the state before optimizer step ``step``."""

    step: int  #: optimizer steps done when it was taken
    cursor: int  #: index of the next batch drawn from the data
    run: Dict[str, Any]  #: the rewind policy's own state (trigger statistics, LR scale, history length)
    nbytes: int
    state: Optional[Dict[str, Any]] = None  #: in memory
    path: Optional[str] = None  #: on disk

    def load(self) -> Dict[str, Any]:
        if self.state is not None:
            return self.state
        return torch.load(self.path, map_location="cpu", weights_only=True)


class Ring:
    """The last ``keep`` snapshots, oldest first."""

    def __init__(self, keep: int, directory: Optional[str] = None):
        self.keep = keep
        self.directory = directory
        self.entries: List[Entry] = []
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    def add(self, step: int, cursor: int, run: Dict[str, Any], state: Dict[str, Any]) -> Entry:
        size = nbytes(state)
        if self.directory is None:
            entry = Entry(step, cursor, run, size, state=state)
        else:
            path = os.path.join(self.directory, f"rewind-step{step:09d}.pt")
            torch.save(state, path)
            entry = Entry(step, cursor, run, size, path=path)
        self.entries.append(entry)
        while len(self.entries) > self.keep:
            self._drop(self.entries.pop(0))
        return entry

    def recycle(self) -> Optional[Dict[str, Any]]:
        """When the ring is full: evict the oldest snapshot now, and hand its
        tensors back for the next one to reuse (host memory only)."""
        if len(self.entries) < self.keep:
            return None
        e = self.entries.pop(0)
        self._drop(e)
        return e.state

    def get(self, step: int) -> Optional[Entry]:
        return next((e for e in self.entries if e.step == step), None)

    def newest_before(self, step: int) -> Optional[Entry]:
        """The newest snapshot taken before optimizer step ``step`` ran
        earlier than it (``entry.step < step``)."""
        older = [e for e in self.entries if e.step < step]
        return older[-1] if older else None

    def drop_after(self, step: int) -> None:
        """Forget the snapshots of a trajectory abandoned at ``step``."""
        keep = [e for e in self.entries if e.step <= step]
        for e in self.entries:
            if e.step > step:
                self._drop(e)
        self.entries = keep

    def clear(self) -> None:
        for e in self.entries:
            self._drop(e)
        self.entries = []

    def oldest_cursor(self) -> Optional[int]:
        return self.entries[0].cursor if self.entries else None

    def _drop(self, e: Entry) -> None:
        if e.path is not None and os.path.exists(e.path):
            os.remove(e.path)
