"""``nanguard.patch`` / ``nanguard.unpatch``: make an existing Hugging Face
Transformers model (or a ``torch.nn.TransformerEncoderLayer`` stack) NaN-safe
in one call, and undo it exactly.

What is patched, by data rather than by copied model code:

- **attention** of Hugging Face models: an attention function backed by
  :func:`nanguard.functional.safe_sdpa` is registered with transformers'
  own extension points, ``AttentionInterface.register("nanguard", fn)`` and
  ``AttentionMaskInterface.register("nanguard", sdpa_mask)`` (boolean masks,
  ``None`` when ``is_causal`` can serve), and selected on the model with
  ``model.set_attn_implementation("nanguard")``. The model's own modules,
  projections and rotary code run unchanged. Gemma-2's
  ``attn_logit_softcapping`` arrives as the ``softcap`` argument and is kept.
- **attention** of ``torch.nn.MultiheadAttention`` (inside
  ``TransformerEncoderLayer`` and friends): swapped for
  :class:`SafeMultiheadAttention`, a subclass that shares every parameter and
  computes the same projections around ``safe_sdpa``.
- **norms**: each known norm module is swapped for a nanguard module sharing
  its parameters (``state_dict`` keys and values unchanged): ``nn.LayerNorm``
  -> :class:`nanguard.nn.StableLayerNorm`, ``nn.RMSNorm`` ->
  :class:`nanguard.nn.StableRMSNorm`, Llama-style ``*RMSNorm`` (Llama,
  Mistral, Qwen2, Qwen3) and Gemma-style ``1 + weight`` ``*RMSNorm`` (Gemma,
  Gemma-2) -> a generated subclass of the original class whose ``forward``
  calls :func:`nanguard.functional.rms_norm` with the original's dtype rules.
- **activations** whose 16-bit arithmetic overflows: GPT-2's
  ``NewGELUActivation`` (``x**3`` in fp16) -> the same function through
  PyTorch's fused ``F.gelu(approximate="tanh")``.

The model types nanguard knows are the rows of :data:`FAMILIES`; one helper
per kind of module lives in :data:`NORM_HELPERS`. A model type not in the
table is left untouched and reported in the summary; inside a known model a
module nanguard does not know (a norm-like or attention-like class not in the
table) is left untouched and listed. Each module is either swapped whole or
not at all, and a failure part-way rolls everything back.

``patch`` also accepts a model *class* (``nanguard.patch(LlamaForCausalLM)``):
every instance built afterwards, including by ``from_pretrained``, is patched
at the end of its construction. ``unpatch(cls)`` stops that.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import safe_sdpa
from .layernorm import StableLayerNorm, StableRMSNorm, rms_norm

__all__ = [
    "patch",
    "unpatch",
    "PatchSummary",
    "SafeMultiheadAttention",
    "FAMILIES",
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS",
]

#: the name nanguard's attention function is registered under in transformers
ATTN_IMPLEMENTATION = "nanguard"
#: oldest transformers release whose attention registry, mask interface and
#: ``set_attn_implementation`` this module uses (kept in pyproject.toml too)
MIN_TRANSFORMERS = "4.56"

#: model_type -> {norm class name: helper kind}; attention goes through the
#: AttentionInterface for every row.
FAMILIES: Dict[str, Dict[str, str]] = {
    "llama": {"LlamaRMSNorm": "hf_rms"},
    "mistral": {"MistralRMSNorm": "hf_rms"},
    "qwen2": {"Qwen2RMSNorm": "hf_rms"},
    "qwen3": {"Qwen3RMSNorm": "hf_rms"},
    "gemma": {"GemmaRMSNorm": "hf_rms_unit_offset"},
    "gemma2": {"Gemma2RMSNorm": "hf_rms_unit_offset"},
    "gpt2": {"LayerNorm": "layernorm", "NewGELUActivation": "gelu_tanh"},
    "bert": {"LayerNorm": "layernorm"},
}

#: plain PyTorch modules patched in any model that is not a Hugging Face one
TORCH_MODULES: Dict[type, str] = {
    nn.LayerNorm: "layernorm",
    nn.RMSNorm: "rmsnorm",
    nn.MultiheadAttention: "mha",
}

_PATCH_ATTR = "_nanguard_patch"
_OPTS_ATTR = "_nanguard_attn_opts"


# ---- summary -------------------------------------------------------------------


@dataclasses.dataclass
class PatchSummary:
    """What :func:`patch` did. ``patched`` counts swapped modules per
    ``"Old -> New"``; ``skipped`` maps a module (qualified name) or model type
    to the reason it was left untouched."""

    model_type: str
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)
    attn_implementation: Optional[Tuple[str, str]] = None  #: (before, after)

    @property
    def total(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        lines = [f"nanguard.patch: {self.model_type}"]
        if self.attn_implementation:
            lines.append(f"  attention implementation: {self.attn_implementation[0]} -> {self.attn_implementation[1]}")
        for k, n in self.patched.items():
            lines.append(f"  {n:4d} x {k}")
        for k, why in self.skipped.items():
            lines.append(f"  left untouched: {k} ({why})")
        if not self.patched and not self.attn_implementation:
            lines.append("  nothing patched")
        return "\n".join(lines)


@dataclasses.dataclass
class _Record:
    """Everything needed to undo a patch, kept on the model (not a module,
    not in ``state_dict``)."""

    swaps: List[Tuple[nn.Module, str, nn.Module, nn.Module]]  # parent, name, old, new
    configs: List[Tuple[object, object]]  # config, its _attn_implementation_internal
    opts_on: List[nn.Module]  # attention modules given _OPTS_ATTR
    attrs: List[Tuple[object, str, object]]  # (obj, attr, old value) to restore
    summary: PatchSummary


# ---- sharing state between an old module and its replacement ---------------------


def _share(old: nn.Module, cls: type) -> nn.Module:
    """A module of class ``cls`` holding the very same parameters, buffers and
    submodules as ``old`` (same objects, same order, so ``state_dict`` keys and
    values are unchanged) and a copy of its other attributes."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for k, v in old.__dict__.items():
        if k in ("_parameters", "_buffers", "_modules") or k.endswith("hooks") or k.startswith("_forward") \
                or k.startswith("_backward") or k.startswith("_state_dict") or k.startswith("_load_state_dict"):
            continue
        new.__dict__[k] = v
    new._parameters = collections.OrderedDict(old._parameters)
    new._buffers = collections.OrderedDict(old._buffers)
    new._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    new._modules = collections.OrderedDict(old._modules)
    return new


