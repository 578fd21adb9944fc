"""``grad_guard_reduce`` / ``grad_guard_apply_`` / ``fused_unscale_clip_`` in
PyTorch operations.

The composite path of ops/grad_guard.c and kernels/grad_guard.c, with their
arithmetic (kernels/grad_guard_math.h). With ``s`` = inv_scale (fp32):

- pass 1 (reduce): ``u = fp32(x) * s`` in fp32 (``x * double(s)`` for fp64
  gradients); stats = float64 [4]: sum of ``u*u`` squared in fp64 (norm 2) or
  max ``|u|`` ignoring NaN (norm inf), NaN count and Inf count of the stored
  ``x``, index of the first tensor holding one (-1 when none). An empty list,
  or one of zero-size tensors only, gives ``[0, 0, 0, -1]``;
- pass 2 (apply): ``total_norm`` is NaN when a NaN was counted, inf when an
  Inf was, else ``sqrt(acc)`` / ``acc``. When it is finite every gradient is
  multiplied in place by ``coef = double(s) * min(1, max_norm / (total_norm +
  1e-6))`` (``max_norm`` 0 zeroes them, inf only unscales); otherwise no
  gradient changes and ``found_inf`` is set to 1. ``found_inf`` is never
  cleared. total_norm is returned as 0-dim float32 (float64 for fp64 grads).

Nothing is read back to the host: every decision is a ``torch.where`` on
device scalars, and host-side branches look at sizes and dtypes only.

The product is formed as the C does it, bit for bit: fp32 / fp16 / bf16
gradients are multiplied in fp32 by ``fp32(coef)``, or in fp64 by ``coef``
when that is below the fp32 normal range (the C's rare "wide" path), then
rounded to the gradient's dtype. Both are computed here as one fp64
multiply by a multiplier picked on the device: the product of two fp32
numbers is exact in fp64, so rounding it to fp32 gives exactly the fp32
product. A multiplier of exactly 1 leaves every bit as it was, as in C.

The sums of squares, per bucket of gradients concatenated or cut (``_BUCKET``),
come from ``vector_norm(u, dtype=float64)`` squared (fp64 squares of the fp32 ``u``, as the C, then a square root and a
square): the summation order and those two roundings make the last bits of
the sum differ from the C's (about 1e-15 relative); the NaN / Inf counts, the
first offending tensor and the max-|u| norm are exact.
``torch._foreach_norm`` is not used: on CUDA it accumulates fp32 inputs in
fp32, which overflows for ``|u|`` above ~1e19 where the C norm is finite.
"""

from __future__ import annotations

import math

import torch

from ._checks import FLOAT_DTYPES, check, dtype_name

_REDUCE = "nanguard::grad_guard_reduce"
_APPLY = "nanguard::grad_guard_apply_"
_FUSED = "nanguard::fused_unscale_clip_"

# stats layout (NG_GG_* in kernels/grad_guard_math.h)
NORM, NAN, INF, FIRST_BAD, NSTATS = 0, 1, 2, 3, 4

_EPS = 1e-6  # NG_GG_EPS
_FLT_MIN = 2.0**-126  # smallest normal fp32


# ---- argument checks (ops/grad_guard.c) ---------------------------------------------


def _check_view(op: str, t: torch.Tensor, name: str, floating: bool) -> None:
    check(t.layout == torch.strided, op, f"{name} must be a strided (dense) tensor")
    if floating:
        check(
            t.dtype in FLOAT_DTYPES,
            op,
            f"{name} must be float16, bfloat16, float32 or float64 (got {dtype_name(t.dtype)})",
        )


def _check_same_device(op: str, a: torch.Tensor, an: str, b: torch.Tensor, bn: str) -> None:
    check(
        a.device == b.device,
        op,
        f"{bn} is on {b.device} but {an} is on {a.device}; both must be on the same device",
    )


def _check_scalar(op: str, t: torch.Tensor, name: str) -> None:
    """A float32 one-element tensor (inv_scale, found_inf)."""
    check(
        t.dtype == torch.float32 and t.numel() == 1,
        op,
        f"{name} must be a float32 tensor with one element (got {dtype_name(t.dtype)}, "
        f"{t.numel()} elements)",
    )


