"""safe_sdpa: forward and all three gradients against an fp64 reference, the
failures it exists for (fp16 score overflow, fully masked rows in every mask
convention), dropout, gradcheck, opcheck, torch.compile, broadcasting and
GQA, bad inputs, and CUDA-vs-CPU cases (skipped without a GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nanguard.functional import safe_sdpa
from nanguard.nn import SafeAttention

import conftest
from conftest import assert_close as _assert_close
from conftest import requires_cuda, requires_kernels

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
ops = torch.ops.nanguard

def assert_close(got, ref, kind, dtype, mask=None):
    """The shared tolerance check, with atol scaled by 1 + max|ref| (see the
    "attention" entries of conftest.TOLERANCES).

    An additive mask of magnitude M shifts every score of a row by up to M
    before the softmax: a row masked entirely with -1e4 (the naive-module
    convention) is still a valid softmax, but its fp32 scores carry an
    absolute rounding error of about M * 2^-24 that no kernel can avoid. The
    allowance grows by that much when such a mask is given."""
    r = ref.detach().double().cpu()
    scale = 1.0 + (r[torch.isfinite(r)].abs().max().item() if r.numel() else 0.0)
    if mask is not None and mask.dtype != torch.bool and mask.numel():
        # the shift that matters is the smallest |mask| of each row (the
        # positions that dominate its softmax), at its worst over the rows
        m = mask.double().abs()
        m[~torch.isfinite(mask) | (mask <= torch.finfo(mask.dtype).min)] = float("inf")
        row_shift = m.amin(-1)
        row_shift = row_shift[torch.isfinite(row_shift)]
        unit = 2.0**-53 if dtype == torch.float64 else 2.0**-24  # scores are fp32 (fp64)
        atol = conftest.TOLERANCES["attention" if kind == "out" else "attention_grad"][dtype][0]
        if row_shift.numel():
            scale += 4 * unit * row_shift.max().item() * scale / atol
    _assert_close(got, ref, "attention" if kind == "out" else "attention_grad", dtype, scale)


def masked_positions(mask):
    """Where a mask masks: bool False, or float -inf / <= finfo(dtype).min."""
    if mask.dtype == torch.bool:
        return ~mask
    return (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)


def ref_sdpa(q, k, v, mask=None, causal=False, scale=None, max_score=None, softcap=None, keep=None,
             dropout_p=0.0):
    """Plain attention in float64 with autograd; fully masked rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if max_score is not None:
        s = s.clamp(-max_score, max_score)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    L, S = s.shape[-2:]
    dead = torch.zeros(s.shape, dtype=torch.bool)
    if mask is not None:
        dead = dead | masked_positions(mask).expand(s.shape)
        if mask.dtype != torch.bool:
            s = s + mask.double().masked_fill(masked_positions(mask), 0.0)
    if causal:
        dead = dead | torch.ones(L, S, dtype=torch.bool).triu(1)
    empty = dead.all(-1, keepdim=True)
    s = s.masked_fill(dead, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def make_mask(kind, shape, dtype, seed, full_rows=False):
    """bool / 'neginf' / 'lowest' / 'additive' masks; full_rows masks every
    third query row entirely."""
    g = torch.Generator().manual_seed(seed)
    dead = torch.rand(shape, generator=g) < 0.3
    if full_rows:
        dead[..., ::3, :] = True
    else:
        dead[..., 0] = False  # no row entirely masked
    if kind == "bool":
        return ~dead
    base = -1.5 * torch.rand(shape, generator=g, dtype=torch.float64)
    fill = {"neginf": float("-inf"), "lowest": torch.finfo(dtype).min, "additive": -1e4}[kind]
    return base.to(dtype).masked_fill(dead, fill)


def check_case(dtype, B, Hq, Hkv, L, S, E, Ev, mask_kind=None, mask_shape="full", causal=False,
               max_score=None, softcap=None, full_rows=False, seed=0, scale_in=1.0):
    q = rand((B, Hq, L, E), dtype, seed, scale_in).requires_grad_()
    k = rand((B, Hkv, S, E), dtype, seed + 1, scale_in).requires_grad_()
    v = rand((B, Hkv, S, Ev), dtype, seed + 2).requires_grad_()
    mask = None
    if mask_kind is not None:
        mshape = {"full": (B, Hq, L, S), "pad": (B, 1, 1, S), "ls": (L, S)}[mask_shape]
        mask = make_mask(mask_kind, mshape, dtype, seed + 3, full_rows)
    out = safe_sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=Hq != Hkv,
                    max_score=max_score, softcap=softcap)
    assert out.dtype == dtype and out.shape == (B, Hq, L, Ev)
    g = rand(out.shape, dtype, seed + 4)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_sdpa(*leaves, mask=mask, causal=causal, max_score=max_score, softcap=softcap)
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    assert_close(out, ref, "out", dtype)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert torch.isfinite(got).all(), f"d{name} not finite"
        assert_close(got, want, "grad", dtype)
    return out, grads


# ---- forward and gradients vs fp64 ------------------------------------------------

