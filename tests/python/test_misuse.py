"""Misuse: every public function and every ``torch.ops.nanguard`` overload
under wrong or hostile arguments.

Two parts:

1. Invariants of the op layer, each with a test that failed before the op
   layer kept it: a failing call releases every tensor argument it was
   given; a meta tensor among CPU ones raises instead of returning
   uninitialised memory; in-place ops bump version counters and refuse
   leaves that require grad; read-only inputs stay copy-on-write; a failure
   inside PyTorch's thread pool never applies work twice; a gradient list is
   checked for overlapping gradients before any gradient is written.
2. A generated suite: for each overload and public function, each argument
   in turn is made wrong in each way (dtype, device incl. meta, layout,
   size, rank, bad scalars). Every case either raises a Python exception
   whose message names the argument, or (for inputs the op documents as
   accepted, such as a transposed input) returns what the same call gives on
   a contiguous copy. No case may crash, hang or return uninitialised data.

The leak checks are exact (``Tensor._use_count()`` of every argument) plus an
RSS check with a stated margin (``RSS_MARGIN_MIB``).
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

import nanguard
from nanguard import _lib
from conftest import requires_kernels
from nanguard.functional import layer_norm, rms_norm, safe_sdpa

ops = torch.ops.nanguard


def rng(seed=0, offset=0):
    return torch.tensor([seed, offset], dtype=torch.int64)


# ---- 1. op-layer invariants ---------------------------------------------------


def _failing_calls():
    """(name, call, trailing tensors) for each overload: the call fails on its
    first tensor argument (an int32 tensor where a float one belongs), so every
    tensor after it had not been taken when the first check ran."""
    x = torch.randn(4, 8)
    bad = torch.zeros(4, 8, dtype=torch.int32)
    w, b = torch.randn(8), torch.randn(8)
    mean, rstd = torch.zeros(4), torch.ones(4)
    yield "stable_layernorm.weight_bias", lambda: ops.stable_layernorm.weight_bias(bad, w, b, 1e-5, False), (w, b)
    yield "stable_layernorm.weight", lambda: ops.stable_layernorm.weight(bad, w, 1e-5, False), (w,)
    yield "stable_layernorm.bias", lambda: ops.stable_layernorm.bias(bad, b, 1e-5, False), (b,)
    yield "stable_layernorm_backward.weight", (
        lambda: ops.stable_layernorm_backward.weight(bad, x, w, mean, rstd, False, True)), (x, w, mean, rstd)
    yield "stable_layernorm_backward", (
        lambda: ops.stable_layernorm_backward(bad, x, mean, rstd, False, True)), (x, mean, rstd)
    q = torch.randn(1, 2, 3, 4)
    qbad = q.to(torch.int32)
    m = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    r = rng()
    args = (0.0, False, 0.5, 0.0, 0.0)
    yield "safe_sdpa", lambda: ops.safe_sdpa(qbad, q, q, *args, r), (q, r)
    yield "safe_sdpa.masked", lambda: ops.safe_sdpa.masked(qbad, q, q, m, *args, r), (q, m, r)
    out, lse = ops.safe_sdpa(q, q, q, *args, r)
    yield "safe_sdpa_backward", (
        lambda: ops.safe_sdpa_backward(qbad, q, q, q, out, lse, *args, r)), (q, out, lse, r)
    yield "safe_sdpa_backward.masked", (
        lambda: ops.safe_sdpa_backward.masked(qbad, q, q, q, m, out, lse, *args, r)), (q, m, out, lse, r)
    g = [torch.zeros(5, dtype=torch.int32)]
    s, f, st = torch.ones(1), torch.zeros(1), torch.zeros(4, dtype=torch.float64)
    yield "grad_guard_reduce", lambda: ops.grad_guard_reduce(g, s, 2.0), (s,)
    yield "grad_guard_apply_", lambda: ops.grad_guard_apply_(g, s, st, f, 1.0, 2.0), (s, st, f)
    yield "fused_unscale_clip_", lambda: ops.fused_unscale_clip_(g, s, f, 1.0, 2.0), (s, f)
    counts = torch.zeros(1, 3, dtype=torch.int64)
    values = torch.zeros(1, 2, dtype=torch.float64)
    yield "tensor_stats_", lambda: ops.tensor_stats_(bad, counts, values, 0), (counts, values)


@pytest.mark.parametrize("case", [c[0] for c in _failing_calls()])
def test_failed_call_releases_every_later_tensor_argument(case):
    """A check that fails on the first argument must release the ones the op
    had not read yet (use counts back to where they were)."""
    _, call, trailing = next(c for c in _failing_calls() if c[0] == case)
    before = [t._use_count() for t in trailing]
    for _ in range(3):
        with pytest.raises(RuntimeError, match="must be"):
            call()
    assert [t._use_count() for t in trailing] == before


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: Allowed RSS growth over 1,000 failing calls. Each call passes two 64 KiB
#: parameters, so leaking even one of them per call would grow RSS by at
#: least 62 MiB; the margin absorbs allocator and interpreter noise.
RSS_MARGIN_MIB = 16


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_a_thousand_failing_calls_leave_rss_and_use_counts_flat():
    """Each call gets new 64 KiB parameters (a leaked handle keeps its own
    storage alive, so a leak shows in RSS), and one kept pair whose use
    counts are checked exactly."""
    bad = torch.zeros(2, 16384, dtype=torch.int32)
    kept_w, kept_b = torch.randn(16384), torch.randn(16384)
    uses = (kept_w._use_count(), kept_b._use_count())

    def fail(w, b):
        try:
            ops.stable_layernorm.weight_bias(bad, w, b, 1e-5, False)
        except RuntimeError:
            return
        raise AssertionError("the call did not fail")

    for _ in range(50):  # warm up the allocator and the dispatcher's caches
        fail(torch.randn(16384), torch.randn(16384))
    gc.collect()
    rss0 = _rss_bytes()
    for _ in range(1000):
        fail(torch.randn(16384), torch.randn(16384))
        fail(kept_w, kept_b)
    gc.collect()
    grown = (_rss_bytes() - rss0) / 2**20
    assert (kept_w._use_count(), kept_b._use_count()) == uses
    assert grown < RSS_MARGIN_MIB, f"RSS grew by {grown:.1f} MiB over 2000 failing calls"


def test_meta_tensor_among_cpu_tensors_raises_naming_it():
    """A meta tensor among CPU ones selects the fake kernel; it must raise,
    not return uninitialised CPU memory."""
    x, w = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(RuntimeError, match="weight"):
        ops.stable_layernorm.weight(x, w.to("meta"), 1e-5, False)
    with pytest.raises(RuntimeError, match="input"):
        ops.stable_layernorm.weight(x.to("meta"), w, 1e-5, False)
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="rng"):
        ops.safe_sdpa(q, q, q, 0.0, False, 0.5, 0.0, 0.0, rng().to("meta"))
    with pytest.raises(RuntimeError, match="key"):
        ops.safe_sdpa(q, q.to("meta"), q, 0.0, False, 0.5, 0.0, 0.0, rng())
    with pytest.raises(RuntimeError, match="found_inf"):
        ops.fused_unscale_clip_([torch.randn(3)], torch.ones(1), torch.zeros(1, device="meta"), 1.0, 2.0)
    with pytest.raises(RuntimeError, match="counts"):
        ops.tensor_stats_(torch.randn(3), torch.zeros(1, 3, dtype=torch.int64, device="meta"),
                          torch.zeros(1, 2, dtype=torch.float64), 0)


def test_all_meta_calls_still_give_shapes():
    """Shape inference on the meta device keeps working (every tensor meta;
    rng is a CPU tensor as the Python wrapper always makes it)."""
    x = torch.empty(3, 4, device="meta")
    y, mean, rstd = ops.stable_layernorm.weight(x, torch.empty(4, device="meta"), 1e-5, False)
    assert y.device.type == "meta" and y.shape == (3, 4) and mean.shape == (3,)
    q = torch.empty(1, 2, 5, 8, device="meta")
    out = safe_sdpa(q, q, q)
    assert out.device.type == "meta" and out.shape == (1, 2, 5, 8)


def test_inplace_ops_bump_version_counters():
    """Every tensor an in-place op writes gets its version counter bumped, so
    autograd sees the write."""
    g = torch.randn(4)
    f = torch.zeros(1)
    v0, f0 = g._version, f._version
    ops.fused_unscale_clip_([g], torch.ones(1), f, 1.0, 2.0)
    assert g._version > v0 and f._version > f0
    st = ops.grad_guard_reduce([g], torch.ones(1), 2.0)
    v0, f0 = g._version, f._version
    ops.grad_guard_apply_([g], torch.ones(1), st, f, 1.0, 2.0)
    assert g._version > v0 and f._version > f0
    counts = torch.zeros(1, 3, dtype=torch.int64)
    values = torch.zeros(1, 2, dtype=torch.float64)
    c0, val0 = counts._version, values._version
    ops.tensor_stats_(torch.randn(3), counts, values, 0)
    assert counts._version > c0 and values._version > val0


def test_inplace_change_to_a_saved_tensor_is_an_autograd_error():
    """The gradient-penalty case: a tensor saved for backward, then clipped in
    place, must make backward raise instead of using new values."""
    x = torch.randn(5, requires_grad=True)
    y = x * 2.0
    z = (y * y).sum()  # saves y
    with torch.no_grad():
        ops.fused_unscale_clip_([y], torch.ones(1), torch.zeros(1), 0.1, 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_inplace_op_on_a_leaf_that_requires_grad_is_refused():
    """As PyTorch refuses ``p.mul_(2)`` on such a leaf while grad mode is on;
    under torch.no_grad (how optimizers and clip_grad_norm_ work) it runs."""
    p = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*grads"):
        ops.fused_unscale_clip_([p], torch.ones(1), torch.zeros(1), 1.0, 2.0)
    st = ops.grad_guard_reduce([p.detach()], torch.ones(1), 2.0)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*grads"):
        ops.grad_guard_apply_([p], torch.ones(1), st, torch.zeros(1), 1.0, 2.0)
    fi = torch.zeros(1, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*found_inf"):
        ops.fused_unscale_clip_([torch.randn(3)], torch.ones(1), fi, 1.0, 2.0)
    counts = torch.zeros(1, 3, dtype=torch.float64).long()
    values = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*values"):
        ops.tensor_stats_(torch.randn(3), counts, values, 0)
    before = p.detach().clone()
    with torch.no_grad():
        ops.fused_unscale_clip_([p], torch.ones(1), torch.zeros(1), 1e-3, 2.0)
    assert not torch.equal(p.detach(), before)


def _cow(t):
    return torch._lazy_clone(t)


def test_read_only_inputs_stay_copy_on_write():
    """An op that only reads a tensor must not materialise a lazy
    (copy-on-write) clone of it."""
    is_cow = torch._C._is_cow_tensor
    x, w, b = _cow(torch.randn(3, 8)), _cow(torch.randn(8)), _cow(torch.randn(8))
    _, mean, rstd = ops.stable_layernorm.weight_bias(x, w, b, 1e-5, False)
    assert is_cow(x) and is_cow(w) and is_cow(b)
    gy, mean, rstd = _cow(torch.randn(3, 8)), _cow(mean), _cow(rstd)
    ops.stable_layernorm_backward.weight(gy, x, w, mean, rstd, False, True)
    assert all(is_cow(t) for t in (gy, x, w, mean, rstd))
    q, k, v = (_cow(torch.randn(1, 2, 3, 4)) for _ in range(3))
    m = _cow(torch.zeros(1, 1, 3, 3))
    r = _cow(rng())
    args = (0.0, False, 0.5, 0.0, 0.0)
    out, lse = ops.safe_sdpa.masked(q, k, v, m, *args, r)
    go, out, lse = _cow(torch.randn(1, 2, 3, 4)), _cow(out), _cow(lse)
    ops.safe_sdpa_backward.masked(go, q, k, v, m, out, lse, *args, r)
    assert all(is_cow(t) for t in (q, k, v, m, r, go, out, lse))
    s = _cow(torch.ones(1))
    g = [_cow(torch.randn(5))]
    st = ops.grad_guard_reduce(g, s, 2.0)
    assert is_cow(s) and is_cow(g[0])
    st = _cow(st)
    ops.grad_guard_apply_([torch.randn(5)], s, st, torch.zeros(1), 1.0, 2.0)
    assert is_cow(s) and is_cow(st)
    x = _cow(torch.randn(7))
    ops.tensor_stats_(x, torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.float64), 0)
    assert is_cow(x)


@requires_kernels
def test_a_failing_thread_pool_never_applies_work_twice():
    """When PyTorch's parallel_for fails after part of the range ran, the
    op raises instead of re-running the whole range (which would scale
    gradients in place twice). The library's self-test runs a range function
    that adds 1 to every element it is given and fails on its first call."""
    import ctypes

    lib = ctypes.CDLL(_lib.loaded()["libnanguard.so"])
    fn = lib.ng_selftest_parallel_failure
    fn.restype = ctypes.c_int
    # returns the largest number of times any element was processed; 1 when
    # the failure was detected and nothing ran twice
    assert fn() == 1


def test_empty_gradients_of_any_shape_are_guarded():
    """A zero-size gradient is contiguous whatever its strides (PyTorch's
    rule); found by test_fuzz.py: a [0, 0] gradient was refused as
    non-contiguous, so clip_grad_norm_ raised on it."""
    p = torch.nn.Parameter(torch.zeros(0, 0))
    p.grad = torch.zeros(0, 0)
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.full((3,), 4.0)
    total = nanguard.clip_grad_norm_([p, q], 1.0)
    assert math.isclose(total.item(), math.sqrt(48.0), rel_tol=1e-6)
    ops.fused_unscale_clip_([torch.zeros(0, 0), torch.zeros(2, 0, 3)], torch.ones(1), torch.zeros(1), 1.0, 2.0)


def test_clip_grad_norm_rejects_overlapping_grads_before_writing():
    """A gradient whose elements overlap (an expanded view) cannot be
    written back; it is refused before any other gradient is clipped."""
    p1, p2 = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    p1.grad = torch.full((4,), 10.0)
    p2.grad = torch.ones(1).expand(4)
    with pytest.raises(ValueError, match=r"grads\[1\].*overlap"):
        nanguard.clip_grad_norm_([p1, p2], 1.0)
    assert torch.equal(p1.grad, torch.full((4,), 10.0))


# ---- 2. the generated suite ------------------------------------------------------
#
# Each overload is described by a builder of valid arguments (schema order,
# with names), the arguments it writes in place, and its scalar arguments.
# Every tensor argument is then made wrong in each way below, one at a time:
#
#   dtype       a dtype the argument does not accept               -> raises
#   meta        moved to the meta device, the others on the CPU    -> raises
#   transposed, sliced (stride 2), expanded (stride 0), overlapping
#               the same values (expanded: broadcast ones) through another
#               layout: read-only arguments give exactly what the same
#               call gives on a contiguous copy; arguments written in place
#               raise (the op would not be writing the caller's tensor)
#   zero        the first dimension made 0                          -> table
#   zerod       a 0-d tensor                                        -> table
#   manydims    70 dimensions (PyTorch tensors may have up to 64 in some
#               ops; nanguard's limit is its own)                   -> table
#
# and each float scalar is given NaN, +Inf, -Inf and -1. "raises" means a
# RuntimeError / ValueError / TypeError whose message names the argument.
# The `VALID` table lists the shape cases an op accepts (compared against the
# same call on contiguous copies); every other shape case must raise.

RAISES = (RuntimeError, ValueError, TypeError)


def _same_values(t, kind):
    """t's values through another layout (None when the kind does not apply)."""
    if kind == "transposed":
        if t.dim() < 2 or t.shape[-1] < 2 or t.shape[-2] < 2:
            return None
        return t.mT.contiguous().mT
    if kind == "sliced":
        if t.dim() < 1 or t.shape[-1] < 1:
            return None
        buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    if kind == "expanded":
        d = next((i for i, n in enumerate(t.shape) if n > 1), None)
        if d is None:
            return None
        return t.narrow(d, 0, 1).expand(t.shape)
    if kind == "overlapping":
        if t.dim() < 2 or t.shape[-2] < 2 or t.shape[-1] < 2:
            return None
        strides = list(torch.empty(t.shape).stride())
        strides[-2] = 1  # row r starts one element after row r - 1
        need = 1 + sum((n - 1) * s for n, s in zip(t.shape, strides))
        if t.is_floating_point():
            base = torch.arange(need, dtype=torch.float64).to(t.dtype)
        else:
            base = torch.zeros(need, dtype=t.dtype)
        return base.as_strided(t.shape, strides)
    raise AssertionError(kind)


