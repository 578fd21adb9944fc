"""Activations whose 16-bit arithmetic overflows (GPT-2's ``gelu_new``):
recognised by a probe, replaced by PyTorch's fused equivalent."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import UnsupportedModuleError
from ._norm_forms import _subclass


class _GELUTanh:
    """``forward`` of a tanh-approximated GELU written out by hand (GPT-2's
    ``gelu_new``, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``), as
    PyTorch's fused kernel (``F.gelu(approximate="tanh")``: the same
    function, with float math for 16-bit inputs). Written out in fp16, ``x**3``
    overflows for |x| > 40 and the backward's ``3 x**2`` for |x| > 148, where
    ``0 * inf`` makes a NaN gradient from finite inputs."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.gelu(input, approximate="tanh")


_ACT_CACHE: Dict[tuple, object] = {}


def _act_replacement(m: nn.Module) -> Optional[type]:
    """A fused replacement for a parameter-free GELU-like activation whose
    16-bit arithmetic overflows; None when it does not overflow (nothing to
    fix); raises :class:`UnsupportedModuleError` when it overflows but is
    not the tanh GELU."""
    # an instance's own settings (nn.GELU's approximate=...) can change its math
    key = (type(m), tuple(sorted((k, v) for k, v in m.__dict__.items()
                                 if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None))))))
    if key in _ACT_CACHE:
        hit = _ACT_CACHE[key]
    else:
        hit = _act_probe(m)
        _ACT_CACHE[key] = hit
    if isinstance(hit, str):
        raise UnsupportedModuleError(hit)
    return hit


def _act_probe(m: nn.Module):
    """None when ``m`` is finite in fp16 on the probe, the generated fused
    class when it overflows and is the tanh GELU, else why it cannot be
    replaced."""
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
