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
from ._dtensor import DTensorPlan
from . import _verdicts
from ._plan import MAX_LIST, _Plan

__all__ = ["clip_grad_norm_", "guard_", "GuardStats", "MAX_LIST", "STATS_LAYOUT"]

_ops = torch.ops.nanguard

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


def _make_plan(grads, inv_scale, norm_type, found_inf, process_group):
    """The plan of one guarded step: DTensor gradients (FSDP2, HSDP, tensor
    parallel) are guarded through their local shards, reduced over their
    meshes (nanguard.grad_guard._dtensor)."""
    if _dist.any_dtensor(grads):
        return DTensorPlan(grads, inv_scale, norm_type, found_inf, process_group)
    return _Plan(grads, inv_scale, norm_type, found_inf)


def _reduce(plan, grads: List[torch.Tensor], process_group) -> torch.Tensor:
    """Pass 1 of a guarded step; a plain-tensor plan's stats are published for
    sentinel watching (``_verdicts``: references, no sync)."""
    stats = plan.reduce(process_group)
    if type(plan) is _Plan:
        _verdicts.publish(grads, stats)
    return stats


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
    grads = list(grads)
    plan = _make_plan(grads, inv_scale, norm_type, found_inf, process_group)
    stats = _reduce(plan, grads, process_group)
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
    stats = _reduce(plan, grads, process_group)
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