def _wrong_dtype(t):
    if t.dtype == torch.bool:
        return t.to(torch.int32)
    if t.dtype == torch.int64:
        return t.to(torch.float32)
    return t.to(torch.int32)


LAYOUTS = ("transposed", "sliced", "expanded", "overlapping")
SHAPES = ("zero", "zerod", "manydims")
BAD_SCALARS = (math.nan, math.inf, -math.inf, -1.0)


def _shape_mutation(t, kind):
    if kind == "zero":
        return None if t.dim() == 0 else t.new_zeros((0, *t.shape[1:]))
    if kind == "zerod":
        return None if t.dim() == 0 else t.flatten()[0].clone()
    if kind == "manydims":
        return t.reshape((1,) * (70 - t.dim()) + tuple(t.shape))
    raise AssertionError(kind)


class Spec:
    def __init__(self, name, call, build, mutated=(), valid=(), scalars=None):
        self.name, self.call, self.build = name, call, build
        self.mutated = set(mutated)
        self.valid = set(valid)  # (arg, kind) shape cases the op accepts
        self.scalars = scalars or {}  # name -> {bad value: None (raises) or equivalent value}


def _ln_args(has_w, has_b):
    def build():
        g = torch.Generator().manual_seed(1)
        a = [("input", torch.randn(4, 8, generator=g))]
        if has_w:
            a.append(("weight", torch.randn(8, generator=g)))
        if has_b:
            a.append(("bias", torch.randn(8, generator=g)))
        return a + [("eps", 1e-5), ("rms", False)]
    return build


