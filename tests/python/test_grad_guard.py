"""nanguard's gradient guard: torch.ops.nanguard.grad_guard_reduce /
grad_guard_apply_ / fused_unscale_clip_, nanguard.clip_grad_norm_ and
nanguard.amp.GradScaler.

Against GradScaler.unscale_ + clip_grad_norm_ computed in fp64 on random
gradient sets (1 and 500 tensors, empty ones, one NaN, one Inf, norm under
and over max_norm, norm 2 and inf), against the stock fp32 path, a small
fp16-autocast training loop vs the stock GradScaler loop (with and without
overflow), two real gloo processes vs one process holding everything,
opcheck, and bad inputs.
"""

from __future__ import annotations

import gc
import math
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch

import nanguard
from nanguard import grad_guard as gg
from nanguard.grad_guard import _plan
from nanguard.amp import GradScaler

from conftest import DEVICES, TOLERANCES, requires_cuda

ops = torch.ops.nanguard

TOL = TOLERANCES["grad_guard"]
NORM_RTOL = 1e-6


def make_grads(n, dtype, seed, device="cpu", mag=1000.0, empty_every=7):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 3000, (n,), generator=gen).tolist()
    out = []
    for i, s in enumerate(sizes):
        if empty_every and i % empty_every == 3:
            s = 0
        shape = (s,) if i % 2 else (1, s)
        out.append((torch.randn(shape, generator=gen, dtype=torch.float64) * mag).to(dtype).to(device))
    return out


def reference(grads, inv_scale, max_norm, norm_type):
    """GradScaler.unscale_ + clip_grad_norm_, in fp64. Returns (found_inf,
    total_norm, expected grads or None when the step is skipped)."""
    g64 = [g.double().cpu() for g in grads]
    s = float(inv_scale)
    found = not math.isfinite(s) or any(not torch.isfinite(g).all() for g in g64)
    # a finite gradient whose unscaled value (the fp32 product for the 16/32-bit
    # dtypes) its dtype cannot hold would be written back as Inf: found too
    for g in grads:
        g = g.cpu()
        native = g * s if g.dtype == torch.float64 else g.float() * torch.tensor(s, dtype=torch.float32)
        found = found or not bool((torch.isfinite(native.to(g.dtype)) | ~torch.isfinite(g)).all())
    u = [g * s for g in g64]
    if not math.isfinite(s):
        total = math.nan
    elif u:
        total = torch.linalg.vector_norm(torch.cat([x.flatten() for x in u]), norm_type).item()
    else:
        total = 0.0
    if found:
        return True, total, None
    clip = min(1.0, max_norm / (total + 1e-6))
    return False, total, [x * clip for x in u]


def check_against_reference(grads, inv_scale, max_norm, norm_type):
    before = [g.clone() for g in grads]
    found, total, want = reference(grads, inv_scale, max_norm, norm_type)
    tn, stats, fi = gg.guard_(grads, inv_scale, max_norm, norm_type)
    got_found = any(v.item() for v in fi.values())
    assert got_found == found
    if found:
        assert not math.isfinite(tn.item())
        for g, b in zip(grads, before):  # untouched
            torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert tn.item() == pytest.approx(total, rel=NORM_RTOL, abs=1e-30)
        for g, w in zip(grads, want):
            atol, rtol = TOL[g.dtype]
            torch.testing.assert_close(g.double().cpu(), w, atol=atol, rtol=rtol)
    return stats


