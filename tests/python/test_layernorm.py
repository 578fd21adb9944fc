"""stable_layernorm: forward and every gradient against fp64 references and
PyTorch, the edge cases it exists for, gradcheck, opcheck, torch.compile,
bad inputs, modules and state_dict compatibility."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import nanguard
from nanguard.functional import layer_norm, rms_norm
from nanguard.nn import StableLayerNorm, StableRMSNorm

from conftest import assert_close, requires_cuda

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def ref_norm(x, shape, w, b, eps, rms):
    """fp64 reference with the textbook formulas (PyTorch ops in float64)."""
    x = x.double()
    dims = tuple(range(-len(shape), 0))
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    else:
        mean = x.mean(dims, keepdim=True)
        var = (x - mean).pow(2).mean(dims, keepdim=True)
        y = (x - mean) * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def make(shape, dtype, device="cpu", seed=0, scale=3.0, offset=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(device, dtype)


def run_case(dtype, shape, nshape, has_w, has_b, rms, device="cpu", eps=1e-5):
    x = make(shape, dtype, device, 1).requires_grad_()
    w = make(nshape, dtype, device, 2, 0.5, 1.0).requires_grad_() if has_w else None
    b = make(nshape, dtype, device, 3, 0.25, 0.0).requires_grad_() if has_b and not rms else None
    if rms:
        y = rms_norm(x, nshape, w, eps)
    else:
        y = layer_norm(x, nshape, w, b, eps)
    assert y.dtype == dtype and y.shape == x.shape
    leaves = [t for t in (x, w, b) if t is not None]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(leaves64)
    x64 = next(it)
    w64 = next(it) if w is not None else None
    b64 = next(it) if b is not None else None
    ref = ref_norm(x64, nshape, w64, b64, eps, rms)
    assert_close(y, ref, "layernorm", dtype)
    # gradients: a fixed cotangent, rounded to dtype so both sides see the same one
    gy = make(shape, dtype, device, 4, 1.0, 0.0)
    grads = torch.autograd.grad(y, leaves, gy)
    refs = torch.autograd.grad(ref, leaves64, gy.double())
    rows = x.numel() // max(1, math.prod(nshape))
    for name, g, r in zip("xwb", grads, refs):
        # parameter grads sum over rows: absolute error grows with the row count
        scale = 1.0 if name == "x" else max(1.0, rows / 8)
        assert g.dtype == dtype
        assert_close(g, r, "layernorm_grad", dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 3, 127, 4097])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", ["none", "weight", "weight_bias", "bias"])
def test_matches_fp64_reference(dtype, cols, rms, affine):
    rows = 6 if cols > 1000 else 20
    run_case(dtype, (2, rows // 2, cols), (cols,), "weight" in affine, "bias" in affine, rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_multi_dim_normalized_shape(dtype):
    run_case(dtype, (3, 4, 5, 6), (5, 6), True, True, False)
    run_case(dtype, (3, 4, 5, 6), (4, 5, 6), True, False, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("rms", [False, True])
def test_default_matches_pytorch(dtype, rms):
    x = make((8, 17, 96), dtype)
    w = make((96,), dtype, seed=5)
    b = make((96,), dtype, seed=6)
    if rms:
        ours, theirs = rms_norm(x, (96,), w), F.rms_norm(x, (96,), w)
    else:
        ours, theirs = layer_norm(x, (96,), w, b), F.layer_norm(x, (96,), w, b)
    tol = 1e-12 if dtype == torch.float64 else 3e-6
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_constant_rows_give_bias_exactly(dtype, eps):
    x = torch.tensor([0.1, -7.25, 3.0, 0.0], dtype=torch.float64).repeat_interleave(37).view(4, 37)
    x = x.to(dtype).requires_grad_()
    w = torch.full((37,), 2.0, dtype=dtype)
    b = torch.linspace(-1, 1, 37, dtype=torch.float64).to(dtype)
    y = layer_norm(x, (37,), w, b, eps)
    assert torch.equal(y, b.expand_as(y))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    z = rms_norm(torch.zeros(3, 37, dtype=dtype, requires_grad=True), (37,), w, eps)
    assert torch.equal(z, torch.zeros_like(z))


def test_fp16_near_max_is_finite_and_correct():
    x = (6.0e4 + 5000 * torch.rand(16, 256, generator=torch.Generator().manual_seed(0)))
    x = x.clamp(max=65504).half().requires_grad_()
    y = layer_norm(x, (256,))
    assert torch.isfinite(y).all()
    assert_close(y, ref_norm(x.detach(), (256,), None, None, 1e-5, False), "layernorm", torch.float16)
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    # and RMSNorm, whose squares (3.6e9) are far past fp16's range
    z = rms_norm(x, (256,), eps=1e-6)
    assert torch.isfinite(z).all()
    assert_close(z, ref_norm(x.detach(), (256,), None, None, 1e-6, True), "layernorm", torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_squares_overflowing_fp32_still_correct(dtype):
    x = make((4, 64), torch.float64, scale=1e30, offset=0.0).to(dtype)
    for rms in (False, True):
        f = rms_norm if rms else layer_norm
        y = f(x, (64,), None, 1e-5) if rms else f(x, (64,))
        assert torch.isfinite(y).all()
        assert_close(y, ref_norm(x, (64,), None, None, 1e-5, rms), "layernorm", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_row_is_nan_and_only_that_row(dtype, rms, bad):
    x = make((5, 33), dtype).requires_grad_(False)
    x[2, 7] = bad
    y = rms_norm(x, (33,)) if rms else layer_norm(x, (33,))
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3, 4]]).all()


def test_non_contiguous_input():
    base = make((33, 16, 4), torch.float32)
    x = base.transpose(0, 2)  # (4, 16, 33), last dim strided
    assert not x.is_contiguous()
    w = make((33,), torch.float32, seed=2)
    b = make((66,), torch.float32, seed=3)[::2]  # strided parameter too
    y = layer_norm(x, (33,), w, b)
    torch.testing.assert_close(y, F.layer_norm(x, (33,), w, b), atol=3e-6, rtol=3e-6)
    xg = x.detach().requires_grad_()
    layer_norm(xg, (33,), w, b).square().sum().backward()
    xr = x.detach().requires_grad_()
    F.layer_norm(xr, (33,), w, b).square().sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5)])
def test_empty_tensors(shape):
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    b = torch.randn(shape[-1], requires_grad=True)
    y = layer_norm(x, (shape[-1],), w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.zeros_like(b))


def test_thread_count_does_not_change_results():
    x = make((300, 257), torch.float32).requires_grad_()
    w = make((257,), torch.float32, seed=2).requires_grad_()
    b = make((257,), torch.float32, seed=3).requires_grad_()
    gy = make((300, 257), torch.float32, seed=4)
    results = []
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = layer_norm(x, (257,), w, b)
            results.append((y, *torch.autograd.grad(y, (x, w, b), gy)))
    finally:
        torch.set_num_threads(old)
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_eps_floor():
    x = make((4, 64), torch.float16, scale=1e-3)
    tiny = 1e-12
    plain = layer_norm(x, (64,), eps=tiny)
    assert_close(plain, ref_norm(x, (64,), None, None, tiny, False), "layernorm", torch.float16)
    floored = layer_norm(x, (64,), eps=tiny, eps_floor="auto")
    floor = nanguard.layernorm.EPS_FLOOR[torch.float16]
    assert_close(floored, ref_norm(x, (64,), None, None, floor, False), "layernorm", torch.float16)
    explicit = layer_norm(x, (64,), eps=tiny, eps_floor=1e-3)
    assert_close(explicit, ref_norm(x, (64,), None, None, 1e-3, False), "layernorm", torch.float16)
    with pytest.raises(ValueError, match="eps_floor"):
        layer_norm(x, (64,), eps_floor="big")


# ---- gradcheck / opcheck / compile ----------------------------------------------


AFFINE_RMS = [(a, False) for a in ("none", "weight", "weight_bias", "bias")] + [("none", True), ("weight", True)]


def _norm_fn_and_inputs(affine, rms):
    """f(x, w, b) for the affine variant and fp64 inputs [3, 4, 7] that
    require grad, for gradcheck / gradgradcheck."""
    x = make((3, 4, 7), torch.float64).requires_grad_()
    w = make((7,), torch.float64, seed=2).requires_grad_()
    b = make((7,), torch.float64, seed=3).requires_grad_()
    has_w, has_b = "weight" in affine, "bias" in affine

    def f(x, w, b):
        if rms:
            return rms_norm(x, (7,), w if has_w else None, 1e-5)
        return layer_norm(x, (7,), w if has_w else None, b if has_b else None, 1e-5)

    return f, (x, w, b)


@pytest.mark.parametrize("affine,rms", AFFINE_RMS)
def test_gradcheck(affine, rms):
    assert torch.autograd.gradcheck(*_norm_fn_and_inputs(affine, rms))


@pytest.mark.parametrize("affine,rms", AFFINE_RMS)
def test_gradgradcheck(affine, rms):
    """Double backward (gradient penalties, Hessian-vector products): the
    derivative of the C backward, numerically checked in fp64, with respect
    to the input, the parameters and the incoming gradient."""
    assert torch.autograd.gradgradcheck(*_norm_fn_and_inputs(affine, rms))


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_double_backward_matches_fp64_reference(rms):
    """A gradient penalty d/dx |d(loss)/dx|^2 against the textbook formula
    differentiated twice by autograd, in fp64 (tolerance: the layernorm_grad
    fp64 entry)."""
    x = make((5, 9), torch.float64).requires_grad_()
    w = make((9,), torch.float64, seed=2).requires_grad_()
    b = make((9,), torch.float64, seed=3).requires_grad_()
    gy = make((5, 9), torch.float64, seed=4)

    def penalty(norm):
        y = norm(x, w, b)
        gx, gw = torch.autograd.grad((y * gy).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum() + gw.pow(2).sum(), (x, w, b), allow_unused=True)

    if rms:
        got = penalty(lambda x, w, b: rms_norm(x, (9,), w, 1e-5))
        ref = penalty(lambda x, w, b: ref_norm(x, (9,), w, None, 1e-5, True))
    else:
        got = penalty(lambda x, w, b: layer_norm(x, (9,), w, b, 1e-5))
        ref = penalty(lambda x, w, b: ref_norm(x, (9,), w, b, 1e-5, False))
    for g, r in zip(got, ref):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            assert_close(g, r, "layernorm_grad", torch.float64)


def test_double_backward_keeps_degenerate_and_nan_rows_apart():
    """rstd == 0 (a constant row with eps = 0) gives zero second derivatives
    in that row; a NaN row stays NaN in its own row only."""
    x = make((3, 6), torch.float64)
    x[0] = 2.0
    x[2, 1] = float("nan")
    x.requires_grad_()
    y = layer_norm(x, (6,), eps=0.0)
    (gx,) = torch.autograd.grad((y * make((3, 6), torch.float64, seed=5)).sum(), x, create_graph=True)
    (hx,) = torch.autograd.grad(gx.pow(2).sum(), x)
    assert torch.equal(hx[0], torch.zeros(6, dtype=torch.float64))
    assert torch.isfinite(hx[1]).all()
    assert torch.isnan(hx[2]).all()


def test_statistics_outputs_are_not_differentiable():
    """mean and rstd are for the backward only: they must not claim a
    gradient they never get (it used to be silently zero)."""
    x = make((3, 7), torch.float32).requires_grad_()
    w = make((7,), torch.float32, seed=2).requires_grad_()
    y, mean, rstd = torch.ops.nanguard.stable_layernorm.weight(x, w, 1e-5, False)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    (gx,) = torch.autograd.grad(y.sum(), x)
    x64 = x.detach().double().requires_grad_()
    (rx,) = torch.autograd.grad(ref_norm(x64, (7,), w.detach(), None, 1e-5, False).sum(), x64)
    assert_close(gx, rx, "layernorm_grad", torch.float32)


def test_autocast_output_dtype_matches_torch_modules():
    """Under autocast the drop-in modules return what torch.nn.LayerNorm /
    RMSNorm return (on the CPU autocast leaves both alone)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = make((4, 8), dtype)
        for ours, theirs in ((StableLayerNorm(8), torch.nn.LayerNorm(8)),
                             (StableRMSNorm(8, eps=1e-6), torch.nn.RMSNorm(8, eps=1e-6))):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = ours(x), theirs(x)
            assert got.dtype == want.dtype, (type(ours).__name__, dtype)


