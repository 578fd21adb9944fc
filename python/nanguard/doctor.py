"""Catch the causes of NaN losses before training starts.

* :func:`check_batch`: a batch's tensors (nested dicts / lists / tuples /
  Hugging Face ``BatchEncoding``): NaN / Inf in floating tensors, token ids
  outside ``[0, vocab_size)``, labels that are all ``ignore_index`` (a mean
  loss of 0/0), and attention-mask rows that attend to nothing.
* :func:`doctor`: a static audit of a model and its training setup against
  the known causes, each :class:`Finding` with a severity, the evidence and
  the fix.

Both read tensors back to the host: run them once before training (or on a
suspicious batch), not every step; :func:`nanguard.watch` is the per-step tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["check_batch", "BatchFinding", "BadBatchError", "doctor", "Finding", "format_findings"]

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}

# ---- check_batch ----------------------------------------------------------------------------


@dataclass
class BatchFinding:
    path: str  #: where in the batch, e.g. ``batch['labels']``
    problem: str  #: short description
    count: int  #: how many elements (or rows) have it
    detail: str = ""

    def __str__(self) -> str:
        d = f" ({self.detail})" if self.detail else ""
        return f"{self.path}: {self.problem}: {self.count}{d}"


class BadBatchError(ValueError):
    """Raised by :func:`check_batch` with ``raise_on_problem=True``;
    ``.findings`` holds the list."""

    def __init__(self, findings: List[BatchFinding]):
        self.findings = findings
        super().__init__("problems in the batch:\n" + "\n".join(f"  {f}" for f in findings))


def _walk(obj, path: str, out: List[Tuple[str, str, torch.Tensor]], depth: int = 0) -> None:
    """(path, key, tensor) for every tensor in obj; key is the innermost dict key."""
    if isinstance(obj, torch.Tensor):
        key = path.rsplit("[", 1)[-1].strip("]'\"") if "[" in path else ""
        out.append((path, key, obj))
        return
    if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if hasattr(obj, "items") and callable(obj.items):  # dict, BatchEncoding, ModelOutput
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, depth + 1)


def _is_ids(key: str) -> bool:
    return key.endswith("input_ids")


def _is_labels(key: str) -> bool:
    return key in ("labels", "label_ids", "label", "target", "targets")


def _is_mask(key: str) -> bool:
    return "attention_mask" in key or key.endswith("mask")


def _mask_empty_rows(m: torch.Tensor) -> Tuple[int, str]:
    """Rows of an attention mask that let a query attend to nothing."""
    if m.dim() == 2:  # [batch, keys]: 1/True = attend
        return int((m != 0).sum(-1).eq(0).sum()), "sequences with no token to attend to"
    if m.dtype == torch.bool:  # [..., queries, keys], True = attend
        return int((~m.any(-1)).sum()), "query rows with every key masked"
    if m.is_floating_point():  # additive: -inf / finfo.min = masked
        thresh = torch.finfo(m.dtype).min / 2 if m.dtype != torch.float64 else -1e300
        masked = (m <= thresh) | torch.isneginf(m)
        return int(masked.all(-1).sum()), "query rows with every key masked (additive mask)"
    return int((m != 0).sum(-1).eq(0).sum()), "rows with no key to attend to"


def check_batch(batch, vocab_size: Optional[int] = None, ignore_index: int = -100,
                raise_on_problem: bool = False) -> List[BatchFinding]:
    """Look for the inputs that make a loss NaN.

    Args:
        batch: a tensor, or nested dicts / lists / tuples / ``BatchEncoding``
            of tensors. Keys decide the checks: ``*input_ids`` are token ids,
            ``labels`` are targets, ``*attention_mask`` / ``*mask`` are masks.
        vocab_size: when given, token ids and token-level labels must lie in
            ``[0, vocab_size)`` (labels may also be ``ignore_index``).
        ignore_index: the label value the loss skips.
        raise_on_problem: raise :class:`BadBatchError` instead of returning.

    Returns the list of :class:`BatchFinding` (empty for a clean batch).
    """
    found: List[Tuple[str, str, torch.Tensor]] = []
    _walk(batch, "batch", found)
    out: List[BatchFinding] = []
    for path, key, t in found:
        if t.is_floating_point() or t.is_complex():
            nan = int(torch.isnan(t).sum())
            if nan:
                out.append(BatchFinding(path, "NaN values", nan))
            pinf = int(torch.isposinf(t).sum()) if not t.is_complex() else 0
            if pinf:
                out.append(BatchFinding(path, "+Inf values", pinf))
            if not _is_mask(key):  # -inf is how additive masks say "masked"
                ninf = int(torch.isneginf(t).sum()) if not t.is_complex() else 0
                if ninf:
                    out.append(BatchFinding(path, "-Inf values", ninf))
        if _is_mask(key) and t.numel() and t.dim() >= 2:
            n, what = _mask_empty_rows(t)
            if n:
                out.append(BatchFinding(path, "attention mask rows that attend to nothing", n,
                                        what + ": softmax over no keys gives 0/0"))
        if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0:
            continue
        if _is_ids(key):
            bad = int((t < 0).sum())
            if vocab_size is not None:
                bad += int((t >= vocab_size).sum())
            if bad:
                out.append(BatchFinding(path, "token ids outside [0, vocab_size)", bad,
                                        f"min {int(t.min())}, max {int(t.max())}, vocab_size "
                                        f"{vocab_size}"))
        elif _is_labels(key):
            valid = t != ignore_index
            if not bool(valid.any()):
                out.append(BatchFinding(path, "all labels are ignore_index", t.numel(),
                                        f"ignore_index={ignore_index}: a mean loss over no "
                                        "tokens is 0/0 = NaN"))
                continue
            if t.dim() >= 2:
                rows = int((~valid.reshape(valid.shape[0], -1).any(-1)).sum())
                if rows:
                    out.append(BatchFinding(path, "rows whose labels are all ignore_index", rows,
                                            "per-sequence losses of these rows are 0/0"))
            if vocab_size is not None and t.dim() >= 2:
                bad = int((valid & ((t < 0) | (t >= vocab_size))).sum())
                if bad:
                    out.append(BatchFinding(path, "labels outside [0, vocab_size)", bad,
                                            f"vocab_size {vocab_size}, ignore_index "
                                            f"{ignore_index}"))
    if out and raise_on_problem:
        raise BadBatchError(out)
    return out


# ---- doctor ---------------------------------------------------------------------------------


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
    from .patching._wrappers import _hf_pretrained_base, unwrap

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
    for attr in ("eps", "variance_epsilon", "epsilon"):
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
    if training_args is not None:
        if getattr(training_args, "fp16", False) and autocast_dtype is None:
            autocast_dtype = torch.float16
        elif getattr(training_args, "bf16", False) and autocast_dtype is None:
            autocast_dtype = torch.bfloat16
        if max_grad_norm is None:
            mgn = getattr(training_args, "max_grad_norm", None)
            if isinstance(mgn, (int, float)) and mgn > 0:
                max_grad_norm = float(mgn)
    findings: List[Finding] = []
    tdtype, from_autocast = _training_dtype(model, dtype, autocast_dtype)
    fp16 = tdtype == torch.float16
    depth = _depth(model)
    cfg = _model_config(model)
    hf = _is_hf(model)
    patch_fix = "nanguard.patch(model) (norms with fp32 statistics, attention through safe_sdpa), or "

    # -- precision and loss scaling
    fp16_params = [n for n, p in model.named_parameters() if p.dtype == torch.float16]
    if fp16_params:
        findings.append(Finding(
            "warning", "fp16-params", _names(fp16_params),
            f"{len(fp16_params)} parameter(s) are stored in float16: updates smaller than "
            "2^-11 of a weight are lost, and GradScaler refuses to unscale float16 gradients",
            "keep float32 parameters and run the forward under torch.autocast(dtype=float16) "
            "with a GradScaler, or train in bfloat16"))
    if fp16 and not _scaler_enabled(scaler):
        src = "autocast(float16)" if from_autocast else "float16 parameters"
        findings.append(Finding(
            "error", "fp16-no-scaler", "scaler",
            f"training in {src} with " + ("a disabled GradScaler" if scaler is not None
                                            else "no GradScaler") +
            ": gradients below 2^-24 flush to zero and large ones overflow to inf",
            "use torch.amp.GradScaler('cuda') (or nanguard.amp.GradScaler) around backward and "
            "optimizer.step, or train in bfloat16"))
    if scaler is not None and _scaler_enabled(scaler):
        s = _init_scale(scaler)
        if s is not None and s > HIGH_INIT_SCALE:
            findings.append(Finding(
                "warning", "scaler-init-scale", "scaler",
                f"GradScaler init_scale is {s:g} (> 2^16) for a {depth}-block model: the first "
                "steps overflow and are skipped while the scale backs off, and a loss scaled "
                "this far can reach inf in the forward of the last layers",
                "GradScaler(init_scale=2.0**16) (the default) or lower (2**12 for deep models)"))
    if optimizer is not None and max_grad_norm is None and not _clips(scaler):
        findings.append(Finding(
            "info", "no-grad-clipping", "optimizer",
            "no gradient clipping is visible (pass max_grad_norm= or training_args= if the loop "
            "clips): one spike of a large gradient can push weights to values whose "
            "activations overflow",
            "clip every step: nanguard.clip_grad_norm_(model.parameters(), 1.0) (NaN-safe, no "
            "host sync) or torch.nn.utils.clip_grad_norm_"))

    # -- normalization epsilon
    if fp16:
        small = [(n, e) for n, m in model.named_modules()
                 if not _is_nanguard(m) and (e := _norm_eps(m)) is not None and e < 1e-5]
        if small:
            eps_vals = sorted({e for _, e in small})
            findings.append(Finding(
                "warning", "norm-eps", _names([n for n, _ in small]),
                f"{len(small)} LayerNorm/RMSNorm module(s) use eps "
                f"{', '.join(f'{e:g}' for e in eps_vals)} while training in float16: a row that is "
                "nearly constant has a variance that rounds to 0 in float16 and 1/sqrt(var + eps) "
                "amplifies its rounding noise by up to 1/sqrt(eps)",
                (patch_fix if hf else "")
                + "eps >= 1e-5 for float16 (PyTorch's LayerNorm default), or use "
                "nanguard.nn.StableLayerNorm / StableRMSNorm (fp32 statistics, eps floor "
                "per dtype)"))

    # -- Post-LN
    post_ln: List[str] = []
    for n, m in model.named_modules():
        if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and \
                not m.norm_first:
            post_ln.append(n)
    model_type = getattr(cfg, "model_type", None)
    hf_post = False
    if cfg is not None:
        if hasattr(cfg, "normalize_before"):
            hf_post = not cfg.normalize_before
        elif hasattr(cfg, "do_layer_norm_before"):
            hf_post = not cfg.do_layer_norm_before
        else:
            hf_post = model_type in POST_LN_MODEL_TYPES
    if post_ln or hf_post:
        n_blocks = len(post_ln) if post_ln else depth
        deep = n_blocks >= DEEP_STACK
        where = _names(post_ln) if post_ln else f"model ({model_type})"
        findings.append(Finding(
            "warning" if deep else "info", "post-ln", where,
            f"{n_blocks} Post-LN block(s) (LayerNorm after the residual add"
            + (f", as in every '{model_type}' model" if hf_post else ", norm_first=False")
            + "): gradients near the output are large at initialisation and grow with depth, "
            "so without a long warmup the first steps diverge"
            + ("" if deep else f"; at {n_blocks} blocks this is a risk, not yet a problem"),
            "use Pre-LN blocks (nn.TransformerEncoderLayer(norm_first=True)) for deep stacks, "
            "or keep Post-LN with a learning-rate warmup and gradient clipping"))

    # -- attention masking in fp16
    if fp16:
        mha = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention) and not _is_nanguard(m)]
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        if mha or impl in ("eager", "sdpa"):
            where = _names(mha) if mha else f"model (attn_implementation={impl!r})"
            findings.append(Finding(
                "warning", "attention-fp16-mask", where,
                "attention runs in float16 through "
                + ("nn.MultiheadAttention" if mha else f"the {impl!r} implementation")
                + ": Q.K^T can exceed 65504 and become inf, and a row whose keys are all masked "
                "with -inf gives softmax 0/0 = NaN (padding, causal position 0)",
                (patch_fix if hf or mha else "")
                + "nanguard.nn.SafeAttention / nanguard.functional.safe_sdpa (fp32 scores, fully "
                "masked rows give zeros), or bfloat16"))

    # -- warmup
    if scheduler is not None:
        w = _warmup_of(scheduler)
        if w is False:
            findings.append(Finding(
                "warning", "no-warmup", "scheduler",
                f"{type(scheduler).__name__} starts at the full learning rate: Adam's second "
                "moment is still near zero in the first steps, so early updates are large",
                "warm up over the first 1-5% of steps: "
                "transformers.get_linear_schedule_with_warmup, or SequentialLR(LinearLR("
                "start_factor=0.01), ...)"))
    elif training_args is not None:
        if not (getattr(training_args, "warmup_steps", 0) or getattr(training_args,
                                                                     "warmup_ratio", 0)):
            findings.append(Finding(
                "warning", "no-warmup", "training_args",
                "warmup_steps and warmup_ratio are 0: the first steps run at the full learning "
                "rate", "TrainingArguments(warmup_ratio=0.03) or warmup_steps"))

    # -- large embeddings
    big = [(n, m.num_embeddings) for n, m in model.named_modules()
           if isinstance(m, nn.Embedding) and m.num_embeddings >= LARGE_EMBEDDING_ROWS]
    if big:
        findings.append(Finding(
            "warning" if fp16 else "info", "large-embedding", _names([n for n, _ in big]),
            f"embedding table(s) of up to {max(r for _, r in big)} rows: rare tokens' rows get "
            "sparse gradients, and Adam turns a rare large gradient into a full-size step",
            "clip gradients, keep embeddings in float32, and consider a lower learning rate or "
            "weight decay 0 for the embedding rows"))

    findings.sort(key=lambda f: _SEVERITY_ORDER.get(f.severity, 3))
    if verbose:
        print(format_findings(findings))
    return findings


def _clips(scaler) -> bool:
    """nanguard's GradScaler clips in unscale_and_clip_ when the loop calls it;
    its presence is taken as "clipping visible"."""
    try:
        from .amp import GradScaler as NgScaler
    except Exception:  # pragma: no cover
        return False
    return isinstance(scaler, NgScaler)


# ---- building models from configs (the CLI) ----------------------------------------------------

#: Sizes that keep a model from any config small enough to build in a second.
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
         "n_embd": 64, "n_head": 4, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16}


def model_from_config(model_type: Optional[str] = None, config_path: Optional[str] = None,
                      layers: Optional[int] = None, small: bool = True):
    """Build a Hugging Face model (on the meta device: no weights are
    allocated) from a model type (small sizes) or a config.json."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("building a model from a config needs Hugging Face transformers: "
                          "pip install transformers") from e
    if config_path is not None:
        import json

        with open(config_path) as f:
            data = json.load(f)
        mt = data.pop("model_type", model_type)
        if mt is None:
            raise ValueError(f"{config_path} has no model_type")
        cfg = transformers.AutoConfig.for_model(mt, **data)
    else:
        if not model_type:
            raise ValueError("give a model type (e.g. llama, bert) or a config path")
        cfg = transformers.AutoConfig.for_model(model_type)
        if small:
            for k, v in SMALL.items():
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
            for k in ("num_hidden_layers", "n_layer", "num_layers"):
                if hasattr(cfg, k):
                    setattr(cfg, k, 2)
    if layers is not None:
        for k in ("num_hidden_layers", "n_layer", "num_layers"):
            if hasattr(cfg, k):
                setattr(cfg, k, layers)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    return model