def _ln_bwd_args(has_w):
    def build():
        g = torch.Generator().manual_seed(2)
        x, w = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
        _, mean, rstd = ops.stable_layernorm(x, 1e-5, False)
        a = [("grad_out", torch.randn(4, 8, generator=g)), ("input", x)]
        if has_w:
            a.append(("weight", w))
        return a + [("mean", mean), ("rstd", rstd), ("rms", False), ("with_bias", True)]
    return build


_SDPA_SCALARS = {
    "dropout_p": {v: None for v in BAD_SCALARS},
    "scale": {math.nan: None, math.inf: None, -math.inf: None, -1.0: -1.0},
    # <= 0 turns a guard off; +inf is no clamp; NaN raises
    "max_score": {math.nan: None, math.inf: 0.0, -math.inf: 0.0, -1.0: 0.0},
    "softcap": {math.nan: None, math.inf: None, -math.inf: 0.0, -1.0: 0.0},
}


_SDPA_VALID = {("rng", "manydims")}  # rng: two contiguous int64 values in any shape


def _sdpa_args(masked, backward):
    def build():
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
        m = torch.randn(1, 2, 3, 3, generator=g)
        scal = [("dropout_p", 0.0), ("is_causal", False), ("scale", 0.5), ("max_score", 0.0),
                ("softcap", 0.0), ("rng", rng())]
        if not backward:
            return [("query", q), ("key", k), ("value", v)] + ([("attn_mask", m)] if masked else []) + scal
        if masked:
            out, lse = ops.safe_sdpa.masked(q, k, v, m, 0.0, False, 0.5, 0.0, 0.0, rng())
        else:
            out, lse = ops.safe_sdpa(q, k, v, 0.0, False, 0.5, 0.0, 0.0, rng())
        go = torch.randn(out.shape, generator=g)
        return ([("grad_out", go), ("query", q), ("key", k), ("value", v)]
                + ([("attn_mask", m)] if masked else []) + [("out", out), ("lse", lse)] + scal)
    return build