CASES = {
    # name: (B, Hq, Hkv, L, S, E, Ev, kwargs)
    "plain": (2, 2, 2, 33, 47, 16, 16, {}),
    "L1": (1, 3, 3, 1, 5, 8, 8, {}),
    "L7_S129_D40": (1, 2, 2, 7, 129, 40, 40, {}),
    "L129_D80": (1, 1, 1, 129, 70, 80, 80, {}),
    "D256": (1, 1, 1, 65, 66, 256, 256, {}),
    "Ev_ne_E": (1, 2, 2, 20, 30, 24, 40, {}),
    "gqa": (2, 4, 2, 70, 65, 32, 32, {}),
    "causal": (1, 2, 2, 129, 129, 16, 16, {"causal": True}),
    "causal_L_lt_S": (1, 2, 1, 7, 100, 16, 16, {"causal": True}),
    "causal_L_gt_S": (1, 1, 1, 100, 7, 16, 16, {"causal": True}),
    "bool": (2, 2, 2, 40, 70, 16, 16, {"mask_kind": "bool"}),
    "additive": (2, 2, 2, 23, 31, 16, 16, {"mask_kind": "additive"}),
    "neginf_pad": (2, 2, 2, 9, 77, 16, 16, {"mask_kind": "neginf", "mask_shape": "pad"}),
    "lowest_ls": (1, 2, 1, 23, 31, 16, 16, {"mask_kind": "lowest", "mask_shape": "ls"}),
    "bool_causal": (1, 2, 2, 30, 30, 16, 16, {"mask_kind": "bool", "mask_shape": "ls", "causal": True}),
    "clamp": (1, 2, 2, 20, 33, 16, 16, {"max_score": 2.5, "scale_in": 2.0}),
    "softcap": (1, 2, 2, 20, 33, 16, 16, {"softcap": 3.0, "scale_in": 2.0}),
    "clamp_softcap_mask": (1, 2, 1, 20, 33, 16, 16,
                           {"max_score": 3.0, "softcap": 2.0, "mask_kind": "neginf", "scale_in": 2.0}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_reference(case, dtype):
    B, Hq, Hkv, L, S, E, Ev, kw = CASES[case]
    check_case(dtype, B, Hq, Hkv, L, S, E, Ev, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "neginf", "lowest"])
def test_fully_masked_rows_give_zero_output_and_gradients(kind, dtype):
    out, (dq, dk, dv) = check_case(dtype, 2, 2, 2, 12, 20, 16, 16, mask_kind=kind, full_rows=True, seed=7)
    assert (out[..., ::3, :] == 0).all()
    assert (dq[..., ::3, :] == 0).all()
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def naive_attention(q, k, v, mask):
    """What people write by hand, in the input dtype."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s + mask
    return torch.softmax(s, -1) @ v


def test_fully_masked_fp16_row_naive_nan_safe_zero():
    q, k, v = (rand((1, 1, 4, 8), torch.float16, s) for s in (1, 2, 3))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.float16)
    mask[..., 1, :] = float("-inf")
    assert torch.isnan(naive_attention(q, k, v, mask)[..., 1, :]).all()
    out = safe_sdpa(q, k, v, attn_mask=mask)
    assert (out[..., 1, :] == 0).all() and torch.isfinite(out).all()


def test_fp16_score_overflow_is_finite_and_correct():
    g = torch.Generator().manual_seed(0)
    q = (150 + 50 * torch.rand(1, 2, 8, 64, generator=g)).half()
    k = (150 + 50 * torch.rand(1, 2, 16, 64, generator=g)).half()
    v = torch.randn(1, 2, 16, 64, generator=g).half()
    assert torch.isinf(q[0, 0, 0] @ k[0, 0, 0]).item()  # q.k > 65504 in fp16
    eager = naive_attention(q, k, v, torch.zeros((), dtype=torch.float16))
    assert not torch.isfinite(eager).all()
    out = safe_sdpa(q, k, v)
    assert torch.isfinite(out).all()
    assert_close(out, ref_sdpa(q, k, v), "out", torch.float16)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_inputs_propagate(where):
    q, k, v = (rand((1, 1, 6, 8), torch.float32, s) for s in (1, 2, 3))
    {"q": q, "k": k, "v": v}[where][0, 0, 2, 3] = float("nan")
    out = safe_sdpa(q, k, v, max_score=5.0)
    if where == "q":
        assert torch.isnan(out[0, 0, 2]).all() and torch.isfinite(out[0, 0, [0, 1, 3, 4, 5]]).all()
    elif where == "k":
        assert torch.isnan(out).all()
    else:
        assert torch.isnan(out[..., 3]).all()


@pytest.mark.parametrize("device", conftest.DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["grad_out", "query"])
def test_nan_row_stays_off_keys_padded_for_every_query(device, dtype, where):
    """A NaN in one row of grad_out (or query) reaches dq of that row and dk /
    dv of every key the row attends; the keys of 64-key blocks that a padding
    mask hides from every query of their kv group get exactly 0 (the kernels
    skip those blocks, CPU and CUDA alike); every other batch and kv head
    stays finite."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 70, 200, 64
    q = rand((B, Hq, L, E), torch.float32, 1).to(device, dtype).requires_grad_()
    k = rand((B, Hkv, S, E), torch.float32, 2).to(device, dtype).requires_grad_()
    v = rand((B, Hkv, S, E), torch.float32, 3).to(device, dtype).requires_grad_()
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., 100:] = False  # batch 0: keys 128-199 are whole padded blocks, 100-127 part of one
    gy = rand((B, Hq, L, E), torch.float32, 4).to(device, dtype)
    with torch.no_grad():
        (gy if where == "grad_out" else q)[0, 0, 5, 3] = float("nan")
    safe_sdpa(q, k, v, attn_mask=mask.to(device), enable_gqa=True).backward(gy)
    dq, dk, dv = (t.grad.float().cpu() for t in (q, k, v))
    assert torch.isnan(dq[0, 0, 5]).any() and torch.isfinite(dq[0, 0, :5]).all()
    assert torch.isfinite(dq[1]).all() and torch.isfinite(dq[0, 1:]).all()
    # kv head 0 of batch 0 (query heads 0 and 1): NaN at the attended keys,
    # 0 at the wholly padded blocks
    assert torch.isnan(dk[0, 0, :100]).any(dim=-1).all()
    assert (dk[0, 0, 128:] == 0).all() and (dv[0, 0, 128:] == 0).all()
    if where == "grad_out":
        assert torch.isnan(dv[0, 0, :100, 3]).all()
    for t in (dk, dv):
        assert torch.isfinite(t[1]).all() and torch.isfinite(t[0, 1]).all()


def test_default_matches_pytorch_sdpa():
    q, k, v = (rand((2, 3, 50, 32), torch.float32, s) for s in (1, 2, 3))
    m = torch.rand(2, 1, 50, 50, generator=torch.Generator().manual_seed(4)) > 0.2
    m[..., 0] = True
    for kw in ({}, {"is_causal": True}, {"attn_mask": m}, {"scale": 0.3}):
        torch.testing.assert_close(safe_sdpa(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw),
                                   atol=2e-5, rtol=2e-4)


# fp64: the composite's fp64 matmuls sum in an order that depends on the key
# count, so only the kernels' tiling keeps every bit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, pytest.param(torch.float64, marks=requires_kernels)],
                         ids=str)
