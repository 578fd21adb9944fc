"""``nanguard.patch`` / ``nanguard.unpatch``: make an existing Hugging Face
Transformers model (or any ``nn.Module``, e.g. a ``torch.nn.TransformerEncoder``)
NaN-safe in one call, and undo it exactly.

Patching is data, not copied model code, and it follows rules rather than a
list of model types:

- **attention** of Hugging Face models: an attention function backed by
  :func:`nanguard.functional.safe_sdpa` is registered with transformers'
  own extension points, ``AttentionInterface.register("nanguard", fn)`` and
  ``AttentionMaskInterface.register("nanguard", sdpa_mask)``, and selected
  with ``model.set_attn_implementation("nanguard")``, for every model whose
  attention goes through ``AttentionInterface``. It takes what those models
  pass (``scaling``, ``dropout``, ``softcap``, ``sliding_window`` through the
  mask, ``is_causal``, a ``position_bias`` that is not learned). A model whose
  attention calls pass something ``safe_sdpa`` cannot express exactly
  (attention sinks ``s_aux`` / ``sinks``, sparse ``indices``, a learned
  ``position_bias``) keeps its attention, and the summary says why. The
  keywords are read from the call sites in the model's own source
  (:data:`ATTENTION_KWARGS_UNSUPPORTED`), and the function refuses them at run
  time too, so nothing is ever approximated.
- **attention** of ``torch.nn.MultiheadAttention``: becomes
  :class:`SafeMultiheadAttention` (a subclass computing the same projections
  around ``safe_sdpa``).
- **norms**, recognised by layout: a leaf module whose class name says
  ``Norm`` (or an ``nn.LayerNorm`` / ``nn.RMSNorm``) with a 1-D ``weight``
  (or none), an optional ``bias``, an epsilon attribute (``variance_epsilon``,
  ``eps``, ...) and nothing else. Each candidate form in :data:`NORM_FORMS`
  (RMS or mean-centred; scale ``w`` or ``1 + w``; cast to the input dtype
  before or after the scale) is checked numerically against the original
  class on a tiny probe copy (fp32 values and gradients, bf16 / fp16 inputs
  with fp32 and 16-bit weights, rows of very different scales so that a wrong
  epsilon shows). The first form that matches is used; a class no form
  matches is left untouched and listed.
- **activations** whose 16-bit arithmetic overflows (GPT-2's ``gelu_new``,
  ``x**3`` in fp16): a parameter-free GELU-like module whose fp16 forward or
  backward is non-finite on finite inputs, and whose fp32 values match
  ``F.gelu(approximate="tanh")`` on a probe, becomes PyTorch's fused tanh GELU.

Modules are changed **in place**: the very same module object gets a
nanguard class (``StableLayerNorm``, or a generated ``Stable<Orig>``
subclass of its own class) and ``unpatch`` gives its class back. Parameters,
``state_dict`` keys, hooks (``nanguard.watch``, accelerate's, FSDP2's) and
every reference to the module stay valid, which is what makes wrapped
models work: ``patch`` / ``unpatch`` find the model inside ``torch.compile``'s
``OptimizedModule``, ``DistributedDataParallel`` / ``DataParallel``, FSDP's
``FullyShardedDataParallel``, peft's ``PeftModel`` (LoRA and other adapters,
merged or not) and accelerate-prepared models; FSDP2 (``fully_shard``)
modules are the model itself. A failure part-way rolls everything back.

``patch`` also accepts a model *class* (``nanguard.patch(LlamaForCausalLM)``):
every instance built afterwards, including by ``from_pretrained``, is patched
at the end of its construction. ``unpatch(cls)`` stops that.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import math
import sys
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import safe_sdpa
from .layernorm import StableLayerNorm, StableRMSNorm, layer_norm, rms_norm

__all__ = [
    "patch",
    "unpatch",
    "unwrap",
    "PatchSummary",
    "SafeMultiheadAttention",
    "NORM_FORMS",
    "ATTENTION_KWARGS_UNSUPPORTED",
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS",
]

#: the name nanguard's attention function is registered under in transformers
ATTN_IMPLEMENTATION = "nanguard"
#: oldest transformers release whose attention registry, mask interface and
#: ``set_attn_implementation`` this module uses (kept in pyproject.toml too)
MIN_TRANSFORMERS = "4.56"

#: keyword arguments of an attention call that ``safe_sdpa`` cannot express
#: exactly, with the reason given in the summary when a model passes them
ATTENTION_KWARGS_UNSUPPORTED: Dict[str, str] = {
    "s_aux": "attention sinks (s_aux): a learned extra logit per head in the softmax denominator, "
             "which safe_sdpa does not compute",
    "sinks": "attention sinks (sinks): a learned extra logit per head in the softmax denominator, "
             "which safe_sdpa does not compute",
    "position_bias": "a learned position_bias added to the scores: safe_sdpa's mask carries no gradient",
    "indices": "sparse attention (indices): keys selected per query, which safe_sdpa does not compute",
    "block_indices": "block-sparse attention (block_indices), which safe_sdpa does not compute",
}

_PATCH_ATTR = "_nanguard_patch"
_OPTS_ATTR = "_nanguard_attn_opts"
_NO_OVERFLOW = "_nanguard_no_overflow"


# ---- summary -------------------------------------------------------------------


@dataclasses.dataclass
class PatchSummary:
    """What :func:`patch` did. ``patched`` counts changed modules per
    ``"Old -> New"``; ``skipped`` maps a module (qualified name), a class, or
    ``"attention"`` to the reason it was left untouched; ``wrappers`` lists
    the wrappers the model was found inside, outermost first."""

    model_type: str
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)
    attn_implementation: Optional[Tuple[str, str]] = None  #: (before, after)
    wrappers: List[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        where = f" (inside {' > '.join(self.wrappers)})" if self.wrappers else ""
        lines = [f"nanguard.patch: {self.model_type}{where}"]
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

    classes: List[Tuple[nn.Module, type, List[str]]]  # module, its class before, attributes added
    hooks: list  # handles to remove
    configs: List[Tuple[object, object]]  # config, its _attn_implementation_internal
    opts_on: List[nn.Module]  # attention modules given _OPTS_ATTR
    attrs: List[Tuple[object, str, object]]  # (obj, attr, old value) to restore
    summary: Optional[PatchSummary]

    def __setstate__(self, state):
        # a patched model loaded in a new process (torch.load): its configs
        # name nanguard's attention, which must be registered there too
        self.__dict__.update(state)
        if self.configs:
            _register()


def _new_record() -> _Record:
    return _Record([], [], [], [], [], None)


# ---- finding the model inside wrappers ---------------------------------------------


def unwrap(model: nn.Module) -> Tuple[nn.Module, List[str]]:
    """The model inside the wrappers training code puts around it, and the
    wrappers' class names (outermost first): ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod``), ``DistributedDataParallel`` /
    ``DataParallel`` / FSDP's ``FullyShardedDataParallel`` (``module``),
    peft's ``PeftModel`` (``get_base_model()``) and its tuner (``model``).
    accelerate's ``prepare`` returns one of these or the model itself; an
    FSDP2 (``fully_shard``) module is the model itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    chain: List[str] = []
    for _ in range(32):
        cls = type(model)
        name, mod = cls.__name__, cls.__module__
        inner = None
        if name == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            inner = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or (
                name == "FullyShardedDataParallel" and mod.startswith("torch.distributed")):
            inner = model.module
        elif mod.startswith("peft"):
            if callable(getattr(model, "get_base_model", None)) and name.startswith("Peft"):
                inner = model.get_base_model()
            elif isinstance(getattr(model, "model", None), nn.Module):
                inner = model.model
        if inner is None or inner is model:
            break
        chain.append(name)
        model = inner
    return model, chain


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



