"""safe_sdpa's delegation to PyTorch's fused attention kernels: the
conditions table (each refusal names its argument), the fused path against
the fp64 reference (values, gradients, lse), its NaN rule, torch.compile and
opcheck, and nanguard's own backward fed the fused forward's statistics.

On the CPU the fused kernel is aten._scaled_dot_product_flash_attention_for_cpu
(forced here with backend="fused": "auto" keeps nanguard's faster CPU
kernel). The same file runs the CUDA kernels (flash, memory-efficient) where
a GPU is present. The whole attention suite runs with delegation on under
NANGUARD_SDPA_BACKEND=fused-if-allowed (scripts/gpu_check.sh runs it both
ways)."""

from __future__ import annotations

import math

import pytest
import torch

from nanguard import _delegate
from nanguard.functional import safe_sdpa
from nanguard.nn import SafeAttention

from conftest import DEVICES, requires_cuda
from test_attention import assert_close, rand, ref_sdpa

ops = torch.ops.nanguard


def _fused_dtypes(device):
    # float16 with gradients is never delegated (see the conditions table)
    return [torch.float64, torch.float32, torch.bfloat16] if device == "cpu" else [torch.float32, torch.bfloat16]


CASES = {
    # name: (B, Hq, Hkv, L, S, E, causal)
    "plain": (2, 2, 2, 33, 70, 16, False),
    "causal_square": (1, 2, 2, 129, 129, 32, True),
    "causal_L_lt_S": (1, 2, 2, 7, 100, 16, True),
    "causal_L_gt_S": (1, 2, 2, 100, 64, 16, True),
    "gqa": (2, 4, 2, 40, 65, 32, False),
    "mqa_causal": (1, 4, 1, 70, 70, 8, True),
    "decode": (2, 8, 2, 1, 600, 64, False),
    "D256": (1, 1, 1, 65, 66, 256, False),
    "long": (1, 2, 2, 800, 700, 64, True),  # several of the CPU kernel's key blocks (512)
}