def test_autocast_fp32_policy_computes_in_fp32(monkeypatch):
    """Where PyTorch's layer_norm has an fp32 autocast policy (CUDA), the
    input and the fp32 parameters are used in fp32 and the result is fp32.
    The CPU has no such policy, so the policy table is patched to exercise the
    same code path here; the CUDA test below checks the real one."""
    from nanguard import _checks

    monkeypatch.setitem(_checks._HAS_AUTOCAST, ("layer_norm", "cpu"), True)
    x = make((4, 8), torch.bfloat16)
    w = make((8,), torch.float32, seed=2, scale=0.1, offset=1.0)
    b = make((8,), torch.float32, seed=3, scale=0.1, offset=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer_norm(x, (8,), w, b)
    assert y.dtype == torch.float32
    assert_close(y, ref_norm(x, (8,), w, b, 1e-5, False), "layernorm", torch.float32)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_output_dtype_matches_torch_modules(dtype):
    x = make((4, 8), torch.float32, "cuda")
    for ours, theirs in ((StableLayerNorm(8).cuda(), torch.nn.LayerNorm(8).cuda()),
                         (StableRMSNorm(8, eps=1e-6).cuda(), torch.nn.RMSNorm(8, eps=1e-6).cuda())):
        with torch.autocast("cuda", dtype=dtype):
            h = x.to(dtype)  # an activation autocast produced
            got, want = ours(h), theirs(h)
        assert got.dtype == want.dtype
        assert_close(got, want.double(), "layernorm", want.dtype)


def _opcheck_cases():
    x = make((3, 5), torch.float32).requires_grad_()
    w = make((5,), torch.float32, seed=2).requires_grad_()
    b = make((5,), torch.float32, seed=3).requires_grad_()
    ops = torch.ops.nanguard
    yield ops.stable_layernorm.default, (x, 1e-5, False)
    yield ops.stable_layernorm.default, (x, 1e-5, True)
    yield ops.stable_layernorm.weight, (x, w, 1e-5, True)
    yield ops.stable_layernorm.bias, (x, b, 1e-5, False)
    yield ops.stable_layernorm.weight_bias, (x, w, b, 1e-5, False)
    with torch.no_grad():  # backward ops are called with plain tensors
        _, mean, rstd = ops.stable_layernorm.weight_bias(x, w, b, 1e-5, False)
    gy = torch.randn(3, 5)
    yield ops.stable_layernorm_backward.default, (gy, x.detach(), mean, rstd, False, True)
    yield ops.stable_layernorm_backward.weight, (gy, x.detach(), w.detach(), mean, rstd, False, False)


@pytest.mark.parametrize("case", list(range(7)))
def test_opcheck(case):
    op, args = list(_opcheck_cases())[case]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), StableLayerNorm(48), torch.nn.GELU(), StableRMSNorm(48))
    x = torch.randn(4, 10, 32, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y_eager = m(x)
    torch.testing.assert_close(y, y_eager)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g_eager,) = torch.autograd.grad(y_eager.sum(), x)
    torch.testing.assert_close(g, g_eager)