def _gg_args(kind):
    def build():
        g = torch.Generator().manual_seed(4)
        grads = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g)]
        s = torch.ones(1)
        if kind == "reduce":
            return [("grads", grads), ("inv_scale", s), ("norm_type", 2.0)]
        f = torch.zeros(1)
        if kind == "apply":
            st = ops.grad_guard_reduce(grads, s, 2.0)
            return [("grads", grads), ("inv_scale", s), ("stats", st), ("found_inf", f), ("max_norm", 1.0),
                    ("norm_type", 2.0)]
        return [("grads", grads), ("inv_scale", s), ("found_inf", f), ("max_norm", 1.0), ("norm_type", 2.0)]
    return build


def _ts_args():
    g = torch.Generator().manual_seed(5)
    return [("x", torch.randn(3, 4, generator=g)), ("counts", torch.zeros(2, 3, dtype=torch.int64)),
            ("values", torch.zeros(2, 2, dtype=torch.float64)), ("slot", 1)]


_NORM_SCALARS = {"max_norm": {math.nan: None, math.inf: 1e308, -math.inf: None, -1.0: None},
                 "norm_type": {math.nan: None, math.inf: math.inf, -math.inf: None, -1.0: None}}
_GRADS_VALID = {("grads", "zero"), ("grads", "zerod"), ("grads", "manydims"),
                ("inv_scale", "zerod"), ("inv_scale", "manydims")}

