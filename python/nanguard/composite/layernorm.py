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

On the CPU (``_checks.READ_FREE``: the row check is read on the host),
LayerNorm (not RMSNorm) first runs ATen's fused
``native_layer_norm`` (and its backward) on the fp32 / fp64 values, and keeps
the result only when every row passes a check of its statistics
(``_fused_rows_ok``); otherwise the whole call is recomputed as above. The
check exists because the fused kernel computes ``x * rstd - mean * rstd``:
its error grows with ``|mean| * rstd`` (0.18 for rows of mean 1e4 and
standard deviation 1e-2, against 5e-7 here), a constant row comes out as
rounding noise instead of exactly 0, its backward's ``rstd^3`` leaves the
fp32 range beyond ``rstd`` of 1e-12 or 1e12, and a NaN, an overflow or
``eps = 0`` on a constant row gives it non-finite statistics. Reading the
check is a host read of one flag, free on the CPU; on every other device it
would stall the queue, so they always take the path above.
"""

from __future__ import annotations

import torch

from ._checks import check, check_device_dtype, dtype_name, read_free, stat_dtype


def _acc(x: torch.Tensor) -> torch.Tensor:
    sd = stat_dtype(x.dtype)
    return x if x.dtype == sd else x.to(sd)  # no dispatch for the common fp32 case


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _check_input(op: str, x: torch.Tensor, eps: float) -> None:
    check_device_dtype(op, "input", x)
    check(x.dim() >= 1, op, "input must have at least one dimension")
    check(eps >= 0.0 and eps != float("inf"), op, lambda: f"eps must be a finite number >= 0, got {eps}")


def _check_param(op: str, x: torch.Tensor, p: torch.Tensor, name: str) -> None:
    check(p.device == x.device, op, lambda: f"{name} is on {p.device} but input is on {x.device}")
    half = x.dtype in (torch.float16, torch.bfloat16)
    check(
        p.dtype == x.dtype or (half and p.dtype == torch.float32),
        op,
        lambda: f"{name} must have the dtype of input ({dtype_name(x.dtype)}){' or float32' if half else ''}, "
        f"got {dtype_name(p.dtype)}",
    )
    check(
        p.dim() == 1 and p.shape[0] == x.shape[-1],
        op,
        lambda: f"{name} must have shape [{x.shape[-1]}] (the last dimension of input), got "
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


#: Rows whose ``|mean| * rstd`` is above this take the exact path: the fused
#: kernel's cancellation error is at most about this many fp32 ulps of 1.
_FUSED_MAX_OFFSET = 8.0


def _fused_rows_ok(mean: torch.Tensor, rstd: torch.Tensor, eps: float) -> bool:
    """Whether ATen's fused LayerNorm is as accurate as the exact path on every row.

    ``rstd`` finite within [1e-12, 1e12], ``|mean| * rstd <= 8``, and
    ``var > eps`` (``rstd^2 * eps <= 1/2``) unless the mean is 0: a row of
    variance near 0 and a nonzero mean is where ``x * rstd - mean * rstd``
    leaves rounding noise instead of the exact 0 of a constant row.
    Reductions first, read on the host in one go: a NaN anywhere fails every
    comparison; only a largest ``rstd`` past the eps bound tests the rows.
    """
    if rstd.numel() == 0:
        return True
    lo, hi = torch.aminmax(rstd)
    off = (mean * rstd).abs().amax()
    lo, hi, off = torch.stack((lo, hi, off)).tolist()
    if not (1e-12 <= lo and hi <= 1e12 and off <= _FUSED_MAX_OFFSET):
        return False
    if hi * hi * eps <= 0.5:
        return True
    return bool(((rstd * rstd * eps <= 0.5) | (mean == 0)).all())


def _fused_forward(xa, w, b, eps: float):
    """(y, mean, rstd) from ATen's fused kernel, or None where a row fails the check."""
    n = xa.shape[-1]
    y, mean, rstd = torch.native_layer_norm(
        xa, [n], _acc(w) if w is not None else None, _acc(b) if b is not None else None, eps
    )
    return (y, mean, rstd) if _fused_rows_ok(mean, rstd, eps) else None


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
            lambda: f"bias must have the dtype of weight ({dtype_name(w.dtype) if w is not None else ''}), "
            f"got {dtype_name(b.dtype)}",
        )
    if x.shape[-1] == 0:  # empty rows: var = mean([]) is NaN in PyTorch; the C kernel writes rstd 1/sqrt(eps)
        mean = torch.zeros(x.shape[:-1], dtype=stat_dtype(x.dtype), device=x.device)
        return torch.empty_like(x, memory_format=torch.contiguous_format), mean, _rstd(mean, eps)
    # the rows of a contiguous copy, as the C kernel reads them: the same bits
    # whatever the caller's layout, and any number of dimensions
    shape, lead = x.shape, x.shape[:-1]
    xa = _acc(x.contiguous()).reshape(-1, shape[-1])
    fused = _fused_forward(xa, w, b, eps) if not rms and read_free(x.device) and x.numel() else None
    if fused is not None:
        y, mean, rstd = fused
    else:
        c, mean, rstd = _statistics(xa, eps, rms)
        y = c * rstd.unsqueeze(-1)
        if w is not None:
            y = y * _acc(w)
        if b is not None:
            y = y + _acc(b)
    return _as(y, x.dtype).reshape(shape), mean.reshape(lead), rstd.reshape(lead)


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
    check_device_dtype(op, "grad_out", dy)  # the C op reads grad_out first
    _check_input(op, x, 0.0)
    check(dy.device == x.device, op, lambda: f"grad_out is on {dy.device} but input is on {x.device}")
    check(
        dy.dtype == x.dtype,
        op,
        lambda: f"grad_out has dtype {dtype_name(dy.dtype)} but input has dtype {dtype_name(x.dtype)}; they must match",
    )
    check(dy.shape == x.shape, op, "grad_out must have the shape of input")
    if w is not None:
        _check_param(op, x, w, "weight")
    for name, s in (("mean", mean), ("rstd", rstd)):
        check(s.device == x.device, op, lambda: f"{name} is on {s.device} but input is on {x.device}")
        check(
            s.dtype == stat_dtype(x.dtype) and s.numel() == _rows(x),
            op,
            lambda: f"{name} must be the {dtype_name(stat_dtype(x.dtype))} statistics of input ({name}, one per row)",
        )
    cols = x.shape[-1]
    pdt = w.dtype if w is not None else x.dtype
    # rows of contiguous copies, as in the forward
    rows = _rows(x)
    xa, dya = _acc(x.contiguous()).reshape(rows, cols), _acc(dy.contiguous()).reshape(rows, cols)
    m, r = mean.contiguous().reshape(rows, 1), rstd.contiguous().reshape(rows, 1)
    db = dya.sum(0).to(pdt) if with_bias else torch.empty(0, dtype=pdt, device=x.device)
    if not rms and cols and read_free(x.device) and _fused_rows_ok(m, r, 0.0):
        dx, dw = _fused_backward(dya, xa, w, m, r)
    else:
        xhat = (xa if rms else xa - m) * r
        g = dya * _acc(w) if w is not None else dya
        if cols:
            b_ = (g * xhat).mean(-1, keepdim=True)
            dx = r * (g - xhat * b_) if rms else r * (g - g.mean(-1, keepdim=True) - xhat * b_)
        else:
            dx = g
        dw = (dya * xhat).sum(0) if w is not None else None
    dx = _as(dx, x.dtype).reshape(x.shape)
    return (dx, dw.to(pdt), db) if w is not None else (dx, db)


