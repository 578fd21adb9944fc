"""The flight recorder: hold what the current step needs to run again, and
write it (``_record``) when the step is first found non-finite.

At the step's first forward of the root module a pre-hook keeps the
inputs *by reference* (the very args and kwargs objects: no copy) and the
RNG states and autocast settings in force. A healthy step costs that hook,
one ``torch.get_rng_state()`` (and the CUDA generator's) and the references,
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

from ._record import StepStart, write_record


class FlightRecorder:
    def __init__(self, model: nn.Module, directory, *, rank: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"record_dir must be a path, got {type(directory).__name__}")
        self.model, self.directory, self.rank = model, os.fspath(directory), rank
        self.path: Optional[str] = None  # the record written, once one is
        self._args = self._kwargs = self._start = None
        self._handle = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _device(self) -> Optional[torch.device]:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else None

    def _on_forward(self, module, args, kwargs):
        if self._start is None:  # the step's first forward: later calls (gradient accumulation) reuse it
            self._start = StepStart.capture(self._device())
            self._args, self._kwargs = args, kwargs
        return None

    def step_done(self, *, step: int, nonfinite: bool, report: Optional[str] = None, history=None,
                  loss_scale: Optional[float] = None) -> Optional[str]:
        """End of a step: write its record when it is the first non-finite
        one (returns the path), then drop the references."""
        path = None
        try:
            if nonfinite and self.path is None and self._start is not None:
                path = self.path = write_record(
                    self.directory, model=self.model, args=self._args, kwargs=self._kwargs or {},
                    start=self._start, step=step, rank=self.rank, loss_scale=loss_scale, report=report,
                    history=history)
        finally:
            self._args = self._kwargs = self._start = None
        return path

    def remove(self) -> None:
        self._handle.remove()
        self._args = self._kwargs = self._start = None
