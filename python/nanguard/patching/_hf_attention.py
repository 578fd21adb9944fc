"""Attention of Hugging Face transformers models: nanguard's attention
function (transformers' attention-function signature, backed by
:func:`nanguard.functional.safe_sdpa`), its registration with transformers'
``AttentionInterface`` / ``AttentionMaskInterface``, the rule deciding
whether a model's attention can use it (read from the model's own source),
and switching a model to it."""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _checks
from ..attention import safe_sdpa
from ._wrappers import _hf_pretrained_base

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

#: attribute of an attention module holding the max_score / softcap options of patch
_OPTS_ATTR = "_nanguard_attn_opts"


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
    # read from the instance dict, where patch sets it: a getattr that
    # misses goes through nn.Module.__getattr__, a few microseconds a call
    opts = getattr(module, "__dict__", {}).get(_OPTS_ATTR) or {}
    max_score = opts.get("max_score")
    if softcap is None:
        softcap = opts.get("softcap")
    dev = _checks.device_type(query)
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
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


def _hf_configs(model):
    """The configs of ``model`` and of every transformers model inside it,
    each once."""
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
    """Switch transformers model ``model`` (at ``where`` inside the patched
    model) to nanguard's attention, with the options on its attention
    modules, noting in ``record`` how to undo it; or, when the rule excludes
    its attention, say why in ``summary.skipped``."""
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
