"""``nanguard.z_loss``: the auxiliary loss that keeps a language model's
output logits from drifting (PaLM, Chowdhery et al. 2022; Wortsman et al.
2023 show it fixes output-logit divergence):

    z_loss = coeff * mean_t (log Z_t)^2,   log Z_t = logsumexp_v logits[t, v]

``log Z`` is computed in fp32 for fp16 / bf16 / fp32 logits (fp64 for fp64)
with PyTorch's max-subtracted ``logsumexp``, so neither fp16's range nor a
large logit overflows it; its gradient, ``2 * coeff * log Z_t * softmax_t /
n``, comes from autograd through the same ops. NaN or Inf logits give a NaN
or Inf loss: nothing is hidden.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["z_loss"]


def z_loss(logits: torch.Tensor, coeff: float = 1e-4, *, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``coeff * mean((logsumexp(logits, -1))^2)`` over the positions of
    ``logits`` (``[..., vocab]``) where ``mask`` (bool, ``logits.shape[:-1]``)
    is True (all of them by default). A 0-dim fp32 tensor (fp64 for fp64
    logits); 0 when no position is selected. Add it to the loss:
    ``loss = ce + nanguard.z_loss(logits)``."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got "
                        f"{type(logits).__name__ if not isinstance(logits, torch.Tensor) else logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary dimension of size >= 1, got shape {tuple(logits.shape)}")
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < math.inf:
        raise ValueError(f"coeff must be a finite number >= 0, got {coeff!r}")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype
            raise TypeError(f"mask must be a bool tensor, got {got}")
        if mask.shape != logits.shape[:-1]:
            raise ValueError(f"mask must have the shape of logits without its last dimension, "
                             f"{tuple(logits.shape[:-1])}; got {tuple(mask.shape)}")
        # the selected rows only: a masked-out row (padding, even NaN) gets exactly zero gradient
        logits = logits[mask.to(logits.device)]
    lz = torch.logsumexp(logits.to(acc), dim=-1)
    return coeff * (lz * lz).sum() / max(lz.numel(), 1)
