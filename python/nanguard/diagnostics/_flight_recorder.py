"""The flight recorder: hold what the current step needs to run again, and
write it (``_flight_record``) when the step is first found non-finite.

At the step's first module call, a pre-hook keeps that module's inputs
*by reference* (the very args and kwargs objects: no copy) and the RNG
states and autocast settings in force (autocast as the next module call
sees it, inside the entry's forward: accelerate, and so the Hugging Face
Trainer, enters it in a wrapper of the model's ``forward``, after the
pre-hooks). That module is the model itself, or
the outermost module a wrapper calls (a LightningModule's ``training_step``
calling ``self.lm(**batch)`` records ``lm`` and its inputs); it is the one
the record saves and :func:`nanguard.replay` runs (``entry`` in the
record). A healthy step costs one pre-hook call per module call, one
``torch.get_rng_state()`` (and the CUDA generator's) and the references,
dropped at :meth:`FlightRecorder.step_done`. Only the first non-finite step
is written: later ones follow from it.

Call ``step_done`` before the optimizer step (as ``watch`` does, or through
its ``optimizer=``): the parameters saved are then the ones the failing
step started from. nanguard's gradient guard never applies a non-finite
step, so with it they are those even after the optimizer step.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from ._flight_record import StepStart, current_autocast, write_record


class FlightRecorder:
    def __init__(self, model: nn.Module, directory, *, rank: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"record_dir must be a path, got {type(directory).__name__}")
        self.model, self.directory, self.rank = model, os.fspath(directory), rank
        self.path: Optional[str] = None  # the record written, once one is
        self._args = self._kwargs = self._start = self._entry = None
        self._inner = False
        self._handles = [m.register_forward_pre_hook(self._make_hook(name, m), with_kwargs=True)
                         for name, m in model.named_modules()]

    def _device(self) -> Optional[torch.device]:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else None

    def _make_hook(self, name: str, module: nn.Module):
        def on_forward(_m, args, kwargs):
            if self._start is None:  # the step's first call: later ones (accumulation) reuse it
                self._start = StepStart.capture(self._device())
                self._args, self._kwargs, self._entry = args, kwargs, (name, module)
                self._inner = True
            elif self._inner:
                # the first call inside the entry's forward: autocast entered
                # by a wrapper of that forward (accelerate's, the Trainer's)
                # is in force now, and was not at the entry's pre-hook
                self._inner = False
                if self._start.autocast is None:
                    self._start.autocast = current_autocast(self._device())
            return None

        return on_forward

    def step_done(self, *, step: int, nonfinite: bool, report: Optional[str] = None, history=None,
                  loss_scale: Optional[float] = None) -> Optional[str]:
        """End of a step: write its record when it is the first non-finite
        one (returns the path), then drop the references."""
        path = None
        try:
            if nonfinite and self.path is None and self._start is not None:
                name, module = self._entry
                path = self.path = write_record(
                    self.directory, model=module, args=self._args, kwargs=self._kwargs or {},
                    start=self._start, step=step, rank=self.rank, loss_scale=loss_scale, report=report,
                    history=history, entry=name)
        finally:
            self._args = self._kwargs = self._start = self._entry = None
        return path

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._args = self._kwargs = self._start = self._entry = None