# ---- bad inputs ------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="input"):
        layer_norm(x.long(), (8,))
    with pytest.raises(TypeError, match="input"):
        layer_norm([1.0, 2.0], (2,))
    with pytest.raises(ValueError, match="normalized_shape"):
        layer_norm(x, (7,))
    with pytest.raises(ValueError, match="weight"):
        layer_norm(x, (8,), torch.randn(7))
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, (8,), None, torch.randn(2, 4))
    with pytest.raises(TypeError, match="weight"):
        layer_norm(x, (8,), torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, (8,), eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, (8,), eps=float("nan"))
    with pytest.raises(ValueError, match="weight"):
        layer_norm(x, (8,), torch.ones(8, device="meta"))
    with pytest.raises(TypeError, match="normalized_shape"):
        layer_norm(x, "8")


def test_direct_op_calls_raise_not_crash():
    ops = torch.ops.nanguard
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="input must be float16, bfloat16, float32 or float64"):
        ops.stable_layernorm(x.long(), 1e-5, False)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.stable_layernorm.weight(x, torch.ones(3), 1e-5, False)
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of input \(float32\), got float64"):
        ops.stable_layernorm.weight(x, torch.ones(8, dtype=torch.float64), 1e-5, False)
    with pytest.raises(RuntimeError, match="eps"):
        ops.stable_layernorm(x, -1.0, False)
    with pytest.raises(RuntimeError, match="at least one dimension"):
        ops.stable_layernorm(torch.tensor(1.0), 1e-5, False)
    with pytest.raises(RuntimeError, match="bias is not supported with rms"):
        ops.stable_layernorm.bias(x, torch.ones(8), 1e-5, True)
    _, mean, rstd = ops.stable_layernorm(x, 1e-5, False)
    with pytest.raises(RuntimeError, match="grad_out must have the shape of input"):
        ops.stable_layernorm_backward(torch.randn(4, 9), x, mean, rstd, False, False)
    with pytest.raises(RuntimeError, match="rstd must be"):
        ops.stable_layernorm_backward(x, x, mean, rstd[:2], False, False)
    with pytest.raises(RuntimeError, match="mean must be"):
        ops.stable_layernorm_backward(x, x, mean.double(), rstd, False, False)
    # the process is still alive and the op still works
    torch.testing.assert_close(ops.stable_layernorm(x, 1e-5, False)[0], F.layer_norm(x, (8,)))