# ---- against the fp64 reference ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 500])
@pytest.mark.parametrize("case", ["under", "over", "nan", "inf"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_matches_unscale_then_clip_fp64(device, dtype, n, case, norm_type):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")
    grads = make_grads(n, dtype, seed=n + len(case), device=device, empty_every=0 if n == 1 else 7)
    inv_scale = 1.0 / 1024
    u_norm = reference(grads, inv_scale, 1.0, norm_type)[1]
    max_norm = 2 * u_norm + 1 if case == "under" else 0.25 * u_norm
    if case in ("nan", "inf"):
        k = n // 2 if n > 1 else 0
        while grads[k].numel() == 0:
            k += 1
        grads[k].view(-1)[grads[k].numel() // 2] = math.nan if case == "nan" else -math.inf
    stats = check_against_reference(grads, inv_scale, max_norm, norm_type)
    h = stats.as_dict()
    assert h["nan_count"] == (1 if case == "nan" else 0)
    assert h["inf_count"] == (1 if case == "inf" else 0)
    if case in ("nan", "inf"):
        assert h["first_bad"] == k
    else:
        assert h["first_bad"] == -1


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_empty_tensors_and_empty_list(norm_type):
    grads = [torch.empty(0), torch.randn(5) * 100, torch.empty(0, 3), torch.randn(2, 2)]
    check_against_reference(grads, 0.5, 1.0, norm_type)
    tn, stats, fi = gg.guard_([torch.empty(0)], 0.5, 1.0, norm_type)
    assert tn.item() == 0.0 and stats.as_dict()["first_bad"] == -1 and fi[torch.device("cpu")].item() == 0
    p = torch.nn.Parameter(torch.randn(3))
    assert nanguard.clip_grad_norm_([p], 1.0).item() == 0.0  # no grads, as PyTorch
    assert nanguard.clip_grad_norm_([], 1.0).item() == 0.0


def test_matches_stock_fp32_path():
    """Same decisions and gradients as torch's own GradScaler.unscale_ +
    clip_grad_norm_(foreach=True) on fp32 gradients."""
    for seed, bad in [(1, None), (2, math.nan), (3, math.inf)]:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in (10, 0, 4097, 33, 70000)]
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 4096
        if bad is not None:
            params[3].grad[5] = bad
        saved0 = params[0].grad.clone()
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, t in zip(params, twins):
            t.grad = p.grad.clone()
        opt_a = torch.optim.SGD(params, lr=0.1)
        opt_b = torch.optim.SGD(twins, lr=0.1)
        stock = torch.amp.GradScaler("cpu", init_scale=4096.0)
        ours = GradScaler("cpu", init_scale=4096.0)
        stock.scale(torch.ones(()))  # the scale tensor is created lazily
        ours.scale(torch.ones(()))
        stock.unscale_(opt_b)
        norm_b = torch.nn.utils.clip_grad_norm_(twins, 1.0, foreach=True)
        norm_a = ours.unscale_and_clip_(opt_a, 1.0)
        fa = sum(v.item() for v in ours._found_inf_per_device(opt_a).values())
        fb = sum(v.item() for v in stock._found_inf_per_device(opt_b).values())
        assert (fa > 0) == (fb > 0) == (bad is not None)
        if bad is None:
            torch.testing.assert_close(norm_a, norm_b, rtol=1e-6, atol=0)
            for p, t in zip(params, twins):
                torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=1e-12)
        else:
            # stock clip scaled every gradient by NaN (NaN norm) or 0 (inf
            # norm); ours left them alone (still scaled: step() skips)
            assert math.isnan(norm_a.item()) == math.isnan(bad) and not math.isfinite(norm_a.item())
            assert torch.equal(params[0].grad, saved0)
            assert not torch.equal(twins[0].grad, saved0)


def test_groups_by_dtype_and_reports_first_bad_in_caller_order():
    gen = torch.Generator().manual_seed(0)
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16] * 30
    grads = [torch.randn(50 + i, generator=gen).to(dt) for i, dt in enumerate(dts)]
    check_against_reference([g.clone() for g in grads], 0.125, 0.5, 2.0)
    grads[101].view(-1)[3] = math.inf  # a bf16 tensor
    grads[120].view(-1)[0] = math.nan  # a float32 tensor
    stats = check_against_reference(grads, 0.125, 0.5, 2.0)
    h = stats.as_dict()
    assert (h["nan_count"], h["inf_count"], h["first_bad"]) == (1, 1, 101)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_split_into_several_calls(monkeypatch, norm_type):
    monkeypatch.setattr(gg, "MAX_LIST", 7)  # 60 tensors -> 9 calls, stats combined
    grads = make_grads(60, torch.float32, seed=11)
    check_against_reference([g.clone() for g in grads], 0.25, 1.0, norm_type)
    grads[44].view(-1)[1] = math.inf  # (every 7th tensor from index 3 is empty)
    grads[50].view(-1)[0] = math.nan
    h = check_against_reference(grads, 0.25, 1.0, norm_type).as_dict()
    assert (h["nan_count"], h["inf_count"], h["first_bad"]) == (1, 1, 44)


