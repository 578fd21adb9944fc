"""``stable_layernorm`` and its backward in PyTorch operations.

The composite path of kernels/layernorm.c, with its numerics
(kernels/layernorm_math.h):

- statistics in fp32 (fp64 for fp64 input), with a shift: ``d = x - x[0]``,
  ``mean = x[0] + mean(d)``, ``var = mean((d - mean(d))^2)``. A constant row
  has ``d == 0`` exactly, hence ``var == 0`` and centred values of exactly 0;
- ``var + eps == 0`` gives ``rstd = 0`` (output ``b`` or 0, zero gradient
  through the statistics), never 0/0; a NaN or Inf in a row makes the row's
  statistics NaN;
- a finite row whose fp32 sum of squares overflows is redone scaled by its
  largest centred magnitude, as the C kernel's rare path does;
- fp32 parameters of a 16-bit input are applied in fp32; the output has the
  input's dtype, the parameter gradients the parameters' dtype.
"""

from __future__ import annotations

import torch

from ._checks import check, check_device_dtype, dtype_name, stat_dtype


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(stat_dtype(x.dtype))


def _check_input(op: str, x: torch.Tensor, eps: float) -> None:
    check_device_dtype(op, "input", x)
    check(x.dim() >= 1, op, "input must have at least one dimension")
    check(eps >= 0.0 and eps != float("inf"), op, f"eps must be a finite number >= 0, got {eps}")


def _check_param(op: str, x: torch.Tensor, p: torch.Tensor, name: str) -> None:
    check(p.device == x.device, op, f"{name} is on {p.device} but input is on {x.device}")
    half = x.dtype in (torch.float16, torch.bfloat16)
    check(
        p.dtype == x.dtype or (half and p.dtype == torch.float32),
        op,
        f"{name} must have the dtype of input ({dtype_name(x.dtype)}){' or float32' if half else ''}, "
        f"got {dtype_name(p.dtype)}",
    )
    check(
        p.dim() == 1 and p.shape[0] == x.shape[-1],
        op,
        f"{name} must have shape [{x.shape[-1]}] (the last dimension of input), got "
        f"{list(p.shape)}",
    )