def _rebind(old: nn.Module, new: nn.Module) -> None:
    """Before handing ``old`` back: point it at the parameters / buffers /
    submodules ``new`` holds now (a loader may have replaced them)."""
    for d in ("_parameters", "_buffers", "_modules"):
        od, nd = getattr(old, d), getattr(new, d)
        for k in list(od):
            if k in nd:
                od[k] = nd[k]
    old.train(new.training)


# ---- norm helpers: one per kind of module -------------------------------------------


class _HFRMSNorm:
    """``forward`` of Llama-style RMSNorm (Llama, Mistral, Qwen2, Qwen3):
    ``weight * (x / rms(x)).to(x.dtype)`` with fp32 statistics. When weight
    and input share a dtype the multiply is fused into the op (one rounding
    instead of two); otherwise it is done after, so the output dtype follows
    PyTorch's promotion exactly as the original's does."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon
        shape = (hidden_states.shape[-1],)
        if self.weight.dtype == hidden_states.dtype:
            return rms_norm(hidden_states, shape, self.weight, eps)
        return self.weight * rms_norm(hidden_states, shape, None, eps)


class _HFRMSNormUnitOffset:
    """``forward`` of Gemma-style RMSNorm (Gemma, Gemma-2): the scale is
    ``1 + weight``, and normalisation and scaling are both done in float32
    before one cast back to the input dtype, as the original does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps)
        return y.type_as(x)


_GENERATED: Dict[Tuple[type, type], type] = {}


def _subclass(orig: type, mixin: type) -> type:
    """``Stable<Orig>``: the original class with nanguard's ``forward`` (so
    ``isinstance`` checks and ``_init_weights`` in transformers keep working)."""
    key = (orig, mixin)
    if key not in _GENERATED:
        _GENERATED[key] = type("Stable" + orig.__name__, (mixin, orig), {"__module__": __name__})
    return _GENERATED[key]


