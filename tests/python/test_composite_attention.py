"""The composite safe_sdpa (nanguard.composite.attention), called directly on
the CPU: forward and backward of the four overloads against the fp64
reference of test_attention.py and against the C kernels on the same
inputs, with the shared tolerance table; fully masked rows, NaN propagation,
the dropout mask bit for bit, the query-row chunking, strides, empty shapes
and the argument checks (the same messages as ops/attention.c)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import pathlib
import re

import pytest
import torch

import conftest
from conftest import requires_kernels
from test_attention import assert_close, make_mask, rand, ref_sdpa, rng

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
ops = torch.ops.nanguard
SOURCE = pathlib.Path(__file__).resolve().parents[2] / "python" / "nanguard" / "composite" / "attention.py"


def _load_composite():
    try:
        from nanguard.composite import attention
    except ImportError:  # the package's __init__ is not there yet: the file alone
        spec = importlib.util.spec_from_file_location("nanguard_composite_attention", SOURCE)
        attention = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(attention)
    return attention


comp = _load_composite()
K = comp.KERNELS

#: the C kernels, when the library is loaded (else the ops are the composite itself)
KERNELS_LOADED = not conftest.COMPOSITE_ONLY


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(impl, q, k, v, mask, args):
    """(out, lse) of the composite ("comp") or the C op ("c")."""
    if impl == "comp":
        return K["safe_sdpa"](q, k, v, *args) if mask is None else K["safe_sdpa.masked"](q, k, v, mask, *args)
    return ops.safe_sdpa(q, k, v, *args) if mask is None else ops.safe_sdpa.masked(q, k, v, mask, *args)


def backward(impl, g, q, k, v, mask, out, lse, args):
    if impl == "comp":
        if mask is None:
            return K["safe_sdpa_backward"](g, q, k, v, out, lse, *args)
        return K["safe_sdpa_backward.masked"](g, q, k, v, mask, out, lse, *args)
    if mask is None:
        return ops.safe_sdpa_backward(g, q, k, v, out, lse, *args)
    return ops.safe_sdpa_backward.masked(g, q, k, v, mask, out, lse, *args)


def make_case(dtype, B, Hq, Hkv, L, S, E, Ev, mask_kind=None, mask_shape="full", mask_dtype=None,
              causal=False, max_score=None, softcap=None, full_rows=False, seed=0, scale_in=1.0,
              dropout_p=0.0, rng_vals=(0, 0)):
    q = rand((B, Hq, L, E), dtype, seed, scale_in)
    k = rand((B, Hkv, S, E), dtype, seed + 1, scale_in)
    v = rand((B, Hkv, S, Ev), dtype, seed + 2)
    mask = None
    if mask_kind is not None:
        mshape = {"full": (B, Hq, L, S), "pad": (B, 1, 1, S), "ls": (1, 1, L, S)}[mask_shape]
        mask = make_mask(mask_kind, mshape, mask_dtype or dtype, seed + 3, full_rows)
    args = (dropout_p, causal, 1.0 / math.sqrt(E), max_score or 0.0, softcap or 0.0, rng(*rng_vals))
    g = rand((B, Hq, L, Ev), dtype, seed + 4)
    return q, k, v, mask, args, g


def check_against_c(dtype, q, k, v, mask, args, g):
    """Composite forward and backward equal the C op's within the table's
    tolerance, lse included (-inf and NaN at the same places). Returns the
    composite's (out, lse, dq, dk, dv)."""
    out, lse = forward("comp", q, k, v, mask, args)
    grads = backward("comp", g, q, k, v, mask, out, lse, args)
    if KERNELS_LOADED:
        c_out, c_lse = forward("c", q, k, v, mask, args)
        c_grads = backward("c", g, q, k, v, mask, c_out, c_lse, args)
        assert_close(out, c_out, "out", dtype, mask)
        finite = c_lse[c_lse.isfinite()]
        conftest.assert_close(lse, c_lse, "attention", acc_dtype(dtype),
                              1.0 + (finite.abs().max().item() if finite.numel() else 0.0))
        for got, want in zip(grads, c_grads):
            assert_close(got, want, "grad", dtype, mask)
    return (out, lse, *grads)


