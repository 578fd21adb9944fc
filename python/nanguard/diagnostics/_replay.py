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

import sys
from typing import List, Optional

import torch

from . import _flight_record, _triage
from ._batch import check_batch
from ._flight_record import FlightRecord
from ._step import LossFn, ReplayResult, Step, StepOutcome
from ._walk import tensor_leaves

def _batch_findings(rec: FlightRecord, model: torch.nn.Module) -> List[str]:
    """Non-finite inputs (with the first index) and token ids outside the
    embedding, from ``check_batch`` and a direct scan."""
    out: List[str] = []
    leaves = tensor_leaves(list(rec.args), "args")
    for key, value in rec.kwargs.items():
        leaves += tensor_leaves(value, key)
    for name, _, t in leaves:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0])
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            out.append(f"`{name}` holds {kind} (first at {name}[{', '.join(map(str, idx))}])")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    for f in check_batch(dict(rec.kwargs), vocab_size=vocab):
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
    reproduced = (not outcome.finite) == rec.recorded_nonfinite
    res = ReplayResult(
        path=str(path), step=rec.step, reproduced=reproduced, recorded_nonfinite=rec.recorded_nonfinite,
        outcome=outcome, first_op=first.op if first else None, node=first.node if first else None,
        module=first.module if first else None, pass_=first.pass_ if first else None,
        inputs=first.inputs if first else [], batch=batch, triage=variants, verdict="", notes=notes)
    res.verdict = _triage.verdict(res, step)
    return res


def _notes(rec: FlightRecord, step: Step, outcome: StepOutcome) -> List[str]:
    notes = []
    if rec.recorded_nonfinite and outcome.finite:
        notes.append("the recorded step was non-finite but its replay is finite: kernels that are not "
                     "deterministic (atomics on CUDA, thread-count dependent reductions) or another device "
                     f"or PyTorch version (recorded with torch {rec.versions['torch']}, replayed with "
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