def cli_main(argv=None) -> int:
    """``python -m nanguard doctor``: audit a model built from a config."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m nanguard doctor",
        description="Audit a Hugging Face model built from a config (small sizes for "
                    "--model-type; no weights are allocated) for the known causes of NaN.")
    p.add_argument("--model-type", help="a Hugging Face model type: llama, bert, gpt2, ...")
    p.add_argument("--config", help="path to a config.json (its sizes are kept)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="the training dtype to audit for (autocast)")
    p.add_argument("--no-scaler", action="store_true",
                   help="the float16 loop has no GradScaler (default: it has one)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16,
                   help="the GradScaler's init_scale (float16)")
    args = p.parse_args(argv)
    if not args.model_type and not args.config:
        p.error("give --model-type or --config")
    try:
        model = model_from_config(args.model_type, args.config, args.layers)
    except ImportError as e:
        print(f"nanguard doctor: {e}")
        return 2
    dt = getattr(torch, args.dtype)
    cfg = model.config
    print(f"model: {type(model).__name__} ({cfg.model_type}, {_depth(model)} layers, "
          f"attn_implementation={getattr(cfg, '_attn_implementation', None)}), training dtype "
          f"{args.dtype}")
    scaler = None
    if dt == torch.float16 and not args.no_scaler:
        import warnings

        with warnings.catch_warnings():  # no CUDA here is fine: it is only inspected
            warnings.simplefilter("ignore")
            scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
    findings = doctor(model, scaler=scaler, autocast_dtype=dt if dt != torch.float32 else None)
    print(format_findings(findings))
    return 1 if any(f.severity == "error" for f in findings) else 0