SPECS = [
    Spec("stable_layernorm", ops.stable_layernorm.default, _ln_args(False, False),
         valid={("input", "zero"), ("input", "manydims")},
         scalars={"eps": {v: None for v in BAD_SCALARS}}),
    Spec("stable_layernorm.weight", ops.stable_layernorm.weight, _ln_args(True, False),
         valid={("input", "zero"), ("input", "manydims")},
         scalars={"eps": {v: None for v in BAD_SCALARS}}),
    Spec("stable_layernorm.bias", ops.stable_layernorm.bias, _ln_args(False, True),
         valid={("input", "zero"), ("input", "manydims")},
         scalars={"eps": {v: None for v in BAD_SCALARS}}),
    Spec("stable_layernorm.weight_bias", ops.stable_layernorm.weight_bias, _ln_args(True, True),
         valid={("input", "zero"), ("input", "manydims")},
         scalars={"eps": {v: None for v in BAD_SCALARS}}),
    # mean / rstd are checked for dtype, device and one value per row: any
    # shape holding them is read the same way
    Spec("stable_layernorm_backward", ops.stable_layernorm_backward.default, _ln_bwd_args(False),
         valid={("mean", "manydims"), ("rstd", "manydims")}),
    Spec("stable_layernorm_backward.weight", ops.stable_layernorm_backward.weight, _ln_bwd_args(True),
         valid={("mean", "manydims"), ("rstd", "manydims")}),
    Spec("safe_sdpa", ops.safe_sdpa.default, _sdpa_args(False, False), scalars=_SDPA_SCALARS, valid=_SDPA_VALID),
    Spec("safe_sdpa.masked", ops.safe_sdpa.masked, _sdpa_args(True, False), scalars=_SDPA_SCALARS, valid=_SDPA_VALID),
    Spec("safe_sdpa_backward", ops.safe_sdpa_backward.default, _sdpa_args(False, True),
         scalars=_SDPA_SCALARS, valid=_SDPA_VALID),
    Spec("safe_sdpa_backward.masked", ops.safe_sdpa_backward.masked, _sdpa_args(True, True),
         scalars=_SDPA_SCALARS, valid=_SDPA_VALID),
    Spec("grad_guard_reduce", ops.grad_guard_reduce.default, _gg_args("reduce"), valid=_GRADS_VALID,
         scalars={"norm_type": _NORM_SCALARS["norm_type"]}),
    Spec("grad_guard_apply_", ops.grad_guard_apply_.default, _gg_args("apply"), mutated={"grads", "found_inf"},
         valid=_GRADS_VALID | {("found_inf", "zerod"), ("found_inf", "manydims"), ("stats", "manydims")},
         scalars=_NORM_SCALARS),
    Spec("fused_unscale_clip_", ops.fused_unscale_clip_.default, _gg_args("fused"), mutated={"grads", "found_inf"},
         valid=_GRADS_VALID | {("found_inf", "zerod"), ("found_inf", "manydims")}, scalars=_NORM_SCALARS),
    Spec("tensor_stats_", ops.tensor_stats_.default, _ts_args, mutated={"counts", "values"},
         valid={("x", "zero"), ("x", "zerod"), ("x", "manydims")}),
]


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone() if v.device.type != "meta" else v
    if isinstance(v, list):
        return [_clone(t) for t in v]
    return v