# ---- norms: forms recognised by layout and checked on a probe ----------------------

#: names under which norm classes keep their epsilon, in the order tried
_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps")
_NOT_NORMS = ("batchnorm", "groupnorm", "instancenorm", "weightnorm", "spectralnorm", "normal")


def _eps(self) -> float:
    name = type(self)._ng_eps_attr
    return getattr(self, name) if name else type(self)._ng_eps_default


def _shape(self, x: torch.Tensor) -> Tuple[int, ...]:
    """The normalised shape: the weight's, else ``normalized_shape``, else
    (a parameter-free norm) the input's last dimension."""
    w = getattr(self, "weight", None)
    if w is not None:
        return tuple(w.shape)
    ns = getattr(self, "normalized_shape", None)
    if ns is None:
        return (x.shape[-1],)
    return (int(ns),) if isinstance(ns, int) else tuple(ns)


class _RMSCastThenScale:
    """RMSNorm, Llama style (Llama, Mistral, Qwen, Granite, Phi-3, ...):
    ``weight * (x / rms(x)).to(x.dtype)`` with fp32 statistics. When weight
    and input share a dtype the multiply is fused into the op (one rounding
    instead of two); otherwise it is done after, so the output dtype follows
    PyTorch's promotion exactly as the original's does."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = _shape(self, hidden_states)
        if self.weight.dtype == hidden_states.dtype:
            return rms_norm(hidden_states, shape, self.weight, _eps(self))
        return self.weight * rms_norm(hidden_states, shape, None, _eps(self))


class _RMSScaleFloat:
    """RMSNorm scaled in float32 and cast once (OLMo-2, GPT-OSS, Helium):
    ``(weight * x / rms(x)).to(x.dtype)``, everything in float32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y = rms_norm(hidden_states.float(), _shape(self, hidden_states), self.weight.float(), _eps(self))
        return y.to(hidden_states.dtype)


