"""The recorded step and what running it gives: :class:`Step` (the
model, inputs, RNG, autocast and loss scale of a flight record, ready to
run again under any variant), :class:`StepOutcome` (one run) and
:class:`ReplayResult` (what ``replay`` found). Shared by ``_replay`` and
``_triage``, which both import it."""

from __future__ import annotations

import copy
import dataclasses
import json
from contextlib import nullcontext
from typing import Any, Callable, List, Optional

import torch
from torch.utils._pytree import tree_map

from ._flight_record import FlightRecord, output_loss, restore_rng
from ._opcheck import FirstNonFinite, OpChecker

LossFn = Callable[[Any, dict], torch.Tensor]


@dataclasses.dataclass
class StepOutcome:
    """One run of the recorded step (the replay itself, or a variant)."""

    finite: bool  # the loss and every gradient are finite
    loss: Optional[float]
    first: Optional[FirstNonFinite]  # None when finite or not checked
    error: Optional[str] = None  # the run raised: what it said
    setting: Optional[str] = None  # what a variant with a parameter ran with ("loss scale 512 ...")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["first"] = None if self.first is None else dataclasses.asdict(self.first)
        return d


@dataclasses.dataclass
class ReplayResult:
    """What :func:`replay` found. ``first_op``, ``node``, ``module``,
    ``pass_`` and ``inputs`` describe the first op that made a non-finite
    value from finite inputs (None when the replay stayed finite);
    ``triage`` maps each variant's name to its :class:`StepOutcome`;
    ``verdict`` says what a person can act on, and never more than the runs
    showed."""

    path: str
    step: int
    reproduced: bool
    recorded_nonfinite: bool
    outcome: StepOutcome
    first_op: Optional[str]
    node: Optional[str]
    module: Optional[str]
    pass_: Optional[str]
    inputs: List[dict]
    batch: List[str]
    triage: Optional[dict]
    verdict: str
    notes: List[str]

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["outcome"] = self.outcome.to_dict()
        if self.triage is not None:
            d["triage"] = {k: v.to_dict() for k, v in self.triage.items()}
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        lines = [f"nanguard replay of step {self.step} ({self.path})"]
        state = "non-finite" if not self.outcome.finite else "finite"
        lines.append(f"  replayed step: {state}" + (f", loss {self.outcome.loss:.6g}"
                                                      if self.outcome.loss is not None else ""))
        if self.outcome.first is not None:
            lines.append(f"  first non-finite: {self.outcome.first.where()}")
            for i, s in enumerate(self.inputs):
                lines.append(f"    input {i}: {s}")
        for b in self.batch:
            lines.append(f"  batch: {b}")
        if self.triage:
            lines.append("  triage:")
            for name, o in self.triage.items():
                what = "finite" if o.finite else ("error: " + o.error if o.error else "non-finite")
                if not o.finite and o.first is not None:
                    what += f" (first {o.first.where()})"
                lines.append(f"    {name:<22s} {what}")
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def default_loss(output, inputs: dict) -> torch.Tensor:
    """The output's ``.loss`` (or ``["loss"]``), as Hugging Face models return it."""
    loss = output_loss(output)
    if loss is None:
        raise ValueError("loss_fn: the model's output has no .loss; pass loss_fn=(output, inputs) -> loss")
    return loss


class Step:
    """The recorded step, ready to run again under any variant."""

    def __init__(self, rec: FlightRecord, model: torch.nn.Module, loss_fn: Optional[LossFn]):
        self.rec = rec
        self.model = model
        self.loss_fn = loss_fn or default_loss
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def inputs(self, dtype: Optional[torch.dtype] = None):
        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            x = x.to(self.device)
            return x.to(dtype) if dtype is not None and x.is_floating_point() else x

        return tree_map(move, tuple(self.rec.args)), tree_map(move, dict(self.rec.kwargs))

    def run(self, *, model: Optional[torch.nn.Module] = None, autocast: Any = "recorded",
            loss_scale: Any = "recorded", input_dtype: Optional[torch.dtype] = None,
            check: bool = True, strict: bool = False) -> StepOutcome:
        """Run forward and backward once. ``autocast``: "recorded", None (off)
        or a dtype; ``loss_scale``: "recorded", None or a number. An error
        raised by the step is kept in the outcome, or raised when ``strict``."""
        model = model if model is not None else copy.deepcopy(self.model)
        ac = self.rec.autocast
        if autocast == "recorded":
            ctx = torch.autocast(ac["device_type"], dtype=getattr(torch, ac["dtype"])) if ac else nullcontext()
        elif autocast is None:
            ctx = nullcontext()
        else:
            ctx = torch.autocast(self.device.type, dtype=autocast)
        scale = self.rec.loss_scale if loss_scale == "recorded" else loss_scale
        restore_rng(self.rec.rng)
        args, kwargs = self.inputs(input_dtype)
        checker = OpChecker(model) if check else None
        try:
            with checker if checker is not None else nullcontext():
                with ctx:
                    out = model(*args, **kwargs)
                    loss = self.loss_fn(out, {"args": args, **kwargs})
                if checker is not None:
                    checker.forward_done()
                    checker.watch_backward(loss)
                scaled = loss.float() * scale if scale is not None else loss
                scaled.backward()
        except Exception as e:  # a variant that cannot run says why, the others go on
            if strict:
                raise
            return StepOutcome(False, None, checker.first if checker else None, f"{type(e).__name__}: {e}")
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = bool(torch.isfinite(loss.detach()).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        return StepOutcome(finite, float(loss.detach().float().item()), checker.first if checker else None)
