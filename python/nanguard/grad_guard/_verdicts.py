"""What the gradient guard found, kept for ``nanguard.watch(mode="sentinel")``.

Each guard pass over plain tensors (``clip_grad_norm_``, ``guard_`` and so
the GradScaler's ``unscale_and_clip_``) publishes its statistics tensor (the
norm accumulator and the NaN / Inf counts, still on the device) and the
identities of the gradients it covered, under a sequence number. A sentinel
watcher notes the sequence number at its step's first forward; at the
check, the verdicts published since then tell whether the step's
gradients are finite without reading them again. Publishing is a
reference and a frozenset of ids: no host sync, no tensor op.
"""

from __future__ import annotations

import collections
import itertools
from typing import Deque, FrozenSet, List, Tuple

import torch

#: verdicts kept: more guard passes than this between two checks fall back
#: to the watcher's own test of the gradients
KEPT = 16

_seq = itertools.count(1)
_last = 0
_recent: Deque[Tuple[int, torch.Tensor, FrozenSet[int]]] = collections.deque(maxlen=KEPT)


def publish(grads, stats: torch.Tensor) -> None:
    """One guard pass: ``stats`` is its ``[norm_acc, nan, inf, first_bad]``."""
    global _last
    _last = next(_seq)
    _recent.append((_last, stats, frozenset(id(g) for g in grads)))


def sequence() -> int:
    """The number of the newest verdict (0 before any)."""
    return _last


def since(seq: int) -> List[Tuple[torch.Tensor, FrozenSet[int]]]:
    """The verdicts published after ``seq``, oldest first: (stats, the ids
    of the gradients covered). Incomplete when more than ``KEPT`` passes ran
    since ``seq`` (the oldest are gone): the caller then covers less."""
    return [(stats, ids) for s, stats, ids in _recent if s > seq]