# ---- modules -----------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_module_state_dict_both_ways(bias):
    stock = torch.nn.LayerNorm((4, 6), eps=1e-6, bias=bias)
    with torch.no_grad():
        stock.weight.normal_()
        if bias:
            stock.bias.normal_()
    ours = StableLayerNorm((4, 6), eps=1e-6, bias=bias)
    assert ours.state_dict().keys() == stock.state_dict().keys()
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(ours(x), stock(x), atol=3e-6, rtol=3e-6)
    back = torch.nn.LayerNorm((4, 6), eps=1e-6, bias=bias)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), stock(x))
    assert isinstance(ours, torch.nn.LayerNorm)


def test_layernorm_from_module_shares_parameters():
    stock = torch.nn.LayerNorm(16)
    ours = StableLayerNorm.from_module(stock)
    assert ours.weight is stock.weight and ours.bias is stock.bias
    x = torch.randn(5, 16)
    ours(x).sum().backward()
    assert stock.weight.grad is not None
    no_affine = StableLayerNorm.from_module(torch.nn.LayerNorm(16, elementwise_affine=False))
    assert no_affine.weight is None
    torch.testing.assert_close(no_affine(x), F.layer_norm(x, (16,)), atol=3e-6, rtol=3e-6)
    with pytest.raises(TypeError, match="module"):
        StableLayerNorm.from_module(torch.nn.Linear(2, 2))