class _RMSWeightDtype:
    """RMSNorm, T5 style (T5, mT5, UMT5, LongT5): statistics in float32, the
    normalised values kept in float32 unless the weight is 16-bit (then cast
    to the weight's dtype), then ``weight * x``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == hidden_states.dtype == torch.float32:
            return rms_norm(hidden_states, _shape(self, hidden_states), w, _eps(self))
        y = rms_norm(hidden_states.float(), _shape(self, hidden_states), None, _eps(self))
        if w.dtype in (torch.float16, torch.bfloat16):
            y = y.to(w.dtype)
        return w * y


class _RMSNoWeight:
    """A parameter-free RMSNorm computed in float32 and cast once to the
    input dtype (Llama-4's and DeepSeek-V4's unweighted / L2 norms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float(), _shape(self, x), None, _eps(self)).to(x.dtype)


class _RMSUnitOffset:
    """RMSNorm with a ``1 + weight`` scale (Gemma, Gemma-2, Gemma-3):
    normalisation and scaling both in float32, one cast back to the input
    dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x.float(), _shape(self, x), 1.0 + self.weight.float(), _eps(self))
        return y.type_as(x)


class _LNInputDtype:
    """LayerNorm as ``nn.LayerNorm`` computes it: output in the input dtype,
    weight and bias used in the input dtype."""

    eps_floor = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, _shape(self, input), getattr(self, "weight", None), getattr(self, "bias", None),
                          _eps(self))


class _LNCastThenScale:
    """LayerNorm with fp32 statistics, cast to the input dtype, then
    ``weight * x + bias`` (DeBERTa's): as the Llama-style RMS form, fused
    when weight and input share a dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, w, b = _shape(self, x), self.weight, getattr(self, "bias", None)
        if w.dtype == x.dtype and (b is None or b.dtype == x.dtype):
            return layer_norm(x, shape, w, b, _eps(self))
        y = w * layer_norm(x, shape, None, None, _eps(self))
        return y if b is None else y + b


class _LNFloat:
    """LayerNorm computed and scaled in float32, cast once to the input dtype
    (Cohere's, OLMo's parameter-free one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = getattr(self, "weight", None), getattr(self, "bias", None)
        w = None if w is None else w.float()
        b = None if b is None else b.float()
        return layer_norm(x.float(), _shape(self, x), w, b, _eps(self)).to(x.dtype)


class _LNUnitOffset:
    """LayerNorm with a ``1 + weight`` scale, with autocast off and the
    arguments cast to the autocast dtype first when it is on (Nemotron's
    ``LayerNorm1P``); like ``F.layer_norm`` it normalises and scales in
    float32 and rounds once to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight + 1.0, getattr(self, "bias", None)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w = x.to(dt), w.to(dt)
            b = None if b is None else b.to(dt)
        with torch.autocast(dev, enabled=False):
            y = layer_norm(x.float(), _shape(self, x), w.float(), None if b is None else b.float(), _eps(self))
        return y.to(x.dtype)


#: the norm forms nanguard knows, in the order a candidate is tried:
#: name -> (mixin, needs a weight, RMS (no bias) or LayerNorm)
NORM_FORMS: Dict[str, Tuple[type, bool, bool]] = {
    "rms, cast then scale": (_RMSCastThenScale, True, True),
    "rms, scale in fp32": (_RMSScaleFloat, True, True),
    "rms, 1+weight in fp32": (_RMSUnitOffset, True, True),
    "rms, scale in the weight's dtype": (_RMSWeightDtype, True, True),
    "rms, no weight, fp32": (_RMSNoWeight, False, True),
    "layernorm, input dtype": (_LNInputDtype, False, False),
    "layernorm, fp32": (_LNFloat, False, False),
    "layernorm, cast then scale": (_LNCastThenScale, True, False),
    "layernorm, 1+weight": (_LNUnitOffset, True, False),
}


class _GELUTanh:
    """``forward`` of a tanh-approximated GELU written out by hand (GPT-2's
    ``gelu_new``, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``), as
    PyTorch's fused kernel (``F.gelu(approximate="tanh")``: the same
    function, with float math for 16-bit inputs). Written out in fp16, ``x**3``
    overflows for |x| > 40 and the backward's ``3 x**2`` for |x| > 148, where
    ``0 * inf`` makes a NaN gradient from finite inputs."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.gelu(input, approximate="tanh")


_GENERATED: Dict[Tuple[type, type, Optional[str], Optional[float]], type] = {}


def _subclass(orig: type, mixin: type, eps_attr: Optional[str] = None, eps_default: Optional[float] = None) -> type:
    """``Stable<Orig>``: the original class with nanguard's ``forward`` (so
    ``isinstance`` checks and ``_init_weights`` in transformers keep working)."""
    key = (orig, mixin, eps_attr, eps_default)
    if key not in _GENERATED:
        _GENERATED[key] = type("Stable" + orig.__name__, (mixin, orig),
                               {"__module__": __name__, "_ng_eps_attr": eps_attr, "_ng_eps_default": eps_default,
                                "_ng_key": key, "__reduce_ex__": _reduce_generated})
    return _GENERATED[key]


def _reduce_generated(self, protocol):
    """Pickle a module of a generated class by what generates it (the
    original class, the form, the epsilon), so ``torch.save(model)`` and
    ``copy.deepcopy`` work in a process that has not patched yet."""
    return (_new_generated, type(self)._ng_key, self.__getstate__())


def _new_generated(orig: type, mixin: type, eps_attr: Optional[str], eps_default: Optional[float]) -> nn.Module:
    cls = _subclass(orig, mixin, eps_attr, eps_default)
    return cls.__new__(cls)


class _Unknown(Exception):
    """A module that looked like a candidate but matched no known form."""


def _is_norm_like(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        return True
    lname = type(m).__name__.lower()
    return "norm" in lname and not any(s in lname for s in _NOT_NORMS)


def _norm_layout(m: nn.Module) -> Tuple[Optional[str], Optional[float], bool, bool]:
    """(eps attribute, eps default, has weight, has bias) or raise _Unknown."""
    params = dict(m.named_parameters(recurse=False))
    w, b = params.pop("weight", None), params.pop("bias", None)
    if params:
        raise _Unknown(f"parameters other than weight/bias ({', '.join(params)})")
    if any(True for _ in m.buffers(recurse=False)):
        raise _Unknown("it has buffers")
    for t, name in ((w, "weight"), (b, "bias")):
        if t is not None and t.dim() != 1:
            raise _Unknown(f"a {t.dim()}-D {name}")
    if w is not None and b is not None and w.shape != b.shape:
        raise _Unknown("weight and bias of different shapes")
    for name in _EPS_ATTRS:
        v = getattr(m, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return name, None, w is not None, b is not None
    if w is None:  # a parameter-free norm with its epsilon written in forward (OLMo's): tried as 1e-5 and 1e-6
        return None, None, False, b is not None
    raise _Unknown("no epsilon attribute (" + ", ".join(_EPS_ATTRS) + ")")


def _probe_copy(m: nn.Module, cls: type, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """A tiny real copy of ``m`` on the CPU, of class ``cls``, with fresh
    parameters of ``m``'s shapes in ``dtype`` (weights away from 0 and 1 so
    that ``w`` and ``1 + w`` differ)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for k, v in m.__dict__.items():
        if k.startswith("_") and (k in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
                                  or "hook" in k or k.startswith("_state_dict") or k.startswith("_load_state_dict")
                                  or k.startswith("_forward") or k.startswith("_backward")):
            continue
        if k in ("forward", "_old_forward") or isinstance(v, (torch.Tensor, nn.Module)):
            continue
        new.__dict__[k] = v
    for k, p in m._parameters.items():
        if p is None:
            new._parameters[k] = None
            continue
        base = 0.5 if k == "weight" else 0.0
        data = (base + 0.4 * torch.randn(tuple(p.shape), generator=gen)).to(dtype)
        new._parameters[k] = nn.Parameter(data)
    return new


