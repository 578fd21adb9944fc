"""The composite gradient guard and tensor_stats_ (nanguard.composite.grad_guard,
nanguard.composite.tensor_stats) against the C ops, call by call, on the CPU.

Every comparison runs both on identical copies of the inputs. What must be
bit for bit the same: NaN / Inf counts, first offending tensor, found_inf,
the max-|g| norm, gradients left untouched by a skipped step, and gradients
and total_norm of an apply pass given the same stats (the multiplier then is
the same number). What may differ in the last bits: the sum of squares (the
C adds fixed 65536-element blocks in order, PyTorch its own way), hence the
clip coefficient of a fused call, hence one rounding of a clipped gradient.
Plus: the norm against an fp64 reference, the rare paths (fp32 squares that
overflow, a multiplier below the fp32 normal range, inv_scale > 1), the
tensor_stats census of every dtype and layout, bad arguments, and no host
reads.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import CUDA, requires_kernels
from test_grad_guard import NORM_RTOL, make_grads
from test_grad_guard import reference as gg_reference
from test_tensor_stats import poison, views
from test_tensor_stats import reference as ts_reference

import nanguard  # noqa: F401  (loads the C library)
from nanguard.composite import _checks as composite_checks
from nanguard.composite import grad_guard as cgg
from nanguard.composite import tensor_stats as cts

ops = torch.ops.nanguard

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NORMS = [2.0, math.inf]

#: relative size of one unit in the last place, per dtype
ULP = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

#: the sum of squares: fp64 over exact squares, in another order than the C's
SSQ_RTOL = 1e-12

#: gradients after a fused call: the clip coefficients differ in their last
#: fp64 bits (the sum of squares' order); one rounding to the dtype turns that
#: into at most one unit of 16/32-bit gradients, a few of fp64 ones
FUSED_RTOL = {torch.float64: 2e-15, torch.float32: 2 * ULP[torch.float32],
              torch.float16: 2 * ULP[torch.float16], torch.bfloat16: 2 * ULP[torch.bfloat16]}

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert torch.equal(bits(got), bits(want)), (got, want)


def clones(grads):
    return [g.clone() for g in grads]


# ---- gradient sets ----------------------------------------------------------------------


def grad_set(dtype, seed, where=None):
    """13 small tensors (zero-size ones at 0, 4 and 11) and one of 70000
    elements (more than one 65536-element C block) at 8; `where` poisons
    tensors: "first" a NaN in the first non-empty tensor, "later" a -Inf in
    the big one, "both" both and a +Inf in tensor 12. Returns (grads, the
    expected NaN, Inf counts and first_bad)."""
    grads = [torch.empty(0, dtype=dtype)] + make_grads(13, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    grads[8] = (torch.randn(70000, generator=gen, dtype=torch.float64) * 1000).to(dtype)
    assert grads[4].numel() == 0 and grads[11].numel() == 0
    nan = inf = 0
    first = -1
    if where in ("first", "both"):
        grads[1].view(-1)[-1] = math.nan
        nan, first = 1, 1
    if where in ("later", "both"):
        grads[8].view(-1)[66000] = -math.inf
        inf += 1
        first = 8 if first < 0 else first
    if where == "both":
        grads[12].view(-1)[0] = math.inf
        inf += 1
    return grads, (nan, inf, first)


def compare_stats(got, want, norm_type):
    assert got.dtype == torch.float64 and got.shape == (4,) and got.device == want.device
    assert got[1:].tolist() == want[1:].tolist()
    if norm_type == 2.0:
        torch.testing.assert_close(got[0], want[0], rtol=SSQ_RTOL, atol=0, equal_nan=True)
    else:
        assert_same_bits(got[0], want[0])


def compare_total_norm(got, want):
    assert got.dtype == want.dtype and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=max(2 * ULP[got.dtype], SSQ_RTOL), atol=0, equal_nan=True)


# ---- the two paths of the composite guard ------------------------------------------------


@pytest.fixture(params=["cpu", "general"])
def guard_path(request, monkeypatch):
    """Each guard test runs on both roads of the composite: the CPU's
    shortcut (host reads allowed) and the general one every other device
    takes (no host read), forced on the CPU here."""
    if request.param == "general":
        monkeypatch.setattr(composite_checks, "READ_FREE", frozenset())
    return request.param


# ---- fused_unscale_clip_ (both passes) against the C ------------------------------------


#: _BUCKET as shipped (all 14 tensors in one bucket), and 1000 elements (the
#: 70000-element tensor cut into 70 pieces, the small ones a few per bucket)
BUCKETS = [cgg._BUCKET, 1000]


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("where", [None, "first", "later", "both"])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_fused_matches_c(dtype, norm_type, where, bucket, monkeypatch, guard_path):
    monkeypatch.setattr(cgg, "_BUCKET", bucket)
    grads, (nan, inf, first) = grad_set(dtype, seed=len(str(where)), where=where)
    skipped = where is not None
    for inv_scale in (1.0, 1.0 / 1024, 0.3):
        s = torch.tensor([inv_scale])
        u_norm = gg_reference(grads, inv_scale, 1.0, norm_type)[1]
        for max_norm in (0.0, 0.25 * u_norm, 2 * u_norm + 1, math.inf):
            if not math.isfinite(max_norm):
                max_norm = math.inf
            a, b = clones(grads), clones(grads)
            fa, fb = torch.zeros(()), torch.zeros(())
            tn_c, st_c = ops.fused_unscale_clip_(a, s, fa, max_norm, norm_type)
            tn, st = cgg.fused_unscale_clip_(b, s, fb, max_norm, norm_type)
            compare_stats(st, st_c, norm_type)
            assert st[1:].tolist() == [nan, inf, first]
            compare_total_norm(tn, tn_c)
            assert_same_bits(fb, fa)
            assert fb.item() == (1.0 if skipped else 0.0)
            for x, y, g in zip(b, a, grads):
                if skipped:  # untouched, NaN payloads and all
                    assert_same_bits(x, g)
                else:
                    torch.testing.assert_close(x, y, rtol=FUSED_RTOL[dtype], atol=0)
            if not skipped:  # the norm against the fp64 reference
                assert tn.item() == pytest.approx(u_norm, rel=NORM_RTOL)
            else:
                assert math.isnan(tn.item()) if nan else tn.item() == math.inf


# ---- grad_guard_apply_ from the same stats: bit for bit -----------------------------------


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("bucket", BUCKETS)
def test_apply_from_the_same_stats_is_bitwise_the_cs(dtype, norm_type, bucket, monkeypatch, guard_path):
    monkeypatch.setattr(cgg, "_BUCKET", bucket)
    grads, _ = grad_set(dtype, seed=7)
    for inv_scale in (1.0, 1.0 / 1024, 0.3, 3.0):
        s = torch.tensor([inv_scale])
        st = ops.grad_guard_reduce(grads, s, norm_type)
        assert_same_bits(cgg.grad_guard_reduce(grads, s, norm_type)[1:], st[1:])
        # this call's stats; combined with another group's; another group's NaN;
        # a non-finite sum of squares with zero counts
        bigger = st.clone()
        bigger[0] *= 4.0
        nan_elsewhere = st.clone()
        nan_elsewhere[1], nan_elsewhere[3] = 1.0, -1.0
        inf_acc = st.clone()
        inf_acc[0] = math.inf
        for stats in (st, bigger, nan_elsewhere, inf_acc):
            for max_norm in (0.0, 1e-3, 10.0, math.inf):
                a, b = clones(grads), clones(grads)
                fa, fb = torch.zeros(1), torch.zeros(1)
                tn_c = ops.grad_guard_apply_(a, s, stats, fa, max_norm, norm_type)
                tn = cgg.grad_guard_apply_(b, s, stats, fb, max_norm, norm_type)
                assert_same_bits(tn, tn_c)
                assert_same_bits(fb, fa)
                for x, y in zip(b, a):
                    assert_same_bits(x, y)


@requires_kernels
@pytest.mark.parametrize("init", [0.0, 1.0, 0.5])
def test_found_inf_is_set_never_cleared(init, guard_path):
    for where in (None, "first"):
        grads, _ = grad_set(torch.float32, seed=3, where=where)
        for shape in ((), (1,), (1, 1)):
            fa, fb = torch.full(shape, init), torch.full(shape, init)
            ops.fused_unscale_clip_(clones(grads), torch.tensor([0.5]), fa, 1.0, 2.0)
            cgg.fused_unscale_clip_(clones(grads), torch.tensor([0.5]), fb, 1.0, 2.0)
            assert_same_bits(fb, fa)
            assert fb.flatten().item() == (init if where is None else 1.0)


# ---- empty lists, zero-size tensors ----------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("norm_type", NORMS)
def test_empty_list_and_zero_size_tensors(norm_type, guard_path):
    s = torch.tensor([0.5])
    for grads in ([], [torch.empty(0)], [torch.empty(0, 3, dtype=torch.float16), torch.empty(0, dtype=torch.float16)],
                  [torch.empty(0, dtype=torch.float64)]):
        st_c = ops.grad_guard_reduce(grads, s, norm_type)
        st = cgg.grad_guard_reduce(grads, s, norm_type)
        assert_same_bits(st, st_c)
        assert st.tolist() == [0.0, 0.0, 0.0, -1.0]
        fa, fb = torch.zeros(()), torch.zeros(())
        tn_c, st_c = ops.fused_unscale_clip_(clones(grads), s, fa, 1.0, norm_type)
        tn, st = cgg.fused_unscale_clip_(clones(grads), s, fb, 1.0, norm_type)
        assert_same_bits(tn, tn_c)
        assert_same_bits(st, st_c)
        assert_same_bits(fb, fa)
        # apply with another group's stats: nothing to write, the norm is theirs
        other = torch.tensor([9.0, 0.0, 0.0, -1.0], dtype=torch.float64)
        tn_c = ops.grad_guard_apply_(clones(grads), s, other, fa, 1.0, norm_type)
        tn = cgg.grad_guard_apply_(clones(grads), s, other, fb, 1.0, norm_type)
        assert_same_bits(tn, tn_c)


# ---- the rare paths -------------------------------------------------------------------------


def _apply_both(grads, inv_scale, max_norm, norm_type):
    """reduce + apply on both sides: (C grads, composite grads, C stats,
    composite stats, C found_inf, composite found_inf)."""
    s = torch.tensor([inv_scale])
    a, b = clones(grads), clones(grads)
    fa, fb = torch.zeros(()), torch.zeros(())
    st_c = ops.grad_guard_reduce(a, s, norm_type)
    st = cgg.grad_guard_reduce(b, s, norm_type)
    compare_stats(st, st_c, norm_type)
    # the C's stats on both sides, so that the multipliers are the same number
    assert_same_bits(cgg.grad_guard_apply_(b, s, st_c, fb, max_norm, norm_type),
                     ops.grad_guard_apply_(a, s, st_c, fa, max_norm, norm_type))
    assert_same_bits(fb, fa)
    for x, y in zip(b, a):
        assert_same_bits(x, y)
    return a, b, st_c, st, fa, fb


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", NORMS)
def test_huge_gradients_and_a_multiplier_below_fp32_normals(dtype, norm_type, guard_path):
    """|g| ~ 1e30: the fp32 square is inf but the fp64 sum is finite; clipped
    to 1e-20 with inv_scale 1e-3 the multiplier is ~1e-51, below FLT_MIN (an
    fp32 subnormal, 0 here): the product is formed in fp64."""
    gen = torch.Generator().manual_seed(5)
    grads = [(torch.randn(n, generator=gen, dtype=torch.float64) * 1e30).to(dtype) for n in (100, 0, 257)]
    a, b, st_c, st, fa, fb = _apply_both(grads, 1e-3, 1e-20, norm_type)
    assert math.isfinite(st[0].item()) and fb.item() == 0.0
    tn = torch.tensor(st_c[0].item() ** (0.5 if norm_type == 2.0 else 1.0), dtype=torch.float64)
    coef = float(torch.tensor(1e-3)) * (1e-20 / (tn.item() + 1e-6))
    assert coef < 2.0**-126 and float(torch.tensor(coef, dtype=torch.float32)) == 0.0
    for x, g in zip(b, grads):
        if g.numel():
            assert (x != 0).all()
            torch.testing.assert_close(x.double(), g.double() * coef, rtol=ULP[dtype], atol=0)


@requires_kernels
def test_inv_scale_above_one(guard_path):
    # fp16 60000 * 4 is finite in fp32 but not in fp16: counted as an Inf of
    # tensor 0 (the C's rule), the step skipped, nothing written
    g16 = [torch.tensor([60000.0, -1.0, 2.0], dtype=torch.float16)]
    a, b, st_c, st, fa, fb = _apply_both(g16, 4.0, math.inf, 2.0)
    assert st[1:].tolist() == [0.0, 1.0, 0.0] and fb.item() == 1.0
    assert_same_bits(b[0], g16[0])
    # fp32 3e38 * 4 overflows in fp32: an Inf of tensor 0, an infinite norm, the step skipped
    g32 = [torch.tensor([3e38, 1.0]), torch.tensor([2.0])]
    for norm_type in NORMS:
        a, b, st_c, st, fa, fb = _apply_both(g32, 4.0, 1.0, norm_type)
        assert st[0].item() == math.inf and st[1:].tolist() == [0.0, 1.0, 0.0]
        assert fb.item() == 1.0
        for x, g in zip(b, g32):
            assert_same_bits(x, g)


@requires_kernels
def test_fp64_sum_of_squares_overflow_skips(guard_path):
    g = [torch.tensor([1e200, 1.0], dtype=torch.float64), torch.tensor([-3.0], dtype=torch.float64)]
    a, b, st_c, st, fa, fb = _apply_both(g, 1.0, 1.0, 2.0)
    assert st.tolist() == [math.inf, 0.0, 0.0, -1.0] and fb.item() == 1.0
    assert_same_bits(b[0], g[0])
    # norm inf does not square: finite, clipped
    a, b, st_c, st, fa, fb = _apply_both(g, 1.0, 1.0, math.inf)
    assert st[0].item() == 1e200 and fb.item() == 0.0


# ---- the CPU road's shortcut against the general road ---------------------------------------


def _both_roads(grads, inv_scale, max_norm, norm_type, monkeypatch):
    """fused_unscale_clip_ on the CPU road and on the general one: (total_norm,
    stats, found_inf, grads) of each."""
    out = []
    for free in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(composite_checks, "READ_FREE", free)
        g, f = clones(grads), torch.zeros(())
        tn, st = cgg.fused_unscale_clip_(g, torch.tensor([inv_scale]), f, max_norm, norm_type)
        out.append((tn, st, f, g))
    return out


def _shortcut(grads, inv_scale, norm_type):
    """What _reduce_cpu gives: stats, or None where it hands over to the general pass."""
    s = torch.tensor(inv_scale, dtype=torch.float64 if grads[0].dtype == torch.float64 else torch.float32)
    return cgg._reduce_cpu(cgg._buckets(grads), s, grads[0].dtype, norm_type == 2.0)


#: (grads, inv_scale, whether the shortcut may keep its result): at the edges
#: of the scaled shortcut (inv_scale 2**k: u = x * s exact unless it leaves the
#: fp32 normal range) and off it
_EDGES = [
    # |u| = 1.5 * 2**127 <= FLT_MAX: exact, kept
    ([torch.tensor([1.5 * 2.0**100, -3.0]), torch.tensor([7.0])], 2.0**27, True),
    # |u| = 2**128 overflows fp32: the C's sum is inf, the step skipped
    ([torch.tensor([2.0**101, -3.0]), torch.tensor([7.0])], 2.0**27, False),
    # every u subnormal (bits lost): the sum is below 2**-100, the max below
    # FLT_MIN, handed over
    ([torch.tensor([2.0**-110 * (1 + 2.0**-23), -(2.0**-112)])], 2.0**-20, False),
    # one normal u among subnormal ones: kept, their share is below 2**-130
    ([torch.tensor([1.0, 2.0**-110 * (1 + 2.0**-23)]), torch.tensor([2.0**-115])], 2.0**-20, True),
    # not a power of two: u formed in fp32 first, kept
    ([torch.tensor([3.0e38, 1.0])], 0.3, True),
    # fp16 widened exactly, scaled by 2**-16 (GradScaler's), kept
    ([torch.tensor([60000.0, -1e-7, 2.0], dtype=torch.float16)], 2.0**-16, True),
    # fp32 u overflows for a non-power-of-two scale: inf, handed over
    ([torch.tensor([3.0e38, 1.0])], 3.0, False),
    # fp16 with inv_scale above 1: 16376 * 4.001 fits fp32, not fp16; the
    # shortcut never counts, so it hands every such case over
    ([torch.tensor([16376.0, 1.0], dtype=torch.float16)], 4.001, False),
]


@pytest.mark.parametrize("case", range(len(_EDGES)))
@pytest.mark.parametrize("norm_type", NORMS)
def test_cpu_shortcut_equals_the_general_road(case, norm_type, monkeypatch):
    grads, inv_scale, kept = _EDGES[case]
    st = _shortcut(grads, inv_scale, norm_type)
    assert (st is not None) == kept, st
    (tn_a, st_a, f_a, g_a), (tn_b, st_b, f_b, g_b) = _both_roads(grads, inv_scale, 1.0, norm_type, monkeypatch)
    compare_stats(st_a, st_b, norm_type)
    assert_same_bits(f_a, f_b)
    compare_total_norm(tn_a, tn_b)
    for x, y in zip(g_a, g_b):
        assert_same_bits(x, y)


def test_cpu_shortcut_is_taken_on_healthy_grads():
    """The shortcut's whole point: finite gradients need no counting pass."""
    for dtype in DTYPES:
        grads, _ = grad_set(dtype, seed=2)
        for inv_scale in (1.0, 2.0**-16, 0.3):
            for norm_type in NORMS:
                assert _shortcut(grads, inv_scale, norm_type) is not None, (dtype, inv_scale, norm_type)
        poisoned, _ = grad_set(dtype, seed=2, where="later")
        assert _shortcut(poisoned, 1.0, 2.0) is None


