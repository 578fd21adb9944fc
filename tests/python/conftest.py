"""Shared pytest setup: tolerances, fp64 references, device parametrization.

Run against an installed nanguard (``pip install --no-build-isolation .``) or a
build tree: ``NANGUARD_LIB_DIR=build PYTHONPATH=python pytest``.
"""

from __future__ import annotations

import pytest
import torch

import nanguard  # noqa: F401  (loads the ops)

#: (atol, rtol) per op and dtype, for |got - ref| <= atol + rtol * |ref|
#: against an fp64 reference computed from the same (rounded) inputs.
#: Reasons for the looser entries:
#: - float32: fp32 accumulation over rows of up to a few thousand elements.
#: - bfloat16 / float16: the output is rounded once to 8 / 11 significant
#:   bits (2^-8 = 3.9e-3, 2^-11 = 4.9e-4 relative); gradients pass through
#:   two such roundings (grad_out in, grad out) and row sums, hence 2-4x.
TOLERANCES = {
    "layernorm": {
        torch.float64: (1e-10, 1e-10),
        torch.float32: (2e-5, 2e-5),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (2e-2, 1e-2),
    },
    "layernorm_grad": {
        torch.float64: (1e-10, 1e-10),
        torch.float32: (1e-4, 1e-4),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (8e-2, 4e-2),
    },
    #: gradients after unscale + clip vs the fp64 reference. Inputs are
    #: identical; what differs is the rounding of the result: fp32 one
    #: multiply by an fp32 coefficient (two roundings); fp16 / bf16 one
    #: rounding to 11 / 8 bits (the stock path rounds twice: unscale, then
    #: clip); fp64 the norm's summation order. Norms are accumulated in fp64
    #: in every case (checked to 1e-6 relative in the test).
    #: safe_sdpa, with atol scaled by 1 + max|ref| (outputs are averages of v
    #: rows, gradients sums over keys). Reasons:
    #: - float64: same math in another order (online softmax vs plain softmax).
    #: - float32: fp32 scores and accumulators over up to 256-long dots and a
    #:   few hundred keys; a ~1 ulp polynomial exp.
    #: - float16 / bfloat16: each output is rounded once to 11 / 8 significant
    #:   bits (4.9e-4 / 3.9e-3 relative); gradients also read the rounded out
    #:   and grad_out (D = rowsum(dout * out)) and sum over keys and heads:
    #:   2-4x that.
    "attention": {
        torch.float64: (1e-10, 1e-9),
        torch.float32: (2e-5, 2e-4),
        torch.float16: (2e-3, 4e-3),
        torch.bfloat16: (1.6e-2, 1.6e-2),
    },
    "attention_grad": {
        torch.float64: (1e-9, 1e-8),
        torch.float32: (1e-4, 1e-3),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (6e-2, 4e-2),
    },
    #: patched vs stock Hugging Face models in fp32. The two sides compute the
    #: same math in a different order (flash-style online softmax vs a full
    #: score matrix; fused vs separate norm multiply), so they differ by fp32
    #: rounding amplified through two layers; gradients sum over the batch and
    #: sequence.
    "hf_logits": {torch.float32: (2e-5, 1e-4)},
    "hf_grads": {torch.float32: (5e-5, 2e-3)},
    "grad_guard": {
        torch.float64: (1e-14, 1e-12),
        torch.float32: (1e-12, 3e-7),
        torch.float16: (1e-7, 1e-3),
        torch.bfloat16: (1e-30, 8e-3),
    },
}


def assert_close(got: torch.Tensor, ref: torch.Tensor, op: str, dtype: torch.dtype, scale=1.0):
    """|got - ref| <= atol*scale + rtol*|ref|, NaN where ref is NaN, in fp64."""
    atol, rtol = TOLERANCES[op][dtype]
    got = got.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    torch.testing.assert_close(got, ref, atol=atol * scale, rtol=rtol, equal_nan=True)


CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

#: NANGUARD_COMPOSITE=1 (or no loadable C library): every op runs its
#: composite path, and the op suites run against it. A test of something
#: only the C kernels have (their messages, code paths, build) is marked
#: ``requires_kernels``.
COMPOSITE_ONLY = nanguard._lib.composite_only() is not None
requires_kernels = pytest.mark.skipif(COMPOSITE_ONLY, reason="the C library is not loaded (composite path)")


def pytest_report_header(config):
    from nanguard import _delegate

    path = "composite path only" if COMPOSITE_ONLY else "C kernels"
    return f"nanguard safe_sdpa backend: {_delegate.DEFAULT} (NANGUARD_SDPA_BACKEND); ops: {path}"


def pytest_terminal_summary(terminalreporter):
    """With NANGUARD_SDPA_BACKEND=fused-if-allowed the attention suite runs
    every call the conditions allow through PyTorch's fused kernels: say how
    many did, so a run that delegated nothing cannot pass for one that did."""
    from nanguard import _delegate

    if _delegate.DEFAULT != "auto" or any(_delegate.counts.values()):
        terminalreporter.write_line(f"safe_sdpa calls through fused kernels (eager): {_delegate.counts}")
