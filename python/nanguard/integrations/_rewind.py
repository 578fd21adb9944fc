"""The callbacks' ``rewind=`` option: :class:`nanguard.Rewind` driven by a
framework's hooks instead of :meth:`~nanguard.Rewind.loop`.

A framework iterates its own data, so a rewound run cannot train on the
window's batches again: after a rewind it goes on from the snapshot's
weights with the framework's next batches, and the window's batches are left
behind (listed as ``"window"`` in ``rewind.skipped_batches`` and its JSON
log). The framework's step counter keeps counting batches; the snapshot's
optimizer, scheduler and scaler states (their step counts included) are
restored, so the learning-rate schedule follows the weights.

The data-versus-state test runs each batch of the trigger again from the
snapshot, forward and backward (no loss scaling, no optimizer step), and
judges its loss and gradient norm by the trigger's rule.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from ..rewind import Rewind

__all__ = ["rewind_kwargs", "make_rewind", "grad_norm_probe", "StepInputs"]

#: the nanguard.Rewind arguments a callback passes on (the objects it trains
#: come from the framework; skip_batches needs a loop that can skip)
KEYS = ("every", "keep", "directory", "patience", "loss_spike", "grad_spike", "window", "min_history",
        "action", "lr_factor", "max_rewinds", "log_path")


def rewind_kwargs(rewind) -> Optional[dict]:
    """The callbacks' ``rewind=`` (False/None: off; True: the defaults; a
    dict: :class:`nanguard.Rewind` arguments) as keyword arguments, checked
    now so that a bad one fails when the callback is built."""
    if rewind is None or rewind is False:
        return None
    if rewind is True:
        kw = {}
    elif isinstance(rewind, dict):
        bad = sorted(set(rewind) - set(KEYS))
        if bad:
            raise ValueError(f"rewind: unknown nanguard.Rewind argument(s) {bad}; a callback takes "
                             f"{', '.join(KEYS)}")
        kw = dict(rewind)
    else:
        raise TypeError(f"rewind must be a bool or a dict of nanguard.Rewind arguments, got {type(rewind).__name__}")
    # the same checks Rewind makes, on a throwaway model and optimizer
    probe = torch.nn.Linear(1, 1)
    Rewind(probe, torch.optim.SGD(probe.parameters(), lr=0.0), **{k: v for k, v in kw.items()
                                                                  if k not in ("directory", "log_path")})
    return kw


def _unwrap_scheduler(scheduler):
    """accelerate's ``AcceleratedScheduler`` holds the torch scheduler."""
    if scheduler is not None and not hasattr(scheduler, "base_lrs"):
        scheduler = getattr(scheduler, "scheduler", None)
    return scheduler if scheduler is not None and hasattr(scheduler, "base_lrs") else None


def make_rewind(kwargs: dict, model, optimizer, scaler, scheduler, probe) -> Rewind:
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    return Rewind(model, optimizer, scaler=scaler, scheduler=_unwrap_scheduler(scheduler), probe=probe, **kwargs)


def grad_norm_probe(params: List[torch.Tensor], run: Callable[[object], Optional[torch.Tensor]], guard=None):
    """A ``probe`` for :class:`nanguard.Rewind`: ``run(batch)`` computes the
    batch's forward and backward and returns its loss (None when it cannot);
    the probe returns (loss, gradient norm) and leaves no gradient behind.
    The ``guard``'s watcher, if any, is paused meanwhile."""

    def probe(batch):
        for p in params:
            p.grad = None
        watcher = guard.watcher if guard is not None else None
        try:
            with torch.enable_grad(), (watcher.paused() if watcher is not None else contextlib.nullcontext()):
                loss = run(batch)
            if loss is None:
                return None
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            return loss.detach(), norm
        finally:
            for p in params:
                p.grad = None

    return probe


class StepInputs:
    """The inputs and output losses of a model's forward calls during one
    optimizer step, held by reference (a Trainer gives its callbacks
    neither): ``batch`` is the step's list of ``(args, kwargs)``, one per
    micro-batch, and :meth:`run` their forward and backward again."""

    def __init__(self, model: torch.nn.Module):
        from ..diagnostics._flight_record import output_loss

        self._output_loss = output_loss
        self.model = model
        self.batch: list = []
        self.losses: list = []
        self.capturing = False
        self._hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       model.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        if self.capturing and torch.is_grad_enabled():
            self.batch.append((args, kwargs))

    def _post(self, module, args, output):
        if self.capturing and torch.is_grad_enabled():
            loss = self._output_loss(output)
            if loss is not None:
                self.losses.append(loss.detach())

    def begin(self) -> list:
        """A new step: a fresh batch list (the one the policy holds)."""
        self.batch, self.losses, self.capturing = [], [], True
        return self.batch

    def loss(self) -> Optional[torch.Tensor]:
        """The step's loss: the mean of its micro-batches' output losses."""
        self.capturing = False
        if not self.losses or len(self.losses) != len(self.batch):
            return None
        return torch.stack([x.float() for x in self.losses]).mean()

    def run(self, batch) -> Optional[torch.Tensor]:
        """Forward and backward of every micro-batch of ``batch``; their mean loss."""
        was, self.capturing = self.capturing, False
        try:
            total = None
            for args, kwargs in batch:
                loss = self._output_loss(self.model(*args, **kwargs))
                if loss is None:
                    return None
                (loss / len(batch)).backward()
                total = loss.detach().float() if total is None else total + loss.detach().float()
            return None if total is None else total / len(batch)
        finally:
            self.capturing = was

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