def check_layout(q, k, v, out, lse, grads):
    B, Hq, L, _ = q.shape
    acc = acc_dtype(q.dtype)
    assert out.shape == (B, Hq, L, v.shape[-1]) and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (B, Hq, L) and lse.dtype == acc and lse.is_contiguous()
    for got, x in zip(grads, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()


# ---- forward and gradients vs fp64 and vs the C kernels ------------------------------

CASES = {
    # name: (B, Hq, Hkv, L, S, E, Ev, kwargs)
    "plain": (2, 2, 2, 33, 47, 16, 16, {}),
    "L1": (1, 3, 3, 1, 5, 8, 8, {}),
    "Ev_ne_E": (1, 2, 2, 20, 30, 24, 40, {}),
    "gqa": (2, 4, 2, 21, 25, 16, 16, {}),
    "gqa_mqa_causal": (1, 6, 1, 12, 12, 8, 8, {"causal": True}),
    "causal_L_lt_S": (1, 2, 1, 7, 30, 16, 16, {"causal": True}),
    "causal_L_gt_S": (1, 1, 1, 30, 7, 16, 16, {"causal": True}),
    "bool": (2, 2, 2, 20, 30, 16, 16, {"mask_kind": "bool"}),
    "additive": (2, 2, 2, 23, 31, 16, 16, {"mask_kind": "additive"}),
    "neginf_pad": (2, 2, 2, 9, 37, 16, 16, {"mask_kind": "neginf", "mask_shape": "pad"}),
    "lowest_ls": (1, 2, 1, 23, 31, 16, 16, {"mask_kind": "lowest", "mask_shape": "ls"}),
    "bool_causal": (1, 2, 2, 30, 30, 16, 16, {"mask_kind": "bool", "mask_shape": "ls", "causal": True}),
    "fp64_mask": (1, 2, 2, 17, 19, 8, 8, {"mask_kind": "lowest", "mask_dtype": torch.float64}),
    "bf16_mask": (1, 2, 2, 17, 19, 8, 8, {"mask_kind": "neginf", "mask_dtype": torch.bfloat16}),
    "fp16_lowest_mask": (1, 2, 2, 17, 19, 8, 8, {"mask_kind": "lowest", "mask_dtype": torch.float16}),
    "clamp": (1, 2, 2, 20, 33, 16, 16, {"max_score": 2.5, "scale_in": 2.0}),
    "softcap": (1, 2, 2, 20, 33, 16, 16, {"softcap": 3.0, "scale_in": 2.0}),
    "clamp_softcap_mask": (1, 2, 1, 20, 33, 16, 16,
                           {"max_score": 3.0, "softcap": 2.0, "mask_kind": "neginf", "scale_in": 2.0}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_reference_and_kernel(case, dtype):
    B, Hq, Hkv, L, S, E, Ev, kw = CASES[case]
    q, k, v, mask, args, g = make_case(dtype, B, Hq, Hkv, L, S, E, Ev, **kw)
    out, lse, *grads = check_against_c(dtype, q, k, v, mask, args, g)
    check_layout(q, k, v, out, lse, grads)

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = ref_sdpa(*leaves, mask=mask, causal=kw.get("causal", False), max_score=kw.get("max_score"),
                   softcap=kw.get("softcap"))
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    assert_close(out, ref, "out", dtype, mask)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert torch.isfinite(got).all(), f"d{name} not finite"
        assert_close(got, want, "grad", dtype, mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "neginf", "lowest"])
def test_fully_masked_rows_give_zeros_lse_minus_inf_and_zero_grads(kind, dtype):
    q, k, v, mask, args, g = make_case(dtype, 2, 2, 1, 12, 20, 16, 16, mask_kind=kind, full_rows=True, seed=7)
    # and batch 1 / head 0 entirely masked: its kv head gets no gradient from it
    mask[1, 0] = False if kind == "bool" else float("-inf")
    out, lse, dq, dk, dv = check_against_c(dtype, q, k, v, mask, args, g)
    assert (out[..., ::3, :] == 0).all() and (out[1, 0] == 0).all()
    assert (lse[..., ::3] == float("-inf")).all() and (lse[1, 0] == float("-inf")).all()
    assert (dq[..., ::3, :] == 0).all() and (dq[1, 0] == 0).all()
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert torch.isfinite(lse[0, :, 1::3]).all() and torch.isfinite(lse[1, 1, 1::3]).all()


def test_no_key_and_empty_shapes():
    for B, L, S in ((2, 5, 0), (0, 5, 6), (2, 0, 6)):
        q, k, v = torch.randn(B, 2, L, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 4)
        args = (0.0, False, 0.3, 0.0, 0.0, rng())
        out, lse = forward("comp", q, k, v, None, args)
        grads = backward("comp", torch.randn(B, 2, L, 4), q, k, v, None, out, lse, args)
        check_layout(q, k, v, out, lse, grads)
        assert (out == 0).all() and (lse == float("-inf")).all()
        assert all((t == 0).all() for t in grads)
        if KERNELS_LOADED:
            c_out, c_lse = forward("c", q, k, v, None, args)
            assert torch.equal(out, c_out) and torch.equal(lse, c_lse)


# ---- the failures the op exists for ---------------------------------------------------


def test_fp16_score_overflow_stays_finite():
    g = torch.Generator().manual_seed(0)
    q = (150 + 50 * torch.rand(1, 2, 8, 64, generator=g)).half()
    k = (150 + 50 * torch.rand(1, 2, 16, 64, generator=g)).half()
    v = torch.randn(1, 2, 16, 64, generator=g).half()
    assert torch.isinf(q[0, 0, 0] @ k[0, 0, 0]).item()  # q.k > 65504 in fp16
    gy = torch.randn(1, 2, 8, 64, generator=g).half()
    args = (0.0, False, 0.125, 0.0, 0.0, rng())
    out, lse = forward("comp", q, k, v, None, args)
    assert_close(out, ref_sdpa(q, k, v), "out", torch.float16)
    if KERNELS_LOADED:
        assert_close(out, forward("c", q, k, v, None, args)[0], "out", torch.float16)
    # (the gradients are finite but not compared: with |s| ~ 2.5e5 the fp32
    # lse has an ulp of 0.016, so the backward's P = exp(s - lse) is only
    # good to ~2 %, in the C kernels as here)
    grads = backward("comp", gy, q, k, v, None, out, lse, args)
    assert all(torch.isfinite(t).all() for t in (out, lse, *grads))


def test_fp16_backward_keeps_a_score_gradient_above_fp16_max():
    """dS exceeds 65504 while dq and dk fit in fp16: dS stays fp32."""
    g = torch.Generator().manual_seed(0)
    q = (0.01 * torch.randn(1, 1, 32, 64, generator=g)).half()
    k = (0.01 * torch.randn(1, 1, 3, 64, generator=g)).half()
    v = (2000 * torch.randn(1, 1, 3, 64, generator=g)).half()
    gy = (200 * torch.randn(1, 1, 32, 64, generator=g)).half()
    out, lse, *grads = check_against_c(torch.float16, q, k, v, None, (0.0, False, 0.125, 0.0, 0.0, rng()), gy)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(ref_sdpa(*leaves), leaves, gy.double())
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        assert_close(got, want, "grad", torch.float16)


# ---- NaN is never hidden --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["q", "k", "v", "mask", "grad_out", "causal_k"])
def test_nan_propagates_as_in_the_kernel(where, dtype):
    """A NaN that reaches a row makes it NaN (out, lse, dq), and only where
    it reaches: the same places as the C op's NaN."""
    q, k, v, mask, args, g = make_case(dtype, 1, 2, 1, 6, 9, 8, 8, mask_kind="additive", max_score=5.0)
    if where == "causal_k":  # key 4: hidden from query rows 0-3 by is_causal
        args = (0.0, True, *args[2:])
        k[0, 0, 4, 3] = float("nan")
    else:
        {"q": q, "k": k, "v": v, "mask": mask, "grad_out": g}[where][0, 0, 2, 3] = float("nan")
    out, lse = forward("comp", q, k, v, mask, args)
    dq, dk, dv = backward("comp", g, q, k, v, mask, out, lse, args)
    if where in ("q", "mask"):
        assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(lse[0, 0, 2])
        assert torch.isfinite(out[0, 0, [0, 1, 3, 4, 5]]).all() and torch.isfinite(out[0, 1]).all()
        assert torch.isnan(dq[0, 0, 2]).all() and torch.isfinite(dq[0, 0, [0, 1, 3, 4, 5]]).all()
    elif where == "k":
        assert torch.isnan(out).all() and torch.isnan(lse).all()
    elif where == "causal_k":
        assert torch.isfinite(out[..., :4, :]).all() and torch.isfinite(lse[..., :4]).all()
        assert torch.isnan(out[..., 4:, :]).all() and torch.isnan(lse[..., 4:]).all()
        # dq = dS K meets key 4's NaN through 0 * NaN in column 3 only
        assert torch.isfinite(dq[..., :4, [0, 1, 2, 4, 5, 6, 7]]).all()
    elif where == "v":
        assert torch.isnan(out[..., 3]).all() and torch.isfinite(out[..., [0, 1, 2, 4, 5, 6, 7]]).all()
    else:
        assert torch.isfinite(out).all() and torch.isnan(dq[0, 0, 2]).all() and torch.isfinite(dq[0, 1]).all()
        assert torch.isnan(dk[0, 0]).any() and torch.isnan(dv[0, 0, :, 3]).all()
    if KERNELS_LOADED:  # NaN at the same places as the C op's
        c_out, c_lse = forward("c", q, k, v, mask, args)
        c_grads = backward("c", g, q, k, v, mask, c_out, c_lse, args)
        for got, want in zip((out, lse, dq, dk, dv), (c_out, c_lse, *c_grads)):
            assert torch.equal(got.isnan(), want.isnan())
            close_where_finite(got, want, "attention" if got is out or got is lse else "attention_grad", dtype)


def close_where_finite(got, want, op, dtype):
    ok = want.isfinite()
    scale = 1.0 + (want[ok].abs().max().item() if ok.any() else 0.0)
    conftest.assert_close(got[ok], want[ok], op, dtype if got.dtype == dtype else acc_dtype(dtype), scale)


def test_keys_no_query_sees_are_left_out():
    """A padded tail (keys hidden from every query of the kv group) and, under
    is_causal, the keys past the last query: a NaN in their key or value rows,
    or one in grad_out or query, reaches neither out nor their gradients,
    which are exactly 0."""
    B, Hq, Hkv, L, S = 2, 4, 2, 5, 12
    q, k, v = rand((B, Hq, L, 8), torch.float32, 1), rand((B, Hkv, S, 8), torch.float32, 2), rand(
        (B, Hkv, S, 8), torch.float32, 3)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., 7:] = False
    k[0, 0, 8, 1] = v[0, 1, 9, 2] = float("nan")
    g = rand((B, Hq, L, 8), torch.float32, 4)
    args = (0.1, False, 0.35, 0.0, 0.0, rng(5, 6))
    out, lse = forward("comp", q, k, v, mask, args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    q2, g2 = q.clone(), g.clone()
    q2[0, 1, 2, 0] = g2[0, 3, 1, 4] = float("nan")
    out2, lse2 = forward("comp", q2, k, v, mask, args)
    for qq, gg, o, ls in ((q, g, out, lse), (q2, g, out2, lse2), (q, g2, out, lse)):
        dq, dk, dv = backward("comp", gg, qq, k, v, mask, o, ls, args)
        assert (dk[0, :, 7:] == 0).all() and (dv[0, :, 7:] == 0).all()
    assert torch.isfinite(dq[1]).all() and torch.isfinite(dk[1]).all() and torch.isfinite(dv[1]).all()
    # causal, L < S: keys L.. are seen by no query
    kc, vc = rand((B, Hkv, S, 8), torch.float32, 2), rand((B, Hkv, S, 8), torch.float32, 3)
    kc[:, :, L + 1, 0] = vc[:, :, L + 2, 0] = float("nan")
    args = (0.0, True, 0.35, 0.0, 0.0, rng())
    out, lse = forward("comp", q, kc, vc, None, args)
    dq, dk, dv = backward("comp", g, q, kc, vc, None, out, lse, args)
    assert all(torch.isfinite(t).all() for t in (out, lse, dq, dk, dv))
    assert (dk[:, :, L:] == 0).all() and (dv[:, :, L:] == 0).all()


# ---- dropout --------------------------------------------------------------------------


def test_philox_known_answers():
    """Random123's known-answer vectors of Philox4x32-10."""
    kat = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for ctr, key, want in kat:
        got = comp._philox4x32_10(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key)
        assert [w.item() for w in got] == want


RNGS = [(0, 0), (11, 5), (2**40 + 3, 2**33 + 7), (-5, -1)]


@requires_kernels
@pytest.mark.parametrize("rng_vals", RNGS, ids=str)
@pytest.mark.parametrize("chunk", [False, True], ids=["whole", "row_chunks"])
def test_dropout_mask_is_the_kernels_bit_for_bit(rng_vals, chunk, monkeypatch):
    """value = identity reads P * keep / (1 - p) back: the composite keeps
    exactly the elements the C op keeps (S = 13: blocks straddle rows and
    heads), also when the rows are processed a few at a time."""
    if chunk:
        monkeypatch.setattr(comp, "_BLOCK_ELEMS", 2 * 3 * 13 * 4)  # 4 query rows a chunk
    B, H, L, S, p = 2, 3, 9, 13, 0.3
    q, k = rand((B, H, L, 8), torch.float64, 1), rand((B, H, S, 8), torch.float64, 2)
    eye = torch.eye(S, dtype=torch.float64).expand(B, H, S, S)
    args = (p, False, 1 / math.sqrt(8), 0.0, 0.0, rng(*rng_vals))
    out, _ = forward("comp", q, k, eye, None, args)
    c_out, _ = forward("c", q, k, eye, None, args)
    assert torch.equal(out != 0, c_out != 0)
    torch.testing.assert_close(out, c_out, rtol=1e-12, atol=1e-14)
    assert 0.55 < (out != 0).double().mean().item() < 0.85


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask_causal_gqa"])
def test_dropout_matches_kernel_and_reference(masked, dtype):
    """With dropout_p = 0.3 the composite's output and gradients equal the C
    op's (only possible with the same keep mask), and the fp64 reference
    built from that mask."""
    kw = {"mask_kind": "bool", "causal": True} if masked else {}
    q, k, v, mask, args, g = make_case(dtype, 2, 4, 2 if masked else 4, 11, 14, 8, 8, dropout_p=0.3,
                                       rng_vals=(2**35 + 17, 3), **kw)
    out, lse, *grads = check_against_c(dtype, q, k, v, mask, args, g)
    check_layout(q, k, v, out, lse, grads)
    # the keep mask, read back through value = identity with the same rng
    eye = torch.eye(14, dtype=torch.float64).expand(2, 4, 14, 14)
    kq = [t.double() for t in (q, k)]
    if masked:
        kq[1] = kq[1].repeat_interleave(2, dim=1)
    probe, _ = forward("comp", *kq, eye, mask, args)
    keep = probe != 0
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = ref_sdpa(*leaves, mask=mask, causal=masked, keep=keep, dropout_p=0.3)
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    assert_close(out, ref, "out", dtype, mask)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, "grad", dtype, mask)


# ---- chunks, strides, broadcasting ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_row_chunks_match_the_kernel(dtype, monkeypatch):
    """One query row a chunk (the score block bound below one row) gives the
    C op's results: causal offsets, mask rows and dropout counters follow
    the chunk."""
    monkeypatch.setattr(comp, "_BLOCK_ELEMS", 1)
    q, k, v, mask, args, g = make_case(dtype, 2, 4, 2, 10, 12, 8, 8, mask_kind="lowest", causal=True,
                                       max_score=2.0, softcap=3.0, dropout_p=0.25, rng_vals=(9, 4), scale_in=2.0)
    check_against_c(dtype, q, k, v, mask, args, g)
    q, k, v, mask, args, g = make_case(dtype, 1, 2, 1, 10, 12, 8, 8, mask_kind="neginf", mask_shape="ls")
    check_against_c(dtype, q, k, v, mask, args, g)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(dtype):
    """[B, L, H, E] memory seen as [B, H, L, E], a value with a transposed
    last dim, an expanded (stride 0) mask, a non-contiguous grad_out and out:
    the results of the contiguous inputs, and contiguous outputs."""
    B, H, L, S = 2, 3, 10, 12
    q = rand((B, L, H, 16), dtype, 1).transpose(1, 2)
    k = rand((B, S, H, 16), dtype, 2).transpose(1, 2)
    v = rand((B, H, 8, S), dtype, 3).transpose(-1, -2)
    mask = torch.rand(1, 1, 1, S, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True
    mask = mask.expand(B, H, L, S)
    g = rand((B, L, H, 8), dtype, 5).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or g.is_contiguous())
    args = (0.2, True, 0.25, 0.0, 0.0, rng(3, 1))
    out, lse = forward("comp", q, k, v, mask, args)
    grads = backward("comp", g, q, k, v, mask, out.transpose(1, 2).contiguous().transpose(1, 2), lse, args)
    check_layout(q, k, v, out, lse, grads)
    cont = [t.contiguous() for t in (q, k, v)]
    out_c, lse_c = forward("comp", *cont, mask.contiguous(), args)
    grads_c = backward("comp", g.contiguous(), *cont, mask.contiguous(), out_c, lse_c, args)
    for got, want in zip((out, lse), (out_c, lse_c)):
        assert_close(got, want, "out", dtype)
    for got, want in zip(grads, grads_c):
        assert_close(got, want, "grad", dtype)
    check_against_c(dtype, q, k, v, mask, args, g)


# ---- the module and its arguments -----------------------------------------------------


def test_kernels_take_the_schema_arguments_in_order():
    assert set(K) == {"safe_sdpa", "safe_sdpa.masked", "safe_sdpa_backward", "safe_sdpa_backward.masked"}
    for name, fn in K.items():
        packet, _, overload = name.partition(".")
        schema = getattr(getattr(ops, packet), overload or "default")._schema
        assert list(inspect.signature(fn).parameters) == [a.name for a in schema.arguments], name


def test_module_imports_only_torch_and_the_standard_library():
    """The module reaches only torch and the standard library: itself, and
    the one sibling it imports (composite/_checks.py, the shared checks)."""
    checks = SOURCE.with_name("_checks.py")
    for path in (SOURCE, checks):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert path == SOURCE and node.level == 1 and node.module == "_checks", node.module
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"torch", "math", "typing", "__future__"}, (path.name, roots)
        assert "torch.ops" not in path.read_text() and "_lib" not in path.read_text()