@pytest.mark.parametrize("L,scale", [(256, None), (130, None), (130, 0.3)])
def test_masked_tiles_are_skipped_without_changing_a_bit(dtype, L, scale):
    """A key tile that the mask masks for every query of a block is skipped,
    forward and backward (its probabilities are all 0): a causal mask passed
    as a tensor, as Hugging Face passes causal + padding, gives the bits of
    is_causal=True (output and gradients), whose tiles above the diagonal
    were never computed, and a padded tail
    (whole tiles masked for every query) gives the bits of the same call
    with those keys cut off. A scale that is not a power of two rounds the
    same way with a bool mask as without."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, L, 64, dtype=dtype) for _ in range(3))
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    out = safe_sdpa(qm, km, vm, attn_mask=tril, scale=scale, backend="nanguard")
    ref = safe_sdpa(qc, kc, vc, is_causal=True, scale=scale, backend="nanguard")
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, want in ((qm, qc), (km, kc), (vm, vc)):
        assert torch.equal(got.grad, want.grad)
    keep = 64  # the first key tile only
    pad = torch.zeros(1, 1, L, L, dtype=torch.bool)
    pad[..., :keep] = True
    got = safe_sdpa(q, k, v, attn_mask=pad, scale=scale, backend="nanguard")
    cut = safe_sdpa(q, k[:, :, :keep], v[:, :, :keep], attn_mask=pad[..., :keep], scale=scale, backend="nanguard")
    assert torch.equal(got, cut)


@pytest.mark.parametrize("scale", [-0.2, 0.0, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_any_finite_scale_matches_fp64_reference(scale, dtype):
    """A scale <= 0 reverses (or flattens) the order of the scores, so the
    softmax's max is not the scaled max of the raw scores: such a call scales
    first, and matches the reference forward and backward, masked or not."""
    q = rand((1, 2, 70, 16), dtype, 1, 2.0).requires_grad_()
    k = rand((1, 2, 90, 16), dtype, 2, 2.0).requires_grad_()
    v = rand((1, 2, 90, 16), dtype, 3).requires_grad_()
    for kw in ({}, {"is_causal": True}, {"attn_mask": make_mask("bool", (1, 1, 70, 90), dtype, 4)}):
        out = safe_sdpa(q, k, v, scale=scale, backend="nanguard", **kw)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = ref_sdpa(*leaves, mask=kw.get("attn_mask"), causal=kw.get("is_causal", False), scale=scale)
        g = rand(out.shape, dtype, 5)
        assert_close(out, ref, "out", dtype)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves, g.double())):
            assert_close(got, want, "grad", dtype)


@pytest.mark.parametrize("L,S", [(5, 9), (9, 5), (1, 4)])
def test_causal_alignment_matches_pytorch_when_lengths_differ(L, S):
    q = rand((1, 2, L, 8), torch.float64, 1)
    k, v = rand((1, 2, S, 8), torch.float64, 2), rand((1, 2, S, 8), torch.float64, 3)
    torch.testing.assert_close(safe_sdpa(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---- shapes, broadcasting, layouts ---------------------------------------------------


@pytest.mark.parametrize(
    "qs,ks,ms",
    [
        ((7, 8), (9, 8), None),                 # 2-d
        ((3, 7, 8), (3, 9, 8), (7, 9)),         # 3-d, [L, S] mask
        ((2, 3, 7, 8), (1, 3, 9, 8), (2, 1, 1, 9)),  # batch broadcast, padding mask
        ((2, 2, 3, 7, 8), (2, 2, 3, 9, 8), (2, 1, 3, 7, 9)),  # 5-d
        ((2, 4, 7, 8), (2, 1, 9, 8), (4, 7, 9)),  # one kv head serves all
    ],
)
def test_broadcasting_matches_reference(qs, ks, ms):
    q = rand(qs, torch.float64, 1).requires_grad_()
    k = rand(ks, torch.float64, 2).requires_grad_()
    v = rand(ks, torch.float64, 3).requires_grad_()
    m = None if ms is None else make_mask("bool", ms, torch.float64, 4)
    out = safe_sdpa(q, k, v, attn_mask=m)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b)


def test_gqa_matches_pytorch():
    q = rand((2, 8, 10, 16), torch.float64, 1)
    k, v = rand((2, 2, 12, 16), torch.float64, 2), rand((2, 2, 12, 16), torch.float64, 3)
    torch.testing.assert_close(safe_sdpa(q, k, v, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


# ---- decode shapes: a few query rows against a long key sequence -------------------
# The forward takes its decode path for L <= 20 (CPU) or 16 (CUDA) rows against any S (one read of
# each kv head for all the query heads of its group, long key ranges split
# across tasks and combined in a fixed order); the backward is the usual one,
# fed that forward's out and lse.

DECODE_CASES = {
    "L1_gqa_bool_pad": (2, 8, 2, 1, 600, 64, 64, {"mask_kind": "bool", "mask_shape": "pad"}),
    "L1_mha_S2048_E128": (1, 4, 4, 1, 2048, 128, 128, {}),
    "L1_mqa_neginf": (1, 4, 1, 1, 1500, 32, 32, {"mask_kind": "neginf"}),
    "L4_mqa_lowest_full_rows": (1, 6, 1, 4, 1100, 40, 24, {"mask_kind": "lowest", "full_rows": True}),
    "L3_bool_full_rows_ls": (2, 4, 2, 3, 333, 16, 16, {"mask_kind": "bool", "mask_shape": "ls", "full_rows": True}),
    "L16_gqa_additive": (1, 8, 2, 16, 513, 64, 64, {"mask_kind": "additive"}),
    "L3_causal": (1, 4, 2, 3, 700, 32, 32, {"causal": True}),
    "L2_guards_mask": (1, 4, 2, 2, 900, 32, 32, {"max_score": 3.0, "softcap": 2.0, "scale_in": 2.0,
                                                 "mask_kind": "neginf", "mask_shape": "ls"}),
    "L7_S33_odd": (1, 3, 1, 7, 33, 20, 12, {"mask_kind": "bool"}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_shapes_match_fp64_reference(case, dtype):
    B, Hq, Hkv, L, S, E, Ev, kw = DECODE_CASES[case]
    check_case(dtype, B, Hq, Hkv, L, S, E, Ev, **kw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_fully_masked_rows_are_zero_with_lse_minus_inf(dtype, device):
    q, k, v = rand((2, 8, 1, 64), dtype, 1), rand((2, 2, 900, 64), dtype, 2), rand((2, 2, 900, 64), dtype, 3)
    mask = torch.ones(2, 1, 1, 900, dtype=torch.bool)
    mask[1] = False  # every key of batch row 1 is padding
    mask[0, ..., 400:] = False  # and most of row 0: whole key splits see only padding
    out, lse = ops.safe_sdpa.masked(*(t.to(device) for t in (q, k, v, mask)), 0.0, False, 0.125, 0.0, 0.0, rng())
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    ref = ref_sdpa(q, k, v, mask=mask, scale=0.125)
    assert_close(out, ref, "out", dtype)


def test_decode_does_not_depend_on_the_thread_count():
    q = rand((1, 8, 2, 64), torch.float32, 1)
    k, v = rand((1, 2, 3000, 64), torch.float32, 2), rand((1, 2, 3000, 64), torch.float32, 3)
    mask = rand((1, 1, 2, 3000), torch.float32, 4) > -1.0
    ref, ref_lse = ops.safe_sdpa.masked(q, k, v, mask, 0.0, False, 0.125, 0.0, 0.0, rng())
    n = torch.get_num_threads()
    try:
        for t in {1, 2, 3}:
            torch.set_num_threads(t)
            out, lse = ops.safe_sdpa.masked(q, k, v, mask, 0.0, False, 0.125, 0.0, 0.0, rng())
            assert torch.equal(out, ref) and torch.equal(lse, ref_lse), t
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("shape", [(1, 2, 3, 200), (2, 3, 1, 77)])
def test_decode_dropout_matches_the_backwards_mask(shape):
    """The decode forward drops the elements the backward regenerates (same
    Philox element indices): gradients equal the fp64 reference built from
    the mask the forward drew."""
    B, H, L, S = shape
    keep = check_dropout_against_reference(B, H, L, S, 0.4, 7, 5)[0]
    assert 0.5 < keep.double().mean().item() < 0.7


def test_non_contiguous_inputs():
    base = rand((2, 10, 3, 16), torch.float32, 1)  # [B, L, H, E]
    q = base.transpose(1, 2)
    k, v = rand((2, 3, 12, 16), torch.float32, 2), rand((2, 3, 16, 12), torch.float32, 3).transpose(-1, -2)
    assert not q.is_contiguous() and not v.is_contiguous()
    torch.testing.assert_close(safe_sdpa(q, k, v), safe_sdpa(q.contiguous(), k, v.contiguous()))


def test_empty_and_thread_count():
    q = torch.randn(0, 2, 5, 8)
    assert safe_sdpa(q, q, q).shape == (0, 2, 5, 8)
    q, k, v = (rand((2, 4, 130, 32), torch.float32, s) for s in (1, 2, 3))
    ref = safe_sdpa(q, k, v, is_causal=True)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(safe_sdpa(q, k, v, is_causal=True), ref)
    finally:
        torch.set_num_threads(n)


# ---- dropout -------------------------------------------------------------------------


def rng(seed=0, offset=0):
    """The ops' dropout argument: Philox [seed, offset] as a CPU int64 tensor."""
    return torch.tensor([seed, offset], dtype=torch.int64)