def _probe_inputs(width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different scales and offsets (a wrong epsilon or a wrong
    centring shows on the small ones), in float32."""
    rows = []
    for scale, shift in ((1.0, 0.0), (1e-3, 0.0), (3e-2, 0.02), (30.0, 5.0), (1.0, 2.0), (0.1, -0.3)):
        rows.append(shift + scale * torch.randn(width, generator=gen))
    return torch.stack(rows).view(2, 3, width)


def _check_same(a, b, rtol: float, atol: float, wide_from_16: bool = False) -> bool:
    """Same dtype, shape and non-finite pattern, and every element within
    ``atol + rtol * |a|``. ``wide_from_16``: the input was 16-bit; when the
    output is fp32 / fp64 anyway, 99% of its elements must also agree to fp32
    rounding, so a form that rounds to 16 bits where the original keeps
    fp32 (T5's norm against Llama's form) cannot pass on the loose bound,
    while an occasional rounding flip of a value both round does not fail."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    wide = a.dtype in (torch.float32, torch.float64)
    a, b = a.double(), b.double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return False
    fin = torch.isfinite(a)
    d, ref = (a[fin] - b[fin]).abs(), a[fin].abs()
    if wide_from_16 and ref.numel():
        # a value rounded to 16 bits and then added to (DeBERTa's w * x + b)
        # keeps an absolute error of the terms' size, not the sum's
        atol = atol + rtol * float(ref.max())
    if not bool((d <= atol + rtol * ref).all()):
        return False
    if wide_from_16 and wide and d.numel():
        off = (d > 1e-6 + 2e-5 * ref).double().mean().item()
        return off <= 0.01
    return True


#: probe cases: (input dtype, parameter dtype, rtol, atol). fp32: the same
#: math in another order (one fused multiply, two-pass statistics); 16-bit:
#: both round the output once or twice, so two units in the last place.
_PROBE_CASES = (
    (torch.float32, torch.float32, 2e-5, 1e-6),
    (torch.bfloat16, torch.float32, 2 ** -7, 1e-3),
    (torch.bfloat16, torch.bfloat16, 2 ** -7, 1e-3),
    (torch.float16, torch.float32, 2 ** -10, 1e-4),
    (torch.float16, torch.float16, 2 ** -10, 1e-4),
)


def _matches(m: nn.Module, new_cls: type) -> Optional[str]:
    """None when ``new_cls`` computes what ``type(m)`` computes on the
    probes (values, dtypes, and fp32 gradients), else what differed."""
    width = _shape_of(m)[-1]
    for i, (xdt, pdt, rtol, atol) in enumerate(_PROBE_CASES):
        gen = torch.Generator().manual_seed(1234 + i)
        orig = _probe_copy(m, type(m), pdt, gen)
        gen = torch.Generator().manual_seed(1234 + i)
        ours = _probe_copy(m, new_cls, pdt, gen)
        x = _probe_inputs(width, torch.Generator().manual_seed(99)).to(xdt)
        grad_check = xdt == torch.float32
        xa, xb = x.clone().requires_grad_(grad_check), x.clone().requires_grad_(grad_check)
        with torch.autocast("cpu", enabled=False), torch.set_grad_enabled(grad_check):
            try:
                a = orig(xa)
            except Exception:
                continue  # the original does not run on this case: nothing to match
            try:
                b = ours(xb)
            except Exception as e:
                return f"fails where the original runs ({type(e).__name__}: {e})"
            if not _check_same(a, b, rtol, atol, wide_from_16=xdt != torch.float32):
                return f"output differs for {xdt} input with {pdt} parameters"
            if grad_check:
                go = torch.randn(a.shape, generator=torch.Generator().manual_seed(7))
                pa, pb = [xa] + list(orig.parameters()), [xb] + list(ours.parameters())
                ga = torch.autograd.grad(a, pa, go, allow_unused=True)
                gb = torch.autograd.grad(b, pb, go, allow_unused=True)
                for u, v in zip(ga, gb):
                    if (u is None) != (v is None) or (u is not None and not _check_same(u, v, 1e-4, 1e-5)):
                        return "gradients differ in fp32"
    return None


#: the width of the probe of a parameter-free norm that does not say its width
_PROBE_WIDTH = 64


def _shape_of(m: nn.Module) -> Tuple[int, ...]:
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor):
        return tuple(w.shape)
    b = getattr(m, "bias", None)
    if isinstance(b, torch.Tensor):
        return tuple(b.shape)
    ns = getattr(m, "normalized_shape", None)
    if ns is None:
        return (_PROBE_WIDTH,)  # it normalises whatever width it is given
    return (int(ns),) if isinstance(ns, int) else tuple(ns)


