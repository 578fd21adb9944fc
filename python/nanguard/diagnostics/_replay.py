"""``nanguard.replay``: run a recorded failing step again, op by op, and
(``triage=True``) under each item of the standard checklist.

The step is rebuilt from its flight record (``_flight_record``): the model (its
Hugging Face class and config, or the one passed in) with the recorded
parameters and buffers, the inputs, the RNG states at the step's start, the
autocast settings and the loss scale. Its forward and backward run under the
op-level checker (``_opcheck``), which names the first op that made a
non-finite value from finite inputs. Each triage variant (``_triage``) runs
the same step again from a fresh copy of the same weights, inputs and RNG.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from contextlib import nullcontext
from typing import Any, Callable, List, Optional

import torch
from torch.utils._pytree import tree_map

from . import _flight_record
from ._opcheck import FirstNonFinite, OpChecker
from ._walk import tensor_leaves

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
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        raise ValueError("loss_fn: the model's output has no .loss; pass loss_fn=(output, inputs) -> loss")
    return loss


class Step:
    """The recorded step, ready to run again under any variant."""

    def __init__(self, rec: dict, model: torch.nn.Module, loss_fn: Optional[LossFn]):
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

        return tree_map(move, tuple(self.rec["args"])), tree_map(move, dict(self.rec["kwargs"]))

    def run(self, *, model: Optional[torch.nn.Module] = None, autocast: Any = "recorded",
            loss_scale: Any = "recorded", input_dtype: Optional[torch.dtype] = None,
            check: bool = True, strict: bool = False) -> StepOutcome:
        """Run forward and backward once. ``autocast``: "recorded", None (off)
        or a dtype; ``loss_scale``: "recorded", None or a number. An error
        raised by the step is kept in the outcome, or raised when ``strict``."""
        model = model if model is not None else copy.deepcopy(self.model)
        ac = self.rec["autocast"]
        if autocast == "recorded":
            ctx = torch.autocast(ac["device_type"], dtype=getattr(torch, ac["dtype"])) if ac else nullcontext()
        elif autocast is None:
            ctx = nullcontext()
        else:
            ctx = torch.autocast(self.device.type, dtype=autocast)
        scale = self.rec["loss_scale"] if loss_scale == "recorded" else loss_scale
        _flight_record.restore_rng(self.rec["rng"])
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


def _batch_findings(rec: dict, model: torch.nn.Module) -> List[str]:
    """Non-finite inputs (with the first index) and token ids outside the
    embedding, from ``check_batch`` and a direct scan."""
    import nanguard

    out: List[str] = []
    leaves = tensor_leaves(list(rec["args"]), "args")
    for key, value in rec["kwargs"].items():
        leaves += tensor_leaves(value, key)
    for name, _, t in leaves:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0])
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            out.append(f"`{name}` holds {kind} (first at {name}[{', '.join(map(str, idx))}])")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    for f in nanguard.check_batch(dict(rec["kwargs"]), vocab_size=vocab):
        if f.problem not in ("NaN values", "+Inf values", "-Inf values"):  # reported above, with an index
            out.append(str(f))
    return out


def replay(path: str, model: Optional[torch.nn.Module] = None, loss_fn: Optional[LossFn] = None,
           triage: bool = False) -> ReplayResult:
    """Run the step recorded in ``path`` again and name the first op that
    made a non-finite value from finite inputs.

    Args:
        path: a flight record, ``nanguard-step<N>[-rank<R>].pt``.
        model: the model to replay on (its parameters are replaced by the
            recorded ones). Needed unless the record holds a Hugging Face
            model's class and config.
        loss_fn: ``loss_fn(output, inputs) -> loss``; default: the output's
            ``.loss``. ``inputs`` is the recorded keyword inputs, with the
            positional ones under ``"args"``.
        triage: also run the step under each variant of the checklist (fp32,
            bf16, ``nanguard.patch``, clamped scores, larger norm eps,
            dropout off, lower loss scales, the batch check) and name the
            cause when they single one out.
    """
    from . import _triage

    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    rec = _flight_record.load_record(path)
    step = Step(rec, _flight_record.build_model(rec, model), loss_fn)
    outcome = step.run(strict=True)
    batch = _batch_findings(rec, step.model)
    variants = _triage.run_variants(step) if triage else None
    notes = _notes(rec, step, outcome)
    first = outcome.first
    reproduced = (not outcome.finite) == rec["recorded_nonfinite"]
    res = ReplayResult(
        path=str(path), step=rec["step"], reproduced=reproduced, recorded_nonfinite=rec["recorded_nonfinite"],
        outcome=outcome, first_op=first.op if first else None, node=first.node if first else None,
        module=first.module if first else None, pass_=first.pass_ if first else None,
        inputs=first.inputs if first else [], batch=batch, triage=variants, verdict="", notes=notes)
    res.verdict = _triage.verdict(res, step)
    return res


def _notes(rec: dict, step: Step, outcome: StepOutcome) -> List[str]:
    notes = []
    if rec["recorded_nonfinite"] and outcome.finite:
        notes.append("the recorded step was non-finite but its replay is finite: kernels that are not "
                     "deterministic (atomics on CUDA, thread-count dependent reductions) or another device "
                     f"or PyTorch version (recorded with torch {rec['versions']['torch']}, replayed with "
                     f"{torch.__version__}) can round differently near an overflow")
    if outcome.error:
        notes.append(f"the replay raised {outcome.error}")
    return notes


def cli(argv: Optional[List[str]] = None) -> int:
    """``python -m nanguard replay PATH [--triage] [--json]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m nanguard replay",
        description="Run a recorded failing step again (a nanguard flight record, nanguard-step<N>.pt), "
                    "name the first op that made a non-finite value from finite inputs, and with --triage "
                    "rerun it under the standard checklist to say what fixes it. The record must hold a "
                    "Hugging Face model's class and config; other models are replayed from Python with "
                    "nanguard.replay(path, model=...).")
    p.add_argument("path", help="the flight record")
    p.add_argument("--triage", action="store_true", help="rerun the step under each variant of the checklist")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    try:
        res = replay(args.path, triage=args.triage)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"nanguard replay: {e}", file=sys.stderr)
        return 2
    print(res.to_json(indent=2) if args.json else res)
    return 0 if res.reproduced else 1