def check_dropout_against_reference(B, H, L, S, p, seed, off):
    """fp64 q, k, v (head dims 8 / 5): out and its gradients equal the
    reference built from the keep mask the op drew (read back with
    dropped_probs). Returns (keep, (q, k, v), the op's args after q, k, v)."""
    _, _, d = dropped_probs(B, H, L, S, p, seed, off)
    keep = d != 0
    q, k, v = (rand(s, torch.float64, i).requires_grad_() for i, s in
               enumerate([(B, H, L, 8), (B, H, S, 8), (B, H, S, 5)]))
    args = (p, False, 1 / math.sqrt(8), 0.0, 0.0, rng(seed, off))
    out, _ = ops.safe_sdpa(q, k, v, *args)
    ref = ref_sdpa(q, k, v, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b)
    return keep, (q, k, v), args


def dropped_probs(B, H, L, S, p, seed, offset, dtype=torch.float64, device="cpu"):
    """P * keep / (1 - p) read back through value = identity. rng stays on
    the CPU whatever the device."""
    q = rand((B, H, L, 8), dtype, 1).to(device)
    k = rand((B, H, S, 8), dtype, 2).to(device)
    eye = torch.eye(S, dtype=dtype, device=device).expand(B, H, S, S)
    out, _ = ops.safe_sdpa(q, k, eye, p, False, 1 / math.sqrt(8), 0.0, 0.0, rng(seed, offset))
    return q, k, out


def test_dropout_keep_rate_and_scaling():
    p = 0.3
    q, k, d = dropped_probs(2, 4, 64, 200, p, seed=123, offset=7)
    keep = d != 0
    rate = keep.double().mean().item()  # sd = sqrt(.21 / 102400) = 1.4e-3
    assert abs(rate - (1 - p)) < 7e-3, rate
    ref = ref_sdpa(q, k, torch.eye(200, dtype=torch.float64).expand(2, 4, 200, 200), keep=keep, dropout_p=p)
    torch.testing.assert_close(d, ref)
    # another offset: another mask; same seed and offset: the same one
    _, _, d2 = dropped_probs(2, 4, 64, 200, p, seed=123, offset=8)
    _, _, d3 = dropped_probs(2, 4, 64, 200, p, seed=123, offset=7)
    assert not torch.equal(d2 != 0, keep) and torch.equal(d3, d)


def test_dropout_forward_backward_consistent():
    """Gradients with dropout equal the fp64 reference that uses the mask the
    forward drew (read back through value = identity); gradcheck agrees."""
    _, qkv, args = check_dropout_against_reference(1, 2, 9, 13, 0.4, 99, 3)
    assert torch.autograd.gradcheck(lambda q, k, v: ops.safe_sdpa(q, k, v, *args)[0], qkv)


def test_dropout_follows_torch_manual_seed():
    q, k, v = (rand((1, 2, 16, 8), torch.float32, s).requires_grad_() for s in (1, 2, 3))

    def step():
        out = safe_sdpa(q, k, v, dropout_p=0.5)
        return out, torch.autograd.grad(out.sum(), (q, k, v))

    torch.manual_seed(0)
    a, ga = step()
    torch.manual_seed(0)
    b, gb = step()
    c, _ = step()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    m = SafeAttention(dropout=0.5)
    torch.manual_seed(3)
    ya = m(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(m(q, k, v), ya)
    m.eval()
    torch.testing.assert_close(m(q, k, v), safe_sdpa(q, k, v))


def test_dropout_rng_is_the_default_generators_next_draw():
    """safe_sdpa's dropout equals the op called with the default CPU
    generator's next torch.randint(0, 2**62, (2,)) as rng, also when the
    default device is another one (the pair always lives on the CPU)."""
    q, k, v = (rand((1, 2, 16, 8), torch.float32, s) for s in (1, 2, 3))
    torch.manual_seed(5)
    a = safe_sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    want = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    b, _ = ops.safe_sdpa(q, k, v, 0.3, False, 1 / math.sqrt(8), 0.0, 0.0, want)
    assert torch.equal(a, b)
    torch.manual_seed(5)
    with torch.device("meta"):
        c = safe_sdpa(q, k, v, dropout_p=0.3)
    assert torch.equal(a, c)


# ---- gradcheck / opcheck / compile -------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_score": 0.8}, {"softcap": 1.5}, {"max_score": 1.0, "softcap": 0.7}, {"mask": "bool"},
     {"mask": "additive"}, {"mask": "neginf_rows"}, {"is_causal": True, "gqa": True}],
    ids=["plain", "clamp", "softcap", "clamp_softcap", "bool", "additive", "masked_rows", "causal_gqa"],
)
def test_gradcheck(kw):
    kw = dict(kw)
    hkv = 1 if kw.pop("gqa", False) else 2
    q = rand((1, 2, 5, 4), torch.float64, 1, 2.0).requires_grad_()
    k = rand((1, hkv, 6, 4), torch.float64, 2, 2.0).requires_grad_()
    v = rand((1, hkv, 6, 3), torch.float64, 3).requires_grad_()
    mask = kw.pop("mask", None)
    if mask == "neginf_rows":
        mask = make_mask("neginf", (1, 2, 5, 6), torch.float64, 4, full_rows=True)
    elif mask is not None:
        mask = make_mask(mask, (1, 2, 5, 6), torch.float64, 4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: safe_sdpa(q, k, v, attn_mask=mask, enable_gqa=True, **kw), (q, k, v)
    )