# ---- tensor_stats_ ------------------------------------------------------------------------


def _specials(dtype):
    """Every class of value: NaN, +-Inf, +-0, subnormals, the largest finite."""
    fi = torch.finfo(dtype)
    v = [math.nan, math.inf, -math.inf, 0.0, -0.0, fi.tiny / 4, -fi.tiny / 2, fi.max, -fi.max, 1.5, -7.0]
    return torch.tensor(v, dtype=torch.float64).to(dtype)


def _buffers(slots, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(-5, 5, (slots, 3), generator=gen, dtype=torch.int64)
    values = torch.randn(slots, 2, generator=gen, dtype=torch.float64)
    return counts, values


@requires_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_stats_matches_c(dtype):
    torch.manual_seed(0)
    base = (torch.randn(6, 35, 40, dtype=torch.float64) * 100).to(dtype)
    poison(base, 1)
    base.view(-1)[100:111] = _specials(dtype)
    cases = list(views(base)) + [
        ("specials", _specials(dtype)),
        ("all-nan", torch.full((5,), math.nan, dtype=dtype)),
        ("zeros", torch.zeros(3, 4, dtype=dtype)),
        ("neg-zero", torch.full((2,), -0.0, dtype=dtype)),
        ("empty-2d", torch.empty(3, 0, dtype=dtype)),
    ]
    slots = 4
    ca, va = _buffers(slots, 2)
    cb, vb = ca.clone(), va.clone()
    for i, (name, x) in enumerate(cases):
        slot = (3 * i) % slots
        ops.tensor_stats_(x, ca, va, slot)
        assert cts.tensor_stats_(x, cb, vb, slot) is None
        # every slot, written or not, bit for bit
        assert_same_bits(cb, ca), name
        assert_same_bits(vb, va), name
        want = ts_reference(x)
        assert tuple(cb[slot].tolist()) + tuple(vb[slot].tolist()) == want, name


# ---- bad arguments: RuntimeError, naming the argument, as the C says it ---------------------------

_s = torch.tensor([1.0])
_f = torch.zeros(())
_g = [torch.randn(4)]
_st = torch.zeros(4, dtype=torch.float64)

BAD_GG = [
    ("grad_guard_reduce", ([torch.randn(3), torch.randn(3).half()], _s, 2.0), "is float32, tensor 1 is float16"),
    ("grad_guard_reduce", ([torch.randn(2), torch.randn(2), torch.randn(2).double()], _s, 2.0), "tensor 2 is float64"),
    ("grad_guard_reduce", (_g, _s, 1.0), "norm_type must be 2.0 or inf, got 1"),
    ("grad_guard_reduce", (_g, torch.tensor([1.0, 2.0]), 2.0), "inv_scale must be a float32 tensor with one element"),
    ("grad_guard_reduce", (_g, torch.tensor([1.0], dtype=torch.float64), 2.0), "inv_scale must be a float32"),
    ("grad_guard_reduce", (_g, torch.tensor([[1.0]]).to_sparse(), 2.0), "inv_scale must be a strided"),
    ("grad_guard_reduce", ([torch.ones(3, dtype=torch.int32)], _s, 2.0), "grads must be float16"),
    ("grad_guard_reduce", ([torch.randn(4), torch.randn(4, 4).t()], _s, 2.0), r"grads\[1\] must be contiguous$"),
    ("fused_unscale_clip_", ([torch.randn(4, 4).t()], _s, _f, 1.0, 2.0), r"contiguous \(it is updated in place\)"),
    ("fused_unscale_clip_", (_g, _s, _f, -1.0, 2.0), "max_norm must be >= 0 .inf for no clipping., got -1"),
    ("fused_unscale_clip_", (_g, _s, _f, math.nan, 2.0), "max_norm must be >= 0"),
    ("fused_unscale_clip_", (_g, _s, _f, 1.0, 0.0), "norm_type must be 2.0 or inf"),
    ("fused_unscale_clip_", (_g, _s, torch.zeros(2), 1.0, 2.0), "found_inf must be a float32 tensor with one element"),
    ("fused_unscale_clip_", (_g, _s, torch.zeros(1, dtype=torch.float64), 1.0, 2.0), "found_inf must be a float32"),
    ("grad_guard_apply_", (_g, _s, torch.zeros(3, dtype=torch.float64), _f, 1.0, 2.0), "stats must be a contiguous"),
    ("grad_guard_apply_", (_g, _s, torch.zeros(4), _f, 1.0, 2.0), "stats must be a contiguous float64"),
    ("grad_guard_apply_", (_g, _s, torch.zeros(8, dtype=torch.float64)[::2], _f, 1.0, 2.0), "stats must be a"),
    ("grad_guard_apply_", (_g, _s, torch.zeros(4, dtype=torch.int64), _f, 1.0, 2.0), "stats must be float16"),
    ("grad_guard_apply_", (_g, _s, _st, torch.zeros(3), 1.0, 2.0), "found_inf must be a float32"),
    ("grad_guard_apply_", (_g, _s, _st, _f, -0.5, 2.0), "max_norm must be >= 0"),
    ("grad_guard_apply_", (_g, _s, _st, _f, 1.0, 3.0), "norm_type must be 2.0 or inf, got 3"),
]

_x = torch.randn(5)
_c = torch.zeros(4, 3, dtype=torch.int64)
_v = torch.zeros(4, 2, dtype=torch.float64)

BAD_TS = [
    ((torch.arange(5), _c, _v, 0), "x must be float16, bfloat16, float32 or float64"),
    ((torch.eye(3).to_sparse(), _c, _v, 0), "x must be a strided"),
    ((_x, _c, torch.zeros(4, 2), 0), "values must be a contiguous float64 tensor of shape .slots, 2."),
    ((_x, _c, torch.zeros(4, 3, dtype=torch.float64), 0), "values must be a contiguous float64"),
    ((_x, _c, torch.zeros(2, 4, dtype=torch.float64).t(), 0), "values must be a contiguous float64"),
    ((_x, _c, torch.zeros(8, dtype=torch.float64), 0), "values must be a contiguous float64"),
    ((_x, _c, torch.zeros(4, 2, dtype=torch.int64), 0), "values must be float16"),
    ((_x, _c.int(), _v, 0), "counts must be a contiguous int64 tensor of shape .slots, 3."),
    ((_x, torch.zeros(4, 2, dtype=torch.int64), _v, 0), "counts must be a contiguous int64"),
    ((_x, torch.zeros(3, 4, dtype=torch.int64).t(), _v, 0), "counts must be a contiguous int64"),
    ((_x, torch.zeros(3, 3, dtype=torch.int64), _v, 0), "counts has 3 slots but values has 4; they must match"),
    ((_x, _c, _v, 4), "slot 4 is out of range for a buffer of 4 slots"),
    ((_x, _c, _v, -1), "slot -1 is out of range"),
]


def _raised(fn, args) -> str:
    with pytest.raises(RuntimeError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("case", range(len(BAD_GG)))
def test_grad_guard_bad_arguments(case):
    name, args, msg = BAD_GG[case]
    got = _raised(cgg.KERNELS[name], args)
    assert got.startswith(f"nanguard::{name}: ")
    assert re.search(msg, got), got
    want = _raised(getattr(ops, name), args)
    if "another dtype" not in want:  # the C names only the dtypes it knows
        assert got == want.splitlines()[0]


@pytest.mark.parametrize("case", range(len(BAD_TS)))
def test_tensor_stats_bad_arguments(case):
    args, msg = BAD_TS[case]
    counts, values = args[1].clone(), args[2].clone()
    got = _raised(cts.tensor_stats_, args)
    assert got.startswith("nanguard::tensor_stats_: ")
    assert re.search(msg, got), got
    want = _raised(ops.tensor_stats_, args)
    if "another dtype" not in want:
        assert got == want.splitlines()[0]
    assert torch.equal(args[1], counts) and torch.equal(args[2], values)  # nothing written


def test_other_device_is_refused():
    """The C library cannot see a meta tensor; the composite names both devices."""
    m = torch.ones(1, device="meta")
    with pytest.raises(RuntimeError, match="grads is on cpu but inv_scale is on meta; both must be on the same device"):
        cgg.grad_guard_reduce([torch.randn(3)], m, 2.0)
    with pytest.raises(RuntimeError, match="found_inf is on meta but inv_scale is on cpu"):
        cgg.fused_unscale_clip_([torch.randn(3)], _s, torch.zeros((), device="meta"), 1.0, 2.0)
    with pytest.raises(RuntimeError, match="stats is on meta but inv_scale is on cpu"):
        cgg.grad_guard_apply_([torch.randn(3)], _s, _st.to("meta"), _f, 1.0, 2.0)
    with pytest.raises(RuntimeError, match="counts is on meta but x is on cpu"):
        cts.tensor_stats_(_x, _c.to("meta"), _v, 0)


# ---- no host reads ---------------------------------------------------------------------------


def _no_reads(monkeypatch):
    def refuse(*_):
        raise AssertionError("a tensor value was read on the host")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)


def _inputs(device):
    """Every kernel's inputs, made before host reads are refused."""
    out = []
    for dtype in DTYPES:
        for where in (None, "both"):
            grads = [g.to(device) for g in grad_set(dtype, seed=11, where=where)[0]]
            out.append((grads, grads[8][::3], torch.tensor([0.5], device=device),
                        torch.zeros((), device=device), torch.zeros(2, 3, dtype=torch.int64, device=device),
                        torch.zeros(2, 2, dtype=torch.float64, device=device)))
    return out


def _run_every_kernel(inputs):
    for grads, strided, s, f, c, v in inputs:
        for norm_type in NORMS:
            st = cgg.grad_guard_reduce(grads, s, norm_type)
            cgg.grad_guard_apply_(grads, s, st, f, 1.0, norm_type)
            cgg.fused_unscale_clip_(grads, s, f, 0.0, norm_type)
        cgg.fused_unscale_clip_([], s, f, 1.0, 2.0)
        cts.tensor_stats_(grads[8], c, v, 1)
        cts.tensor_stats_(strided, c, v, 0)
        cts.tensor_stats_(grads[4], c, v, 0)


def test_no_host_reads(monkeypatch):
    """The road every device but the CPU takes reads nothing on the host."""
    monkeypatch.setattr(composite_checks, "READ_FREE", frozenset())
    inputs = _inputs("cpu")
    _no_reads(monkeypatch)
    _run_every_kernel(inputs)


@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_no_cuda_sync():
    """On CUDA every host read or synchronising copy raises in this mode."""
    _run_every_kernel(_inputs("cuda"))  # warm up (first allocations may sync)
    inputs = _inputs("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run_every_kernel(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
