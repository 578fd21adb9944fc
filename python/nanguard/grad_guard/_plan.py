"""The plan of one guarded step on plain tensors: the gradients grouped by
(device, dtype) into op calls of at most ``MAX_LIST`` tensors, pass 1
(``grad_guard_reduce``) over every call, the per-call statistics combined
on the device (and across ranks), pass 2 (``grad_guard_apply_``). The
DTensor plan (``_dtensor``) builds on its helpers."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

from .. import _checks
from .. import distributed as _dist

_ops = torch.ops.nanguard

#: Tensors per op call. The C layer takes lists of any length; this bound
#: only caps the host-side tables of one call.
MAX_LIST = 1024


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of t share memory (an expanded or as_strided
    view): sorted by stride, each dim must step past everything the smaller
    dims span. Plain Python on sizes and strides, so it traces."""
    extent = 0
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    for st, n in dims:
        if st == 0:
            return True
        if st <= extent:
            break
        extent += (n - 1) * st
    else:
        return False
    # interleaved strides the walk above cannot decide: count the offsets
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n) * st).reshape(-1)
    return offsets.unique().numel() < offsets.numel()


def _group(grads: Sequence[torch.Tensor]):
    """(device, dtype) -> list of (index, tensor), in first-seen order."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tuple[int, torch.Tensor]]] = {}
    for i, g in enumerate(grads):
        _checks.check_tensor(f"grads[{i}]", g)
        if g.is_sparse:
            raise TypeError(f"grads[{i}] is sparse; nanguard guards dense gradients")
        if _overlaps(g):  # refused before anything is written
            raise ValueError(f"grads[{i}] has elements that overlap in memory (an expanded view); "
                             "it cannot be written in place")
        groups.setdefault((g.device, g.dtype), []).append((i, g))
    _check_meta("grads", [g for g in grads], grads)
    return groups


def _check_meta(name, tensors, grads):
    """A meta tensor only among meta tensors (shape inference): mixed with
    real ones it has no values to guard."""
    metas = [t.device.type == "meta" for t in tensors]
    if any(metas) and not all(g.device.type == "meta" for g in grads):
        k = metas.index(True)
        label = f"{name}[{k}]" if len(tensors) > 1 or name == "grads" else name
        raise ValueError(f"{label} is on meta but not every gradient is; a meta tensor has no "
                         "values to guard")


def _to(t: torch.Tensor, device: torch.device, dtype=None) -> torch.Tensor:
    """Copy to device without a host sync where that is safe: a copy to the
    CPU must complete before a CPU kernel reads it, so it blocks."""
    return t.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def _per_device(t: torch.Tensor, device: torch.device, cache: Dict[torch.device, torch.Tensor]):
    if device not in cache:
        cache[device] = _to(t, device, torch.float32).reshape(())
    return cache[device]


def _empty_stats(device) -> torch.Tensor:
    """The [4] stats of no gradient at all."""
    return torch.tensor([0.0, 0.0, 0.0, -1.0], dtype=torch.float64, device=device)


def _first_bad_of_call(first_bad: torch.Tensor, idx: List[int], device) -> torch.Tensor:
    """One call's first bad index (its stats[3], -1 when none) as an index
    into the caller's list, through ``idx`` (the caller's index of each
    tensor of the call); inf when none. The table goes host to device,
    never the other way: no sync."""
    lut = _to(torch.tensor(idx, dtype=torch.float64), device)
    mapped = lut.index_select(0, first_bad.clamp(min=0).long().reshape(1)).reshape(())
    return torch.where(first_bad >= 0, mapped, torch.full_like(mapped, math.inf))


def _combine_rows(rows: torch.Tensor, inf_norm: bool) -> torch.Tensor:
    """[acc, nan, inf] of several [acc, nan, inf, ...] rows ([n, >=3]): the
    accumulators summed (norm 2) or maxed (norm inf), the counts summed."""
    acc = rows[:, 0].amax() if inf_norm else rows[:, 0].sum()
    return torch.cat([acc.reshape(1), rows[:, 1:3].sum(0)])


def _first_of(firsts: List[torch.Tensor]) -> torch.Tensor:
    """[the least of the mapped first bad indices], -1 when all are inf."""
    first = torch.stack(firsts).amin()
    return torch.where(torch.isinf(first), torch.full_like(first, -1.0), first).reshape(1)


def _combine(parts: List[torch.Tensor], firsts: List[torch.Tensor], inf_norm: bool, device):
    """Combine [4] stats of several calls into one [4] tensor on `device`.
    firsts hold each call's first bad index already mapped to the caller's
    list (inf when none)."""
    s = torch.stack([_to(p, device) for p in parts])
    return torch.cat([_combine_rows(s, inf_norm), _first_of([_to(f, device) for f in firsts])])


def _norm_from_stats(stats: torch.Tensor, inf_norm: bool) -> torch.Tensor:
    """The float32 0-dim total norm the stats imply (NaN when any value is
    NaN, inf when any is inf): the norm of a caller that holds no gradient."""
    tn = stats[0] if inf_norm else stats[0].sqrt()
    tn = torch.where(stats[2] > 0, torch.full_like(tn, math.inf), tn)
    return torch.where(stats[1] > 0, torch.full_like(tn, math.nan), tn).float()


def _all_reduce(stats: torch.Tensor, inf_norm: bool, process_group) -> torch.Tensor:
    """One all-reduce of [acc, nan, inf] over process_group (first_bad stays
    this rank's)."""
    head = _dist.all_reduce_stats(stats[0:3].reshape(1, 3), 1, inf_norm, process_group)
    return torch.cat([head.reshape(3), stats[3:4]])


# ---- the plan ------------------------------------------------------------------------


class _Plan:
    """The op calls of one guarded step: batches of at most MAX_LIST tensors
    of one (device, dtype), with the per-device inv_scale and found_inf."""

    def __init__(self, grads, inv_scale, norm_type, found_inf):
        self.norm_type = norm_type
        self.inf_norm = norm_type == math.inf
        self.found_inf = {} if found_inf is None else found_inf
        groups = _group(grads)
        if not isinstance(inv_scale, torch.Tensor):
            inv_scale = torch.tensor(float(inv_scale), dtype=torch.float32)
        else:
            _checks.check_tensor("inv_scale", inv_scale)
            _check_meta("inv_scale", [inv_scale], grads)
            if inv_scale.numel() != 1:
                raise ValueError(f"inv_scale must have one element, got {inv_scale.numel()}")
        self.main = grads[0].device if grads else inv_scale.device
        self.scales: Dict[torch.device, torch.Tensor] = {}
        self.writeback: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.batches = []  # (device, tensors, their indices in grads)
        for (dev, _), items in groups.items():
            _per_device(inv_scale, dev, self.scales)
            if dev not in self.found_inf:
                self.found_inf[dev] = torch.zeros((), dtype=torch.float32, device=dev)
            for b in range(0, len(items), MAX_LIST):
                chunk = items[b : b + MAX_LIST]
                ts = []
                for _, g in chunk:
                    if not g.is_contiguous():  # guarded through a contiguous copy
                        c = g.contiguous()
                        self.writeback.append((g, c))
                        g = c
                    ts.append(g)
                self.batches.append((dev, ts, [i for i, _ in chunk]))

    def reduce(self, process_group=None) -> torch.Tensor:
        """Pass 1 over every batch; the combined float64 [4] stats."""
        if not self.batches:
            stats = _empty_stats(self.main)
        else:
            parts, firsts = [], []
            for dev, ts, idx in self.batches:
                st = _ops.grad_guard_reduce(ts, self.scales[dev], self.norm_type)
                parts.append(st)
                firsts.append(_first_bad_of_call(st[3], idx, dev))
            stats = _combine(parts, firsts, self.inf_norm, self.main)
        if process_group is not None:
            stats = _all_reduce(stats, self.inf_norm, process_group)
        return stats

    def apply(self, stats: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Pass 2 with the combined stats; the total norm on the main device."""
        if not self.batches:
            return _norm_from_stats(stats, self.inf_norm)
        total = None
        stats_on: Dict[torch.device, torch.Tensor] = {}
        for dev, ts, _ in self.batches:
            if dev not in stats_on:
                stats_on[dev] = _to(stats, dev)
            tn = _ops.grad_guard_apply_(
                ts, self.scales[dev], stats_on[dev], self.found_inf[dev], max_norm, self.norm_type
            )
            if total is None:
                total = tn
        for g, c in self.writeback:
            g.copy_(c)
        return total if total.device == self.main else total.to(self.main)

    def wrap(self, total: torch.Tensor) -> torch.Tensor:
        return total
