"""``nanguard.patch(model, qk_norm=True)``: RMSNorm on the queries and keys of
every attention head, before the scores (ViT-22B, Dehghani et al. 2023;
OLMo 2): the logits ``q . k`` can no longer grow with the weights, the
instability Wortsman et al. 2023 measure it to remove.

For each attention module whose q and k come from child projections
(``q_proj`` / ``k_proj``, ``query`` / ``key``, or GPT-2's fused ``c_attn``)
and that has no q/k norm of its own, two :class:`QKNorm` modules are added
to it (``q_norm``, ``k_norm``: one ``weight`` of ``head_dim`` shared by the
heads, as OLMo 2 and Qwen3 have them), and a forward hook on the projection
normalises each head's rows of its output with nanguard's ``rms_norm``
(fp32 statistics). Rotary embeddings come after, as in those models.

**Initialisation.** A pretrained model's projections were not trained for
normalised rows, so a ``weight`` of ones would rescale every q and k to
norm ``sqrt(head_dim)`` and change every logit. Instead the weight is
calibrated on the first forward pass (under ``no_grad``, once):
``w_j = sqrt(E[x_j^2] / E[x_j^2 / ms(x)])``, the expectations over that
batch's tokens and heads and ``ms(x)`` a row's mean square, so that each
dimension keeps its mean square over the batch. What still changes: within
the batch, a token's q (or k) keeps its direction but its per-head norm is
set by ``w`` alone, so tokens with larger- or smaller-than-typical q and k
get logits scaled towards the typical; the logits of a typical token are
nearly unchanged. ``test_qk_norm.py`` measures the output change against a
weight of ones. The calibration happens before the first optimizer step
only if the model runs a forward first: patch before building the
optimizer (the new weights must be in it).

The model's ``state_dict`` gains ``<attention>.q_norm.weight``,
``k_norm.weight`` and their ``calibrated`` flags; ``nanguard.unpatch``
removes them and the hooks.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

__all__ = ["QKNorm", "add_qk_norms"]

EPS = 1e-6


class QKNorm(nn.Module):
    """RMSNorm over the ``head_dim`` rows of every head of a projection's
    output ``[..., heads * head_dim]``, its ``weight`` calibrated on the
    first call (module docstring)."""

    def __init__(self, head_dim: int, eps: float = EPS, device=None, dtype=None):
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool, device=device))
        self._checked = False  # the buffer read once (then no host read per call)

    def calibrate(self, rows: torch.Tensor) -> None:
        with torch.no_grad():
            x2 = rows.detach().float().square()
            ms = x2.mean(-1, keepdim=True)
            num = x2.reshape(-1, self.head_dim).mean(0)
            den = (x2 / (ms + self.eps)).reshape(-1, self.head_dim).mean(0)
            w = torch.where(den > 0, torch.sqrt(num / den.clamp_min(torch.finfo(torch.float32).tiny)),
                            torch.ones_like(num))
            self.weight.copy_(w.to(self.weight.dtype))
            self.calibrated.fill_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..functional import rms_norm

        rows = x.unflatten(-1, (-1, self.head_dim))
        if not self._checked:
            if not bool(self.calibrated):  # a checkpoint's calibrated weight is kept
                self.calibrate(rows)
            self._checked = True
        return rms_norm(rows, (self.head_dim,), self.weight.to(rows.dtype), self.eps).flatten(-2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, eps={self.eps}"


def _sources(model: nn.Module) -> List[Tuple[str, nn.Module, str, str, int, Optional[int]]]:
    """(name, attention module, q child, k child, head_dim, fused width)."""
    out = []
    for name, m in model.named_modules():
        d = getattr(m, "head_dim", None)
        if not isinstance(d, int) or d < 1 or getattr(m, "is_cross_attention", False):
            continue
        kids = dict(m.named_children())
        if any(n in kids for n in ("q_norm", "k_norm", "query_norm", "key_norm")):
            continue
        if "q_proj" in kids and "k_proj" in kids:
            out.append((name, m, "q_proj", "k_proj", d, None))
        elif "query" in kids and "key" in kids:
            out.append((name, m, "query", "key", d, None))
        elif "c_attn" in kids and isinstance(getattr(m, "split_size", None), int):
            out.append((name, m, "c_attn", "c_attn", d, m.split_size))
    return out


def _weight_of(m: nn.Module) -> torch.Tensor:
    return next(m.parameters())


class _Hook:
    """The projection's forward hook: an object, not a closure, so that a
    deep copy of the model (an EMA copy, ``copy.deepcopy``) gets hooks that
    call its own copies of the norms."""

    def __init__(self, q: QKNorm, k: Optional[QKNorm] = None, width: Optional[int] = None):
        self.q, self.k, self.width = q, k, width

    def __call__(self, _m, _args, out):
        if not isinstance(out, torch.Tensor):
            return None
        if self.width is None:  # a q or a k projection of its own
            return self.q(out)
        w = self.width
        if out.shape[-1] < 2 * w:
            return None
        return torch.cat([self.q(out[..., :w]), self.k(out[..., w:2 * w]), out[..., 2 * w:]], dim=-1)


def add_qk_norms(model: nn.Module, record, summary) -> None:
    """Add the norms and hooks to every attention module found; the record
    learns how to remove them."""
    n = 0
    for _, attn, q, k, d, width in _sources(model):
        proj_q, proj_k = getattr(attn, q), getattr(attn, k)
        w = _weight_of(proj_q)
        qn = QKNorm(d, device=w.device, dtype=w.dtype)
        kn = QKNorm(d, device=w.device, dtype=w.dtype)
        attn.add_module("q_norm", qn)
        attn.add_module("k_norm", kn)
        record.modules_added += [(attn, "q_norm"), (attn, "k_norm")]
        if width is not None:
            record.hooks.append(proj_q.register_forward_hook(_Hook(qn, kn, width)))
        else:
            record.hooks.append(proj_q.register_forward_hook(_Hook(qn)))
            record.hooks.append(proj_k.register_forward_hook(_Hook(kn)))
        n += 1
    if n:
        summary.patched["attention: qk-norm added (q_norm, k_norm)"] = n
    else:
        summary.skipped["qk_norm"] = "no attention module with q and k projections of its own"
