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

On the CPU, where reading a value on the host waits for no device queue, the
common case takes a shorter road with the same results (``_reduce_cpu`` /
``_apply_cpu``): a step whose gradients are all finite needs no NaN / Inf
count, and a sum of squares (or max ``|u|``) that comes out finite proves it,
because a NaN or Inf in ``x`` makes ``u`` and so the sum non-finite for every
``inv_scale``, and fp64 cannot overflow on fp32 squares. So pass 1 is, per
bucket, the fp32 (fp64) ``u`` into a reused buffer and its fp64 norm,
squared (as above), and only a non-finite sum runs the counting pass above.
An inv_scale of 2**k (GradScaler's, or 1) skips ``u`` itself where that is
provably exact (``_reduce_cpu``). Pass 2 reads the multiplier on the host
and multiplies every gradient in place with one ``_foreach_mul_`` (its
Tensor overload: the Python-number one rounds the multiplier to fp16 / bf16
first), with the exact semantics above; a multiplier of exactly 1 writes
nothing, and a skipped step and the wide path take the general code.
"""

from __future__ import annotations

import math

import torch

from ._checks import FLOAT_DTYPES, check, dtype_name, read_free

_REDUCE = "nanguard::grad_guard_reduce"
_APPLY = "nanguard::grad_guard_apply_"
_FUSED = "nanguard::fused_unscale_clip_"

# stats layout (NG_GG_* in kernels/grad_guard_math.h)
NORM, NAN, INF, FIRST_BAD, NSTATS = 0, 1, 2, 3, 4

_EPS = 1e-6  # NG_GG_EPS
_FLT_MIN = 2.0**-126  # smallest normal fp32
_FLT_MAX = float(torch.finfo(torch.float32).max)
#: the smallest |u| each dtype rounds to +-Inf (NG_GG_F16_OVERFLOW,
#: NG_GG_BF16_OVERFLOW): a finite gradient unscaled past it counts as an Inf
_OVERFLOW = {torch.float16: 65520.0, torch.bfloat16: float.fromhex("0x1.ffp+127"),
             torch.float32: math.inf, torch.float64: math.inf}


# ---- argument checks (ops/grad_guard.c) ---------------------------------------------


def _check_view(op: str, t: torch.Tensor, name: str, floating: bool) -> None:
    check(t.layout == torch.strided, op, lambda: f"{name} must be a strided (dense) tensor")
    if floating:
        check(
            t.dtype in FLOAT_DTYPES,
            op,
            lambda: f"{name} must be float16, bfloat16, float32 or float64 (got {dtype_name(t.dtype)})",
        )


def _check_same_device(op: str, a: torch.Tensor, an: str, b: torch.Tensor, bn: str) -> None:
    check(
        a.device == b.device,
        op,
        lambda: f"{bn} is on {b.device} but {an} is on {a.device}; both must be on the same device",
    )


def _check_scalar(op: str, t: torch.Tensor, name: str) -> None:
    """A float32 one-element tensor (inv_scale, found_inf)."""
    check(
        t.dtype == torch.float32 and t.numel() == 1,
        op,
        lambda: f"{name} must be a float32 tensor with one element (got {dtype_name(t.dtype)}, "
        f"{t.numel()} elements)",
    )


def _check_list(op: str, grads, inv_scale: torch.Tensor, mut: bool) -> torch.dtype:
    """gg_read_list: validates grads against inv_scale; returns the list's
    dtype (float32 for an empty list)."""
    _check_view(op, inv_scale, "inv_scale", False)
    _check_scalar(op, inv_scale, "inv_scale")
    dtype = grads[0].dtype if len(grads) else torch.float32
    dev = inv_scale.device
    for k, g in enumerate(grads):
        # one test of everything the checks below ask, so that a list of
        # good gradients builds no message
        if not (g.layout == torch.strided and g.dtype == dtype and dtype in FLOAT_DTYPES
                and g.device == dev and g.is_contiguous()):
            _check_view(op, g, "grads", True)
            _check_same_device(op, inv_scale, "inv_scale", g, "grads")
            check(
                g.dtype == dtype,
                op,
                lambda: f"grads must all have one dtype (tensor 0 is {dtype_name(dtype)}, tensor {k} is "
                f"{dtype_name(g.dtype)}); group them by dtype",
            )
            check(g.is_contiguous(), op,
                  lambda: f"grads[{k}] must be contiguous{' (it is updated in place)' if mut else ''}")
    return dtype


def _norm_arg(op: str, norm_type: float) -> bool:
    """True for norm 2, False for norm inf."""
    check(norm_type in (2.0, math.inf), op, lambda: f"norm_type must be 2.0 or inf, got {norm_type:g}")
    return norm_type == 2.0


def _check_stats(op: str, inv_scale: torch.Tensor, stats: torch.Tensor) -> None:
    _check_same_device(op, inv_scale, "inv_scale", stats, "stats")
    check(
        stats.dtype == torch.float64 and stats.numel() == NSTATS and stats.is_contiguous(),
        op,
        lambda: f"stats must be a contiguous float64 tensor of {NSTATS} elements, as grad_guard_reduce returns",
    )


def _check_found_inf(op: str, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    _check_scalar(op, found_inf, "found_inf")
    _check_same_device(op, inv_scale, "inv_scale", found_inf, "found_inf")


def _check_max_norm(op: str, max_norm: float) -> None:
    check(max_norm >= 0.0, op, lambda: f"max_norm must be >= 0 (inf for no clipping), got {max_norm:g}")


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
        total = g.numel()
        if total == 0:
            continue
        flat = g.view(-1)  # contiguous: _check_list
        for piece in (flat,) if total <= _BUCKET else flat.split(_BUCKET):
            n = piece.numel()
            if cur and size + n > _BUCKET:
                out.append(cur)
                cur, size = [], 0
            cur.append((k, piece))
            size += n
    if cur:
        out.append(cur)
    return out


def _finite_stats(acc: torch.Tensor) -> torch.Tensor:
    """The stats of a pass that found nothing: [acc, 0, 0, -1]."""
    zero = torch.zeros(2, dtype=torch.float64, device=acc.device)
    return torch.cat((acc.reshape(1).to(torch.float64), zero, torch.full_like(zero[:1], -1.0)))


#: FLT_MAX squared, exact in fp64
_FLT_MAX2 = _FLT_MAX**2


def _reduce_cpu(buckets, s: torch.Tensor, dtype: torch.dtype, norm2: bool):
    """Pass 1 on the CPU when every gradient is finite: the stats, or None
    when the general pass is needed (a non-finite sum or max: the counts; a
    scaled shortcut that might not be exact).

    For 16/32-bit gradients and an inv_scale of 2**k (GradScaler's, or 1),
    ``u = x * s`` is exact in fp32 unless it overflows or falls below the
    normal range, so the sum of squares of ``x`` times ``s*s`` (a power of
    4) is the one of ``u``, and max ``|x|`` times ``s`` is max ``|u|``; the
    result proves the exception absent: a sum within FLT_MAX squared means
    no ``|u|`` above FLT_MAX, and for ``s < 1`` a sum above 2**-100 leaves
    the subnormal ``u`` a share below 2**-130 of it (max ``|u|``: normal).
    Any other inv_scale forms ``u`` in a buffer first."""
    sv = s.item()
    if dtype in (torch.float16, torch.bfloat16) and not abs(sv) <= 1.0:
        return None  # an unscaled value may pass what the dtype holds: the general pass counts it
    scaled = dtype != torch.float64 and 0.0 < sv < math.inf and math.frexp(sv)[0] == 0.5
    size = max(sum(t.numel() for _, t in b) for b in buckets)
    u_buf = None if scaled else torch.empty(size, dtype=s.dtype)
    sq_buf = torch.empty(size, dtype=torch.float64) if norm2 and s.dtype != torch.float64 else u_buf
    x_buf = None
    parts = []
    for bucket in buckets:
        n = sum(t.numel() for _, t in bucket)
        if len(bucket) == 1:
            x = bucket[0][1]
        else:
            if x_buf is None:
                x_buf = u_buf if u_buf is not None and dtype == s.dtype else torch.empty(size, dtype=dtype)
            x = torch.cat([t for _, t in bucket], out=x_buf[:n])
        if scaled:
            u = x
        elif dtype == s.dtype:
            u = torch.mul(x, s, out=u_buf[:n])
        else:  # fp16 / bf16: widened exactly, then the fp32 product
            u = u_buf[:n].copy_(x).mul_(s)
        if norm2:
            # exact to fp64; ATen's vector_norm, not a dot product: the BLAS
            # splits a long one over threads, so its sum changes with their count
            sq = u if u.dtype == torch.float64 else sq_buf[:n].copy_(u)
            parts.append(torch.linalg.vector_norm(sq).square())
        else:
            lo, hi = torch.aminmax(u)  # NaN propagates; none is there when finite
            parts.append(torch.maximum(-lo, hi).to(torch.float64))
    acc = torch.stack(parts).sum() if norm2 else torch.stack(parts).amax()
    if scaled:
        acc = acc * (sv * sv if norm2 else sv)
    a = acc.item()
    if not math.isfinite(a):
        return None
    if scaled and not (a <= (_FLT_MAX2 if norm2 else _FLT_MAX)
                       and (sv >= 1.0 or a == 0.0 or a >= (2.0**-100 if norm2 else _FLT_MIN))):
        return None
    return _finite_stats(acc)


def _reduce(grads, inv_scale: torch.Tensor, dtype: torch.dtype, norm2: bool) -> torch.Tensor:
    """Pass 1: the float64 [4] stats of grads."""
    dev = inv_scale.device
    n = len(grads)
    buckets = _buckets(grads)
    if not buckets:
        stats = torch.zeros(NSTATS, dtype=torch.float64, device=dev)
        stats[FIRST_BAD] = -1.0
        return stats
    if read_free(dev):
        stats = _reduce_cpu(buckets, inv_scale.reshape(()).to(_unscale_dtype(dtype)), dtype, norm2)
        if stats is not None:
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
        # NaN / Inf are classified on the stored x, not on u, but for a
        # finite x unscaled past what its dtype holds (|s| > 1 only), an Inf
        nan, inf = torch.isnan(x), torch.isinf(x) | (u.abs() >= _OVERFLOW[dtype])
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


def _apply_cpu(grads, ok: torch.Tensor, m: torch.Tensor, write: torch.Tensor, dtype: torch.dtype) -> bool:
    """Pass 2's multiply on the CPU, one _foreach_mul_ by the multiplier
    read on the host; False leaves the case (a skipped step, the wide path)
    to the general code."""
    if not ok.item():
        return False
    if not write.item():
        return True  # a multiplier of exactly 1: every bit stays
    mult = m if dtype == torch.float64 else m.to(torch.float32)
    if mult.to(torch.float64).item() != m.item():  # below the fp32 normal range
        return False
    torch._foreach_mul_(list(grads), mult)
    return True


def _apply(grads, inv_scale: torch.Tensor, stats: torch.Tensor, found_inf: torch.Tensor,
           max_norm: float, dtype: torch.dtype, norm2: bool) -> torch.Tensor:
    """Pass 2: clip / unscale grads in place from stats; returns total_norm."""
    st = stats.reshape(-1)
    acc = st[NORM]
    base = acc.sqrt() if norm2 else acc
    s64 = inv_scale.reshape(()).to(torch.float64)
    total = torch.where(st[NAN] > 0, math.nan, torch.where(st[INF] > 0, math.inf, base))
    total = torch.where(torch.isfinite(s64) & (s64 > 0), total, math.nan)  # ng_gg_step_norm
    ok = torch.isfinite(total)
    # not `max_norm / t`: a Python number over a tensor is `reciprocal(t) * max_norm`
    c = torch.full_like(total, max_norm) / (total + _EPS)
    clip = torch.where(c < 1.0, c, 1.0)  # a NaN quotient gives 1, as the C's `c < 1 ? c : 1`
    coef = s64 * clip
    if dtype == torch.float64:
        m = coef
    else:
        wide = (coef != 0) & (coef.abs() < _FLT_MIN)
        m = torch.where(wide, coef, coef.to(torch.float32).to(torch.float64))
    write = ok & (m != 1.0)
    if read_free(inv_scale.device) and grads and _apply_cpu(grads, ok, m, write, dtype):
        return total.to(_unscale_dtype(dtype))
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
