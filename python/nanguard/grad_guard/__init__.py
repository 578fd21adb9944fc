"""Fused gradient guard: unscale, NaN/Inf check, global norm and clip in two
memory passes, with no host sync. The Python face of
``torch.ops.nanguard.grad_guard_reduce`` / ``grad_guard_apply_`` /
``fused_unscale_clip_``.

``clip_grad_norm_`` is a drop-in for :func:`torch.nn.utils.clip_grad_norm_`
that never writes NaN into gradients: when the total norm is not finite the
gradients are left untouched (and ``error_if_nonfinite=True`` raises, as
PyTorch does). ``guard_`` is the general form used by
:class:`nanguard.amp.GradScaler`: it also unscales and reports NaN / Inf
counts and the first offending tensor.

Lists are grouped by (device, dtype), one op call per group (and per
``MAX_LIST`` tensors); the per-call statistics are combined on the device
(and across ranks with ``process_group=``) between the two passes.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .. import _checks
from .. import distributed as _dist

__all__ = ["clip_grad_norm_", "guard_", "GuardStats", "MAX_LIST", "STATS_LAYOUT"]

_ops = torch.ops.nanguard

#: Tensors per op call. The C layer takes lists of any length; this bound
#: only caps the host-side tables of one call.
MAX_LIST = 1024

#: Meaning of the four float64 entries of a stats tensor.
STATS_LAYOUT = ("norm_acc", "nan_count", "inf_count", "first_bad")

_TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]


# ---- fake kernels (torch.compile / opcheck) ------------------------------------


def _norm_dtype(grads) -> torch.dtype:
    return torch.float64 if len(grads) and grads[0].dtype == torch.float64 else torch.float32


@torch.library.register_fake("nanguard::grad_guard_reduce")
def _fake_reduce(grads, inv_scale, norm_type):
    _checks.fake_same_device("nanguard::grad_guard_reduce", "inv_scale", inv_scale, ("grads", grads))
    return inv_scale.new_empty((4,), dtype=torch.float64)


@torch.library.register_fake("nanguard::grad_guard_apply_")
def _fake_apply(grads, inv_scale, stats, found_inf, max_norm, norm_type):
    _checks.fake_same_device("nanguard::grad_guard_apply_", "inv_scale", inv_scale, ("grads", grads),
                             ("stats", stats), ("found_inf", found_inf))
    return inv_scale.new_empty((), dtype=_norm_dtype(grads))


@torch.library.register_fake("nanguard::fused_unscale_clip_")
def _fake_fused(grads, inv_scale, found_inf, max_norm, norm_type):
    _checks.fake_same_device("nanguard::fused_unscale_clip_", "inv_scale", inv_scale, ("grads", grads),
                             ("found_inf", found_inf))
    return (
        inv_scale.new_empty((), dtype=_norm_dtype(grads)),
        inv_scale.new_empty((4,), dtype=torch.float64),
    )


# grads and found_inf are written in place: version counters and the leaf check
_checks.register_inplace("nanguard::grad_guard_apply_")
_checks.register_inplace("nanguard::fused_unscale_clip_")


# ---- helpers ----------------------------------------------------------------------


class GuardStats:
    """Statistics of one guarded step, kept on the device until read.

    ``tensor`` is float64 [4]: sum of squares (norm 2) or max |g| (norm inf) of
    the unscaled gradients, NaN count, Inf count, index of the first gradient
    holding a NaN/Inf (-1 when none; with ``process_group`` it is this rank's
    index). Reading a property copies to the host (a sync on CUDA).
    """

    def __init__(self, tensor: torch.Tensor, total_norm: torch.Tensor, norm_type: float):
        self.tensor = tensor
        self.total_norm = total_norm
        self.norm_type = norm_type

    def _host(self) -> List[float]:
        return self.tensor.tolist()

    @property
    def nan_count(self) -> int:
        return int(self._host()[1])

    @property
    def inf_count(self) -> int:
        return int(self._host()[2])

    @property
    def first_bad(self) -> int:
        return int(self._host()[3])

    @property
    def finite(self) -> bool:
        return bool(torch.isfinite(self.total_norm).item())

    def as_dict(self) -> Dict[str, float]:
        h = self._host()
        return {
            "total_norm": float(self.total_norm.item()),
            "nan_count": int(h[1]),
            "inf_count": int(h[2]),
            "first_bad": int(h[3]),
        }

    def __repr__(self) -> str:
        return f"GuardStats({self.as_dict()})"


def _norm_type(norm_type) -> float:
    # What torch.nn.utils.clip_grad_norm_ takes: anything float() reads, so
    # also the strings "inf", "2", "-inf" and 0-d tensors.
    if isinstance(norm_type, str) or (isinstance(norm_type, torch.Tensor) and norm_type.dim() == 0):
        try:
            return float(norm_type)
        except (ValueError, RuntimeError):
            raise TypeError(f"norm_type must be a float (or a string of one, such as 'inf'), "
                            f"got {norm_type!r}") from None
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a float, got {type(norm_type).__name__}")
    return float(norm_type)


def _max_norm(max_norm) -> float:
    if isinstance(max_norm, torch.Tensor):
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a float, got {type(max_norm).__name__}")
    max_norm = float(max_norm)
    if not (max_norm >= 0.0):
        raise ValueError(
            f"max_norm must be >= 0 (inf for no clipping), got {max_norm}: nanguard refuses a "
            "negative max_norm, which torch.nn.utils.clip_grad_norm_ would turn into a negative "
            "clip coefficient that flips the sign of every gradient"
        )
    return max_norm


def _grads_of(parameters: _TensorOrTensors) -> List[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


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


# ---- the guard ------------------------------------------------------------------------


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


def _make_plan(grads, inv_scale, norm_type, found_inf, process_group):
    """The plan of one guarded step: DTensor gradients (FSDP2, HSDP, tensor
    parallel) are guarded through their local shards, reduced over their
    meshes (nanguard.grad_guard._dtensor)."""
    if _dist.any_dtensor(grads):
        from ._dtensor import DTensorPlan

        return DTensorPlan(grads, inv_scale, norm_type, found_inf, process_group)
    return _Plan(grads, inv_scale, norm_type, found_inf)


@torch.no_grad()
def guard_(
    grads: Sequence[torch.Tensor],
    inv_scale: Union[torch.Tensor, float] = 1.0,
    max_norm: float = math.inf,
    norm_type: float = 2.0,
    *,
    found_inf: Optional[Dict[torch.device, torch.Tensor]] = None,
    process_group=None,
) -> Tuple[torch.Tensor, GuardStats, Dict[torch.device, torch.Tensor]]:
    """Unscale, check and clip ``grads`` in place, in two passes.

    When every value is finite, each gradient becomes
    ``g * inv_scale * min(1, max_norm / (total_norm + 1e-6))`` where
    ``total_norm`` is the norm of the unscaled gradients (over every device,
    dtype and, with ``process_group``, every rank). When any value or the
    norm is not finite, nothing is written and ``found_inf[device]`` is set
    to 1 on every device involved.

    Args:
        grads: gradient tensors (any mix of devices and float dtypes).
        inv_scale: 1 / loss scale, a float or a one-element float32 tensor.
        max_norm: clipping threshold; ``inf`` unscales and checks only.
        norm_type: 2.0 or ``inf``.
        found_inf: per-device float32 flags to set (created when None).
        process_group: all-reduce the norm and the NaN/Inf counts over this
            group between the passes (sharded gradients: FSDP, DTensor...).
            Every rank of the group must call, even one without gradients.

    Returns:
        ``(total_norm, stats, found_inf)``: the 0-dim norm (float32, float64
        for float64 gradients) on the first gradient's device, a
        :class:`GuardStats`, and the per-device flags. No host sync.
    """
    norm_type = _norm_type(norm_type)
    max_norm = _max_norm(max_norm)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf for the fused guard, got {norm_type}")
    plan = _make_plan(list(grads), inv_scale, norm_type, found_inf, process_group)
    stats = plan.reduce(process_group)
    total = plan.apply(stats, max_norm)
    return plan.wrap(total), GuardStats(stats, total, norm_type), plan.found_inf


def _torch_norm_guarded(grads, max_norm, norm_type, error_if_nonfinite, foreach):
    """Norms other than 2 and inf: PyTorch's norm, nanguard's no-poison rule."""
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    clip = torch.where(torch.isfinite(total), clip, torch.ones_like(clip))
    for g in grads:
        g.mul_(clip.to(g.device))
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    process_group=None,
) -> torch.Tensor:
    """Clip the gradient norm of an iterable of parameters, in place.

    Same arguments and return value as :func:`torch.nn.utils.clip_grad_norm_`
    (``foreach`` is accepted and ignored for norms 2 and inf, which use
    nanguard's fused two-pass kernels), except that a non-finite total norm
    never writes NaN or zeros into the gradients: they are left untouched.
    The total norm is float32 (float64 when the gradients are float64),
    accumulated in float64, so float16 gradients whose norm exceeds 65504 get
    a finite norm. With ``process_group`` the norm is the norm over every
    rank's gradients (for sharded gradients).

    Returns:
        Total norm of the gradients (viewed as a single vector).
    """
    grads = _grads_of(parameters)
    max_norm = _max_norm(max_norm)
    norm_type = _norm_type(norm_type)
    if not grads and process_group is None:
        return torch.tensor(0.0)
    if norm_type not in (2.0, math.inf):
        if process_group is not None:
            raise ValueError("process_group= needs norm_type 2.0 or inf")
        return _torch_norm_guarded(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    plan = _make_plan(grads, 1.0, norm_type, None, process_group)
    stats = plan.reduce(process_group)
    if error_if_nonfinite:
        # Checked before anything is written, as PyTorch does (one host sync).
        acc, nan, inf = stats[:3].tolist()
        if nan or inf or not math.isfinite(acc):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
    return plan.wrap(plan.apply(stats, max_norm))