def _check_list(op: str, grads, inv_scale: torch.Tensor, mut: bool) -> torch.dtype:
    """gg_read_list: validates grads against inv_scale; returns the list's
    dtype (float32 for an empty list)."""
    _check_view(op, inv_scale, "inv_scale", False)
    _check_scalar(op, inv_scale, "inv_scale")
    dtype = torch.float32
    for k, g in enumerate(grads):
        _check_view(op, g, "grads", True)
        _check_same_device(op, inv_scale, "inv_scale", g, "grads")
        if k == 0:
            dtype = g.dtype
        check(
            g.dtype == dtype,
            op,
            f"grads must all have one dtype (tensor 0 is {dtype_name(dtype)}, tensor {k} is "
            f"{dtype_name(g.dtype)}); group them by dtype",
        )
        check(g.is_contiguous(), op, f"grads[{k}] must be contiguous{' (it is updated in place)' if mut else ''}")
    return dtype


def _norm_arg(op: str, norm_type: float) -> bool:
    """True for norm 2, False for norm inf."""
    check(norm_type in (2.0, math.inf), op, f"norm_type must be 2.0 or inf, got {norm_type:g}")
    return norm_type == 2.0


def _check_stats(op: str, inv_scale: torch.Tensor, stats: torch.Tensor) -> None:
    _check_same_device(op, inv_scale, "inv_scale", stats, "stats")
    check(
        stats.dtype == torch.float64 and stats.numel() == NSTATS and stats.is_contiguous(),
        op,
        f"stats must be a contiguous float64 tensor of {NSTATS} elements, as grad_guard_reduce returns",
    )