def _rstd(var: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(var + eps); 0 where var + eps == 0; NaN where it is NaN or inf."""
    den = var + eps
    ok = (den > 0) & (den < float("inf"))
    r = torch.rsqrt(torch.where(ok, den, torch.ones_like(den)))
    return torch.where(ok, r, torch.where(den == 0, torch.zeros_like(den), torch.full_like(den, float("nan"))))


def _statistics(xa: torch.Tensor, eps: float, rms: bool):
    """(centred values, mean, rstd) of fp32 / fp64 rows."""
    if rms:
        c = xa
        mean = torch.zeros(xa.shape[:-1], dtype=xa.dtype, device=xa.device)
    else:
        shift = xa[..., :1]
        d = xa - shift
        md = d.mean(-1, keepdim=True)
        c = d - md
        mean = (shift + md).squeeze(-1)
    var = (c * c).mean(-1)
    # A finite row whose squares overflow: var is inf, but amax^2 * mean((c/amax)^2)
    # is finite. A row holding NaN or Inf has a non-finite amax and stays NaN.
    amax = c.abs().amax(-1) if c.shape[-1] else torch.zeros_like(var)
    scaled = (var == float("inf")) & (amax > 0) & (amax < float("inf"))
    safe = torch.where(scaled, amax, torch.ones_like(amax))
    cs = c / safe.unsqueeze(-1)
    vs = (cs * cs).mean(-1)
    rstd = torch.where(scaled, (1.0 / safe) * torch.rsqrt(vs + eps / safe / safe), _rstd(var, eps))
    return c, mean, rstd


def _forward(op: str, x, w, b, eps: float, rms: bool):
    _check_input(op, x, eps)
    if w is not None:
        _check_param(op, x, w, "weight")
    if b is not None:
        check(not rms, op, "bias is not supported with rms=True (RMSNorm has no bias)")
        _check_param(op, x, b, "bias")
        check(
            w is None or b.dtype == w.dtype,
            op,
            f"bias must have the dtype of weight ({dtype_name(w.dtype) if w is not None else ''}), "
            f"got {dtype_name(b.dtype)}",
        )
    xa = _acc(x)
    if x.shape[-1] == 0:  # empty rows: var = mean([]) is NaN in PyTorch; the C kernel writes rstd 1/sqrt(eps)
        mean = torch.zeros(x.shape[:-1], dtype=xa.dtype, device=x.device)
        return torch.empty_like(x, memory_format=torch.contiguous_format), mean, _rstd(mean, eps)
    c, mean, rstd = _statistics(xa, eps, rms)
    y = c * rstd.unsqueeze(-1)
    if w is not None:
        y = y * _acc(w)
    if b is not None:
        y = y + _acc(b)
    return y.to(x.dtype).contiguous(), mean, rstd


def layernorm(x, eps, rms):
    return _forward("nanguard::stable_layernorm", x, None, None, eps, rms)


def layernorm_weight(x, w, eps, rms):
    return _forward("nanguard::stable_layernorm", x, w, None, eps, rms)


def layernorm_bias(x, b, eps, rms):
    return _forward("nanguard::stable_layernorm", x, None, b, eps, rms)


def layernorm_weight_bias(x, w, b, eps, rms):
    return _forward("nanguard::stable_layernorm", x, w, b, eps, rms)


def _backward(dy, x, w, mean, rstd, rms: bool, with_bias: bool):
    op = "nanguard::stable_layernorm_backward"
    _check_input(op, x, 0.0)
    check(dy.device == x.device, op, f"grad_out is on {dy.device} but input is on {x.device}")
    check(
        dy.dtype == x.dtype,
        op,
        f"grad_out has dtype {dtype_name(dy.dtype)} but input has dtype {dtype_name(x.dtype)}; they must match",
    )
    check(dy.shape == x.shape, op, "grad_out must have the shape of input")
    if w is not None:
        _check_param(op, x, w, "weight")
    for name, s in (("mean", mean), ("rstd", rstd)):
        check(s.device == x.device, op, f"{name} is on {s.device} but input is on {x.device}")
        check(
            s.dtype == stat_dtype(x.dtype) and s.numel() == _rows(x),
            op,
            f"{name} must be the {dtype_name(stat_dtype(x.dtype))} statistics of input ({name}, one per row)",
        )
    cols = x.shape[-1]
    pdt = w.dtype if w is not None else x.dtype
    lead = x.shape[:-1]
    xa, dya = _acc(x), _acc(dy)
    m = mean.reshape(lead).unsqueeze(-1)
    r = rstd.reshape(lead).unsqueeze(-1)
    xhat = (xa if rms else xa - m) * r
    g = dya * _acc(w) if w is not None else dya
    if cols:
        b_ = (g * xhat).mean(-1, keepdim=True)
        dx = r * (g - xhat * b_) if rms else r * (g - g.mean(-1, keepdim=True) - xhat * b_)
    else:
        dx = g
    flat = (_rows(x), cols)
    dw = (dya * xhat).reshape(flat).sum(0).to(pdt)
    db = dya.reshape(flat).sum(0).to(pdt) if with_bias else torch.empty(0, dtype=pdt, device=x.device)
    dx = dx.to(x.dtype).contiguous()
    return (dx, dw, db) if w is not None else (dx, db)


def _rows(x: torch.Tensor) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


def layernorm_backward(dy, x, mean, rstd, rms, with_bias):
    return _backward(dy, x, None, mean, rstd, rms, with_bias)


def layernorm_backward_weight(dy, x, w, mean, rstd, rms, with_bias):
    return _backward(dy, x, w, mean, rstd, rms, with_bias)


KERNELS = {
    "stable_layernorm": layernorm,
    "stable_layernorm.weight": layernorm_weight,
    "stable_layernorm.bias": layernorm_bias,
    "stable_layernorm.weight_bias": layernorm_weight_bias,
    "stable_layernorm_backward": layernorm_backward,
    "stable_layernorm_backward.weight": layernorm_backward_weight,
}