def _contig(v):
    if isinstance(v, torch.Tensor):
        return v.contiguous().clone() if v.device.type != "meta" else v
    if isinstance(v, list):
        return [_contig(t) for t in v]
    return v


def _flat(out):
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _assert_same(got, want, label):
    assert len(got) == len(want), label
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, label
        if g.device.type == "meta":
            continue
        # the op reads the same values in the same order: exactly equal
        # (flattened: assert_close compares at most 64 dims)
        torch.testing.assert_close(g.reshape(-1), w.reshape(-1), rtol=0, atol=0, equal_nan=True, msg=label)


def _cases():
    """(id, spec, argument list, mutated arg name, expectation) for every case.
    expectation: "raises", or a function of the original args giving the
    reference call's arguments."""
    for spec in SPECS:
        base = spec.build()
        for i, (name, value) in enumerate(base):
            is_list = isinstance(value, list)
            if not (isinstance(value, torch.Tensor) or is_list):
                continue
            t = value[0] if is_list else value

            def put(new, i=i, is_list=is_list):
                args = [v for _, v in spec.build()]
                args[i] = [new] + args[i][1:] if is_list else new
                return args

            label = f"{name}[0]" if is_list else name
            yield f"{spec.name}:{label}:dtype", spec, put(_wrong_dtype(t)), name, "raises"
            others = [v for n, v in base if n not in (name, "rng") and isinstance(v, (torch.Tensor, list))]
            # meta among CPU tensors raises; when it is the only tensor (rng
            # aside, which stays on the CPU) the call is shape inference
            mixed = others or (is_list and len(value) > 1)
            yield f"{spec.name}:{label}:meta", spec, put(t.to("meta")), name, ("raises" if mixed else "same")
            for kind in LAYOUTS:
                new = _same_values(t, kind)
                if new is None:
                    continue
                # written in place: only a view that is still contiguous (a
                # one-element one) is accepted; others would not be the
                # caller's memory. grads, stats and rng are documented as
                # contiguous in every op.
                strict = name in spec.mutated or name in ("grads", "stats", "rng")
                expect = "raises" if strict and not new.is_contiguous() else "same"
                yield f"{spec.name}:{label}:{kind}", spec, put(new), name, expect
            for kind in SHAPES:
                new = _shape_mutation(t, kind)
                if new is None:
                    continue
                expect = "same" if (name, kind) in spec.valid else "raises"
                yield f"{spec.name}:{label}:{kind}", spec, put(new), name, expect
        for i, (name, _) in enumerate(base):
            for bad, equiv in spec.scalars.get(name, {}).items():
                args = [v for _, v in spec.build()]
                args[i] = bad
                expect = "raises" if equiv is None else ("equiv", i, equiv)
                yield f"{spec.name}:{name}={bad}", spec, args, name, expect