def _check_found_inf(op: str, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    _check_scalar(op, found_inf, "found_inf")
    _check_same_device(op, inv_scale, "inv_scale", found_inf, "found_inf")


def _check_max_norm(op: str, max_norm: float) -> None:
    check(max_norm >= 0.0, op, f"max_norm must be >= 0 (inf for no clipping), got {max_norm:g}")


# ---- the two passes -------------------------------------------------------------------


def _unscale_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


#: elements per bucket: small gradients are concatenated up to this many (one
#: set of operations per bucket instead of per tensor), a larger one is cut
#: into pieces of this many, so every temporary (fp64 ones included) stays
#: small enough to be reused from cache rather than freshly mapped
_BUCKET = 1 << 18


def _buckets(grads):
    """Lists of (tensor index, flat piece of that gradient), nonempty
    gradients only, each list of at most _BUCKET elements."""
    out, cur, size = [], [], 0
    for k, g in enumerate(grads):
        flat = g.reshape(-1)
        for i in range(0, flat.numel(), _BUCKET):  # no piece of a zero-size one
            piece = flat[i : i + _BUCKET]
            n = piece.numel()
            if cur and size + n > _BUCKET:
                out.append(cur)
                cur, size = [], 0
            cur.append((k, piece))
            size += n
    if cur:
        out.append(cur)
    return out


def _reduce(grads, inv_scale: torch.Tensor, dtype: torch.dtype, norm2: bool) -> torch.Tensor:
    """Pass 1: the float64 [4] stats of grads."""
    dev = inv_scale.device
    n = len(grads)
    buckets = _buckets(grads)
    if not buckets:
        stats = torch.zeros(NSTATS, dtype=torch.float64, device=dev)
        stats[FIRST_BAD] = -1.0
        return stats
    s = inv_scale.reshape(()).to(_unscale_dtype(dtype))
    norms, counts = [], []
    no = torch.zeros((), dtype=torch.bool, device=dev)
    flags = [no] * n  # per tensor: holds a NaN or Inf (zero-size ones never do)
    for bucket in buckets:
        x = bucket[0][1] if len(bucket) == 1 else torch.cat([t for _, t in bucket])
        u = x.to(s.dtype) * s
        if norm2:
            norms.append(torch.linalg.vector_norm(u, 2, dtype=torch.float64).square())
        else:
            a = u.abs()
            # NaN never wins the C's `a > m ? a : m` (it is reported by the counts)
            norms.append(torch.where(torch.isnan(a), 0.0, a).amax().to(torch.float64))
        # NaN / Inf are classified on the stored x, not on u
        nan, inf = torch.isnan(x), torch.isinf(x)
        counts.append(torch.stack((torch.count_nonzero(nan), torch.count_nonzero(inf))))
        # which tensors hold one: views of the bucket's mask, no copy
        bad = nan | inf
        sizes = [t.numel() for _, t in bucket]
        for (k, _), b in zip(bucket, bad.split(sizes) if len(bucket) > 1 else (bad,)):
            flags[k] = b.any() if flags[k] is no else flags[k] | b.any()
    acc = torch.stack(norms).sum() if norm2 else torch.stack(norms).amax()
    total = torch.stack(counts).sum(0).to(torch.float64)  # NaN, Inf
    # the first tensor holding one, -1 when none; arange is made on the device:
    # a host list copied there would wait for the device's queue
    first = torch.where(torch.stack(flags), torch.arange(n, device=dev), n).amin()
    first = torch.where(first < n, first, -1)
    return torch.cat((acc.reshape(1), total, first.reshape(1).to(torch.float64)))


def _apply(grads, inv_scale: torch.Tensor, stats: torch.Tensor, found_inf: torch.Tensor,
           max_norm: float, dtype: torch.dtype, norm2: bool) -> torch.Tensor:
    """Pass 2: clip / unscale grads in place from stats; returns total_norm."""
    st = stats.reshape(-1)
    acc = st[NORM]
    base = acc.sqrt() if norm2 else acc
    total = torch.where(st[NAN] > 0, math.nan, torch.where(st[INF] > 0, math.inf, base))
    ok = torch.isfinite(total)
    # not `max_norm / t`: a Python number over a tensor is `reciprocal(t) * max_norm`
    c = torch.full_like(total, max_norm) / (total + _EPS)
    clip = torch.where(c < 1.0, c, 1.0)  # a NaN quotient gives 1, as the C's `c < 1 ? c : 1`
    coef = inv_scale.reshape(()).to(torch.float64) * clip
    if dtype == torch.float64:
        m = coef
    else:
        wide = (coef != 0) & (coef.abs() < _FLT_MIN)
        m = torch.where(wide, coef, coef.to(torch.float32).to(torch.float64))
    write = ok & (m != 1.0)
    for bucket in _buckets(grads):
        views = [t for _, t in bucket]
        x = views[0] if len(views) == 1 else torch.cat(views)
        if dtype == torch.float64:
            y = x * m
        else:
            y = (x.to(torch.float64) * m).to(torch.float32).to(dtype)
        if len(views) == 1:
            torch.where(write, y, x, out=x)
        else:  # back into each gradient: the unwritten ones get their own bits again
            torch._foreach_copy_(views, list(torch.where(write, y, x).split([t.numel() for t in views])))
    found_inf.masked_fill_(~ok, 1.0)
    return total.to(_unscale_dtype(dtype))


# ---- the ops ----------------------------------------------------------------------------


def grad_guard_reduce(grads, inv_scale, norm_type):
    dtype = _check_list(_REDUCE, grads, inv_scale, False)
    norm2 = _norm_arg(_REDUCE, norm_type)
    return _reduce(grads, inv_scale, dtype, norm2)


def grad_guard_apply_(grads, inv_scale, stats, found_inf, max_norm, norm_type):
    dtype = _check_list(_APPLY, grads, inv_scale, True)
    _check_view(_APPLY, stats, "stats", True)
    _check_view(_APPLY, found_inf, "found_inf", False)
    norm2 = _norm_arg(_APPLY, norm_type)
    _check_stats(_APPLY, inv_scale, stats)
    _check_found_inf(_APPLY, inv_scale, found_inf)
    _check_max_norm(_APPLY, max_norm)
    return _apply(grads, inv_scale, stats, found_inf, max_norm, dtype, norm2)


def fused_unscale_clip_(grads, inv_scale, found_inf, max_norm, norm_type):
    dtype = _check_list(_FUSED, grads, inv_scale, True)
    _check_view(_FUSED, found_inf, "found_inf", False)
    norm2 = _norm_arg(_FUSED, norm_type)
    _check_found_inf(_FUSED, inv_scale, found_inf)
    _check_max_norm(_FUSED, max_norm)
    stats = _reduce(grads, inv_scale, dtype, norm2)
    return _apply(grads, inv_scale, stats, found_inf, max_norm, dtype, norm2), stats


KERNELS = {
    "grad_guard_reduce": grad_guard_reduce,
    "grad_guard_apply_": grad_guard_apply_,
    "fused_unscale_clip_": fused_unscale_clip_,
}
