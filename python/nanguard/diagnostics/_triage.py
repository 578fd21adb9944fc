"""Triage: the standard NaN checklist, run on the recorded step, and the
verdict it supports.

Each variant reruns the same step from a fresh copy of the same weights,
inputs and RNG state, changing one thing:

================== ============================================================
variant            change
================== ============================================================
``float32``        autocast off, parameters and floating inputs in fp32
``bfloat16``       bf16 instead of fp16 (autocast dtype, or 16-bit weights);
                   only when the step ran in fp16
``nanguard.patch`` ``nanguard.patch(model)``: safe attention, stable norms,
                   safe activations
``max_score``      ``nanguard.patch(model, max_score=MAX_SCORE)``
``norm eps``       every norm's ``eps`` / ``variance_epsilon`` raised to
                   ``TRIAGE_NORM_EPS``
``dropout off``    every dropout's probability set to 0
``loss scale``     the loss scale halved until the gradients are finite
                   (down to 1); only when a loss scale was recorded
================== ============================================================

The batch check (non-finite inputs, token ids outside the embedding) runs
on the recorded inputs themselves. The verdict names a cause only when the
runs single one out, and says which variants did and did not help.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
from torch import nn

from ..layernorm import NORM_EPS_ATTRS
from ..patching import patch
from ._step import ReplayResult, Step, StepOutcome

#: the clamp the ``max_score`` variant applies to scaled attention scores
MAX_SCORE = 50.0
#: the norm epsilon the ``norm eps`` variant raises every smaller one to: a
#: what-if of triage, unrelated to the floors ``stable_layernorm`` applies
#: (``nanguard.layernorm.EPS_FLOOR``)
TRIAGE_NORM_EPS = 1e-4

_MATMULS = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addbmm", "einsum")
_DESCRIBE = {
    "float32": "in fp32", "bfloat16": "in bf16", "nanguard.patch": "with nanguard.patch",
    "max_score": f"with scores clamped to ±{MAX_SCORE:g}", "norm eps": f"with norm eps raised to {TRIAGE_NORM_EPS:g}",
    "dropout off": "with dropout off",
}


def _fp16(step: Step) -> bool:
    ac = step.rec.autocast
    if ac is not None:
        return ac["dtype"] == "float16"
    return any(p.dtype == torch.float16 for p in step.model.parameters())


def _copy(step: Step) -> nn.Module:
    return copy.deepcopy(step.model)


def _raise_eps(model: nn.Module) -> nn.Module:
    for m in model.modules():
        for attr in NORM_EPS_ATTRS:
            v = getattr(m, attr, None)
            if isinstance(v, float) and v < TRIAGE_NORM_EPS:
                setattr(m, attr, TRIAGE_NORM_EPS)
    return model


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr, v in list(vars(m).items()):
            if "dropout" in attr and isinstance(v, float):  # transformers' attention_dropout and kin
                setattr(m, attr, 0.0)
    return model


def _patched(step: Step, **kw) -> nn.Module:
    model = _copy(step)
    patch(model, **kw)
    return model


def _loss_scale_sweep(step: Step) -> Optional[StepOutcome]:
    """The step at the recorded loss scale halved k = 1, 2, ... times, down to
    1: the first finite run, else the run at scale 1."""
    scale = step.rec.loss_scale
    if scale is None or scale <= 1:
        return None
    k, last = 0, None
    while scale / 2 ** (k + 1) >= 1:
        k += 1
        last = step.run(loss_scale=scale / 2**k, check=False)
        last.setting = f"loss scale {scale / 2**k:g} (recorded {scale:g} / 2^{k})"
        if last.finite:
            break
    return last


def run_variants(step: Step) -> Dict[str, StepOutcome]:
    """Each variant of the checklist on the recorded step."""
    out: Dict[str, StepOutcome] = {}
    fp32 = _copy(step).float()
    out["float32"] = step.run(model=fp32, autocast=None, input_dtype=torch.float32)
    if _fp16(step):
        if step.rec.autocast is not None:
            out["bfloat16"] = step.run(autocast=torch.bfloat16)
        else:
            out["bfloat16"] = step.run(model=_copy(step).to(torch.bfloat16), input_dtype=torch.bfloat16)
    for name, build in (("nanguard.patch", lambda: _patched(step)),
                        ("max_score", lambda: _patched(step, max_score=MAX_SCORE))):
        try:
            model = build()
        except Exception as e:  # a model nanguard cannot patch: the variant says so

            out[name] = StepOutcome(False, None, None, f"{type(e).__name__}: {e}")
            continue
        out[name] = step.run(model=model)
    out["norm eps"] = step.run(model=_raise_eps(_copy(step)))
    out["dropout off"] = step.run(model=_no_dropout(_copy(step)))
    sweep = _loss_scale_sweep(step)
    if sweep is not None:
        out["loss scale"] = sweep
    return out


def _describe(name: str, o: StepOutcome) -> str:
    return o.setting if name == "loss scale" and o.setting else _DESCRIBE.get(name, name)


def _kind(res: ReplayResult) -> str:
    f = res.outcome.first
    out = f.output
    what = "Inf" if out.get("inf") and not out.get("nan") else "NaN"
    op = f.op.split("::")[-1]
    if what == "Inf" and out["dtype"] == "float16" and op in _MATMULS:
        attn = f.module is not None and any(s in f.module.lower() for s in ("attn", "attention"))
        return "fp16 overflow in attention scores" if attn and f.pass_ == "forward" else "fp16 overflow"
    return f"{what} made from finite inputs ({out['dtype']})"


def _variants_summary(t: Dict[str, StepOutcome]) -> str:
    finite = [_describe(n, o) for n, o in t.items() if o.finite]
    if not finite:
        return "no variant is finite"
    s = "finite " + ", ".join(finite)
    idle = [w for n, w in (("norm eps", "eps"), ("dropout off", "dropout")) if n in t and not t[n].finite]
    if idle:
        s += "; " + " and ".join(idle) + (" do not matter" if len(idle) > 1 else " does not matter")
    return s


def verdict(res: ReplayResult, step: Step) -> str:
    """One or two sentences a person can act on, claiming no more than the
    replay and its variants showed."""
    o, t = res.outcome, res.triage
    if res.batch:
        s = "the batch is bad: " + "; ".join(res.batch)
        return s + (f" ({_variants_summary(t)})" if t is not None else "")
    if o.finite:
        return ("the replayed step is finite, so the failure is not reproduced here: "
                + "; ".join(res.notes or ["see the notes"]))
    f = o.first
    if f is None:
        bad = _nonfinite_state(step)
        if bad:
            return f"the weights were already non-finite at the step's start (`{bad}`): an earlier step poisoned them"
        return f"the step is non-finite but no op made a non-finite value from finite inputs ({o.error or 'unknown'})"
    if f.module is None and f.pass_ == "forward":
        s = (f"the loss function, outside the model, made the first non-finite value: `{f.op}` "
             f"gave {_kind(res).split(' made')[0]} from finite inputs")
        return s + (f" ({_variants_summary(t)})" if t is not None else "")
    where = f"`{f.module}`" if f.module else "the model"
    if f.pass_ == "backward" and t is not None and "loss scale" in t:
        ls = t["loss scale"]
        head = (f"gradient overflow in the backward of {where} (first node `{f.node}`, op `{f.op}`) "
                f"at loss scale {step.rec.loss_scale:g}")
        if ls.finite:
            return (f"{head}: finite at {ls.setting}. The GradScaler's backoff handles this: it skips "
                    "the step and lowers the scale")
        return f"{head}, and it persists at loss scale 1: a real overflow, not the scaler's ({_variants_summary(t)})"
    node = f", node `{f.node}`" if f.node else ""
    s = f"{_kind(res)} in {where} (first op `{f.op}`, {f.pass_}{node})"
    return s + (f": {_variants_summary(t)}" if t is not None else "")


def _nonfinite_state(step: Step) -> Optional[str]:
    for k, v in step.rec.state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            return k
    return None


__all__: List[str] = ["run_variants", "verdict", "MAX_SCORE", "TRIAGE_NORM_EPS"]