#: (class, eps attribute, eps value, layout) -> (replacement class, form) or the reason none fits
_NORM_CACHE: Dict[tuple, object] = {}


def _norm_replacement(m: nn.Module) -> Tuple[type, str]:
    """The class ``m`` becomes and the name of its form; raises _Unknown
    with the reason when no form matches."""
    if type(m) is nn.LayerNorm:
        return StableLayerNorm, "nn.LayerNorm"
    if type(m) is nn.RMSNorm:
        return StableRMSNorm, "nn.RMSNorm"
    if not _has_shape(m) or len(_shape_of(m)) != 1:
        raise _Unknown("not a norm over the last dimension with a known width")
    eps_attr, _, has_w, has_b = _norm_layout(m)
    eps_val = getattr(m, eps_attr) if eps_attr else None
    key = (type(m), eps_attr, eps_val, has_w, has_b)
    hit = _NORM_CACHE.get(key)
    if hit is None:
        tried = []
        for form, (mixin, needs_w, is_rms) in NORM_FORMS.items():
            if (needs_w and not has_w) or (is_rms and has_b):
                continue
            for eps_default in ((None,) if eps_attr else (1e-5, 1e-6)):
                cls = _subclass(type(m), mixin, eps_attr, eps_default)
                why = _matches(m, cls)
                if why is None:
                    hit = (cls, form)
                    break
                tried.append(f"{form}" + (f" (eps {eps_default:g})" if eps_default else "") + f": {why}")
            if hit is not None:
                break
        if hit is None:
            hit = "matches no known norm form on the probe (" + "; ".join(tried) + ")" if tried \
                else "a layout no known norm form has"
        _NORM_CACHE[key] = hit
    if isinstance(hit, str):
        raise _Unknown(hit)
    return hit


