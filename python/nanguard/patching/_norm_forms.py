"""Norms: the forms nanguard knows (:data:`NORM_FORMS`), how a candidate
module is recognised by its layout, and the numerical probe that picks the
form a class computes. Also the generated ``Stable<Orig>`` classes (the
original class with a nanguard ``forward``) that norms and activations
become."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..layernorm import NORM_EPS_ATTRS as _EPS_ATTRS
from ..layernorm import StableLayerNorm, StableRMSNorm, layer_norm, rms_norm
from ..nn import UnsupportedModuleError

_NOT_NORMS = ("batchnorm", "groupnorm", "instancenorm", "weightnorm", "spectralnorm", "normal")
#: the width of the probe of a parameter-free norm that does not say its width
_PROBE_WIDTH = 64


def _eps(self) -> float:
    name = type(self)._ng_eps_attr
    return getattr(self, name) if name else type(self)._ng_eps_default


def _shape(m: nn.Module, x: Optional[torch.Tensor] = None) -> Tuple[int, ...]:
    """The normalised shape: the weight's, else the bias's, else
    ``normalized_shape``, else (a parameter-free norm that does not say its
    width) the input's last dimension, or :data:`_PROBE_WIDTH` when there is
    no input yet."""
    for name in ("weight", "bias"):
        t = getattr(m, name, None)
        if isinstance(t, torch.Tensor):
            return tuple(t.shape)
    ns = getattr(m, "normalized_shape", None)
    if ns is None:
        return (_PROBE_WIDTH,) if x is None else (x.shape[-1],)
    return (int(ns),) if isinstance(ns, int) else tuple(ns)


# ---- the forms: mix-ins giving the original class nanguard's forward ------------------------


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


# ---- generated classes: Stable<Orig> -----------------------------------------------------------


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


# ---- recognising a norm and probing its form ----------------------------------------------------


def _is_norm_like(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        return True
    lname = type(m).__name__.lower()
    return "norm" in lname and not any(s in lname for s in _NOT_NORMS)


def _norm_layout(m: nn.Module) -> Tuple[Optional[str], Optional[float], bool, bool]:
    """(eps attribute, eps default, has weight, has bias), or raise
    :class:`UnsupportedModuleError`."""
    params = dict(m.named_parameters(recurse=False))
    w, b = params.pop("weight", None), params.pop("bias", None)
    if params:
        raise UnsupportedModuleError(f"parameters other than weight/bias ({', '.join(params)})")
    if any(True for _ in m.buffers(recurse=False)):
        raise UnsupportedModuleError("it has buffers")
    for t, name in ((w, "weight"), (b, "bias")):
        if t is not None and t.dim() != 1:
            raise UnsupportedModuleError(f"a {t.dim()}-D {name}")
    if w is not None and b is not None and w.shape != b.shape:
        raise UnsupportedModuleError("weight and bias of different shapes")
    for name in _EPS_ATTRS:
        v = getattr(m, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return name, None, w is not None, b is not None
    if w is None:  # a parameter-free norm with its epsilon written in forward (OLMo's): tried as 1e-5 and 1e-6
        return None, None, False, b is not None
    raise UnsupportedModuleError("no epsilon attribute (" + ", ".join(_EPS_ATTRS) + ")")


#: what ``nn.Module.__init__`` sets up (parameter, buffer, submodule and hook
#: tables): never copied into a probe
_MODULE_STATE = frozenset(vars(nn.Module()))


def _probe_copy(m: nn.Module, cls: type, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """A tiny real copy of ``m`` on the CPU, of class ``cls``: ``m``'s
    configuration attributes (not its tensors, submodules, hooks or a
    ``forward`` replaced on the instance) and fresh parameters of ``m``'s
    shapes in ``dtype`` (weights away from 0 and 1 so that ``w`` and ``1 + w``
    differ)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for k, v in m.__dict__.items():
        if k in _MODULE_STATE or "hook" in k or k in ("forward", "_old_forward") \
                or isinstance(v, (torch.Tensor, nn.Module)):
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
    width = _shape(m)[-1]
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


#: (class, eps attribute, eps value, layout) -> (replacement class, form) or the reason none fits
_NORM_CACHE: Dict[tuple, object] = {}


def _norm_replacement(m: nn.Module) -> Tuple[type, str]:
    """The class ``m`` becomes and the name of its form; raises
    :class:`UnsupportedModuleError` with the reason when no form matches.
    The probe's verdict is cached per class, epsilon and layout."""
    if type(m) is nn.LayerNorm:
        return StableLayerNorm, "nn.LayerNorm"
    if type(m) is nn.RMSNorm:
        return StableRMSNorm, "nn.RMSNorm"
    if not _has_shape(m) or len(_shape(m)) != 1:
        raise UnsupportedModuleError("not a norm over the last dimension with a known width")
    eps_attr, _, has_w, has_b = _norm_layout(m)
    eps_val = getattr(m, eps_attr) if eps_attr else None
    key = (type(m), eps_attr, eps_val, has_w, has_b)
    if key not in _NORM_CACHE:
        _NORM_CACHE[key] = _probe_forms(m, eps_attr, has_w, has_b)
    hit = _NORM_CACHE[key]
    if isinstance(hit, str):
        raise UnsupportedModuleError(hit)
    return hit


def _probe_forms(m: nn.Module, eps_attr: Optional[str], has_w: bool, has_b: bool):
    """(generated class, form) of the first form of :data:`NORM_FORMS` the
    layout allows and the probe matches, else the reason none does."""
    tried = []
    for form, (mixin, needs_w, is_rms) in NORM_FORMS.items():
        if (needs_w and not has_w) or (is_rms and has_b):
            continue
        for eps_default in ((None,) if eps_attr else (1e-5, 1e-6)):
            cls = _subclass(type(m), mixin, eps_attr, eps_default)
            why = _matches(m, cls)
            if why is None:
                return cls, form
            tried.append(f"{form}" + (f" (eps {eps_default:g})" if eps_default else "") + f": {why}")
    if tried:
        return "matches no known norm form on the probe (" + "; ".join(tried) + ")"
    return "a layout no known norm form has"


def _has_shape(m: nn.Module) -> bool:
    try:
        _shape(m)
        return True
    except (AttributeError, TypeError, ValueError):
        return False


