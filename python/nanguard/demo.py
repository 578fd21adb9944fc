"""``python -m nanguard demo``: the failure modes nanguard exists for, side by
side with what stock PyTorch code gives on the same inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .functional import layer_norm, rms_norm


def _fmt(t: torch.Tensor) -> str:
    t = t.float()
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    if nan or inf:
        return f"{nan} NaN, {inf} Inf"
    return f"finite, max |y| = {t.abs().max().item():.4g}"


def norm_cases() -> list[tuple[str, str, str]]:
    """(case, stock result, nanguard result) for the normalization failures."""
    g = torch.Generator().manual_seed(0)
    rows = []
    # 1. constant rows with eps = 0 (padding rows, dead features): 0/0 in stock
    x = torch.full((4, 64), 0.5)
    rows.append(("LayerNorm, constant rows, eps=0",
                 _fmt(F.layer_norm(x, (64,), eps=0.0)), _fmt(layer_norm(x, (64,), eps=0.0))))
    # 2. all-zero rows through RMSNorm with eps = 0
    z = torch.zeros(4, 64)
    rows.append(("RMSNorm, all-zero rows, eps=0",
                 _fmt(F.rms_norm(z, (64,), eps=0.0)), _fmt(rms_norm(z, (64,), eps=0.0))))
    # 3. fp16 activations near the top of the range through an RMSNorm written
    #    the usual way in the activation dtype (x * rsqrt(mean(x^2) + eps))
    h = (6.0e4 + 5000 * torch.rand(4, 64, generator=g)).clamp(max=65504).half()
    hand = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    rows.append(("RMSNorm in fp16, |x| ~ 6e4 (x^2 overflows)", _fmt(hand), _fmt(rms_norm(h, (64,), eps=1e-6))))
    # 4. a NaN in one row: it must stay visible, and only in that row
    x = torch.randn(4, 64, generator=g)
    x[1, 3] = float("nan")
    ours = layer_norm(x, (64,))
    rows.append(("NaN in row 1 (must stay NaN, rows 0,2,3 finite)",
                 _fmt(F.layer_norm(x, (64,))[1]),
                 f"row 1: {_fmt(ours[1])}; others: {_fmt(ours[[0, 2, 3]])}"))
    return rows


def main(argv=None) -> int:
    import nanguard

    nanguard.info()
    print()
    rows = norm_cases()
    w = [max(len(r[i]) for r in rows + [("case", "stock PyTorch", "nanguard")]) for i in range(3)]
    print(f"{'case':<{w[0]}}  {'stock PyTorch':<{w[1]}}  nanguard")
    for case, stock, ours in rows:
        print(f"{case:<{w[0]}}  {stock:<{w[1]}}  {ours}")
    return 0