def _has_shape(m: nn.Module) -> bool:
    try:
        _shape_of(m)
        return True
    except (AttributeError, TypeError, ValueError):
        return False


_ACT_CACHE: Dict[tuple, object] = {}


def _act_replacement(m: nn.Module) -> Optional[type]:
    """A fused replacement for a parameter-free GELU-like activation whose
    16-bit arithmetic overflows; None when it does not overflow (nothing to
    fix); raises _Unknown when it overflows but is not the tanh GELU."""
    # an instance's own settings (nn.GELU's approximate=...) can change its math
    key = (type(m), tuple(sorted((k, v) for k, v in m.__dict__.items()
                                 if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None))))))
    if key in _ACT_CACHE:
        hit = _ACT_CACHE[key]
    else:
        hit = _act_probe(m)
        _ACT_CACHE[key] = hit
    if isinstance(hit, str):
        raise _Unknown(hit)
    return hit


def _act_probe(m: nn.Module):
    x = torch.tensor([-300.0, -150.0, -41.0, -1.0, 0.5, 41.0, 150.0, 300.0], dtype=torch.float16)
    xs = x.clone().requires_grad_()
    try:
        with torch.autocast("cpu", enabled=False):
            y = m(xs)
            (g,) = torch.autograd.grad(y.float().sum(), xs)
    except Exception as e:
        return f"does not run on a 16-bit probe ({type(e).__name__})"
    if bool(torch.isfinite(y).all()) and bool(torch.isfinite(g).all()):
        return None
    grid = torch.linspace(-8.0, 8.0, 161)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        a = m(grid)
    ref = F.gelu(grid, approximate="tanh")
    if not (isinstance(a, torch.Tensor) and a.shape == ref.shape and torch.allclose(a, ref, rtol=1e-5, atol=1e-6)):
        return "overflows in 16-bit arithmetic but is not the tanh GELU; no exact fused replacement"
    return _subclass(type(m), _GELUTanh)


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
    ``([B, L, Hq, D], None)``. Arguments that change the math and that
    ``safe_sdpa`` cannot express raise ``NotImplementedError`` (never an
    approximation)."""
    for k in ("s_aux", "sinks", "indices", "block_indices"):
        if kwargs.get(k) is not None:
            raise NotImplementedError(f"nanguard attention: {ATTENTION_KWARGS_UNSUPPORTED[k]}")
    if position_bias is not None and position_bias.requires_grad:
        raise NotImplementedError(f"nanguard attention: {ATTENTION_KWARGS_UNSUPPORTED['position_bias']}")
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
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    if position_bias is not None:
        # a fixed (not learned) additive bias: one float mask, as transformers' sdpa path builds it
        bias = position_bias.to(torch.float32)
        if attention_mask is None and causal:
            attention_mask = torch.ones(q_len, key.shape[2], dtype=torch.bool, device=query.device).tril()
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attention_mask, float("-inf"))
        elif attention_mask is not None:
            bias = bias + attention_mask.float()
        attention_mask, causal = bias.to(query.dtype) if query.dtype == torch.float64 else bias, False
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
    if "transformers" not in sys.modules:
        return None  # a model of transformers cannot exist without it
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


_KWARGS_CACHE: Dict[str, Optional[frozenset]] = {}


def _attention_call_kwargs(module_name: str) -> Optional[frozenset]:
    """Keyword names passed to ``attention_interface(...)`` anywhere in a
    modeling module's source (None when the source cannot be read)."""
    if module_name in _KWARGS_CACHE:
        return _KWARGS_CACHE[module_name]
    found = None
    mod = sys.modules.get(module_name)
    try:
        tree = ast.parse(inspect.getsource(mod))
    except (OSError, TypeError, SyntaxError):
        tree = None
    if tree is not None:
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
                found.update(k.arg for k in node.keywords if k.arg)
        found = frozenset(found)
    _KWARGS_CACHE[module_name] = found
    return found


