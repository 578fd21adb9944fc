"""``nanguard.amp.GradScaler``: :class:`torch.amp.GradScaler` plus a fused
``unscale_and_clip_`` (nanguard's two-pass gradient guard), a ``min_scale``
floor and a record of skipped steps and their causes.

The usual loop stays the usual loop::

    scaler = nanguard.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.unscale_and_clip_(optimizer, max_norm=1.0)
    scaler.step(optimizer)      # skipped when a gradient was NaN / Inf
    scaler.update()

``unscale_and_clip_`` records the optimizer's state exactly as ``unscale_``
does (stage ``UNSCALED`` and one ``found_inf`` flag per device), so ``step``
skips the step on non-finite gradients and never unscales twice, and
``update`` backs the scale off as usual.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Dict, List, Optional

import torch
from torch.amp.grad_scaler import OptState

from . import grad_guard as _gg

__all__ = ["GradScaler", "SkippedStep"]


@dataclasses.dataclass
class SkippedStep:
    """One optimizer step that was skipped because of non-finite gradients."""

    step: int  #: number of update() calls before this one
    nan_count: int
    inf_count: int
    #: index (in the optimizer's parameters that had gradients, in
    #: param_group order) of the first gradient holding a NaN/Inf; -1 when
    #: only the norm overflowed or another rank held the value
    first_bad: int
    scale: float  #: loss scale in use when the step was skipped

    @property
    def cause(self) -> str:
        if self.nan_count:
            return "nan"
        if self.inf_count:
            return "inf"
        return "norm overflow"


class GradScaler(torch.amp.GradScaler):
    """:class:`torch.amp.GradScaler` with nanguard's fused unscale + clip.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval,
        enabled: as :class:`torch.amp.GradScaler`.
        min_scale: floor for the loss scale. After ``update()`` the scale is
            never below it; a warning says when the floor is hit (this reads
            the scale on the host once per ``update()``, after ``step()`` has
            already synchronised). ``None`` (default) keeps PyTorch's
            behaviour.
        history: how many :class:`SkippedStep` records to keep.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: Optional[float] = None,
        history: int = 1000,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        if min_scale is not None:
            min_scale = float(min_scale)
            if not (min_scale > 0.0) or math.isinf(min_scale):
                raise ValueError(f"min_scale must be a finite number > 0, got {min_scale}")
            if min_scale > init_scale:
                raise ValueError(f"min_scale ({min_scale}) is above init_scale ({init_scale})")
        self._min_scale = min_scale
        self._history_len = int(history)
        self._pending: List[_gg.GuardStats] = []  # this iteration's guard stats
        self._pending_scale: Optional[torch.Tensor] = None
        self._skipped: List[SkippedStep] = []
        self._updates = 0
        self._nan_steps = 0
        self._inf_steps = 0
        self._overflow_steps = 0
        self._floor_hits = 0

    # ---- the fused unscale + clip ----------------------------------------------

    def unscale_and_clip_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float = math.inf,
        norm_type: float = 2.0,
        *,
        process_group=None,
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip their global norm, in
        two passes over the gradients and with no host sync.

        Equivalent to ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``, except
        that when any gradient is NaN/Inf (or the norm overflows) the
        gradients are left untouched and the step will be skipped by
        ``step()``. ``max_norm=inf`` unscales and checks only.

        Returns the total norm of the unscaled gradients (0-dim tensor on the
        first gradient's device; NaN/Inf when the step will be skipped).
        """
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not self._enabled:
            return _gg.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]],
                max_norm,
                norm_type,
                process_group=process_group,
            )
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        for i, g in enumerate(grads):
            if g.is_sparse:
                raise TypeError(
                    f"gradient {i} is sparse: use unscale_() and torch.nn.utils.clip_grad_norm_"
                )
        inv_scale = self._scale.double().reciprocal().float()
        # one float32 flag per device holding gradients, as unscale_ makes them
        # (none without gradients: step() then raises as PyTorch's does)
        found_inf: Dict[torch.device, torch.Tensor] = {}
        total, stats, found_inf = _gg.guard_(
            grads, inv_scale, max_norm, norm_type, found_inf=found_inf, process_group=process_group
        )
        state["found_inf_per_device"] = found_inf
        state["stage"] = OptState.UNSCALED
        self._pending.append(stats)
        self._pending_scale = self._scale.detach().clone()
        return total

    # ---- update: floor and records ------------------------------------------------

    def update(self, new_scale=None) -> None:
        if not self._enabled:
            return
        pending, self._pending = self._pending, []
        scale_used = self._pending_scale
        super().update(new_scale)
        self._record(pending, scale_used)
        self._updates += 1
        if self._min_scale is not None and self._scale is not None:
            # one host read; step() has already synchronised the stream
            if float(self._scale.item()) < self._min_scale:
                self._floor_hits += 1
                warnings.warn(
                    f"nanguard.amp.GradScaler: loss scale fell below min_scale={self._min_scale} "
                    f"at update {self._updates}; held at the floor. Gradients keep overflowing "
                    "at this scale: look for the layer producing them (nanguard.watch).",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._scale.fill_(self._min_scale)

    def _record(self, pending: List[_gg.GuardStats], scale_used) -> None:
        if not pending:
            return
        hs = [p.tensor.tolist() for p in pending]
        norms = [p.total_norm.item() for p in pending]
        nan = sum(int(h[1]) for h in hs)
        inf = sum(int(h[2]) for h in hs)
        finite = all(math.isfinite(n) for n in norms)
        if nan == 0 and inf == 0 and finite:
            return
        first = next((int(h[3]) for h in hs if h[3] >= 0), -1)
        scale = float(scale_used.item()) if scale_used is not None else float("nan")
        self._nan_steps += 1 if nan else 0
        self._inf_steps += 1 if (inf and not nan) else 0
        self._overflow_steps += 1 if not (nan or inf) else 0
        self._skipped.append(SkippedStep(self._updates, nan, inf, first, scale))
        del self._skipped[: max(0, len(self._skipped) - self._history_len)]

    # ---- what happened -----------------------------------------------------------

    @property
    def skipped_steps(self) -> List[SkippedStep]:
        """Steps skipped because of non-finite gradients (guarded by
        ``unscale_and_clip_``), oldest first, at most ``history`` of them."""
        return list(self._skipped)

    def skip_summary(self) -> Dict[str, int]:
        """Counts since construction: updates, skipped steps by cause, floor hits."""
        return {
            "updates": self._updates,
            "skipped": self._nan_steps + self._inf_steps + self._overflow_steps,
            "nan": self._nan_steps,
            "inf": self._inf_steps,
            "norm_overflow": self._overflow_steps,
            "min_scale_hits": self._floor_hits,
        }

    @property
    def min_scale(self) -> Optional[float]:
        return self._min_scale
