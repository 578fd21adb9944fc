"""Drop-in modules: same constructor arguments and state_dict keys as the
PyTorch / Hugging Face modules they replace.

:class:`SafeMultiheadAttention` is what :func:`nanguard.patch` turns an
``nn.MultiheadAttention`` into; :class:`UnsupportedModuleError` is what a
``from_module`` raises for a module it cannot convert exactly (``patch``
lists such modules in its summary instead, and re-exports the class as
``nanguard.patching.UnsupportedModuleError``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SafeAttention, safe_sdpa
from .layernorm import StableLayerNorm, StableRMSNorm

__all__ = ["SafeAttention", "SafeMultiheadAttention", "StableLayerNorm", "StableRMSNorm"]


class UnsupportedModuleError(TypeError):
    """A module that looks like a candidate for a nanguard replacement but
    that nanguard cannot convert exactly (a subclass with its own
    ``forward``, an unsupported option, a norm of no known form). A
    ``TypeError``, as ``StableLayerNorm.from_module`` raises for a module of
    the wrong class: what is refused is the kind of module, not a value."""


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

    @staticmethod
    def _check_convertible(module: nn.Module) -> None:
        """Raise :class:`UnsupportedModuleError` unless ``module`` is an
        ``nn.MultiheadAttention`` this class computes exactly."""
        if type(module) is not nn.MultiheadAttention:
            raise UnsupportedModuleError("a subclass of nn.MultiheadAttention with its own forward"
                                         if isinstance(module, nn.MultiheadAttention)
                                         else f"not an nn.MultiheadAttention: {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise UnsupportedModuleError("add_bias_kv / add_zero_attn are not supported by SafeMultiheadAttention")

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention, *, max_score=None, softcap=None) -> "SafeMultiheadAttention":
        """A SafeMultiheadAttention sharing ``module``'s parameters and
        ``out_proj`` (no copy); raises :class:`UnsupportedModuleError` for a
        module :meth:`_check_convertible` refuses."""
        cls._check_convertible(module)
        new = cls(module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
                  kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first, device="meta")
        for name, p in module.named_parameters(recurse=False):
            setattr(new, name, p)
        new.out_proj = module.out_proj
        new.train(module.training)
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
        q, k, v = self._project_heads(query, key, value)
        mask = _mha_mask(attn_mask, key_padding_mask, B, self.num_heads, L, key.shape[0])
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

    def _project_heads(self, query, key, value):
        """The input projections of (L|S, B, E) query, key and value, as
        (B, H, L|S, head_dim)."""
        H, D = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.chunk(3)
        return tuple(F.linear(x, w, b).view(x.shape[0], x.shape[1], H, D).permute(1, 2, 0, 3)
                     for x, w, b in ((query, wq, bq), (key, wk, bk), (value, wv, bv)))


def _mha_mask(attn_mask, key_padding_mask, B, H, L, S):
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