def _norm_hf_rms(m: nn.Module) -> nn.Module:
    if not (isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float)):
        raise _Unknown("not the Llama-style RMSNorm layout (weight, variance_epsilon)")
    return _share(m, _subclass(type(m), _HFRMSNorm))


def _norm_hf_rms_unit(m: nn.Module) -> nn.Module:
    if not (isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1
            and isinstance(getattr(m, "eps", None), float)):
        raise _Unknown("not the Gemma-style RMSNorm layout (weight, eps)")
    return _share(m, _subclass(type(m), _HFRMSNormUnitOffset))


def _norm_layernorm(m: nn.Module) -> nn.Module:
    if type(m) is not nn.LayerNorm:
        raise _Unknown("a subclass of nn.LayerNorm with its own forward")
    return StableLayerNorm.from_module(m)


def _norm_rmsnorm(m: nn.Module) -> nn.Module:
    if type(m) is not nn.RMSNorm:
        raise _Unknown("a subclass of nn.RMSNorm with its own forward")
    return StableRMSNorm.from_module(m)


def _mha(m: nn.Module) -> nn.Module:
    return SafeMultiheadAttention.from_module(m)


class _GELUTanh:
    """``forward`` of GPT-2's ``gelu_new``, ``0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3)))``, as PyTorch's fused kernel (``F.gelu(approximate="tanh")``,
    the same function, with float math for 16-bit inputs). Written out in
    fp16 as transformers does, ``x**3`` overflows for |x| > 40 and the
    backward's ``3 x**2`` for |x| > 148, where ``0 * inf`` makes a NaN
    gradient from finite inputs."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.gelu(input, approximate="tanh")


def _act_gelu_tanh(m: nn.Module) -> nn.Module:
    if list(m.parameters()) or list(m.children()):
        raise _Unknown("not the parameter-free NewGELUActivation")
    return _share(m, _subclass(type(m), _GELUTanh))


#: helper kind -> function(old module) -> replacement sharing its parameters
NORM_HELPERS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "hf_rms": _norm_hf_rms,
    "hf_rms_unit_offset": _norm_hf_rms_unit,
    "layernorm": _norm_layernorm,
    "rmsnorm": _norm_rmsnorm,
    "mha": _mha,
    "gelu_tanh": _act_gelu_tanh,
}

#: helper kinds that are activations (patched when ``activation=True``)
_ACTIVATIONS = {"gelu_tanh"}


class _Unknown(Exception):
    """A module that matched the table but not the layout its helper knows."""


# ---- nn.MultiheadAttention ------------------------------------------------------------


def _no_fastpath_hook(module, args):
    """A forward pre-hook that does nothing. Its presence is what keeps
    ``TransformerEncoderLayer``'s fused inference fast path (which reads the
    attention weights directly and never calls ``self_attn``) from running."""
    return None


class SafeMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose attention is :func:`safe_sdpa`.

    Same parameters and ``state_dict`` keys (it is a subclass, and
    :meth:`from_module` shares the original's parameters). ``key_padding_mask``
    and ``attn_mask`` keep PyTorch's conventions (bool ``True`` = not
    allowed, float = added); a query whose every key is masked gives zeros
    instead of NaN. ``need_weights=True`` needs the attention matrix that
    ``safe_sdpa`` never forms: such calls run the stock implementation
    (``TransformerEncoderLayer`` / ``DecoderLayer`` always pass ``False``).
    Modules built with ``add_bias_kv`` or ``add_zero_attn`` are not converted.
    """

    max_score: Optional[float] = None
    softcap: Optional[float] = None

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention, *, max_score=None, softcap=None) -> "SafeMultiheadAttention":
        if type(module) is not nn.MultiheadAttention:
            raise _Unknown("a subclass of nn.MultiheadAttention with its own forward")
        if module.bias_k is not None or module.add_zero_attn:
            raise _Unknown("add_bias_kv / add_zero_attn are not supported by SafeMultiheadAttention")
        new = _share(module, cls)
        new.max_score = max_score
        new.softcap = softcap
        new.register_forward_pre_hook(_no_fastpath_hook)
        return new

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if need_weights:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=True,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # now (L, B, E) as in F.multi_head_attention_forward
        L, B, E = query.shape
        S = key.shape[0]
        H, D = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.chunk(3)
        q = F.linear(query, wq, bq).view(L, B, H, D).permute(1, 2, 0, 3)
        k = F.linear(key, wk, bk).view(S, B, H, D).permute(1, 2, 0, 3)
        v = F.linear(value, wv, bv).view(S, B, H, D).permute(1, 2, 0, 3)
        mask = _mha_mask(attn_mask, key_padding_mask, B, H, L, S, q.dtype)
        causal = bool(is_causal) and mask is None
        out = safe_sdpa(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                        is_causal=causal, max_score=self.max_score, softcap=self.softcap)
        out = out.permute(2, 0, 1, 3).reshape(L, B, E)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if unbatched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _mha_mask(attn_mask, key_padding_mask, B, H, L, S, dtype):
    """PyTorch's MHA masks (bool True = masked, or additive float) combined
    into one mask for safe_sdpa, broadcastable to (B, H, L, S): bool (True =
    attend) when both are bool, else additive float."""
    parts = []
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 3:  # (B*H, L, S)
            m = m.view(B, H, L, S)
        parts.append(m)
    if key_padding_mask is not None:
        parts.append(key_padding_mask.view(B, 1, 1, S))
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        blocked = parts[0]
        for p in parts[1:]:
            blocked = blocked | p
        return ~blocked
    total = None
    for p in parts:
        f = torch.zeros(p.shape, dtype=torch.float32, device=p.device).masked_fill(p, float("-inf")) \
            if p.dtype == torch.bool else p.float()
        total = f if total is None else total + f
    return total


