"""``nanguard.patching``: :func:`patch` / :func:`unpatch` (``nanguard.patch``,
``nanguard.unpatch``) make an existing Hugging Face Transformers model (or any
``nn.Module``, e.g. a ``torch.nn.TransformerEncoder``) NaN-safe in one call,
and undo it exactly.

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
  :class:`nanguard.nn.SafeMultiheadAttention` (a subclass computing the
  same projections around ``safe_sdpa``).
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

Patching again with the same options does nothing and returns the same
summary; with other options (another ``max_score``) it re-patches, as if
``unpatch`` had been called first.

The package's parts: ``_wrappers`` (:func:`unwrap`), ``_norm_forms``
(:data:`NORM_FORMS`, recognising and probing norms, the generated
``Stable<Orig>`` classes), ``_activations``, ``_hf_attention`` (the
transformers attention function, its registration and the rule reading
attention call sites), ``_apply`` (plan, apply, undo, class patching).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..attention import _check_guard
from ..nn import UnsupportedModuleError
from ._apply import PatchSummary, _Options, _patch_class, _patch_model, _unpatch_class, _unpatch_model
from ._hf_attention import ATTENTION_KWARGS_UNSUPPORTED, ATTN_IMPLEMENTATION, MIN_TRANSFORMERS
from ._norm_forms import NORM_FORMS
from ._wrappers import unwrap

__all__ = [
    "patch",
    "unpatch",
    "unwrap",
    "PatchSummary",
    "UnsupportedModuleError",
    "NORM_FORMS",
    "ATTENTION_KWARGS_UNSUPPORTED",
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS",
]


def patch(model_or_class, *, attention: bool = True, norm: bool = True, max_score: Optional[float] = None,
          softcap: Optional[float] = None, activation: bool = True, qk_norm: bool = False) -> PatchSummary:
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
        qk_norm: add an RMSNorm on every head's queries and keys before the
            scores (``q_norm`` / ``k_norm`` submodules, their weights
            calibrated on the first forward so that a pretrained model
            changes little: ``nanguard.patching._qk_norm``). Off by default:
            it adds parameters (patch before building the optimizer) and
            ``state_dict`` keys.

    The model's ``state_dict`` keys and values are unchanged (``qk_norm``
    adds keys). Patching a
    patched model again with the same options does nothing and returns the
    same summary; with other options it re-patches, as if :func:`unpatch`
    had been called first. :func:`unpatch` undoes it exactly.
    """
    for name, v in (("attention", attention), ("norm", norm), ("activation", activation), ("qk_norm", qk_norm)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    # safe_sdpa's own check: a finite number > 0, or None for off
    opts = _Options(attention, norm, activation,
                    None if max_score is None else _check_guard("max_score", max_score),
                    None if softcap is None else _check_guard("softcap", softcap), qk_norm)
    if isinstance(model_or_class, type):
        return _patch_class(model_or_class, opts)
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(f"patch expects an nn.Module or a model class, got {type(model_or_class).__name__}")
    return _patch_model(model_or_class, opts)


def unpatch(model_or_class) -> None:
    """Undo :func:`patch`: every changed module gets its own class back (the
    same objects, with whatever parameters they hold now), and the attention
    implementation and options come back. Wrappers are looked through as
    :func:`patch` does. A model that is not patched is left as it is; for a
    class, instances built from now on are no longer patched."""
    if isinstance(model_or_class, type):
        _unpatch_class(model_or_class)
        return
    if not isinstance(model_or_class, nn.Module):
        raise TypeError(f"unpatch expects an nn.Module or a model class, got {type(model_or_class).__name__}")
    _unpatch_model(model_or_class)
