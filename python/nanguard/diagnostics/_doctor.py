"""Catch the causes of NaN losses before training starts.

:func:`doctor` is a static audit of a model and its training setup against
the known causes, each :class:`Finding` with a severity, the evidence and the
fix. Run it once before training; :func:`nanguard.watch` is the per-step tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..layernorm import EPS_FLOOR, NORM_EPS_ATTRS

__all__ = ["doctor", "Finding", "format_findings"]

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    severity: str  #: "error", "warning" or "info"
    code: str  #: stable identifier, e.g. "post-ln"
    where: str  #: module name(s), "optimizer", "scaler", "scheduler", "model"
    evidence: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code} @ {self.where}\n    evidence: {self.evidence}\n" \
               f"    fix: {self.fix}"


def format_findings(findings: List[Finding]) -> str:
    if not findings:
        return "nanguard doctor: no findings"
    head = f"nanguard doctor: {len(findings)} finding(s)"
    return head + "\n" + "\n".join(str(f) for f in findings)


#: Hugging Face model types whose blocks normalize after the residual add.
POST_LN_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "albert", "deberta",
    "deberta-v2", "mpnet", "ernie", "layoutlm", "roformer", "squeezebert", "funnel", "bart",
    "marian", "blenderbot-small", "xlm", "flaubert", "nezha", "luke", "big_bird", "canine",
})
#: Blocks at or above this depth make Post-LN a warning (below: information).
DEEP_STACK = 12
#: Embedding tables with at least this many rows are reported.
LARGE_EMBEDDING_ROWS = 65536
#: Above this, GradScaler's first steps are skipped while it backs off.
HIGH_INIT_SCALE = 2.0 ** 16


def _model_config(model: nn.Module):
    return getattr(model, "config", None)


def _is_hf(model: nn.Module) -> bool:
    """A Hugging Face transformers model (inside any wrapper nanguard.patch
    sees through): nanguard.patch(model) is then the one-line fix."""
    from ..patching._wrappers import _hf_pretrained_base, unwrap

    base = _hf_pretrained_base()
    return base is not None and isinstance(unwrap(model)[0], base)


def _is_nanguard(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("nanguard")


def _depth(model: nn.Module) -> int:
    cfg = _model_config(model)
    for attr in ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers"):
        v = getattr(cfg, attr, None) if cfg is not None else None
        if isinstance(v, int):
            return v
    # the longest ModuleList of identical blocks
    best = 0
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and \
                len({type(m) for m in mod}) == 1:
            best = max(best, len(mod))
    return best


def _training_dtype(model: nn.Module, dtype, autocast_dtype) -> Tuple[Optional[torch.dtype], bool]:
    """(dtype the math runs in, whether it comes from autocast)."""
    if autocast_dtype is not None:
        return autocast_dtype, True
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return torch.get_autocast_dtype(dev), True
        except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - old torch
            pass
    if dtype is not None:
        return dtype, False
    counts: Dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        return None, False
    return max(counts, key=counts.get), False


def _norm_eps(mod: nn.Module) -> Optional[float]:
    name = type(mod).__name__
    if not ("LayerNorm" in name or "RMSNorm" in name or isinstance(mod, (nn.LayerNorm,
                                                                          nn.RMSNorm))):
        return None
    for attr in NORM_EPS_ATTRS:
        v = getattr(mod, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    if isinstance(mod, nn.RMSNorm) and mod.eps is None:
        return None  # torch picks finfo(dtype).eps: fine
    return None


def _names(names: List[str], k: int = 3) -> str:
    shown = ", ".join(f"'{n or '<root>'}'" for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def _warmup_of(scheduler) -> Optional[bool]:
    """True / False when the schedule can be inspected, None when it cannot."""
    from torch.optim import lr_scheduler as L

    if isinstance(scheduler, (L.LinearLR,)):
        return scheduler.start_factor < 1.0
    if isinstance(scheduler, L.OneCycleLR):
        return True
    if isinstance(scheduler, L.ConstantLR):
        return scheduler.factor < 1.0
    if isinstance(scheduler, L.SequentialLR):
        first = scheduler._schedulers[0] if scheduler._schedulers else None
        return _warmup_of(first) if first is not None else None
    if isinstance(scheduler, L.ChainedScheduler):
        ws = [_warmup_of(s) for s in scheduler._schedulers]
        return any(w for w in ws if w) if any(w is not None for w in ws) else None
    if isinstance(scheduler, L.LambdaLR):
        try:
            fs = [float(f(s)) for f in scheduler.lr_lambdas for s in (0, 1)]
            peak = max(float(f(s)) for f in scheduler.lr_lambdas for s in range(0, 20001, 50))
        except Exception:
            return None
        return fs[0] < 0.5 * peak
    if isinstance(scheduler, (L.StepLR, L.MultiStepLR, L.ExponentialLR, L.CosineAnnealingLR,
                              L.PolynomialLR, L.CosineAnnealingWarmRestarts)):
        return False
    return None


def _init_scale(scaler) -> Optional[float]:
    v = getattr(scaler, "_init_scale", None)
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(scaler.get_scale())
    except Exception:
        return None


def _scaler_enabled(scaler) -> bool:
    if scaler is None:
        return False
    try:
        return bool(scaler.is_enabled())
    except Exception:
        return bool(getattr(scaler, "_enabled", True))


def _clips(scaler) -> bool:
    """nanguard's GradScaler clips in unscale_and_clip_ when the loop calls it;
    its presence is taken as "clipping visible"."""
    try:
        from ..amp import GradScaler as NgScaler
    except Exception:  # pragma: no cover
        return False
    return isinstance(scaler, NgScaler)


# ---- the audit: a context, and one rule per finding ----------------------------------------


@dataclass(frozen=True)
class _AuditContext:
    """What the rules read: the training objects, and the facts derived from
    them once."""

    model: nn.Module
    optimizer: Any = None
    scaler: Any = None
    scheduler: Any = None
    training_args: Any = None
    max_grad_norm: Optional[float] = None
    tdtype: Optional[torch.dtype] = None  #: the dtype the math runs in
    from_autocast: bool = False  #: tdtype comes from autocast, not from the parameters
    depth: int = 0  #: the number of blocks
    cfg: Any = None  #: the model's Hugging Face config, if it has one
    hf: bool = False  #: a transformers model, so nanguard.patch(model) applies

    @property
    def fp16(self) -> bool:
        return self.tdtype == torch.float16


def _context(model: nn.Module, optimizer, scaler, scheduler, dtype, autocast_dtype,
             max_grad_norm, training_args) -> _AuditContext:
    """training_args' fp16 / bf16 and max_grad_norm fill in what the
    arguments leave unset."""
    if training_args is not None:
        if getattr(training_args, "fp16", False) and autocast_dtype is None:
            autocast_dtype = torch.float16
        elif getattr(training_args, "bf16", False) and autocast_dtype is None:
            autocast_dtype = torch.bfloat16
        if max_grad_norm is None:
            mgn = getattr(training_args, "max_grad_norm", None)
            if isinstance(mgn, (int, float)) and mgn > 0:
                max_grad_norm = float(mgn)
    tdtype, from_autocast = _training_dtype(model, dtype, autocast_dtype)
    return _AuditContext(model, optimizer, scaler, scheduler, training_args, max_grad_norm,
                         tdtype, from_autocast, _depth(model), _model_config(model),
                         _is_hf(model))


_PATCH_FIX = "nanguard.patch(model) (norms with fp32 statistics, attention through safe_sdpa), or "


def _rule_fp16_params(ctx: _AuditContext) -> List[Finding]:
    fp16_params = [n for n, p in ctx.model.named_parameters() if p.dtype == torch.float16]
    if not fp16_params:
        return []
    return [Finding(
        "warning", "fp16-params", _names(fp16_params),
        f"{len(fp16_params)} parameter(s) are stored in float16: updates smaller than "
        "2^-11 of a weight are lost, and GradScaler refuses to unscale float16 gradients",
        "keep float32 parameters and run the forward under torch.autocast(dtype=float16) "
        "with a GradScaler, or train in bfloat16")]


def _rule_fp16_no_scaler(ctx: _AuditContext) -> List[Finding]:
    if not ctx.fp16 or _scaler_enabled(ctx.scaler):
        return []
    src = "autocast(float16)" if ctx.from_autocast else "float16 parameters"
    return [Finding(
        "error", "fp16-no-scaler", "scaler",
        f"training in {src} with " + ("a disabled GradScaler" if ctx.scaler is not None
                                        else "no GradScaler") +
        ": gradients below 2^-24 flush to zero and large ones overflow to inf",
        "use torch.amp.GradScaler('cuda') (or nanguard.amp.GradScaler) around backward and "
        "optimizer.step, or train in bfloat16")]


def _rule_scaler_init_scale(ctx: _AuditContext) -> List[Finding]:
    if ctx.scaler is None or not _scaler_enabled(ctx.scaler):
        return []
    s = _init_scale(ctx.scaler)
    if s is None or s <= HIGH_INIT_SCALE:
        return []
    return [Finding(
        "warning", "scaler-init-scale", "scaler",
        f"GradScaler init_scale is {s:g} (> 2^16) for a {ctx.depth}-block model: the first "
        "steps overflow and are skipped while the scale backs off, and a loss scaled "
        "this far can reach inf in the forward of the last layers",
        "GradScaler(init_scale=2.0**16) (the default) or lower (2**12 for deep models)")]


def _rule_no_grad_clipping(ctx: _AuditContext) -> List[Finding]:
    if ctx.optimizer is None or ctx.max_grad_norm is not None or _clips(ctx.scaler):
        return []
    return [Finding(
        "info", "no-grad-clipping", "optimizer",
        "no gradient clipping is visible (pass max_grad_norm= or training_args= if the loop "
        "clips): one spike of a large gradient can push weights to values whose "
        "activations overflow",
        "clip every step: nanguard.clip_grad_norm_(model.parameters(), 1.0) (NaN-safe, no "
        "host sync) or torch.nn.utils.clip_grad_norm_")]


def _rule_norm_eps(ctx: _AuditContext) -> List[Finding]:
    if not ctx.fp16:
        return []
    floor = EPS_FLOOR[torch.float16]  # what stable_layernorm's eps_floor="auto" applies in fp16
    small = [(n, e) for n, m in ctx.model.named_modules()
             if not _is_nanguard(m) and (e := _norm_eps(m)) is not None and e < floor]
    if not small:
        return []
    eps_vals = sorted({e for _, e in small})
    return [Finding(
        "warning", "norm-eps", _names([n for n, _ in small]),
        f"{len(small)} LayerNorm/RMSNorm module(s) use eps "
        f"{', '.join(f'{e:g}' for e in eps_vals)} while training in float16: a row that is "
        "nearly constant has a variance that rounds to 0 in float16 and 1/sqrt(var + eps) "
        "amplifies its rounding noise by up to 1/sqrt(eps)",
        (_PATCH_FIX if ctx.hf else "")
        + f"eps >= {floor:g} for float16 (PyTorch's LayerNorm default), or use "
        "nanguard.nn.StableLayerNorm / StableRMSNorm (fp32 statistics, eps floor "
        "per dtype)")]


def _hf_post_ln(cfg) -> bool:
    """Whether a Hugging Face config describes Post-LN blocks."""
    if cfg is None:
        return False
    if hasattr(cfg, "normalize_before"):
        return not cfg.normalize_before
    if hasattr(cfg, "do_layer_norm_before"):
        return not cfg.do_layer_norm_before
    return getattr(cfg, "model_type", None) in POST_LN_MODEL_TYPES


def _rule_post_ln(ctx: _AuditContext) -> List[Finding]:
    post_ln = [n for n, m in ctx.model.named_modules()
               if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
               and not m.norm_first]
    hf_post = _hf_post_ln(ctx.cfg)
    if not (post_ln or hf_post):
        return []
    model_type = getattr(ctx.cfg, "model_type", None)
    n_blocks = len(post_ln) if post_ln else ctx.depth
    deep = n_blocks >= DEEP_STACK
    where = _names(post_ln) if post_ln else f"model ({model_type})"
    return [Finding(
        "warning" if deep else "info", "post-ln", where,
        f"{n_blocks} Post-LN block(s) (LayerNorm after the residual add"
        + (f", as in every '{model_type}' model" if hf_post else ", norm_first=False")
        + "): gradients near the output are large at initialisation and grow with depth, "
        "so without a long warmup the first steps diverge"
        + ("" if deep else f"; at {n_blocks} blocks this is a risk, not yet a problem"),
        "use Pre-LN blocks (nn.TransformerEncoderLayer(norm_first=True)) for deep stacks, "
        "or keep Post-LN with a learning-rate warmup and gradient clipping")]


def _rule_attention_fp16_mask(ctx: _AuditContext) -> List[Finding]:
    if not ctx.fp16:
        return []
    mha = [n for n, m in ctx.model.named_modules()
           if isinstance(m, nn.MultiheadAttention) and not _is_nanguard(m)]
    impl = getattr(ctx.cfg, "_attn_implementation", None) if ctx.cfg is not None else None
    if not (mha or impl in ("eager", "sdpa")):
        return []
    where = _names(mha) if mha else f"model (attn_implementation={impl!r})"
    return [Finding(
        "warning", "attention-fp16-mask", where,
        "attention runs in float16 through "
        + ("nn.MultiheadAttention" if mha else f"the {impl!r} implementation")
        + ": Q.K^T can exceed 65504 and become inf, and a row whose keys are all masked "
        "with -inf gives softmax 0/0 = NaN (padding, causal position 0)",
        (_PATCH_FIX if ctx.hf or mha else "")
        + "nanguard.nn.SafeAttention / nanguard.functional.safe_sdpa (fp32 scores, fully "
        "masked rows give zeros), or bfloat16")]


def _rule_no_warmup(ctx: _AuditContext) -> List[Finding]:
    if ctx.scheduler is not None:
        if _warmup_of(ctx.scheduler) is not False:
            return []
        return [Finding(
            "warning", "no-warmup", "scheduler",
            f"{type(ctx.scheduler).__name__} starts at the full learning rate: Adam's second "
            "moment is still near zero in the first steps, so early updates are large",
            "warm up over the first 1-5% of steps: "
            "transformers.get_linear_schedule_with_warmup, or SequentialLR(LinearLR("
            "start_factor=0.01), ...)")]
    args = ctx.training_args
    if args is None or getattr(args, "warmup_steps", 0) or getattr(args, "warmup_ratio", 0):
        return []
    return [Finding(
        "warning", "no-warmup", "training_args",
        "warmup_steps and warmup_ratio are 0: the first steps run at the full learning "
        "rate", "TrainingArguments(warmup_ratio=0.03) or warmup_steps")]


def _rule_large_embedding(ctx: _AuditContext) -> List[Finding]:
    big = [(n, m.num_embeddings) for n, m in ctx.model.named_modules()
           if isinstance(m, nn.Embedding) and m.num_embeddings >= LARGE_EMBEDDING_ROWS]
    if not big:
        return []
    return [Finding(
        "warning" if ctx.fp16 else "info", "large-embedding", _names([n for n, _ in big]),
        f"embedding table(s) of up to {max(r for _, r in big)} rows: rare tokens' rows get "
        "sparse gradients, and Adam turns a rare large gradient into a full-size step",
        "clip gradients, keep embeddings in float32, and consider a lower learning rate or "
        "weight decay 0 for the embedding rows")]


#: The rules in report order (a stable sort then puts the most severe first).
_RULES: Tuple[Callable[[_AuditContext], List[Finding]], ...] = (
    _rule_fp16_params,
    _rule_fp16_no_scaler,
    _rule_scaler_init_scale,
    _rule_no_grad_clipping,
    _rule_norm_eps,
    _rule_post_ln,
    _rule_attention_fp16_mask,
    _rule_no_warmup,
    _rule_large_embedding,
)


def doctor(model: nn.Module, optimizer=None, scaler=None, scheduler=None, *,
           dtype: Optional[torch.dtype] = None, autocast_dtype: Optional[torch.dtype] = None,
           max_grad_norm: Optional[float] = None, training_args=None,
           verbose: bool = False) -> List[Finding]:
    """Audit a model and its training setup for the known causes of NaN.

    Args:
        model: the model (a Hugging Face model's ``config`` is used when
            present).
        optimizer, scaler, scheduler: the training objects, when available.
        dtype: the training dtype when the parameters do not show it.
        autocast_dtype: the dtype of the autocast region the model runs in
            (detected automatically when ``doctor`` is called inside one).
        max_grad_norm: the gradient clipping the loop applies, if any.
        training_args: a Hugging Face ``TrainingArguments``: its ``fp16`` /
            ``bf16``, ``max_grad_norm`` and warmup settings are used.
        verbose: print the report as well.

    Returns the findings, most severe first (empty when nothing was found).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ctx = _context(model, optimizer, scaler, scheduler, dtype, autocast_dtype, max_grad_norm,
                   training_args)
    findings = [f for rule in _RULES for f in rule(ctx)]
    findings.sort(key=lambda f: _SEVERITY_ORDER.get(f.severity, 3))
    if verbose:
        print(format_findings(findings))
    return findings