def test_rmsnorm_module():
    stock = torch.nn.RMSNorm(24)
    with torch.no_grad():
        stock.weight.normal_()
    ours = StableRMSNorm(24)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(ours(x), stock(x), atol=3e-6, rtol=3e-6)
    shared = StableRMSNorm.from_module(stock)
    assert shared.weight is stock.weight and shared.eps is None
    back = torch.nn.RMSNorm(24)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back.weight, stock.weight)
    x16 = x.half()
    torch.testing.assert_close(ours.half()(x16).float(), stock.half()(x16).float(), atol=4e-3, rtol=4e-3)


# ---- property-based fuzzing ------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    cols=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    rms=st.booleans(),
    affine=st.sampled_from(["none", "weight", "weight_bias"]),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_shapes_strides_dtypes(lead, cols, dtype, rms, affine, transpose, seed):
    shape = (*lead, cols)
    x = make(shape, torch.float64, seed=seed).to(dtype)
    if transpose and len(lead) >= 1 and lead[-1] > 0:
        # same values, different strides: build the transposed layout, view it back
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    w = make((cols,), dtype, seed=seed + 1) if "weight" in affine else None
    b = make((cols,), dtype, seed=seed + 2) if affine == "weight_bias" and not rms else None
    y = rms_norm(x, (cols,), w, 1e-5) if rms else layer_norm(x, (cols,), w, b)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, ref_norm(x, (cols,), w, b, 1e-5, rms), "layernorm", dtype)


# ---- fp16 / bf16 input with fp32 parameters ------------------------------------------
#
# A model that keeps its norms in fp32 while the rest runs in 16 bits
# (Hugging Face's _keep_in_fp32_modules): the fp32 weight / bias are applied
# in fp32, never rounded to 16 bits, as PyTorch's mixed-dtype layer_norm does;
# the output keeps the input dtype and the parameter gradients are fp32.