def _attention_blocker(model: nn.Module) -> Optional[str]:
    """Why the model's attention cannot go through nanguard's function
    exactly, or None when it can."""
    base = _hf_pretrained_base()
    subs = [m for m in model.modules() if isinstance(m, base)]
    for m in subs:
        can = getattr(type(m), "_can_set_attn_implementation", None)
        if can is not None and not can():
            return (f"{type(m).__name__} computes attention itself, not through AttentionInterface; "
                    "its attention is left as is")
    modules = {type(m).__module__ for m in model.modules() if "attention" in type(m).__name__.lower()}
    modules |= {type(m).__module__ for m in subs}
    for name in sorted(modules):
        kws = _attention_call_kwargs(name)
        if kws is None:
            continue
        for k, why in ATTENTION_KWARGS_UNSUPPORTED.items():
            if k in kws:
                return f"its attention passes {k}: {why}; its attention is left as is"
    return None


# ---- patch / unpatch -------------------------------------------------------------------------


def _plan(model: nn.Module, summary: PatchSummary, norm: bool, attention_mha: bool, activation: bool):
    """(module, qualified name, new class, extra attributes) for every module
    to change; modules that look like candidates but match no known form go
    to ``summary.skipped``. Nothing is changed here."""
    plan = []
    for qual, child in model.named_modules():
        if child is model or _is_ours(child):
            continue
        cls = type(child)
        leaf = not any(True for _ in child.children())
        new, extra = None, {}
        try:
            if isinstance(child, nn.MultiheadAttention):
                if not attention_mha:
                    continue
                if type(child) is not nn.MultiheadAttention:
                    raise _Unknown("a subclass of nn.MultiheadAttention with its own forward")
                if child.bias_k is not None or child.add_zero_attn:
                    raise _Unknown("add_bias_kv / add_zero_attn are not supported by SafeMultiheadAttention")
                new, extra = SafeMultiheadAttention, {"max_score": None, "softcap": None, "_ng_hook": True}
            elif leaf and _is_norm_like(child):
                if not norm:
                    continue
                new, _ = _norm_replacement(child)
                if new is StableLayerNorm or new is StableRMSNorm:
                    extra = {"eps_floor": None}
            elif leaf and activation and "gelu" in cls.__name__.lower() and not list(child.parameters(recurse=False)):
                new = _act_replacement(child)
                if new is None:
                    continue
            else:
                continue
        except _Unknown as e:
            summary.skipped[qual] = f"{cls.__name__}: {e}"
            continue
        if "forward" in child.__dict__ and "_old_forward" not in child.__dict__:
            # a forward replaced on the instance would keep running the old code
            summary.skipped[qual] = f"{cls.__name__}: its forward is replaced on the instance"
            continue
        plan.append((child, qual, new, extra))
    return plan


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("nanguard")


def _check_guard(name, v):
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")