def _run(device, dtype, case, backend):
    B, Hq, Hkv, L, S, E, causal = CASES[case]
    q = rand((B, Hq, L, E), dtype, 1).to(device).requires_grad_()
    k = rand((B, Hkv, S, E), dtype, 2).to(device).requires_grad_()
    v = rand((B, Hkv, S, E), dtype, 3).to(device).requires_grad_()
    out = safe_sdpa(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, backend=backend)
    g = rand(out.shape, dtype, 4).to(device)
    return (q, k, v), g, out, torch.autograd.grad(out, (q, k, v), g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_fp64_reference(case, device):
    for dtype in _fused_dtypes(device):
        before = dict(_delegate.counts)
        (q, k, v), g, out, grads = _run(device, dtype, case, "fused")
        assert sum(_delegate.counts.values()) == sum(before.values()) + 1  # it did delegate
        leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
        ref = ref_sdpa(*leaves, causal=CASES[case][-1])
        ref_grads = torch.autograd.grad(ref, leaves, g.cpu().double())
        assert out.dtype == dtype
        assert_close(out, ref, "out", dtype)
        for got, want in zip(grads, ref_grads):
            assert torch.isfinite(got).all()
            assert_close(got, want, "grad", dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_float16_inference_keeps_scores_in_fp32(device):
    """float16 without gradients is delegated: q.k above 65504 (inf in
    float16) stays finite and correct, since the fused kernels form scores
    in fp32."""
    g = torch.Generator().manual_seed(0)
    q = (150 + 50 * torch.rand(1, 2, 8, 64, generator=g)).half()
    k = (150 + 50 * torch.rand(1, 2, 80, 64, generator=g)).half()
    v = torch.randn(1, 2, 80, 64, generator=g).half()
    assert torch.isinf(q[0, 0, 0] @ k[0, 0, 0]).item()
    n = sum(_delegate.counts.values())
    with torch.no_grad():
        out = safe_sdpa(q.to(device), k.to(device), v.to(device), is_causal=True, backend="fused")
    assert sum(_delegate.counts.values()) == n + 1
    assert torch.isfinite(out).all()
    assert_close(out, ref_sdpa(q, k, v, causal=True), "out", torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "causal_L_gt_S", "gqa", "decode", "long"])
def test_fused_lse_is_nanguards_lse_and_feeds_nanguards_backward(case, device):
    """The statistics are the same quantity: the fused kernel's logsumexp
    equals nanguard's lse (natural log, scaled scores, fp32 [B, H, L]), and
    nanguard's backward op fed the fused forward's (out, lse) gives the
    fused backward's gradients."""
    dtype = torch.float32
    B, Hq, Hkv, L, S, E, causal = CASES[case]
    q = rand((B, Hq, L, E), dtype, 1).to(device)
    k = rand((B, Hkv, S, E), dtype, 2).to(device)
    v = rand((B, Hkv, S, E), dtype, 3).to(device)
    scale = 1 / math.sqrt(E)
    rng = torch.zeros(2, dtype=torch.int64)
    kernel = _delegate.choose(q, k, v, None, 0.0, causal, scale, 0.0, 0.0, "fused")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = _delegate.fused_forward(kernel, qg, kg, vg, causal, scale)
    ng_out, ng_lse = ops.safe_sdpa(q, k, v, 0.0, causal, scale, 0.0, 0.0, rng)
    assert lse.shape == ng_lse.shape == (B, Hq, L) and lse.dtype == ng_lse.dtype == torch.float32
    torch.testing.assert_close(lse, ng_lse, atol=2e-5, rtol=2e-5)
    assert_close(out, ng_out, "out", dtype)
    g = rand(out.shape, dtype, 4).to(device)
    fused_grads = torch.autograd.grad(out, (qg, kg, vg), g)
    ng_grads = ops.safe_sdpa_backward(g, q, k, v, out.detach(), lse.contiguous(), 0.0, causal, scale,
                                      0.0, 0.0, rng)
    for a, b in zip(fused_grads, ng_grads):
        assert_close(a, b, "grad", dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_fused_path_never_hides_a_nan(where, device):
    """The NaN rule of docs/attention.md on the fused path: a NaN in q
    reaches its row, in k every row, in v its column; 64 keys (the fewest
    the CPU kernel is given: below one vector it zeroed an all-NaN row)."""
    q, k, v = (rand((1, 2, 6, 16), torch.float32, 1), rand((1, 2, 64, 16), torch.float32, 2),
               rand((1, 2, 64, 16), torch.float32, 3))
    {"q": q, "k": k, "v": v}[where][0, 0, 2, 3] = float("nan")
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        out = safe_sdpa(q, k, v, is_causal=causal, backend="fused")
        o = out[0, 0].detach().cpu()
        if where == "q":
            assert torch.isnan(o[2]).all() and torch.isfinite(o[[0, 1, 3, 4, 5]]).all()
        elif where == "k":
            # causal: rows 0 and 1 cannot see key 2
            assert torch.isnan(o[2:]).all() and (causal or torch.isnan(o).all())
        else:
            assert torch.isnan(o[2:, 3]).all()
        assert torch.isfinite(out[0, 1].detach()).all()  # the other head is untouched
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        if where == "q":
            assert torch.isnan(dq[0, 0, 2].cpu()).all()
        assert torch.isfinite(dq[0, 1]).all() and torch.isfinite(dk[0, 1]).all()


def test_cpu_flash_below_one_vector_of_keys_would_hide_a_nan():
    """Why the CPU row 'at least 64 keys' exists: PyTorch's CPU flash kernel,
    called directly with 5 keys, returns 0 for a query row of NaN. The
    table refuses such a call (backend='auto' runs nanguard's kernel, which
    returns NaN)."""
    q, k, v = rand((1, 1, 3, 8), torch.float32, 1), rand((1, 1, 5, 8), torch.float32, 2), rand(
        (1, 1, 5, 8), torch.float32, 3)
    q[0, 0, 1] = float("nan")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=0.3)
    assert (out[0, 0, 1] == 0).all() and lse[0, 0, 1] == 0  # the NaN hidden, the row taken as masked
    with pytest.raises(ValueError, match="key: the CPU flash kernel"):
        safe_sdpa(q, k, v, backend="fused")
    assert torch.isnan(safe_sdpa(q, k, v, backend="fused-if-allowed")[0, 0, 1]).all()


# ---- the table: every refusal names its argument ------------------------------------


def _qkv(B=1, Hq=2, Hkv=2, L=8, S=64, E=16, Ev=16, dtype=torch.float32, grad=False, device="cpu"):
    return (rand((B, Hq, L, E), dtype, 1).to(device).requires_grad_(grad),
            rand((B, Hkv, S, E), dtype, 2).to(device).requires_grad_(grad),
            rand((B, Hkv, S, Ev), dtype, 3).to(device).requires_grad_(grad))


REFUSALS = {
    # name: (qkv kwargs, safe_sdpa kwargs, the argument the error names)
    "mask": ({}, {"attn_mask": torch.ones(8, 64, dtype=torch.bool)}, "attn_mask"),
    "float_mask": ({}, {"attn_mask": torch.zeros(8, 64)}, "attn_mask"),
    "clamp": ({}, {"max_score": 5.0}, "max_score"),
    "softcap": ({}, {"softcap": 30.0}, "softcap"),
    "dropout": ({}, {"dropout_p": 0.1}, "dropout_p"),
    "Ev_ne_E": ({"Ev": 8}, {}, "value"),
    "fp16_grad": ({"dtype": torch.float16, "grad": True}, {}, "query"),
    "no_keys": ({"S": 0}, {}, "key"),
    "few_keys_cpu": ({"S": 63}, {}, "key"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_forced_fused_names_the_argument_that_rules_it_out(case):
    qkw, kw, arg = REFUSALS[case]
    q, k, v = _qkv(**qkw)
    with pytest.raises(ValueError, match=rf"backend='fused' cannot run this call .*\({arg}: "):
        safe_sdpa(q, k, v, backend="fused", **kw)
    # auto / fused-if-allowed: nanguard's kernel, the same result as backend="nanguard"
    if case != "dropout":
        want = safe_sdpa(q, k, v, backend="nanguard", **kw)
        for backend in ("auto", "fused-if-allowed"):
            n = sum(_delegate.counts.values())
            torch.testing.assert_close(safe_sdpa(q, k, v, backend=backend, **kw), want, equal_nan=True)
            assert sum(_delegate.counts.values()) == n


def test_allowed_calls_and_the_cpu_default():
    q, k, v = _qkv()
    assert _delegate.choose(q, k, v, None, 0.0, True, 0.25, 0.0, 0.0, "fused") == "cpu_flash"
    assert _delegate.choose(q, k, v, None, 0.0, True, 0.25, 0.0, 0.0, "fused-if-allowed") == "cpu_flash"
    assert _delegate.choose(q, k, v, None, 0.0, True, 0.25, 0.0, 0.0, "nanguard") is None
    # auto keeps nanguard's kernel on the CPU (measured faster there)
    assert _delegate.choose(q, k, v, None, 0.0, True, 0.25, 0.0, 0.0, "auto") is None
    # float16 without gradients, a negative scale (the CPU kernel scales
    # before taking the max) and GQA are allowed on the CPU
    h = [t.half() for t in _qkv(Hkv=1)]
    assert _delegate.choose(*h, None, 0.0, False, -0.5, 0.0, 0.0, "fused") == "cpu_flash"
    with torch.no_grad():
        g = _qkv(dtype=torch.float16, grad=True)
        assert _delegate.choose(*g, None, 0.0, False, 0.25, 0.0, 0.0, "fused") == "cpu_flash"


def test_backend_argument_is_checked():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend must be one of"):
        safe_sdpa(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="backend must be one of"):
        SafeAttention(backend="cudnn")
    m = SafeAttention(is_causal=True, backend="fused")
    n = _delegate.counts["cpu_flash"]
    torch.testing.assert_close(m(q, k, v), safe_sdpa(q, k, v, is_causal=True, backend="nanguard"))
    assert _delegate.counts["cpu_flash"] == n + 1 and "backend=fused" in repr(m)


def test_environment_default(monkeypatch):
    for value in ("auto", "nanguard", "fused-if-allowed", ""):
        monkeypatch.setenv("NANGUARD_SDPA_BACKEND", value)
        assert _delegate._default_from_env() == (value or "auto")
    monkeypatch.setenv("NANGUARD_SDPA_BACKEND", "fused")
    with pytest.raises(ValueError, match="per-call"):
        _delegate._default_from_env()


def test_dropout_p_one_on_the_fused_path_keeps_a_nan():
    q, k, v = _qkv(L=5)
    q[0, 0, 1, 2] = float("nan")
    out = safe_sdpa(q, k, v, dropout_p=1.0, backend="fused")
    assert torch.isnan(out[0, 0, 1]).all()
    out[0, 0, 1] = 0.0
    assert (out == 0).all()


def test_fused_double_backward_raises():
    q = rand((1, 1, 3, 4), torch.float64, 1).requires_grad_()
    k = rand((1, 1, 64, 4), torch.float64, 2)
    (g,) = torch.autograd.grad(safe_sdpa(q, k, k, backend="fused").pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for .*_backward is not implemented"):
        g.sum().backward()


# ---- compile, opcheck, gradcheck ---------------------------------------------------------


def test_gradcheck_fused():
    q = rand((1, 2, 5, 4), torch.float64, 1, 2.0).requires_grad_()
    k = rand((1, 1, 64, 4), torch.float64, 2, 2.0).requires_grad_()
    v = rand((1, 1, 64, 4), torch.float64, 3).requires_grad_()
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: safe_sdpa(q, k, v, is_causal=causal, enable_gqa=True, backend="fused"), (q, k, v))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_fused(backend):
    """The decision traces (no graph break under fullgraph=True) and the
    compiled fused path gives eager's values and gradients."""
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)
            self.attn = SafeAttention(is_causal=True, backend="fused")

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
            return self.attn(q, k, v).transpose(1, 2).reshape(x.shape)

    m = Block()
    x = torch.randn(2, 70, 32, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    y, y_eager = compiled(x), m(x)
    torch.testing.assert_close(y, y_eager, atol=2e-5, rtol=2e-4)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g_eager,) = torch.autograd.grad(y_eager.sum(), x)
    torch.testing.assert_close(g, g_eager, atol=2e-5, rtol=2e-4)
    # the traced graph holds the fused op; a call the table refuses (auto on
    # the CPU) traces to nanguard's op, also without a graph break
    for attn_backend, want in (("fused", "aten._scaled_dot_product_flash_attention_for_cpu"),
                               ("auto", "nanguard.safe_sdpa.default")):
        m.attn.backend = attn_backend
        torch._dynamo.reset()
        assert want in _traced_ops(m, x)


def _traced_ops(fn, *args):
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(fn, fullgraph=True, backend=record)(*args)
    return seen


def test_opcheck_of_the_fused_op():
    """The op the CPU path calls passes opcheck (schema, fake kernel,
    autograd registration, AOT dispatch) for the arguments nanguard gives it."""
    q = rand((2, 4, 5, 8), torch.float32, 1).requires_grad_()
    k = rand((2, 4, 64, 8), torch.float32, 2).requires_grad_()
    v = rand((2, 4, 64, 8), torch.float32, 3).requires_grad_()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for causal in (False, True):
        torch.library.opcheck(op, (q, k, v, 0.0, causal), {"scale": 0.35})


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_auto_delegates_where_the_table_allows(dtype):
    q, k, v = _qkv(B=2, Hq=4, Hkv=4, L=128, S=128, E=64, Ev=64, dtype=dtype, device="cuda")
    kernel = _delegate.choose(q, k, v, None, 0.0, True, 0.125, 0.0, 0.0, "auto")
    assert kernel == ("efficient" if dtype == torch.float32 else "flash")
    # causal with L != S: flash would align it bottom-right; memory-efficient is top-left
    q2 = q[:, :, :100]
    if dtype != torch.float32:
        assert _delegate.choose(q2, k, v, None, 0.0, True, 0.125, 0.0, 0.0, "auto") == "efficient"
        out = safe_sdpa(q2, k, v, is_causal=True)
        assert_close(out, ref_sdpa(q2.cpu(), k.cpu(), v.cpu(), causal=True), "out", dtype)
    with pytest.raises(ValueError, match="scale"):
        safe_sdpa(q, k, v, scale=-0.1, backend="fused")