def _bad_calls():
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8)
    args = (0.0, False, 0.3, 0.0, 0.0, rng())
    m1 = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    out, lse = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5)

    def with_param(i, x):
        return (*args[:i], x, *args[i + 1:])

    fwd = [
        ("query must be float16, bfloat16, float32 or float64 (got int64)", (q.long(), k, k, *args)),
        ("key must be 4-d", (q, k[0], k, *args)),
        ("key has dtype float64 but query has dtype float32; they must match", (q, k.double(), k, *args)),
        ("key's head dim (4) must equal query's (8)", (q, k[..., :4], k, *args)),
        ("key and value must have the batch size of query", (q, k, k[:1], *args)),
        ("value must have key's heads and sequence length", (q, k, k[:, :, :5], *args)),
        ("multiple of key/value heads", (q, k[:, :2], k[:, :2], *args)),
        ("dropout_p must be in [0, 1), got 1", (q, k, k, *with_param(0, 1.0))),
        ("dropout_p must be in [0, 1), got -0.1", (q, k, k, *with_param(0, -0.1))),
        ("dropout_p must be in", (q, k, k, *with_param(0, math.nan))),
        ("scale must be finite", (q, k, k, *with_param(2, math.inf))),
        ("max_score must not be NaN", (q, k, k, *with_param(3, math.nan))),
        ("softcap must be finite", (q, k, k, *with_param(4, math.inf))),
        ("softcap must be finite", (q, k, k, *with_param(4, math.nan))),
        ("rng must be an int64 tensor, got ", (q, k, k, *with_param(5, torch.zeros(2, dtype=torch.int32)))),
        ("rng must have exactly 2 elements, got 3", (q, k, k, *with_param(5, torch.zeros(3, dtype=torch.int64)))),
        ("rng must be contiguous", (q, k, k, *with_param(5, torch.zeros(4, dtype=torch.int64)[::2]))),
    ]
    masked = [
        ("attn_mask's key length dim is 7; it must be 6 or 1",
         (q, k, k, torch.ones(1, 1, 5, 7, dtype=torch.bool), *args)),
        ("attn_mask's heads dim is 2; it must be 3 or 1", (q, k, k, torch.ones(1, 2, 5, 6), *args)),
        ("attn_mask must be 4-d", (q, k, k, torch.ones(5, 6, dtype=torch.bool), *args)),
        ("attn_mask must be bool or float16, bfloat16, float32 or float64 (got ",
         (q, k, k, torch.ones(1, 1, 5, 6, dtype=torch.int32), *args)),
    ]
    bwd = [
        ("lse must be the forward's float32 logsumexp", (out, q, k, k, out, lse[:, :1], *args)),
        ("lse must be the forward's float32 logsumexp", (out, q, k, k, out, lse.double(), *args)),
        ("grad_out must have the shape of out", (out[:, :, :2], q, k, k, out, lse, *args)),
        ("out must have shape [B, Hq, L, Ev]", (out, q, k, k, out[..., :4], lse, *args)),
        ("grad_out has dtype float64 but query has dtype float32", (out.double(), q, k, k, out, lse, *args)),
        ("dropout_p must be in", (out, q, k, k, out, lse, *with_param(0, 1.5))),
        ("rng must have exactly 2 elements, got 0",
         (out, q, k, k, out, lse, *with_param(5, torch.zeros(0, dtype=torch.int64)))),
    ]
    bwd_masked = [("attn_mask must be 4-d", (out, q, k, k, m1[0], out, lse, *args))]
    return ([("safe_sdpa", *c) for c in fwd] + [("safe_sdpa.masked", *c) for c in masked]
            + [("safe_sdpa_backward", *c) for c in bwd] + [("safe_sdpa_backward.masked", *c) for c in bwd_masked])


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_arguments_raise_the_kernels_messages(i):
    name, msg, call_args = _bad_calls()[i]
    op = "nanguard::safe_sdpa_backward" if "backward" in name else "nanguard::safe_sdpa"
    pattern = re.escape(f"{op}: ") + ".*" + re.escape(msg)
    with pytest.raises(RuntimeError, match=pattern):
        K[name](*call_args)
    if KERNELS_LOADED:
        packet, _, overload = name.partition(".")
        with pytest.raises(RuntimeError, match=re.escape(msg)):
            getattr(getattr(ops, packet), overload or "default")(*call_args)


def test_devices_must_match():
    q = torch.randn(1, 1, 4, 8)
    meta = torch.empty(1, 1, 4, 8, device="meta")
    args = (0.0, False, 0.3, 0.0, 0.0, rng())
    with pytest.raises(RuntimeError, match="key is on meta but query is on cpu"):
        K["safe_sdpa"](q, meta, q, *args)
    with pytest.raises(RuntimeError, match="attn_mask is on meta but query is on cpu"):
        K["safe_sdpa.masked"](q, q, q, meta, *args)
    with pytest.raises(RuntimeError, match="rng must be a CPU tensor"):
        K["safe_sdpa"](q, q, q, *args[:-1], torch.zeros(2, dtype=torch.int64, device="meta"))