def test_fp16_norm_beyond_fp16_range_and_fp32_squares_overflow():
    # fp16 gradients whose norm is > 65504: the fp16 norm PyTorch returns is
    # inf (and clip_grad_norm_ then zeroes every gradient); ours is finite.
    g = [torch.full((4096,), 60000.0, dtype=torch.float16)]
    check_against_reference(g, 1.0, 1.0, 2.0)
    # fp32 values whose squares overflow fp32
    g = [torch.tensor([1e38, -2e38, 1e30, 0.0]), torch.full((1000,), 1e20)]
    check_against_reference(g, 1.0, 1.0, 2.0)
    # ... or underflow it
    g = [torch.full((1000,), 1e-30)]
    tn, _, _ = gg.guard_(g, 1.0, 1.0)
    assert tn.item() == pytest.approx(1e-30 * math.sqrt(1000), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize(
    "dtype, x, s_in, s_out",
    [
        # fp16: 16376 * 4.0004 rounds to 65504 in fp16, 16376 * 4.001 to Inf
        (torch.float16, 16376.0, 4.0004, 4.001),
        # bf16: the fp32 product lies between bf16's overflow limit and FLT_MAX for 4108
        (torch.bfloat16, 8.29e34, 4100.0, 4108.0),
        (torch.float32, 1e35, 3.4, 4108.0),
    ],
)
def test_unscaling_past_the_dtype_range_is_found(device, norm_type, dtype, x, s_in, s_out):
    """A loss scale below 1 (inv_scale > 1) can unscale a finite gradient
    past what its dtype holds. That value would be written back as Inf (as
    torch's unscale_ writes it, reporting the step finite): it counts as an Inf
    and the step is skipped. Just inside the range, the step goes on."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")
    for s, out in ((s_in, False), (s_out, True)):
        g = make_grads(3, dtype, seed=5, device=device, mag=1.0)
        g[1].view(-1)[7] = x
        # the premise, from torch's own rounding: the product fits the dtype or not
        prod = torch.tensor(x, dtype=dtype).float() * torch.tensor(s, dtype=torch.float32)
        assert bool(torch.isinf(prod.to(dtype))) == out
        stats = check_against_reference(g, s, 1e30, norm_type)
        assert stats.inf_count == (1 if out else 0) and stats.nan_count == 0
        assert stats.first_bad == (1 if out else -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inv_scale", [math.nan, math.inf, -math.inf, -0.5, 0.0])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_an_inv_scale_not_finite_and_positive_skips_the_step_with_a_nan_norm(device, dtype, inv_scale, norm_type):
    """NaN / Inf would write NaN / Inf into every gradient, a negative
    inv_scale would flip every sign and 0 zero them, both with a finite norm."""
    g = make_grads(2, dtype, seed=9, device=device)
    before = [t.clone() for t in g]
    tn, _, fi = gg.guard_(g, inv_scale, 1.0, norm_type)
    assert math.isnan(tn.item()) and any(v.item() for v in fi.values())
    for t, b in zip(g, before):
        assert torch.equal(t, b)


def test_non_contiguous_gradients_are_written_back():
    base = torch.randn(64, 32) * 10
    p = torch.nn.Parameter(torch.zeros(32, 64))
    p.grad = base.t()  # non-contiguous view
    want = reference([p.grad], 1.0, 1.0, 2.0)[2][0]
    nanguard.clip_grad_norm_([p], 1.0)
    torch.testing.assert_close(p.grad.double(), want, rtol=3e-7, atol=0)
    assert p.grad.data_ptr() == base.data_ptr()


def test_error_if_nonfinite_raises_before_writing():
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.arange(10.0)
    p.grad[4] = math.nan
    before = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        nanguard.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert torch.equal(p.grad[:4], before[:4])
    p.grad[4] = 0.0
    n = nanguard.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert n.item() == pytest.approx(before.nan_to_num(0.0).norm().item())


def test_other_norm_types_fall_back_without_poisoning():
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.arange(10.0)
    q = torch.nn.Parameter(torch.zeros(10))
    q.grad = torch.arange(10.0)
    torch.testing.assert_close(nanguard.clip_grad_norm_([p], 2.0, 1.0), torch.nn.utils.clip_grad_norm_([q], 2.0, 1.0))
    torch.testing.assert_close(p.grad, q.grad)
    p.grad[0] = math.inf
    before = p.grad.clone()
    assert math.isinf(nanguard.clip_grad_norm_([p], 2.0, 1.0).item())
    assert torch.equal(p.grad, before)


def test_thread_count_does_not_change_results():
    grads = make_grads(60, torch.float32, seed=9, mag=1.0)
    grads.append(torch.randn(300000))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = ops.grad_guard_reduce(grads[:40], torch.tensor([0.3]), 2.0)
        torch.set_num_threads(max(2, threads))
        b = ops.grad_guard_reduce(grads[:40], torch.tensor([0.3]), 2.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b)


def test_fused_op_equals_two_passes():
    grads = make_grads(20, torch.float32, seed=4)
    twins = [g.clone() for g in grads]
    s, f1, f2 = torch.tensor([1 / 64.0]), torch.zeros(()), torch.zeros(())
    tn, st = ops.fused_unscale_clip_(grads, s, f1, 1.0, 2.0)
    st2 = ops.grad_guard_reduce(twins, s, 2.0)
    tn2 = ops.grad_guard_apply_(twins, s, st2, f2, 1.0, 2.0)
    assert torch.equal(st, st2) and torch.equal(tn, tn2)
    for a, b in zip(grads, twins):
        assert torch.equal(a, b)


# ---- opcheck and bad inputs -------------------------------------------------------------------


def _opcheck_cases():
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(7, generator=gen) * 100, torch.randn(3, 4, generator=gen), torch.empty(0)]
    s = torch.tensor([0.01])
    yield ops.grad_guard_reduce.default, ([x.clone() for x in g], s, 2.0)
    yield ops.grad_guard_reduce.default, ([x.clone() for x in g], s, math.inf)
    st = ops.grad_guard_reduce([x.clone() for x in g], s, 2.0)
    yield ops.grad_guard_apply_.default, ([x.clone() for x in g], s, st, torch.zeros(()), 1.0, 2.0)
    yield ops.fused_unscale_clip_.default, ([x.clone() for x in g], s, torch.zeros(()), 1.0, 2.0)
    yield ops.fused_unscale_clip_.default, ([x.clone().half() for x in g], s, torch.zeros(1), 0.5, math.inf)


@pytest.mark.parametrize("case", list(range(5)))
def test_opcheck(case):
    op, args = list(_opcheck_cases())[case]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.zeros(s)) for s in (10, 0, 300)]
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 10
    twins = [p.grad.clone() for p in params]
    compiled = torch.compile(lambda: nanguard.clip_grad_norm_(params, 1.0), fullgraph=True,
                             backend="aot_eager")
    tn = compiled()
    tn_eager = gg.guard_(twins, 1.0, 1.0)[0]
    torch.testing.assert_close(tn, tn_eager)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t)


def test_direct_op_calls_raise_not_crash():
    s, f = torch.tensor([1.0]), torch.zeros(())
    g = [torch.randn(4)]
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.grad_guard_reduce([torch.randn(3), torch.randn(3).half()], s, 2.0)
    with pytest.raises(RuntimeError, match="norm_type must be 2.0 or inf"):
        ops.grad_guard_reduce(g, s, 1.0)
    with pytest.raises(RuntimeError, match="inv_scale must be a float32 tensor with one element"):
        ops.grad_guard_reduce(g, torch.tensor([1.0, 2.0]), 2.0)
    with pytest.raises(RuntimeError, match="inv_scale must be a float32"):
        ops.grad_guard_reduce(g, torch.tensor([1.0], dtype=torch.float64), 2.0)
    with pytest.raises(RuntimeError, match="grads must be float16"):
        ops.grad_guard_reduce([torch.ones(3, dtype=torch.int32)], s, 2.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.fused_unscale_clip_([torch.randn(4, 4).t()], s, f, 1.0, 2.0)
    with pytest.raises(RuntimeError, match="max_norm must be >= 0"):
        ops.fused_unscale_clip_(g, s, f, -1.0, 2.0)
    with pytest.raises(RuntimeError, match="max_norm must be >= 0"):
        ops.fused_unscale_clip_(g, s, f, math.nan, 2.0)
    with pytest.raises(RuntimeError, match="found_inf must be a float32"):
        ops.fused_unscale_clip_(g, s, torch.zeros(2), 1.0, 2.0)
    with pytest.raises(RuntimeError, match="stats must be a contiguous float64"):
        ops.grad_guard_apply_(g, s, torch.zeros(3, dtype=torch.float64), f, 1.0, 2.0)
    # long lists: errors release every handle (no leaked references)
    many = [torch.randn(2) for _ in range(300)]
    many[250] = many[250].double()
    uses = [t._use_count() for t in many]
    with pytest.raises(RuntimeError, match="tensor 250 is float64"):
        ops.grad_guard_reduce(many, s, 2.0)
    with pytest.raises(RuntimeError, match="found_inf"):
        ops.fused_unscale_clip_(many[:200], s, torch.zeros(3), 1.0, 2.0)
    st = ops.grad_guard_reduce(many[:250], s, 2.0)
    ops.grad_guard_apply_(many[:250], s, st, f, 1.0, 2.0)
    assert uses == [t._use_count() for t in many]
    # still alive, still right
    tn, st = ops.fused_unscale_clip_([torch.tensor([3.0, 4.0])], s, f, 10.0, 2.0)
    assert tn.item() == 5.0 and f.item() == 0.0


def test_python_bad_inputs():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_norm"):
        nanguard.clip_grad_norm_([p], -1.0)
    with pytest.raises(TypeError, match="norm_type"):
        nanguard.clip_grad_norm_([p], 1.0, "fro")
    with pytest.raises(ValueError, match="norm_type"):
        gg.guard_([p.grad], 1.0, 1.0, 3.0)
    with pytest.raises(TypeError, match="grads\\[0\\]"):
        gg.guard_([torch.ones(3, dtype=torch.int64)], 1.0)


# ---- GradScaler --------------------------------------------------------------------------------


def _tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        torch.nn.Linear(32, 50),
    )


def _train(model, scaler_cls, use_nanguard, steps, blowup_steps=(), max_norm=1.0):
    # SGD: AdamW would turn the last-bit differences of gradients that are
    # mathematically zero (the key bias under softmax) into full-size steps
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    gen = torch.Generator().manual_seed(123)
    scales, norms = [], []
    moved = [torch.zeros_like(p) for p in model.parameters()]  # sum over steps of |update|
    for step in range(steps):
        x = torch.randint(0, 50, (4, 12), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        if step in blowup_steps:
            loss = loss * 1e38  # gradients overflow to inf
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if use_nanguard:
            norms.append(scaler.unscale_and_clip_(opt, max_norm))
        else:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True))
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        for m, p, b in zip(moved, model.parameters(), before):
            m += (p.detach() - b).abs()
    return scaler, scales, norms, moved


# What the comparison with the stock loop can promise on any x86-64 CPU:
# - skips and loss scales are decisions on the same finite/non-finite
#   gradients, so they match exactly;
# - the gradient norm is the same fp32 sum of squares taken in another order
#   (the fused kernel's blocks against torch's foreach norms, whose vector
#   width and blocking depend on the CPU), so the two norms agree to the
#   bound for summing n non-negative terms in any order, n * 2**-24 relative
#   (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., (4.4));
# - the clip coefficient max_norm / norm inherits that relative error, and
#   momentum SGD carries it into each weight at most in proportion to how far
#   the weight moved over the run (twice that, for the gradients' own
#   response to the slightly different weights).
# Without clipping there is no reduction to reorder: unscaling by a power of
# two is exact, so the weights must match bit for bit.
def _norm_rtol(model):
    return sum(p.numel() for p in model.parameters()) * 2.0**-24


@pytest.mark.parametrize("blowup", [(), (1, 3)])
def test_training_loop_matches_stock_gradscaler(blowup):
    a, b = _tiny_model(0), _tiny_model(0)
    sa, scales_a, norms_a, _ = _train(a, GradScaler, True, 6, blowup)
    sb, scales_b, norms_b, moved_b = _train(b, torch.amp.GradScaler, False, 6, blowup)
    assert scales_a == scales_b  # same skips, same backoff / growth
    rtol = _norm_rtol(a)
    for x, y in zip(norms_a, norms_b):
        if math.isfinite(y.item()):
            assert x.item() == pytest.approx(y.item(), rel=rtol)
        else:
            assert not math.isfinite(x.item())
    assert any(y.item() > 1.0 for y in norms_b)  # the clip was active
    for (na, pa), (_, pb), m in zip(a.named_parameters(), b.named_parameters(), moved_b):
        bound = 2 * rtol * m + 1e-7
        worst = ((pa - pb).abs() - bound).max().item()
        assert worst <= 0, f"{na}: exceeds its bound by {worst:.3g}"
    skipped = [s.step for s in sa.skipped_steps]
    assert skipped == list(blowup)
    for s in sa.skipped_steps:
        assert s.cause in ("inf", "nan", "norm overflow")
    assert sa.skip_summary()["skipped"] == len(blowup)


@pytest.mark.parametrize("blowup", [(), (1, 3)])
def test_training_loop_without_clipping_is_bit_identical_to_stock(blowup):
    a, b = _tiny_model(0), _tiny_model(0)
    sa, scales_a, norms_a, _ = _train(a, GradScaler, True, 6, blowup, max_norm=1e30)
    sb, scales_b, _, _ = _train(b, torch.amp.GradScaler, False, 6, blowup, max_norm=1e30)
    assert scales_a == scales_b
    assert [s.step for s in sa.skipped_steps] == list(blowup)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na


def test_unscale_and_clip_state_machine():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.unscale_and_clip_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_and_clip_(opt, 1.0)
    g = [p.grad.clone() for p in model.parameters()]
    w = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # must not unscale again
    for p, gi, wi in zip(model.parameters(), g, w):
        torch.testing.assert_close(p.detach(), wi - 0.1 * gi)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_and_clip_(opt, 1.0)
    scaler.update()
    assert scaler.skipped_steps == []


def test_no_gradients_behaves_like_stock():
    model = torch.nn.Linear(2, 2)
    for cls, call in ((torch.amp.GradScaler, "unscale_"), (GradScaler, "unscale_and_clip_")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu")
        scaler.scale(torch.ones(()))
        getattr(scaler, call)(opt) if call == "unscale_" else scaler.unscale_and_clip_(opt, 1.0)
        with pytest.raises(AssertionError, match="No inf checks"):
            scaler.step(opt)


def test_nan_skips_step_and_records_cause():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    model.bias.grad[1] = math.nan
    w = [p.detach().clone() for p in model.parameters()]
    g = [p.grad.clone() for p in model.parameters()]
    tn = scaler.unscale_and_clip_(opt, 1.0)
    assert math.isnan(tn.item())
    for p, gi in zip(model.parameters(), g):  # untouched, still scaled
        torch.testing.assert_close(p.grad, gi, rtol=0, atol=0, equal_nan=True)
    scaler.step(opt)
    for p, wi in zip(model.parameters(), w):
        assert torch.equal(p.detach(), wi)
    scaler.update()
    assert scaler.get_scale() == 4.0
    (rec,) = scaler.skipped_steps
    assert (rec.cause, rec.nan_count, rec.inf_count, rec.first_bad, rec.scale) == ("nan", 1, 0, 1, 8.0)


def test_min_scale_floor_warns():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            # the warning comes from the step() after the update() that hit the floor
            scaler.scale(model(torch.randn(1, 2)).sum() * math.inf).backward()
            scaler.unscale_and_clip_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scaler.get_scale() == 2.0
    assert any("min_scale" in str(x.message) for x in w)
    assert scaler.skip_summary()["min_scale_hits"] >= 1
    with pytest.raises(ValueError, match="min_scale"):
        GradScaler("cpu", min_scale=-1.0)


def test_bf16_without_scaler():
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    p.grad = (torch.randn(1000) * 0.01).bfloat16()
    before = p.grad.clone()
    n = nanguard.clip_grad_norm_([p], 10.0)  # under max_norm: untouched bits
    assert torch.equal(p.grad, before)
    assert n.dtype == torch.float32
    assert n.item() == pytest.approx(before.double().norm().item(), rel=1e-6)


# ---- two real processes (gloo) ------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for norm_type in (2.0, math.inf):
        for bad in (False, True):
            full = make_grads(40, torch.float32, seed=5, mag=10.0)
            mine = [g for i, g in enumerate(full) if i % world == rank]  # a sharded split
            if bad and rank == 1:
                mine[2].view(-1)[0] = math.nan
            before = [g.clone() for g in mine]
            tn, stats, fi = gg.guard_(mine, 1.0 / 8, 1.0, norm_type, process_group=dist.group.WORLD)
            results[(norm_type, bad)] = (tn, [g.clone() for g in mine], before, fi[torch.device("cpu")].clone(),
                                         stats.tensor.clone())
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_processes_match_one_process(tmp_path):
    world, port = 2, _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__)] + sys.path)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--dist-worker", str(r), str(world), str(port), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for norm_type in (2.0, math.inf):
        # one process holding every gradient
        full = make_grads(40, torch.float32, seed=5, mag=10.0)
        tn1, _, _ = gg.guard_(full, 1.0 / 8, 1.0, norm_type)
        for r in range(world):
            tn, got, _, fi, _ = res[r][(norm_type, False)]
            assert fi.item() == 0.0
            assert tn.item() == pytest.approx(tn1.item(), rel=1e-6)
            mine = [g for i, g in enumerate(full) if i % world == r]
            for a, b in zip(got, mine):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
        # a NaN on rank 1 makes both ranks skip and leaves every gradient alone
        for r in range(world):
            tn, got, before, fi, st = res[r][(norm_type, True)]
            assert fi.item() == 1.0 and math.isnan(tn.item()) and st[1].item() == 1
            for a, b in zip(got, before):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---- CUDA -----------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu_and_is_deterministic(dtype):
    grads = make_grads(300, dtype, seed=3, device="cuda")
    grads.append(torch.randn(3_000_001, device="cuda").to(dtype))
    s = torch.tensor([1 / 256.0], device="cuda")
    a = ops.grad_guard_reduce(grads[:40], s, 2.0)
    b = ops.grad_guard_reduce(grads[:40], s, 2.0)
    assert torch.equal(a, b)
    c = ops.grad_guard_reduce([g.cpu() for g in grads[:40]], s.cpu(), 2.0)
    torch.testing.assert_close(a.cpu(), c, rtol=1e-12, atol=0)
    check_against_reference(grads, 1 / 256.0, 0.5, 2.0)


@requires_cuda
def test_cuda_mixed_devices_and_no_host_sync():
    grads = [torch.randn(1000, device="cuda") * 10, torch.randn(1000) * 10]
    check_against_reference(grads, 1.0, 1.0, 2.0)
    g = make_grads(100, torch.float32, seed=1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gg.guard_(g, torch.tensor(0.5, device="cuda"), 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--dist-worker":
    _dist_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bad", [False, True])
def test_scaler_update_reads_nothing_back(bad):
    """update() makes no host read, and step() only the one PyTorch's own
    step() makes (found_inf); the records are read when asked for."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, min_scale=1.0)
    stock = torch.amp.GradScaler("cpu", init_scale=8.0)
    counts = {}
    gc.collect()
    gc.disable()  # a finalizer run inside a measured call would count its reads
    try:
        _run_both(model, opt, scaler, stock, bad, counts)
    finally:
        gc.enable()
    assert counts["nanguard"][1] == 0, counts
    assert counts["nanguard"][0] <= counts["stock"][0], counts
    summary = scaler.skip_summary()
    assert summary["skipped"] == summary["nan"] + summary["inf"] == int(bad), summary
    assert [s.scale for s in scaler.skipped_steps] == ([8.0] if bad else [])


def _run_both(model, opt, scaler, stock, bad, counts):
    for name, sc in (("nanguard", scaler), ("stock", stock)):
        loss = model(torch.randn(2, 4)).sum() * (math.inf if bad else 1.0)
        sc.scale(loss).backward()
        if sc is scaler:
            sc.unscale_and_clip_(opt, 1.0)
        else:
            sc.unscale_(opt)
        with _HostReads() as step_reads:
            sc.step(opt)
        with _HostReads() as update_reads:
            sc.update()
        counts[name] = (step_reads.reads, update_reads.reads)
        opt.zero_grad()
    counts.update({k: (len(v[0]), len(v[1])) for k, v in counts.items()})


# ---- GradScaler.state_dict: the skip history across a checkpoint ----------------------------------


def _skipping_steps(scaler, model, opt, bad_steps, steps):
    """``steps`` guarded fp32 steps on ``scaler``; the loss is multiplied by
    inf (NaN / Inf gradients) at the steps in ``bad_steps``."""
    for i in range(steps):
        loss = model(torch.randn(2, 4)).sum() * (math.inf if i in bad_steps else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_scaler_state_dict_keeps_skip_history(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = GradScaler("cpu", init_scale=8.0, min_scale=2.0, growth_interval=100)
    with pytest.warns(RuntimeWarning, match="min_scale"):
        _skipping_steps(a, model, opt, {1, 2, 3}, 5)  # 8 -> 4 -> 2 -> 1 held at 2: one floor hit
    assert a.get_scale() == 2.0 and a.skip_summary()["min_scale_hits"] == 1
    path = tmp_path / "scaler.pt"
    torch.save(a.state_dict(), path)
    sd = torch.load(path, weights_only=True)  # plain Python values only
    b = GradScaler("cpu", init_scale=2.0**16)  # no min_scale: the saved one is restored
    b.load_state_dict(sd)
    assert b.get_scale() == a.get_scale() and b.min_scale == 2.0
    assert b.skipped_steps == a.skipped_steps and b.skip_summary() == a.skip_summary()
    assert [(s.step, s.scale) for s in b.skipped_steps] == [(1, 8.0), (2, 4.0), (3, 2.0)]
    # after the load, records continue the numbering and the counts
    _skipping_steps(b, model, opt, {1}, 2)
    assert [s.step for s in b.skipped_steps] == [1, 2, 3, 6]
    assert b.skip_summary()["skipped"] == 4 and b.skip_summary()["updates"] == 7
    # a shorter history keeps the newest records; the counts stay exact
    c = GradScaler("cpu", history=2)
    c.load_state_dict(b.state_dict())
    assert [s.step for s in c.skipped_steps] == [3, 6] and c.skip_summary() == b.skip_summary()
    _skipping_steps(c, model, opt, {0}, 1)
    assert [s.step for s in c.skipped_steps] == [6, 7]


def test_scaler_state_dict_interchangeable_with_torch():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = GradScaler("cpu", init_scale=8.0, growth_interval=3)
    _skipping_steps(ours, model, opt, {0}, 2)
    sd = ours.state_dict()
    assert "nanguard" in sd
    # nanguard -> torch: the extra key is ignored, the scale and its settings load
    stock = torch.amp.GradScaler("cpu", init_scale=1.0)
    stock.load_state_dict(sd)
    assert stock.state_dict() == {k: v for k, v in sd.items() if k != "nanguard"}
    # torch -> nanguard: no history (nothing was recorded), the constructor's min_scale kept
    fresh = GradScaler("cpu", init_scale=2.0**16, min_scale=0.5)
    fresh.load_state_dict(stock.state_dict())
    assert fresh.get_scale() == ours.get_scale() and fresh.min_scale == 0.5
    assert fresh.skipped_steps == [] and fresh.skip_summary()["skipped"] == 0
    # a disabled scaler saves {} as PyTorch's, and loads anything as a no-op
    off = GradScaler("cpu", enabled=False)
    assert off.state_dict() == {}
    off.load_state_dict(sd)


# ---- the statistics helpers the local and the DTensor plans share -------------------


def test_first_bad_of_call_maps_to_the_callers_index():
    """A call's first bad index goes through the caller's index table; none is inf."""
    idx = [4, 9, 11]
    for fb, want in ((0.0, 4.0), (2.0, 11.0), (-1.0, math.inf)):
        got = _plan._first_bad_of_call(torch.tensor(fb, dtype=torch.float64), idx, torch.device("cpu"))
        assert got.dtype == torch.float64 and got.item() == want


def test_combine_rows_sums_or_maxes_the_accumulator_and_sums_counts():
    rows = torch.tensor([[4.0, 1.0, 0.0, 3.0], [9.0, 0.0, 2.0, -1.0], [1.0, 2.0, 0.0, -1.0]],
                        dtype=torch.float64)
    assert _plan._combine_rows(rows, inf_norm=False).tolist() == [14.0, 3.0, 2.0]
    assert _plan._combine_rows(rows, inf_norm=True).tolist() == [9.0, 3.0, 2.0]
    # a NaN accumulator on one call stays NaN under the max, as under the sum
    rows[1, 0] = math.nan
    assert math.isnan(_plan._combine_rows(rows, inf_norm=True)[0].item())
    assert _plan._first_of([torch.tensor(math.inf, dtype=torch.float64)]).tolist() == [-1.0]
    firsts = [torch.tensor(v, dtype=torch.float64) for v in (math.inf, 7.0, 3.0)]
    assert _plan._first_of(firsts).tolist() == [3.0]


def test_norm_from_stats_of_a_rank_without_gradients():
    """The norm a caller holding no gradient returns: from the reduced stats,
    NaN over inf over finite, float32 (checked against fp64 arithmetic)."""
    def stats(acc, nan, inf):
        return torch.tensor([acc, nan, inf, -1.0], dtype=torch.float64)

    acc = 12.345678901234
    got = _plan._norm_from_stats(stats(acc, 0, 0), inf_norm=False)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(math.sqrt(acc), rel=1e-7)
    assert _plan._norm_from_stats(stats(acc, 0, 0), inf_norm=True).item() == pytest.approx(acc, rel=1e-7)
    assert _plan._norm_from_stats(stats(acc, 0, 2), inf_norm=False).item() == math.inf
    assert math.isnan(_plan._norm_from_stats(stats(acc, 1, 2), inf_norm=True).item())
    assert _plan._empty_stats("cpu").tolist() == [0.0, 0.0, 0.0, -1.0]


def test_dtensor_plan_lives_with_the_guard_and_keys_buckets_by_named_tuples():
    from nanguard.grad_guard import _dtensor

    key = _dtensor._BucketKey(_dtensor._Unit("pg"), False)
    assert key.unit.kind == "pg" and key.unit.mesh is None and key.dup is False
    assert key == _dtensor._BucketKey(_dtensor._Unit("pg"), False)  # hashable, by value
    assert _dtensor.DTensorPlan.__module__ == "nanguard.grad_guard._dtensor"


# ---- drop-in: what torch.nn.utils.clip_grad_norm_ accepts --------------------------------


@pytest.mark.parametrize("norm_type", ["inf", "Inf", "infinity", "2", "2.0", "1", "-inf", torch.tensor(2.0)],
                         ids=str)
def test_clip_grad_norm_takes_norm_type_as_pytorch_does(norm_type):
    # torch.nn.utils.clip_grad_norm_ reads norm_type with float(): the strings
    # "inf", "2", ... and 0-d tensors work there, and so they do here
    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in (7, (3, 4))]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        return ps

    ours, theirs = params(), params()
    total = nanguard.clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    torch.testing.assert_close(total, want, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_clip_grad_norm_refusals_say_so():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match="norm_type must be a float.*'fro'"):
        nanguard.clip_grad_norm_([p], 1.0, norm_type="fro")  # PyTorch refuses it too
    # a negative max_norm: PyTorch flips the gradients' sign, nanguard refuses
    with pytest.raises(ValueError, match="nanguard refuses a negative max_norm.*flips the sign"):
        nanguard.clip_grad_norm_([p], -1.0)
    assert torch.equal(p.grad, torch.ones(3))