def _mixed_module(rms, seed=0):
    g = torch.Generator().manual_seed(seed)
    mod = torch.nn.RMSNorm(64) if rms else torch.nn.LayerNorm(64)
    with torch.no_grad():  # fp32 values that 16 bits cannot hold
        mod.weight.copy_(1 + 0.5 * torch.randn(64, generator=g))
        if not rms:
            mod.bias.copy_(0.25 * torch.randn(64, generator=g))
    return mod


def _fp64_norm(x, params, rms, eps):
    if rms:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * params[0]
    return F.layer_norm(x, (x.shape[-1],), params[0], params[1], eps)


def _forward_backward(module, x, grad):
    x = x.detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    y = module(x)
    y.backward(grad)
    return y.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_fp32_params_of_16bit_input_at_least_as_accurate_as_pytorch(dtype, rms):
    torch_mod = _mixed_module(rms)
    ours = (StableRMSNorm if rms else StableLayerNorm).from_module(torch_mod)
    x = make((256, 64), dtype, seed=1)  # 16,384 outputs
    grad = make((256, 64), dtype, seed=4, scale=1.0, offset=0.0)
    y, gx, gp = _forward_backward(ours, x, grad)
    ty, tgx, tgp = _forward_backward(torch_mod, x, grad)
    # dtypes: the output in the input dtype, parameter gradients in fp32,
    # as PyTorch's
    assert y.dtype == ty.dtype == dtype and gx.dtype == tgx.dtype == dtype
    assert [g.dtype for g in gp] == [g.dtype for g in tgp] == [torch.float32] * len(gp)
    # fp64 reference from the same (16-bit) input and the fp32 parameters
    eps = torch.finfo(dtype).eps if rms else 1e-5
    x64 = x.double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in torch_mod.parameters()]
    _fp64_norm(x64, p64, rms, eps).backward(grad.double())

    def err(a, ref):
        return (a.double() - ref).abs().max().item()

    # the output: one rounding of an fp32 result, so within half an ulp of
    # the reference up to fp32 noise, and no worse than PyTorch's (measured,
    # bf16 LayerNorm: 0.0154 for both; it was 0.025 with the parameters
    # rounded to bf16 first)
    ref = _fp64_norm(x64.detach(), [p.detach() for p in p64], rms, eps)
    assert err(y, ref) <= err(ty, ref)
    half_ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    assert ((y.double() - ref).abs() <= half_ulp * ref.abs() + 1e-5).all()
    assert err(gx, x64.grad) <= err(tgx, x64.grad)
    for g, tg, p in zip(gp, tgp, p64):
        # fp32 sums over 256 rows of products of 16-bit values: fp32
        # tolerance (PyTorch's own are off by up to 0.6 here, see the docs)
        assert err(g, p.grad) <= 1e-4 * (1 + p.grad.abs().max().item())
        assert err(g, p.grad) <= err(tg, p.grad)


def test_fp32_params_of_16bit_input_match_pytorch_layernorm_exactly():
    # LayerNorm: the same fp32 arithmetic, rounded once: every one of the
    # 16,384 outputs equals nn.LayerNorm's (4,761 of them did not when the
    # parameters were rounded to bf16 first)
    torch_mod = _mixed_module(False)
    x = make((256, 64), torch.bfloat16, seed=1)
    with torch.no_grad():
        assert torch.equal(StableLayerNorm.from_module(torch_mod)(x), torch_mod(x))


def test_fp32_params_functional_forms():
    x = make((6, 16), torch.bfloat16, seed=1)
    w = make((16,), torch.float32, seed=2, scale=0.5, offset=1.0)
    b = make((16,), torch.float32, seed=3, scale=0.25, offset=0.0)
    ref = lambda w_, b_: ref_norm(x, (16,), w_, b_, 1e-5, False)  # noqa: E731
    # weight and bias, each alone: applied unrounded (within half a bf16 ulp
    # of the fp64 reference, up to fp32 noise)
    for w_, b_ in ((w, b), (w, None), (None, b)):
        y = layer_norm(x, (16,), w_, b_)
        assert y.dtype == torch.bfloat16
        assert ((y.double() - ref(w_, b_)).abs() <= 2.0**-8 * ref(w_, b_).abs() + 1e-5).all()
    # an fp32 weight beside a bf16 bias: the bias is widened (exactly) to fp32
    y = layer_norm(x, (16,), w, b.bfloat16())
    assert torch.equal(y, layer_norm(x, (16,), w, b.bfloat16().float()))
    # multi-dim normalized_shape
    y = layer_norm(x.view(6, 4, 4), (4, 4), w.view(4, 4), b.view(4, 4))
    assert torch.equal(y.view(6, 16), layer_norm(x, (16,), w, b))
    # a bias alone in fp32: its gradient is an fp32 sum
    bb = b.clone().requires_grad_()
    gy = make((6, 16), torch.bfloat16, seed=5)
    layer_norm(x, (16,), None, bb).backward(gy)
    assert bb.grad.dtype == torch.float32
    torch.testing.assert_close(bb.grad, gy.double().sum(0).float(), atol=1e-6, rtol=1e-6)