# ---- the Hugging Face attention function ---------------------------------------------------


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  softcap=None, position_bias=None, **kwargs):
    """transformers' attention-function signature (as ``sdpa_attention_forward``):
    query ``[B, Hq, L, D]``, key/value ``[B, Hkv, S, D]``, mask bool (True =
    attend) or additive float broadcastable to ``[B, 1|Hq, L, S]``; returns
    ``([B, L, Hq, D], None)``."""
    if position_bias is not None:
        raise NotImplementedError("nanguard attention: position_bias (T5-style) is not supported")
    opts = getattr(module, _OPTS_ATTR, None) or {}
    max_score = opts.get("max_score")
    if softcap is None:
        softcap = opts.get("softcap")
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        # autocast casts F.scaled_dot_product_attention's inputs; do the same
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    elif not (query.dtype == key.dtype == value.dtype):
        dt = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:
        # prefill into a longer, empty static cache: the keys past q_len are unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = safe_sdpa(query, key, value, attn_mask=attention_mask, dropout_p=float(dropout), is_causal=causal,
                    scale=scaling, enable_gqa=gqa, max_score=max_score, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    """Register nanguard with transformers' attention and mask registries
    (once; idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True


def _hf_pretrained_base():
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


# ---- patch / unpatch -------------------------------------------------------------------------


def _plan(model: nn.Module, table: Dict[str, str], by_type: Dict[type, str], summary: PatchSummary,
          norm: bool, attention_mha: bool, max_score, softcap=None, activation: bool = True):
    """(parent, name, old, new) for every module to swap; unknown modules go
    to ``summary.skipped``. Nothing is changed here."""
    swaps = []
    for pname, parent in model.named_modules():
        for cname, child in parent._modules.items():
            if child is None or _is_ours(child):
                continue
            qual = f"{pname}.{cname}" if pname else cname
            cls = type(child)
            kind = by_type.get(cls) if by_type else table.get(cls.__name__)
            if kind is None:
                lname = cls.__name__.lower()
                normish = "norm" in lname and "batchnorm" not in lname and "groupnorm" not in lname
                attnish = bool(by_type) and "attention" in lname
                if (normish or attnish) and not any(True for _ in child.children()):
                    summary.skipped[qual] = f"{cls.__name__}: not in nanguard's table"
                continue
            if kind == "mha":
                if not attention_mha:
                    continue
            elif kind in _ACTIVATIONS:
                if not activation:
                    continue
            elif not norm:
                continue
            if "forward" in child.__dict__:
                # e.g. accelerate's device hooks wrap forward on the instance:
                # a replacement would either lose them or run the old forward
                summary.skipped[qual] = f"{cls.__name__}: its forward is replaced on the instance (accelerate hooks?)"
                continue
            try:
                if kind == "mha":
                    new = SafeMultiheadAttention.from_module(child, max_score=max_score, softcap=softcap)
                else:
                    new = NORM_HELPERS[kind](child)
            except _Unknown as e:
                summary.skipped[qual] = f"{cls.__name__}: {e}"
                continue
            swaps.append((parent, cname, child, new))
    return swaps


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("nanguard")


def patch(model_or_class, *, attention: bool = True, norm: bool = True, max_score: Optional[float] = None,
          softcap: Optional[float] = None, activation: bool = True):
    """Make a model NaN-safe in place; returns a :class:`PatchSummary`.

    Args:
        model_or_class: a Hugging Face ``PreTrainedModel`` instance of a type in
            :data:`FAMILIES`, any ``nn.Module`` holding ``nn.LayerNorm`` /
            ``nn.RMSNorm`` / ``nn.MultiheadAttention`` (e.g.
            ``nn.TransformerEncoder``), or a ``PreTrainedModel`` subclass (its
            instances are patched as they are built).
        attention: route attention through ``safe_sdpa``.
        norm: swap norm layers for nanguard's.
        activation: swap activations whose 16-bit arithmetic overflows
            (GPT-2's ``NewGELUActivation``) for PyTorch's fused equivalent.
        max_score: clamp scaled attention scores to ``±max_score`` (off by default).
        softcap: soft-cap scores with ``softcap * tanh(s / softcap)`` for models
            that have no soft-cap of their own (a model's own, like Gemma-2's,
            is always kept).

    The model's ``state_dict`` keys and values are unchanged. Patching a
    patched model raises; :func:`unpatch` undoes it exactly.
    """
    if isinstance(model_or_class, type):
        return _patch_class(model_or_class, attention=attention, norm=norm, max_score=max_score, softcap=softcap,
                            activation=activation)
    model = model_or_class
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch expects an nn.Module or a model class, got {type(model).__name__}")
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise RuntimeError("this model is already patched by nanguard; call nanguard.unpatch(model) first")
    for name, v in (("max_score", max_score), ("softcap", softcap)):
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")
    base = _hf_pretrained_base()
    is_hf = base is not None and isinstance(model, base)
    record = _Record([], [], [], [], None)
    if is_hf:
        mtype = getattr(model.config, "model_type", "?")
        summary = PatchSummary(model_type=f"{mtype} ({type(model).__name__})")
        if mtype not in FAMILIES:
            summary.skipped[mtype] = "model type not in nanguard's table (nanguard.hf.FAMILIES); model left untouched"
            return summary
        swaps = _plan(model, FAMILIES[mtype], {}, summary, norm, False, max_score, activation=activation)
    else:
        summary = PatchSummary(model_type=type(model).__name__)
        swaps = _plan(model, {}, TORCH_MODULES, summary, norm, attention, max_score, softcap)
    record.summary = summary
    try:
        for parent, name, old, new in swaps:
            setattr(parent, name, new)
            record.swaps.append((parent, name, old, new))
            key = f"{type(old).__name__} -> {type(new).__name__}"
            summary.patched[key] = summary.patched.get(key, 0) + 1
        if not is_hf and attention:
            for m in model.modules():
                if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
                    # its nested-tensor inference path bypasses self_attn's forward
                    record.attrs.append((m, "use_nested_tensor", m.use_nested_tensor))
                    m.use_nested_tensor = False
        if is_hf and attention:
            _patch_hf_attention(model, record, summary, max_score, softcap)
    except Exception:
        _undo(record)
        raise
    object.__setattr__(model, _PATCH_ATTR, record)
    return summary


def _hf_configs(model):
    base = _hf_pretrained_base()
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, base) and id(m.config) not in seen:
            seen.add(id(m.config))
            out.append(m.config)
    return out


def _patch_hf_attention(model, record, summary, max_score, softcap):
    _register()
    configs = _hf_configs(model)
    before = model.config._attn_implementation
    can_set = getattr(model, "_can_set_attn_implementation", lambda: True)
    if not can_set():
        summary.skipped["attention"] = "the model does not dispatch through AttentionInterface; attention left as is"
        return
    for c in configs:
        record.configs.append((c, c._attn_implementation_internal))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if any(c._attn_implementation != ATTN_IMPLEMENTATION for c in configs):
        raise RuntimeError("transformers did not accept nanguard's attention implementation on every sub-model")
    n = 0
    for m in model.modules():
        # the innermost modules named *Attention are the ones that call the
        # attention function (BertAttention wraps BertSelfAttention)
        if "Attention" in type(m).__name__ and not any(
                "Attention" in type(c).__name__ for c in m.modules() if c is not m):
            n += 1
            if max_score is not None or softcap is not None:
                object.__setattr__(m, _OPTS_ATTR, {"max_score": max_score, "softcap": softcap})
                record.opts_on.append(m)
    summary.attn_implementation = (before, ATTN_IMPLEMENTATION)
    if n:
        summary.patched[f"attention ({before} -> {ATTN_IMPLEMENTATION}, safe_sdpa)"] = n


def _undo(record: _Record) -> None:
    for parent, name, old, new in reversed(record.swaps):
        _rebind(old, new)
        setattr(parent, name, old)
    for config, impl in record.configs:
        config._attn_implementation_internal = impl
    for m in record.opts_on:
        m.__dict__.pop(_OPTS_ATTR, None)
    for obj, attr, value in reversed(record.attrs):
        setattr(obj, attr, value)


def unpatch(model_or_class) -> None:
    """Undo :func:`patch`: the original modules (the same objects, pointing
    at the current parameters) and attention implementation come back. A
    model that is not patched is left as it is."""
    if isinstance(model_or_class, type):
        _unpatch_class(model_or_class)
        return
    record = getattr(model_or_class, _PATCH_ATTR, None)
    if record is None:
        return
    _undo(record)
    model_or_class.__dict__.pop(_PATCH_ATTR, None)


# ---- classes -------------------------------------------------------------------------------------

_CLASS_PATCHES: "weakref.WeakKeyDictionary[type, Tuple[Optional[Callable], dict]]" = weakref.WeakKeyDictionary()


def _patch_class(cls: type, **opts) -> PatchSummary:
    """Wrap ``cls.post_init`` (which every transformers model calls at the end
    of ``__init__``) so each new instance is patched; ``unpatch(cls)`` removes
    the wrapper."""
    base = _hf_pretrained_base()
    if base is None or not issubclass(cls, base):
        raise TypeError(f"patch(cls) supports transformers PreTrainedModel subclasses, got {cls.__name__}")
    if cls in _CLASS_PATCHES:
        raise RuntimeError(f"{cls.__name__} is already patched by nanguard; call nanguard.unpatch({cls.__name__}) first")
    mtype = getattr(getattr(cls, "config_class", None), "model_type", "?")
    summary = PatchSummary(model_type=f"{mtype} ({cls.__name__}, class)")
    if mtype not in FAMILIES:
        summary.skipped[mtype] = "model type not in nanguard's table (nanguard.hf.FAMILIES); class left untouched"
        return summary
    own = cls.__dict__.get("post_init")
    original = cls.post_init

    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if isinstance(self, cls) and getattr(self, _PATCH_ATTR, None) is None:
            patch(self, **opts)
        return out

    post_init.__wrapped__ = original
    cls.post_init = post_init
    _CLASS_PATCHES[cls] = (own, opts)
    summary.patched[f"{cls.__name__} instances built from now on"] = 1
    return summary


def _unpatch_class(cls: type) -> None:
    entry = _CLASS_PATCHES.pop(cls, None)
    if entry is None:
        return
    own, _ = entry
    if own is None:
        del cls.post_init
    else:
        cls.post_init = own
