"""The flight recorder: hold what the current step needs to run again, and
write it (``_flight_record``) when the step is first found non-finite.

At each forward of the step's entry module (one per micro-batch under
gradient accumulation), a pre-hook keeps that module's inputs *by
reference* (the very args and kwargs objects: no copy) and the RNG states,
grad mode and autocast settings in force (autocast as the next module call
sees it, inside the entry's forward: accelerate, and so the Hugging Face
Trainer, enters it in a wrapper of the model's ``forward``, after the
pre-hooks), and a forward hook on the entry keeps the output's ``.loss``
(a Hugging Face model's) as a detached scalar. The entry is the module of
the step's first call: the model itself, or the outermost module a wrapper
calls (a LightningModule's ``training_step`` calling ``self.lm(**batch)``
records ``lm`` and its inputs); it is the one the record saves and
:func:`nanguard.replay` runs (``entry`` in the record). A healthy step costs
one pre-hook call per module call, one ``torch.get_rng_state()`` (and the
CUDA generator's) per micro-batch and the references, dropped at
:meth:`FlightRecorder.step_done`. Only the first non-finite step is written:
later ones follow from it.

Call ``step_done`` before the optimizer step (as ``watch`` does, or through
its ``optimizer=``): the parameters saved are then the ones the failing
step started from. nanguard's gradient guard never applies a non-finite
step, so with it they are those even after the optimizer step.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, List, Optional

import torch
from torch import nn

from ._flight_record import StepStart, current_autocast, output_loss, write_record

#: micro-batches held without a step_done: beyond this the oldest are dropped
#: (a loop that never ends its steps must not hold every batch it ever ran)
MAX_MICRO_BATCHES = 64


@dataclasses.dataclass
class MicroBatch:
    """One forward of the entry module in the current step, by reference."""

    name: str  # the entry's qualified name in the recorded model ("": the model)
    module: nn.Module
    args: tuple
    kwargs: dict
    start: StepStart
    grad: bool  # grad mode at the forward
    loss: Optional[torch.Tensor] = None  # the output's .loss, detached, once the forward returned


class FlightRecorder:
    """``directory`` None holds the step's micro-batches (for an in-process
    replay) and never writes a record."""

    def __init__(self, model: nn.Module, directory, *, rank: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"record_dir must be a path, got {type(directory).__name__}")
        self.model, self.rank = model, rank
        self.directory = None if directory is None else os.fspath(directory)
        self.path: Optional[str] = None  # the record written, once one is
        self.batches: List[MicroBatch] = []  # the step's micro-batches, in order
        self.paused = False  # an in-process replay runs: record nothing
        self._current: Optional[MicroBatch] = None  # the entry's forward in flight
        self._inner = False
        self._warned = False
        self._post: Optional[Any] = None  # the entry's forward hook's handle
        self._entry: Optional[nn.Module] = None  # the module whose forwards are the micro-batches
        self._wrapped = False  # a wrapper of the entry's forward enters autocast
        # a pre-hook on every module until the first forward names the entry;
        # then on the entry and its children only (the first call inside the
        # entry's forward is one of them), so that a step's other module calls
        # run no hook of the recorder
        self._hooked = {id(m): m.register_forward_pre_hook(self._make_hook(name, m), with_kwargs=True)
                        for name, m in model.named_modules()}

    def device(self) -> Optional[torch.device]:
        """The device of the recorded model (its first parameter's), or None."""
        p = next(self.model.parameters(), None)
        return p.device if p is not None else None

    def _make_hook(self, name: str, module: nn.Module):
        def on_forward(_m, args, kwargs):
            if self.paused:
                return None
            if self._current is None and (self._entry is None or module is self._entry):
                # a forward of the entry (the first call of the first step names it)
                self._begin(name, module, args, kwargs)
            elif self._inner:
                # the first call inside the entry's forward: autocast entered
                # by a wrapper of that forward (accelerate's, the Trainer's)
                # is in force now, and was not at the entry's pre-hook
                self._inner = False
                if self._current is not None:
                    inside = current_autocast(self.device())
                    if inside != self._current.start.autocast:
                        self._current.start.autocast = inside
                        self._wrapped = True  # a wrapper enters autocast at every call: keep looking
                    elif not self._wrapped:
                        self._unhook(keep={id(self._entry)})  # nothing between the entry and its children
            return None

        return on_forward

    def _unhook(self, keep: set) -> None:
        """Remove the pre-hooks of every module whose id is not in ``keep``."""
        for key in [k for k in self._hooked if k not in keep]:
            self._hooked.pop(key).remove()

    def _begin(self, name: str, module: nn.Module, args, kwargs) -> None:
        if len(self.batches) >= MAX_MICRO_BATCHES:
            if not self._warned:
                self._warned = True
                warnings.warn(f"nanguard: {MAX_MICRO_BATCHES} forwards held without a step end; the "
                              "oldest are dropped: call w.step() once per training step", RuntimeWarning,
                              stacklevel=4)
            del self.batches[0]
        mb = MicroBatch(name, module, args, kwargs or {}, StepStart.capture(self.device()),
                        torch.is_grad_enabled())
        self.batches.append(mb)
        self._current = mb
        self._inner = True
        if self._entry is None:
            self._entry = module
            self._post = module.register_forward_hook(self._on_output)
            self._unhook(keep={id(module)} | {id(c) for c in module.children()})

    def _on_output(self, module, _args, output) -> None:
        mb = self._current
        if mb is None or mb.module is not module or self.paused:
            return None
        self._current = None
        self._inner = False
        loss = output_loss(output)
        if loss is not None and loss.is_floating_point():
            mb.loss = loss.detach()
        return None

    def write(self, *, step: int, micro_batch: int = 0, report: Optional[str] = None, history=None,
              loss_scale: Optional[float] = None) -> Optional[str]:
        """Write micro-batch ``micro_batch`` of the step as its record, when
        no record was written yet and there is a directory; the path."""
        if self.path is not None or self.directory is None or not self.batches:
            return None
        k = min(micro_batch, len(self.batches) - 1)
        mb = self.batches[k]
        self.path = write_record(
            self.directory, model=mb.module, args=mb.args, kwargs=mb.kwargs, start=mb.start, step=step,
            rank=self.rank, loss_scale=loss_scale, report=report, history=history, entry=mb.name,
            micro_batch=k)
        return self.path

    def step_done(self, *, step: int, nonfinite: bool, report: Optional[str] = None, history=None,
                  loss_scale: Optional[float] = None) -> Optional[str]:
        """End of a step: write its record (its first micro-batch) when it is
        the first non-finite one (returns the path), then drop the
        references."""
        try:
            if nonfinite:
                return self.write(step=step, report=report, history=history, loss_scale=loss_scale)
            return None
        finally:
            self.drop()

    def drop(self) -> None:
        self.batches = []
        self._current = None
        self._inner = False

    def remove(self) -> None:
        self._unhook(keep=set())
        if self._post is not None:
            self._post.remove()
            self._post = None
        self.drop()