CASES = list(_cases())


def test_hostile_case_count():
    """The suite's size, reported in docs/guarantees.md; it fails when a
    change of the tables above drops cases without updating the page."""
    assert len(CASES) >= 300, len(CASES)


def _run_case(case):
    label, spec, args, name, expect = case
    if expect == "raises":
        with pytest.raises(RAISES) as e:
            spec.call(*args)
        assert name in str(e.value), f"{label}: {e.value}"
        return
    # the reference arguments first: an in-place op writes into args
    ref_args = _contig(args)
    if expect != "same":
        _, i, equiv = expect
        ref_args[i] = equiv
    want = spec.call(*ref_args)
    got = spec.call(*args)
    _assert_same(_flat(got), _flat(want), label)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_direct_op_hostile(case):
    _run_case(case)


# ---- the public functions -----------------------------------------------------
#
# The same mutations through nanguard's Python API. The wrappers check before
# any kernel runs (TypeError / ValueError naming the argument); layouts are
# accepted everywhere (the wrappers copy, and write gradients back), except a
# gradient whose elements overlap, which cannot be written back.


def _pub_ln(input, weight, bias, eps):
    return layer_norm(input, (8,), weight, bias, eps)


def _pub_rms(input, weight, eps):
    return rms_norm(input, (8,), weight, eps)


def _pub_sdpa(query, key, value, attn_mask, dropout_p, scale, max_score, softcap):
    return safe_sdpa(query, key, value, attn_mask, dropout_p, scale=scale, max_score=max_score, softcap=softcap)


def _pub_clip(grads, max_norm):
    import types

    # objects with a .grad, as clip_grad_norm_ reads parameters (a Parameter
    # would refuse a .grad of another dtype before nanguard sees it)
    params = [types.SimpleNamespace(grad=g) for g in grads]
    return nanguard.clip_grad_norm_(params, max_norm), grads


def _pub_guard(grads, inv_scale, max_norm, norm_type):
    from nanguard.grad_guard import guard_

    total, stats, found = guard_(grads, inv_scale, max_norm, norm_type)
    return total, stats.tensor, grads, list(found.values())


def _pub_stats_(x, counts, values, slot):
    nanguard.tensor_stats_(x, counts, values, slot)
    return counts, values


def _pub_stats(x):
    return torch.tensor([v for k, v in sorted(nanguard.tensor_stats(x).items())], dtype=torch.float64)


_PUB_GUARDS = {math.nan: None, math.inf: None, -math.inf: None, -1.0: None}  # finite > 0 or None