def test_double_backward_is_a_clear_error():
    # nanguard's own op's message (a delegated call raises PyTorch's own
    # error: test_attention_delegate)
    q = rand((1, 1, 3, 4), torch.float64, 1).requires_grad_()
    (g,) = torch.autograd.grad(safe_sdpa(q, q, q, backend="nanguard").pow(2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward") as e:
        g.sum().backward()
    # the message says which ops do support it
    assert "layer_norm" in str(e.value) and "rms_norm" in str(e.value)


def test_lse_is_not_differentiable():
    """lse is for the backward only: it must not claim a gradient it never
    gets (it used to be silently zero)."""
    q = rand((1, 2, 3, 4), torch.float32, 1).requires_grad_()
    out, lse = ops.safe_sdpa(q, q, q, 0.0, False, 0.5, 0.0, 0.0, rng())
    assert out.requires_grad and not lse.requires_grad


def test_autocast_casts_like_torch_sdpa():
    """Under autocast, safe_sdpa gets the casts F.scaled_dot_product_attention
    gets (lower precision on the CPU): mixed dtypes are accepted and the
    result has PyTorch's dtype; values against the fp64 reference of the
    cast inputs with the bfloat16 tolerance."""
    q = rand((1, 2, 5, 8), torch.bfloat16, 1)
    k = rand((1, 2, 6, 8), torch.float32, 2)
    v = rand((1, 2, 6, 8), torch.float32, 3)
    m = make_mask("additive", (5, 6), torch.float32, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = safe_sdpa(q, k, v, attn_mask=m)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        same = safe_sdpa(k[:, :, :5], k, v)
    assert got.dtype == want.dtype == torch.bfloat16
    assert same.dtype == torch.bfloat16
    mb = m.to(torch.bfloat16)
    assert_close(got, ref_sdpa(q, k.to(torch.bfloat16), v.to(torch.bfloat16), mask=mb), "out", torch.bfloat16, mb)


def _opcheck_cases():
    q = rand((2, 4, 5, 8), torch.float32, 1).requires_grad_()
    k = rand((2, 2, 7, 8), torch.float32, 2).requires_grad_()
    v = rand((2, 2, 7, 6), torch.float32, 3).requires_grad_()
    m = make_mask("bool", (2, 1, 5, 7), torch.float32, 4)
    fm = make_mask("neginf", (1, 4, 5, 7), torch.float32, 5, full_rows=True)
    args = (0.0, False, 0.35, 0.0, 0.0, rng())
    guards = (0.2, True, 0.35, 2.0, 3.0, rng(11, 5))
    yield ops.safe_sdpa.default, (q, k, v, *args)
    yield ops.safe_sdpa.default, (q, k, v, *guards)
    yield ops.safe_sdpa.masked, (q, k, v, m, *args)
    yield ops.safe_sdpa.masked, (q, k, v, fm, *guards)
    with torch.no_grad():
        out, lse = ops.safe_sdpa.masked(q, k, v, fm, *guards)
        out0, lse0 = ops.safe_sdpa(q, k, v, *args)
    g = torch.randn_like(out)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    yield ops.safe_sdpa_backward.default, (g, qd, kd, vd, out0, lse0, *args)
    yield ops.safe_sdpa_backward.masked, (g, qd, kd, vd, fm, out, lse, *guards)


@pytest.mark.parametrize("case", list(range(6)))
def test_opcheck(case):
    op, args = list(_opcheck_cases())[case]
    torch.library.opcheck(op, args)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.attn = SafeAttention(is_causal=True, softcap=20.0)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).transpose(1, 2).reshape(x.shape)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    m = _Block()
    x = torch.randn(2, 10, 32, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y, y_eager = compiled(x), m(x)
    torch.testing.assert_close(y, y_eager)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g_eager,) = torch.autograd.grad(y_eager.sum(), x)
    torch.testing.assert_close(g, g_eager)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_dropout(backend):
    """dropout_p > 0 traces without a graph break (fullgraph=True raises on
    one); forward and backward use one mask, whose keep rate is 1 - p. With
    value = identity the output is the dropped, rescaled probabilities
    P * keep / (1 - p), so the mask can be read from it."""
    torch._dynamo.reset()
    B, H, L, S, p = 2, 2, 64, 100, 0.3
    m = SafeAttention(dropout=p)  # training mode: dropout on
    q = rand((B, H, L, 8), torch.float64, 1).requires_grad_()
    k = rand((B, H, S, 8), torch.float64, 2).requires_grad_()
    v = torch.eye(S, dtype=torch.float64).repeat(B, H, 1, 1).requires_grad_()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    d = compiled(q, k, v)
    g = rand(d.shape, torch.float64, 3)
    grads = torch.autograd.grad(d, (q, k, v), g)
    assert torch.isfinite(d).all() and all(torch.isfinite(t).all() for t in grads)
    keep = d != 0
    rate = keep.double().mean().item()  # sd = sqrt(.21 / 25600) = 2.9e-3
    assert abs(rate - (1 - p)) < 1.5e-2, rate
    # the backward regenerated the forward's mask: gradients equal the fp64
    # reference that uses the mask read from the output
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    ref = ref_sdpa(ql, kl, vl, keep=keep, dropout_p=p)
    torch.testing.assert_close(d, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, (ql, kl, vl), g)):
        torch.testing.assert_close(got, want)
    # torch.manual_seed makes the compiled dropout reproducible too
    torch.manual_seed(7)
    d1 = compiled(q, k, v)
    torch.manual_seed(7)
    assert torch.equal(compiled(q, k, v), d1) and not torch.equal(d1, d)
    if backend == "aot_eager":  # runs torch.randint itself: eager's very mask
        torch.manual_seed(7)
        assert torch.equal(m(q, k, v), d1)


def test_module_has_no_state_and_repr():
    m = SafeAttention(dropout=0.1, is_causal=True, max_score=30.0)
    assert m.state_dict() == {} and "max_score=30.0" in repr(m)
    with pytest.raises(ValueError, match="dropout"):
        SafeAttention(dropout=1.0)


# ---- bad inputs -----------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    q = torch.randn(2, 3, 5, 8)
    k = torch.randn(2, 3, 6, 8)
    with pytest.raises(TypeError, match="query"):
        safe_sdpa(q.long(), k, k)
    with pytest.raises(TypeError, match="key"):
        safe_sdpa(q, [1.0], k)
    with pytest.raises(TypeError, match="value"):
        safe_sdpa(q, k, k.double())
    with pytest.raises(ValueError, match="head dim"):
        safe_sdpa(q, torch.randn(2, 3, 6, 7), k)
    with pytest.raises(ValueError, match="sequence length"):
        safe_sdpa(q, k, torch.randn(2, 3, 5, 8))
    with pytest.raises(ValueError, match="head dims"):
        big = torch.randn(1, 1, 2, 300)
        safe_sdpa(big, big, big)
    with pytest.raises(ValueError, match="enable_gqa"):
        safe_sdpa(torch.randn(2, 4, 5, 8), k[:, :2], k[:, :2])
    with pytest.raises(ValueError, match="multiple"):
        safe_sdpa(q, k[:, :2], k[:, :2], enable_gqa=True)
    with pytest.raises(ValueError, match="dropout_p"):
        safe_sdpa(q, k, k, dropout_p=1.5)
    with pytest.raises(TypeError, match="is_causal"):
        safe_sdpa(q, k, k, is_causal=1)
    with pytest.raises(ValueError, match="max_score"):
        safe_sdpa(q, k, k, max_score=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        safe_sdpa(q, k, k, softcap=float("nan"))
    with pytest.raises(ValueError, match="scale"):
        safe_sdpa(q, k, k, scale=float("inf"))
    with pytest.raises(ValueError, match="attn_mask"):
        safe_sdpa(q, k, k, attn_mask=torch.ones(5, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        safe_sdpa(q, k, k, attn_mask=torch.ones(5, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        safe_sdpa(q, k, k, attn_mask=torch.zeros(5, 6, requires_grad=True))
    with pytest.raises(ValueError, match="device|key"):
        safe_sdpa(q, k.to("meta"), k)
    with pytest.raises(ValueError, match="at least 2 dims"):
        safe_sdpa(q, k, torch.randn(8))
    with pytest.raises(ValueError, match="same number of heads"):
        safe_sdpa(q, k, torch.randn(2, 2, 6, 8))
    with pytest.raises(ValueError, match="do not broadcast"):
        safe_sdpa(q, torch.randn(3, 3, 6, 8), torch.randn(3, 3, 6, 8))
    with pytest.raises(ValueError, match="attn_mask of shape"):
        safe_sdpa(q, k, k, attn_mask=torch.ones(2, 2, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask of shape"):
        safe_sdpa(q, k, k, attn_mask=torch.ones(1, 2, 3, 5, 6, dtype=torch.bool))


def test_one_head_key_beside_many_head_value_is_broadcast():
    """4-d key with one head, value with all of query's: the one key head
    serves every query head (as broadcasting gives), not just the first."""
    q, v = rand((2, 3, 5, 8), torch.float64, 1), rand((2, 3, 6, 8), torch.float64, 3)
    k = rand((2, 1, 6, 8), torch.float64, 2)
    want = F.scaled_dot_product_attention(q, k.expand(2, 3, 6, 8), v)
    torch.testing.assert_close(safe_sdpa(q, k, v), want)
    torch.testing.assert_close(safe_sdpa(q, v, k), F.scaled_dot_product_attention(
        q, v, k.expand(2, 3, 6, 8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_scalars_fp32_scores_cannot_take_are_refused(dtype):
    """fp16 / bf16 / fp32 inputs are scored in fp32: a scale or soft-cap past
    FLT_MAX is inf there (NaN scores), a clamp or soft-cap that rounds to 0 is
    off. Each is refused by name, through the Python API and by the op;
    fp64 inputs take them."""
    q = torch.randn(1, 2, 3, 8, dtype=dtype)
    tiny = 2.0**-150
    cases = [("scale", dict(scale=1e39), (1e39, 0.0, 0.0)),
             ("softcap", dict(softcap=1e39), (0.3, 0.0, 1e39)),
             ("max_score", dict(max_score=tiny), (0.3, tiny, 0.0)),
             ("softcap", dict(softcap=tiny), (0.3, 0.0, tiny))]
    for name, kw, (scale, max_score, softcap) in cases:
        if dtype == torch.float64:
            safe_sdpa(q, q, q, **kw)
            ops.safe_sdpa(q, q, q, 0.0, False, scale, max_score, softcap, rng())
            continue
        with pytest.raises(ValueError, match=rf"^{name} .*float32"):
            safe_sdpa(q, q, q, **kw)
        with pytest.raises(RuntimeError, match=rf"{name} .*float32"):
            ops.safe_sdpa(q, q, q, 0.0, False, scale, max_score, softcap, rng())
    # the smallest positive float32 is a clamp, if a useless one: kept
    out = safe_sdpa(q, q, q, max_score=2.0**-149)
    assert torch.isfinite(out).all()


def test_direct_op_calls_raise_not_crash():
    q = torch.randn(2, 3, 5, 8)
    k = torch.randn(2, 3, 6, 8)
    args = (0.0, False, 0.3, 0.0, 0.0, rng())
    with pytest.raises(RuntimeError, match="query must be float16"):
        ops.safe_sdpa(q.long(), k, k, *args)
    with pytest.raises(RuntimeError, match="key must be 4-d"):
        ops.safe_sdpa(q, k[0], k, *args)
    with pytest.raises(RuntimeError, match="key has dtype float64 but query has dtype float32"):
        ops.safe_sdpa(q, k.double(), k, *args)
    with pytest.raises(RuntimeError, match="head dim"):
        ops.safe_sdpa(q, k[..., :4], k, *args)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        ops.safe_sdpa(q, k[:, :2], k[:, :2], *args)
    with pytest.raises(RuntimeError, match="dropout_p"):
        ops.safe_sdpa(q, k, k, 1.5, False, 0.3, 0.0, 0.0, rng())
    with pytest.raises(RuntimeError, match="attn_mask's key length"):
        ops.safe_sdpa.masked(q, k, k, torch.ones(1, 1, 5, 7, dtype=torch.bool), *args)
    with pytest.raises(RuntimeError, match="attn_mask must be 4-d"):
        ops.safe_sdpa.masked(q, k, k, torch.ones(5, 6, dtype=torch.bool), *args)
    with pytest.raises(RuntimeError, match="attn_mask must be bool or float16"):
        ops.safe_sdpa.masked(q, k, k, torch.ones(1, 1, 5, 6, dtype=torch.int32), *args)
    out, lse = ops.safe_sdpa(q, k, k, *args)
    with pytest.raises(RuntimeError, match="lse must be"):
        ops.safe_sdpa_backward(out, q, k, k, out, lse[:, :1], *args)
    with pytest.raises(RuntimeError, match="grad_out must have the shape"):
        ops.safe_sdpa_backward(out[:, :, :2], q, k, k, out, lse, *args)
    m = torch.zeros(1, 1, 5, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask requires grad"):
        ops.safe_sdpa.masked(q, k, k, m, *args)
    bad_rng = {
        "rng must be an int64 tensor": torch.zeros(2, dtype=torch.int32),
        "rng must have exactly 2 elements, got 3": torch.zeros(3, dtype=torch.int64),
        "rng must have exactly 2 elements, got 0": torch.zeros(0, dtype=torch.int64),
        "rng must be contiguous": torch.zeros(4, dtype=torch.int64)[::2],
    }
    for msg, r in bad_rng.items():
        for call in (lambda: ops.safe_sdpa(q, k, k, *args[:-1], r),
                     lambda: ops.safe_sdpa.masked(q, k, k, torch.ones(1, 1, 1, 1, dtype=torch.bool), *args[:-1], r),
                     lambda: ops.safe_sdpa_backward(out, q, k, k, out, lse, *args[:-1], r)):
            with pytest.raises(RuntimeError, match=msg):
                call()
    # any 2-element contiguous int64 layout is read as [seed, offset]
    torch.testing.assert_close(ops.safe_sdpa(q, k, k, *args[:-1], torch.zeros(1, 2, dtype=torch.int64))[0],
                               ops.safe_sdpa(q, k, k, *args)[0])
    torch.testing.assert_close(ops.safe_sdpa(q, k, k, *args)[0], F.scaled_dot_product_attention(q, k, k, scale=0.3))


# ---- property-based fuzzing ----------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    L=st.integers(1, 70),
    S=st.integers(0, 70),
    E=st.integers(1, 40),
    Ev=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    mask=st.sampled_from([None, "bool", "neginf", "lowest", "additive"]),
    causal=st.booleans(),
    transpose=st.booleans(),
    guard=st.sampled_from([None, "clamp", "softcap"]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_shapes_strides_dtypes(B, hkv, group, L, S, E, Ev, dtype, mask, causal, transpose, guard, seed):
    Hq = hkv * group
    q = rand((B, Hq, L, E), dtype, seed, 1.5)
    k = rand((B, hkv, S, E), dtype, seed + 1, 1.5)
    v = rand((B, hkv, S, Ev), dtype, seed + 2)
    if transpose:  # [B, L, H, E] memory viewed as [B, H, L, E]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    m = None if mask is None or S == 0 else make_mask(mask, (B, 1, L, S), dtype, seed + 3, full_rows=seed % 2 == 0)
    kw = {"max_score": 2.0} if guard == "clamp" else {"softcap": 2.5} if guard == "softcap" else {}
    qs, ks, vs = (t.requires_grad_() for t in (q, k, v))
    out = safe_sdpa(qs, ks, vs, attn_mask=m, is_causal=causal, enable_gqa=True, **kw)
    g = rand(out.shape, dtype, seed + 4)
    grads = torch.autograd.grad(out, (qs, ks, vs), g, allow_unused=True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_sdpa(*leaves, mask=m, causal=causal, max_score=kw.get("max_score"), softcap=kw.get("softcap"))
    ref_grads = torch.autograd.grad(ref, leaves, g.double(), allow_unused=True)
    assert_close(out, ref, "out", dtype, m)
    for got, want, t in zip(grads, ref_grads, (q, k, v)):
        got = torch.zeros_like(t) if got is None else got
        want = torch.zeros_like(t, dtype=torch.float64) if want is None else want
        assert_close(got, want, "grad", dtype, m)


# ---- CUDA --------------------------------------------------------------------------------


# Shapes that take the tensor-core kernels on sm_80+ (fp16 / bf16 with
# E == Ev in {64, 128}): several key tiles, ragged last tiles, causal with
# L != S, GQA, every mask convention with fully masked rows, the guards.
TC_CASES = {
    "tc_d64": (2, 2, 2, 100, 130, 64, 64, {}),
    "tc_L1_S1": (1, 1, 1, 1, 1, 64, 64, {}),
    "tc_d128_causal": (1, 2, 2, 129, 200, 128, 128, {"causal": True}),
    "tc_d64_causal_L_gt_S": (1, 2, 2, 150, 70, 64, 64, {"causal": True}),
    "tc_gqa_neginf": (2, 4, 2, 70, 65, 64, 64, {"mask_kind": "neginf"}),
    "tc_d128_bool": (1, 2, 2, 64, 64, 128, 128, {"mask_kind": "bool"}),
    "tc_lowest_ls": (1, 2, 1, 23, 31, 64, 64, {"mask_kind": "lowest", "mask_shape": "ls"}),
    "tc_clamp_softcap": (1, 2, 2, 40, 77, 128, 128, {"max_score": 3.0, "softcap": 2.0, "scale_in": 2.0}),
}


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["plain", "D256", "gqa", "causal_L_gt_S", "bool", "neginf_pad",
                                  "clamp_softcap_mask", "L7_S129_D40", *TC_CASES, *DECODE_CASES])
def test_cuda_matches_cpu_op(case, dtype):
    """Decode shapes take the CUDA decode kernel, with the split-KV workspace
    the op allocates where the keys are long."""
    B, Hq, Hkv, L, S, E, Ev, kw = {**CASES, **TC_CASES, **DECODE_CASES}[case]
    kw = dict(kw)
    kw.pop("full_rows", None)  # make_mask below always makes some
    q = rand((B, Hq, L, E), dtype, 1, kw.pop("scale_in", 1.0))
    k = rand((B, Hkv, S, E), dtype, 2)
    v = rand((B, Hkv, S, Ev), dtype, 3)
    mask = None
    if "mask_kind" in kw:
        shape = {"full": (B, Hq, L, S), "pad": (B, 1, 1, S), "ls": (L, S)}[kw.pop("mask_shape", "full")]
        mask = make_mask(kw.pop("mask_kind"), shape, dtype, 4, full_rows=True)
    kw["is_causal"] = kw.pop("causal", False)

    def run(device):
        ts = [t.to(device).requires_grad_() for t in (q, k, v)]
        m = None if mask is None else mask.to(device)
        out = safe_sdpa(*ts, attn_mask=m, enable_gqa=Hq != Hkv, **kw)
        grads = torch.autograd.grad(out, ts, rand(out.shape, dtype, 5).to(device))
        return [out, *grads]

    for got, want in zip(run("cuda"), run("cpu")):
        assert_close(got.float(), want.float(), "grad", dtype)


@requires_cuda
def test_cuda_dropout_draws_the_cpu_mask():
    _, _, cpu = dropped_probs(1, 2, 40, 50, 0.3, 5, 9, torch.float32)
    _, _, gpu = dropped_probs(1, 2, 40, 50, 0.3, 5, 9, torch.float32, "cuda")
    assert torch.equal(cpu != 0, gpu.cpu() != 0)


@requires_cuda
def test_cuda_rng_must_stay_on_the_cpu():
    q = torch.randn(1, 1, 4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="rng must be a CPU tensor"):
        ops.safe_sdpa(q, q, q, 0.1, False, 0.3, 0.0, 0.0, rng().cuda())


@requires_cuda
def test_cuda_dropout_under_torch_compile():
    torch._dynamo.reset()
    q, k, v = (rand((2, 2, 32, 16), torch.float32, s).cuda().requires_grad_() for s in (1, 2, 3))
    f = torch.compile(lambda q, k, v: safe_sdpa(q, k, v, dropout_p=0.25), fullgraph=True, backend="aot_eager")
    out = f(q, k, v)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))


@requires_cuda
def test_cuda_fp16_overflow_and_masked_rows():
    g = torch.Generator().manual_seed(0)
    q = (150 + 50 * torch.rand(1, 2, 8, 64, generator=g)).half().cuda()
    k = (150 + 50 * torch.rand(1, 2, 16, 64, generator=g)).half().cuda()
    v = torch.randn(1, 2, 16, 64, generator=g).half().cuda()
    mask = torch.zeros(1, 1, 8, 16, dtype=torch.float16, device="cuda")
    mask[..., 2, :] = float("-inf")
    out = safe_sdpa(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and (out[..., 2, :] == 0).all()
    assert_close(out.cpu(), ref_sdpa(q.cpu(), k.cpu(), v.cpu(), mask=mask.cpu()), "out", torch.float16)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_tensor_core_path_with_unaligned_rows_and_dropout(dtype):
    """Rows that do not start on 16 bytes (element loads instead of 128-bit
    ones) and dropout (the same Philox mask as the CPU's for the same seed)."""
    B, H, L, S, D = 2, 2, 90, 75, 64
    q = rand((B, H, L, D + 5), dtype, 1)[..., 3 : 3 + D]
    k = rand((B, H, S, D + 5), dtype, 2)[..., 1 : 1 + D]
    v = rand((B, H, S, D), dtype, 3)
    gy = rand((B, H, L, D), dtype, 4)

    def run(device, p):
        ts = [t.to(device).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        out = safe_sdpa(*ts, dropout_p=p, is_causal=True)
        return [out, *torch.autograd.grad(out, ts, gy.to(device))]

    for p in (0.0, 0.2):
        for got, want in zip(run("cuda", p), run("cpu", p)):
            assert_close(got.float().cpu(), want.float(), "grad", dtype)


@requires_cuda
def test_cuda_fp16_backward_survives_a_score_gradient_above_fp16_max():
    """dS = P (dP - D) scale exceeds 65504 here while dq and dk fit in fp16:
    the tensor-core backward must not round dS to inf."""
    g = torch.Generator().manual_seed(0)
    q = (0.01 * torch.randn(1, 1, 32, 64, generator=g)).half()  # small q, k: p near uniform over 3 keys
    k = (0.01 * torch.randn(1, 1, 3, 64, generator=g)).half()
    v = (2000 * torch.randn(1, 1, 3, 64, generator=g)).half()  # large v, dout: |dS| up to ~3e5
    gy = (200 * torch.randn(1, 1, 32, 64, generator=g)).half()

    def run(device):
        ts = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = safe_sdpa(*ts)
        return [out, *torch.autograd.grad(out, ts, gy.to(device))]

    cpu = run("cpu")
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.transpose(-1, -2)) / 8.0
    p = torch.softmax(s, -1)
    dp = gy.double() @ vd.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / 8.0
    assert ds.abs().max() > 65504  # the case this test exists for
    for got, want in zip(run("cuda"), cpu):
        assert torch.isfinite(want).all()
        assert torch.isfinite(got).all()
        assert_close(got.float().cpu(), want.float(), "grad", torch.float16)


# ---- drop-in: what PyTorch's scaled_dot_product_attention accepts --------------------


def test_scale_as_a_0d_tensor_is_accepted_as_pytorch_does():
    # some model code passes scale as a 0-d tensor; PyTorch's sdpa takes it
    q, k, v = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = safe_sdpa(q, k, v, scale=0.3)
    for scale in (torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64)):
        assert torch.equal(safe_sdpa(q, k, v, scale=scale), want)
    assert torch.equal(safe_sdpa(q, k, v, scale=torch.tensor(2)), safe_sdpa(q, k, v, scale=2.0))
    with pytest.raises(ValueError, match="scale"):
        safe_sdpa(q, k, v, scale=torch.tensor([0.3]))  # PyTorch refuses it too
    with pytest.raises(ValueError, match="scale"):
        safe_sdpa(q, k, v, scale=torch.tensor(float("nan")))


def test_dropout_p_one_gives_zeros_and_zero_gradients_as_pytorch():
    # PyTorch (train mode): every weight dropped, output 0, gradients 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g).requires_grad_() for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    got = safe_sdpa(q, k, v, dropout_p=1.0)
    assert torch.equal(got, want) and torch.equal(got, torch.zeros(2, 3, 5, 8))
    gy = torch.randn(2, 3, 5, 8, generator=g)
    for t in torch.autograd.grad(got, (q, k, v), gy):
        assert torch.equal(t, torch.zeros_like(t))
    # with a mask and causal too
    mask = torch.rand(5, 5, generator=g) > 0.3
    assert torch.equal(safe_sdpa(q, k, v, mask, dropout_p=1.0, is_causal=True), torch.zeros(2, 3, 5, 8))
    # a NaN that comes in still goes out (PyTorch's does the same): only its rows
    qn = q.detach().clone()
    qn[0, 0, 1, 2] = float("nan")
    out = safe_sdpa(qn, k, v, dropout_p=1.0)
    assert torch.isnan(out[0, 0, 1]).all()
    out[0, 0, 1] = 0.0
    assert torch.equal(out, torch.zeros(2, 3, 5, 8))


def test_deliberate_refusals_say_so():
    big = torch.randn(1, 1, 2, 300)
    with pytest.raises(ValueError, match=r"head dims must be in \[1, 256\].*nanguard's attention kernels stop at 256"):
        safe_sdpa(big, big, big)


class _CountingGuard:
    """Stands in for torch._C._AutoDispatchBelowAutograd, counting entries."""

    def __init__(self, real):
        self.real, self.entered = real, 0

    def __call__(self):
        self.entered += 1
        return self.real()


def test_calls_without_gradients_skip_the_autograd_layer(monkeypatch):
    """Where no gradient can be recorded (no_grad, or no input requiring
    grad) safe_sdpa and the norms call their op below the autograd layer
    (_checks.call_op), with the same bits as a recorded call and outputs
    that record nothing; a call that records (an input, or only a module's
    weight, requires grad) runs the op's formula as its eager
    torch.autograd.Function (whose forward enters the guard once) and
    backpropagates."""
    from nanguard import _checks
    from nanguard.nn import StableLayerNorm

    guard = _CountingGuard(_checks._BELOW_AUTOGRAD)
    monkeypatch.setattr(_checks, "_BELOW_AUTOGRAD", guard)
    q = rand((2, 4, 3, 16), torch.float32, 1).requires_grad_()
    k, v = (rand((2, 2, 40, 16), torch.float32, s).requires_grad_() for s in (2, 3))
    mask = torch.rand(2, 1, 3, 40, generator=torch.Generator().manual_seed(4)) > 0.3
    for m in (None, mask):
        recorded = safe_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
        assert type(recorded.grad_fn).__name__.startswith("SafeSdpa") and guard.entered == 1
        with torch.no_grad():
            y0 = safe_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
        y1 = safe_sdpa(q.detach(), k.detach(), v.detach(), attn_mask=m, enable_gqa=True)
        assert guard.entered == 3
        guard.entered = 0
        for y in (y0, y1):
            assert y.grad_fn is None and not y.requires_grad
            assert torch.equal(y, recorded.detach())
        recorded.sum().backward()
        assert all(t.grad is not None for t in (q, k, v))
        guard.entered = 0  # (the backward op ran below autograd too)

    ln = StableLayerNorm(16)
    x = rand((3, 16), torch.float32, 5)
    z = ln(x)  # eval-style call with grad mode on: the weight requires grad
    assert type(z.grad_fn).__name__.startswith("StableLayernorm") and guard.entered == 1
    z.sum().backward()
    assert ln.weight.grad is not None
    guard.entered = 0
    with torch.no_grad():
        z0 = ln(x)
    assert guard.entered == 1 and z0.grad_fn is None and torch.equal(z0, z.detach())


@pytest.mark.parametrize("masked", [False, True])
def test_eager_function_matches_the_dispatcher_autograd_kernel(masked):
    """A recorded eager call runs the op's formula as a torch.autograd.Function
    (_checks.register_autograd); called through the dispatcher instead
    (torch.ops, torch.library's autograd kernel) the same formula must give
    the same output and gradient bits, dropout included."""
    from nanguard import _checks

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    rng = torch.tensor([11, 3], dtype=torch.int64)
    m = torch.rand(2, 1, 9, 9, generator=g) > 0.4
    op = torch.ops.nanguard.safe_sdpa.masked if masked else torch.ops.nanguard.safe_sdpa.default
    args = (m,) if masked else ()
    grads = []
    for path in ("function", "dispatcher"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        call = (lambda *a: _checks.call_op(op, *a)) if path == "function" else op
        out, lse = call(*leaves, *args, 0.25, True, 0.25, 0.0, 3.0, rng)
        assert type(out.grad_fn).__name__.startswith("SafeSdpa") == (path == "function")
        assert not lse.requires_grad
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
        grads.append((out.detach(), lse, *torch.autograd.grad(out, leaves, go)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