def test_fp32_params_double_backward_dtypes():
    # the derivative of the backward (a gradient penalty) with the mixed
    # dtypes: each gradient in its leaf's dtype, close to the fp64 one
    x = make((5, 16), torch.bfloat16, seed=1).requires_grad_()
    w = make((16,), torch.float32, seed=2, scale=0.5, offset=1.0).requires_grad_()
    b = make((16,), torch.float32, seed=3, scale=0.25, offset=0.0).requires_grad_()
    gy = make((5, 16), torch.bfloat16, seed=4)

    def penalty(x, w, b):
        y = layer_norm(x, (16,), w, b)
        gx, gw = torch.autograd.grad((y * gy).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.float().pow(2).sum() + gw.float().pow(2).sum(), (x, w))

    hx, hw = penalty(x, w, b)
    assert hx.dtype == torch.bfloat16 and hw.dtype == torch.float32
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    rx, rw = penalty(*leaves64)
    # bf16 first-order gradients enter the penalty: bf16 gradient tolerance
    assert_close(hx, rx, "layernorm_grad", torch.bfloat16)
    assert_close(hw, rw, "layernorm_grad", torch.bfloat16)


def _opcheck_mixed_cases():
    x = make((3, 5), torch.bfloat16).requires_grad_()
    w = make((5,), torch.float32, seed=2).requires_grad_()
    b = make((5,), torch.float32, seed=3).requires_grad_()
    ops = torch.ops.nanguard
    yield ops.stable_layernorm.weight, (x, w, 1e-5, True)
    yield ops.stable_layernorm.bias, (x, b, 1e-5, False)
    yield ops.stable_layernorm.weight_bias, (x, w, b, 1e-5, False)
    with torch.no_grad():
        _, mean, rstd = ops.stable_layernorm.weight_bias(x, w, b, 1e-5, False)
    gy = make((3, 5), torch.bfloat16, seed=4)
    yield ops.stable_layernorm_backward.weight, (gy, x.detach(), w.detach(), mean, rstd, False, True)


@pytest.mark.parametrize("case", list(range(4)))
def test_opcheck_fp32_params_of_bf16_input(case):
    op, args = list(_opcheck_mixed_cases())[case]
    torch.library.opcheck(op, args)