PUBLIC = [
    Spec("layer_norm", _pub_ln,
         lambda: [("input", torch.randn(4, 8)), ("weight", torch.randn(8)), ("bias", torch.randn(8)), ("eps", 1e-5)],
         valid={("input", "zero"), ("input", "manydims")}, scalars={"eps": {v: None for v in BAD_SCALARS}}),
    Spec("rms_norm", _pub_rms, lambda: [("input", torch.randn(4, 8)), ("weight", torch.randn(8)), ("eps", 1e-6)],
         valid={("input", "zero"), ("input", "manydims")}, scalars={"eps": {v: None for v in BAD_SCALARS}}),
    Spec("safe_sdpa", _pub_sdpa,
         lambda: [("query", torch.randn(2, 3, 4)), ("key", torch.randn(2, 5, 4)), ("value", torch.randn(2, 5, 4)),
                  ("attn_mask", torch.randn(3, 5)), ("dropout_p", 0.0), ("scale", 0.5), ("max_score", 5.0),
                  ("softcap", 8.0)],
         # leading dims broadcast: a 70-d query / key / value with leading ones
         # broadcasts like a 3-d one; a 0-d mask broadcasts to every score
         valid={("query", "manydims"), ("key", "manydims"), ("value", "manydims"), ("attn_mask", "zerod")},
         scalars={"dropout_p": {v: None for v in BAD_SCALARS},
                  "scale": {math.nan: None, math.inf: None, -math.inf: None, -1.0: -1.0},
                  "max_score": _PUB_GUARDS, "softcap": _PUB_GUARDS}),
    Spec("clip_grad_norm_", _pub_clip, lambda: [("grads", [torch.randn(3, 5), torch.randn(7)]), ("max_norm", 1.0)],
         valid=_GRADS_VALID, scalars={"max_norm": {math.nan: None, math.inf: 1e308, -math.inf: None, -1.0: None}}),
    Spec("guard_", _pub_guard,
         lambda: [("grads", [torch.randn(3, 5), torch.randn(7)]), ("inv_scale", torch.ones(1)), ("max_norm", 1.0),
                  ("norm_type", 2.0)],
         valid=_GRADS_VALID, scalars=_NORM_SCALARS),
    Spec("tensor_stats_", _pub_stats_, _ts_args, mutated={"counts", "values"},
         valid={("x", "zero"), ("x", "zerod"), ("x", "manydims")}),
    Spec("tensor_stats", _pub_stats, lambda: [("x", torch.randn(3, 4))],
         valid={("x", "zero"), ("x", "zerod"), ("x", "manydims")}),
]


def _public_cases():
    saved = SPECS[:]
    try:
        SPECS[:] = PUBLIC
        for case in _cases():
            label, spec, args, name, expect = case
            kind = label.rsplit(":", 1)[-1]
            if expect == "raises" and name == "grads" and kind in LAYOUTS:
                # the wrappers copy and write back; only overlapping memory
                # cannot be written back
                expect = "raises" if kind in ("expanded", "overlapping") else "same"
            if expect == "same" and kind == "meta" and spec.name == "tensor_stats":
                expect = "raises"  # it reads the counts on the host
            yield ("public:" + label, spec, args, name, expect)
    finally:
        SPECS[:] = saved


PUBLIC_CASES = list(_public_cases())


def test_public_hostile_case_count():
    assert len(PUBLIC_CASES) >= 150, len(PUBLIC_CASES)


@pytest.mark.parametrize("case", PUBLIC_CASES, ids=[c[0] for c in PUBLIC_CASES])
def test_public_function_hostile(case):
    _run_case(case)


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            yield a
        elif isinstance(a, list):
            yield from _tensors(a)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_every_failing_case_in_a_loop_leaks_nothing():
    """Every direct-op case that must raise, run until more than 1,000
    failing calls: each argument's use count is back where it was and RSS
    stays within RSS_MARGIN_MIB."""
    failing = [c for c in CASES if c[4] == "raises"]
    rounds = 1000 // len(failing) + 1
    tensors = [t for c in failing for t in _tensors(c[2])]
    uses = [t._use_count() for t in tensors]
    for c in failing:  # warm up
        _run_case(c)
    gc.collect()
    rss0 = _rss_bytes()
    calls = 0
    for _ in range(rounds):
        for c in failing:
            try:
                c[1].call(*c[2])
            except RAISES:
                calls += 1
    gc.collect()
    grown = (_rss_bytes() - rss0) / 2**20
    assert calls == rounds * len(failing) > 1000
    assert [t._use_count() for t in tensors] == uses
    assert grown < RSS_MARGIN_MIB, f"RSS grew by {grown:.1f} MiB over {calls} failing calls"


def test_scalar_tensors_name_the_one_dtype_they_take():
    """inv_scale and found_inf take float32 only; the message for an integer
    one names float32 and the dtype it got, not a list of float dtypes the
    op does not take."""
    g = [torch.randn(3)]
    with pytest.raises(RuntimeError, match="found_inf must be a float32 tensor with one element.*int64"):
        ops.fused_unscale_clip_(g, torch.ones(1), torch.zeros(1, dtype=torch.int64), 1.0, 2.0)
    with pytest.raises(RuntimeError, match="inv_scale must be a float32 tensor with one element.*bool"):
        ops.grad_guard_reduce(g, torch.ones(1, dtype=torch.bool), 2.0)