def patch(model_or_class, *, attention: bool = True, norm: bool = True, max_score: Optional[float] = None,
          softcap: Optional[float] = None, activation: bool = True):
    """Make a model NaN-safe in place; returns a :class:`PatchSummary`.

    Args:
        model_or_class: a Hugging Face ``PreTrainedModel``, any ``nn.Module``
            (e.g. ``nn.TransformerEncoder``, or a module of yours holding
            transformers models, whose attention is patched too), either of them inside
            ``torch.compile`` / DDP / FSDP / peft / accelerate wrappers, or a
            ``PreTrainedModel`` subclass (its instances are patched as they
            are built).
        attention: route attention through ``safe_sdpa``.
        norm: give norm layers nanguard's ``forward``.
        activation: give activations whose 16-bit arithmetic overflows
            (GPT-2's ``NewGELUActivation``) PyTorch's fused equivalent.
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
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(f"patch expects an nn.Module or a model class, got {type(model_or_class).__name__}")
    for name, v in (("attention", attention), ("norm", norm), ("activation", activation)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    _check_guard("max_score", max_score)
    _check_guard("softcap", softcap)
    model, chain = unwrap(model_or_class)
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise RuntimeError("this model is already patched by nanguard; call nanguard.unpatch(model) first")
    base = _hf_pretrained_base()
    is_hf = base is not None and isinstance(model, base)
    record = _new_record()
    if is_hf:
        mtype = getattr(model.config, "model_type", "?")
        summary = PatchSummary(model_type=f"{mtype} ({type(model).__name__})", wrappers=chain)
    else:
        summary = PatchSummary(model_type=type(model).__name__, wrappers=chain)
    plan = _plan(model, summary, norm, attention, activation)
    record.summary = summary
    try:
        for child, _qual, new, extra in plan:
            old = type(child)
            added = []
            hook = extra.get("_ng_hook")
            for k, v in extra.items():
                if k != "_ng_hook":
                    child.__dict__[k] = v
                    added.append(k)
            if new is SafeMultiheadAttention:
                child.__dict__["max_score"], child.__dict__["softcap"] = max_score, softcap
            child.__class__ = new
            record.classes.append((child, old, added))
            if hook:
                record.hooks.append(child.register_forward_pre_hook(_no_fastpath_hook))
            if "_old_forward" in child.__dict__:
                # accelerate's device hooks call the bound forward they kept
                record.attrs.append((child, "_old_forward", child.__dict__["_old_forward"]))
                child._old_forward = new.forward.__get__(child)
            key = f"{old.__name__} -> {new.__name__}"
            summary.patched[key] = summary.patched.get(key, 0) + 1
        if not is_hf and attention:
            for m in model.modules():
                if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
                    # its nested-tensor inference path bypasses self_attn's forward
                    record.attrs.append((m, "use_nested_tensor", m.use_nested_tensor))
                    m.use_nested_tensor = False
        if is_hf and attention:
            _patch_hf_attention(model, record, summary, max_score, softcap)
        elif attention and base is not None:
            # transformers models held by a module of the user's (a LightningModule, a custom head)
            for qual, sub in _outermost_hf(model, base):
                _patch_hf_attention(sub, record, summary, max_score, softcap, where=qual)
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


def _outermost_hf(model: nn.Module, base: type) -> List[Tuple[str, nn.Module]]:
    """(qualified name, module) of the transformers models inside ``model``
    that no other transformers model inside it holds."""
    found: List[Tuple[str, nn.Module]] = []
    for qual, m in model.named_modules():
        if m is not model and isinstance(m, base) and not any(qual.startswith(q + ".") for q, _ in found):
            found.append((qual, m))
    return found


def _patch_hf_attention(model, record, summary, max_score, softcap, where: str = ""):
    key = f"{where} attention" if where else "attention"
    why = _attention_blocker(model)
    if why is not None:
        summary.skipped[key] = why
        return
    _register()
    configs = _hf_configs(model)
    before = model.config._attn_implementation
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
    if summary.attn_implementation is None:
        summary.attn_implementation = (before, ATTN_IMPLEMENTATION)
    if n:
        k = f"attention ({before} -> {ATTN_IMPLEMENTATION}, safe_sdpa)" + (f" in {where}" if where else "")
        summary.patched[k] = summary.patched.get(k, 0) + n


def _undo(record: _Record) -> None:
    for h in record.hooks:
        h.remove()
    for obj, attr, value in reversed(record.attrs):
        setattr(obj, attr, value)
    for m, old, added in reversed(record.classes):
        m.__class__ = old
        for k in added:
            m.__dict__.pop(k, None)
        if old is nn.MultiheadAttention or issubclass(old, nn.MultiheadAttention):
            m.__dict__.pop("max_score", None)
            m.__dict__.pop("softcap", None)
    for config, impl in record.configs:
        config._attn_implementation_internal = impl
    for m in record.opts_on:
        m.__dict__.pop(_OPTS_ATTR, None)


def unpatch(model_or_class) -> None:
    """Undo :func:`patch`: every changed module gets its own class back (the
    same objects, with whatever parameters they hold now), and the attention
    implementation and options come back. Wrappers are looked through as
    :func:`patch` does. A model that is not patched is left as it is."""
    if isinstance(model_or_class, type):
        _unpatch_class(model_or_class)
        return
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(f"unpatch expects an nn.Module or a model class, got {type(model_or_class).__name__}")
    model, _ = unwrap(model_or_class)
    record = getattr(model, _PATCH_ATTR, None)
    if record is None:
        return
    _undo(record)
    model.__dict__.pop(_PATCH_ATTR, None)


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
        raise RuntimeError(
            f"{cls.__name__} is already patched by nanguard; call nanguard.unpatch({cls.__name__}) first")
    mtype = getattr(getattr(cls, "config_class", None), "model_type", "?")
    summary = PatchSummary(model_type=f"{mtype} ({cls.__name__}, class)")
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