def test_param_dtype_errors_name_the_argument():
    ops = torch.ops.nanguard
    x = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of input \(bfloat16\) or float32, got float16"):
        ops.stable_layernorm.weight(x, torch.ones(8, dtype=torch.float16), 1e-5, False)
    with pytest.raises(RuntimeError, match=r"bias must have the dtype of input \(bfloat16\) or float32, got float64"):
        ops.stable_layernorm.bias(x, torch.ones(8, dtype=torch.float64), 1e-5, False)
    with pytest.raises(RuntimeError, match=r"bias must have the dtype of weight \(float32\), got bfloat16"):
        ops.stable_layernorm.weight_bias(x, torch.ones(8), torch.ones(8).bfloat16(), 1e-5, False)
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of input \(float64\), got float32"):
        ops.stable_layernorm.weight(x.double(), torch.ones(8), 1e-5, False)
    _, mean, rstd = ops.stable_layernorm(x, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of input \(bfloat16\) or float32, got float16"):
        ops.stable_layernorm_backward.weight(x, x, torch.ones(8).half(), mean, rstd, False, True)


# ---- TorchScript -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_module",
    [
        lambda: StableLayerNorm(64),
        lambda: StableLayerNorm(64, bias=False),
        lambda: StableLayerNorm(64, elementwise_affine=False),
        lambda: StableLayerNorm((4, 16)),
        lambda: StableLayerNorm(64, eps=1e-12, eps_floor="auto"),
        lambda: StableLayerNorm(64, eps=1e-12, eps_floor=1e-3),
        lambda: StableRMSNorm(64),
        lambda: StableRMSNorm(64, eps=1e-6),
        lambda: StableRMSNorm(64, eps=1e-12, eps_floor="auto"),
    ],
    ids=["ln", "ln-nobias", "ln-noaffine", "ln-2d", "ln-floor-auto", "ln-floor", "rms", "rms-eps",
         "rms-floor-auto"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jit_script_matches_eager(make_module, dtype):
    torch.manual_seed(0)
    m = make_module()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    scripted = torch.jit.script(m)
    x = make((3, 5, 64), dtype, seed=1)
    if m.normalized_shape == (4, 16):
        x = x.view(3, 5, 4, 16)
    xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, ye = scripted(xs), m(xe)
    assert ys.dtype == ye.dtype and torch.equal(ys, ye)
    g = make(ys.shape, dtype, seed=2)
    params = list(m.parameters())
    gs = torch.autograd.grad(ys, [xs, *params], g)
    ge = torch.autograd.grad(ye, [xe, *params], g)
    for a, b in zip(gs, ge):
        assert torch.equal(a, b)


def test_jit_script_fp32_params_of_bf16_input_and_bad_shape():
    torch_mod = _mixed_module(False)
    m = StableLayerNorm.from_module(torch_mod)
    scripted = torch.jit.script(m)
    x = make((8, 64), torch.bfloat16, seed=1)
    assert torch.equal(scripted(x), m(x))
    with pytest.raises(Exception, match="normalized_shape"):
        scripted(torch.randn(4, 32))


# ---- CUDA ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1, 3, 127, 4097])
@pytest.mark.parametrize("rms", [False, True])
def test_cuda_matches_reference_and_cpu(dtype, cols, rms):
    run_case(dtype, (3, 5, cols), (cols,), True, True, rms, device="cuda")
    x = make((7, cols), dtype)
    w = make((cols,), dtype, seed=2)
    f = (lambda t, w: rms_norm(t, (cols,), w)) if rms else (lambda t, w: layer_norm(t, (cols,), w))
    assert_close(f(x.cuda(), w.cuda()), f(x, w).double(), "layernorm", dtype)


@requires_cuda
def test_cuda_edge_cases():
    x = torch.full((3, 37), 0.1, device="cuda", dtype=torch.float16)
    b = torch.linspace(-1, 1, 37, device="cuda").half()
    assert torch.equal(layer_norm(x, (37,), None, b, 0.0), b.expand_as(x))
    x = make((5, 33), torch.float32, "cuda")
    x[2, 3] = float("inf")
    y = layer_norm(x, (33,))
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()
    with pytest.raises((ValueError, RuntimeError), match="weight"):
        layer_norm(x, (33,), torch.ones(33))
    with pytest.raises(TypeError, match="float64"):
        layer_norm(x.double(), (33,))


@pytest.mark.parametrize("overload,rms", [(o, False) for o in ("default", "weight", "bias", "weight_bias")]
                         + [("default", True), ("weight", True)])  # RMSNorm has no bias
def test_eager_function_matches_the_dispatcher_autograd_kernel(overload, rms):
    """A recorded eager call runs the op's formula as a torch.autograd.Function
    (_checks.register_autograd); through the dispatcher instead (torch.ops,
    torch.library's autograd kernel) the same formula must give the same
    output and gradient bits."""
    from nanguard import _checks

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g)
    params = {"weight": torch.randn(24, generator=g), "bias": torch.randn(24, generator=g)}
    names = [n for n in ("weight", "bias") if n in overload]
    op = getattr(torch.ops.nanguard.stable_layernorm, overload)
    results = []
    for path in ("function", "dispatcher"):
        leaves = [x.clone().requires_grad_(), *(params[n].clone().requires_grad_() for n in names)]
        call = (lambda *a: _checks.call_op(op, *a)) if path == "function" else op
        y, mean, rstd = call(*leaves, 1e-5, rms)
        assert type(y.grad_fn).__name__.startswith("StableLayernorm") == (path == "function")
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
        results.append((y.detach(), mean, rstd, *torch.autograd.grad(y, leaves, gy)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