def _rows(x: torch.Tensor) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


#: elements per block of _fused_backward's weight-gradient sum
_DW_BLOCK = 1 << 16


def _fused_backward(dya, xa, w, m, r):
    """dx from ATen's fused LayerNorm backward, and dw (None without a weight),
    of rows ``xa`` / ``dya`` [R, n] with statistics ``m`` / ``r`` [R, 1].

    Only for statistics that pass ``_fused_rows_ok``: the forward's check, which
    also bounds the cancellation of its ``b * x + c`` form. The eps term of the
    check is the forward's concern (exact zeros), so the backward passes 0.
    dw is summed here: ATen's splits the rows over threads, so its sum would
    change with the thread count.
    """
    n = xa.shape[-1]
    dx = torch.ops.aten.native_layer_norm_backward(
        dya, xa, [n], m, r, _acc(w) if w is not None else None, None, [True, False, False]
    )[0]
    if w is None:
        return dx, None
    # sum(dy * (x - mean) * rstd) over the rows, in blocks of rows: a block's
    # temporary stays in cache, where one of the input's size would be a new
    # allocation (page faults) per pass. The blocks add in a fixed order.
    rows = max(1, _DW_BLOCK // n)
    dw = None
    for i in range(0, xa.shape[0], rows):
        t = xa[i : i + rows] - m[i : i + rows]
        part = t.mul_(r[i : i + rows]).mul_(dya[i : i + rows]).sum(0)
        dw = part if dw is None else dw.add_(part)
    return dx, dw if dw is not None else torch.zeros(n, dtype=xa.dtype, device=xa.device)


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
