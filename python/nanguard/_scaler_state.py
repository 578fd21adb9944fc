"""The one place nanguard reaches into :class:`torch.amp.GradScaler`'s
private per-optimizer state.

``GradScaler.unscale_`` keeps, per optimizer (``_per_optimizer_states[id(opt)]``),
a stage (``OptState.READY`` / ``UNSCALED`` / ``STEPPED``) and one float32
``found_inf`` flag per device; ``step`` reads the flags (in
``_maybe_opt_step``) to skip the optimizer step, ``update`` backs the scale
off from them. nanguard's fused guard replaces ``unscale_``: it takes the
inverse scale from here and hands its flags back here, so ``step`` and
``update`` behave exactly as after ``unscale_``.

Used by :meth:`nanguard.amp.GradScaler.unscale_and_clip_` and by the
integrations' :class:`~nanguard.integrations.StepGuard`. When PyTorch changes
these internals, this module is what changes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["begin_unscale", "end_unscale", "found_inf_flags"]

FoundInf = Dict[torch.device, torch.Tensor]


def begin_unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *,
                  allow_unscaled: bool = False) -> Tuple[Optional[torch.Tensor], FoundInf, dict]:
    """Start unscaling ``optimizer``'s gradients in place of ``scaler.unscale_``.

    Returns ``(inv_scale, found_inf, state)``: the float32 one-element
    ``1 / scale`` (computed in fp64, as ``unscale_`` does), the per-device
    ``found_inf`` flags to fill, and the optimizer's state for
    :func:`end_unscale`.

    Raises as ``unscale_`` does when the scaler has no scale yet, when the
    optimizer was already stepped this iteration, or when it was already
    unscaled. With ``allow_unscaled=True`` an already unscaled optimizer (a
    framework that unscaled for its own norm computation) is not an error:
    ``inv_scale`` is then None (the gradients are unscaled) and ``found_inf``
    is the scaler's own flags, to be added to.
    """
    scaler._check_scale_growth_tracker("unscale_")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    if state["stage"] is OptState.UNSCALED:
        if not allow_unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        return None, state["found_inf_per_device"], state
    return scaler._scale.double().reciprocal().float(), {}, state


def end_unscale(state: dict, found_inf: FoundInf) -> None:
    """Record the guard's ``found_inf`` flags (one float32 tensor per device;
    none when there was no gradient, as ``unscale_`` leaves it) and mark the
    optimizer unscaled: ``scaler.step`` then skips on a flag and never
    unscales again, ``scaler.update`` backs the scale off."""
    state["found_inf_per_device"] = found_inf
    state["stage"] = OptState.UNSCALED


def found_inf_flags(state: dict) -> List[torch.Tensor]:
    """The per-device ``found_inf`` flags ``GradScaler._maybe_opt_step``
    receives in its ``optimizer_state``."""
    return list(state["found_inf_per_device"].values())
