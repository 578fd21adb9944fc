"""tensor_stats: the census against an fp64 reference on every dtype and
layout (views, 10 dimensions, empty, scalar, large and parallel), extremes,
opcheck, torch.compile and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

import nanguard
from nanguard import new_stats_buffers, tensor_stats_

from conftest import DEVICES, requires_cuda

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
op = torch.ops.nanguard.tensor_stats_.default


# ---- tensor_stats ---------------------------------------------------------------------


def reference(x: torch.Tensor):
    """NaN, +Inf, -Inf, max |x| finite (0 if none), min non-zero |x| finite (inf if none)."""
    v = x.detach().to(torch.float64).cpu().flatten()
    fin = v[torch.isfinite(v)].abs()
    nz = fin[fin != 0]
    return (
        int(torch.isnan(v).sum()),
        int((v == math.inf).sum()),
        int((v == -math.inf).sum()),
        float(fin.max()) if fin.numel() else 0.0,
        float(nz.min()) if nz.numel() else math.inf,
    )


def run_stats(x: torch.Tensor, slot=1, slots=3):
    counts, values = new_stats_buffers(slots, x.device)
    tensor_stats_(x, counts, values, slot)
    c, v = counts[slot].tolist(), values[slot].tolist()
    # other slots untouched
    assert counts.cpu().sum() == sum(c)
    return (c[0], c[1], c[2], v[0], v[1])


def poison(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = x.view(-1) if x.is_contiguous() else None
    if flat is None or flat.numel() < 8:
        return x
    idx = torch.randint(0, flat.numel(), (6,), generator=g)
    vals = [math.nan, math.inf, -math.inf, 0.0, math.nan, 1e-6]
    for i, v in zip(idx.tolist(), vals):
        flat[i] = v
    return x


def views(base: torch.Tensor):
    """(name, view) pairs: contiguous and non-contiguous layouts of base [6, 35, 40]."""
    yield "contiguous", base
    yield "transpose", base.transpose(1, 2)
    yield "slice", base[:, 3:30:2, 1:]
    yield "expand", base[:, :1, :].expand(6, 7, 40)
    yield "permute", base.permute(2, 0, 1)
    yield "scalar", base[1, 2, 3]
    yield "empty", base[:, :0]
    # 10 dims that cannot be merged: the op copies to contiguous first
    yield "10-dim", base[:4, :32, :32].reshape(2, 2, 2, 2, 2, 2, 2, 2, 2, 8).permute(
        9, 8, 7, 6, 5, 4, 3, 2, 1, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_stats_matches_reference(device, dtype):
    torch.manual_seed(0)
    base = (torch.randn(6, 35, 40, dtype=torch.float64) * 100).to(dtype)
    poison(base, 1)
    base = base.to(device)
    for name, v in views(base):
        got = run_stats(v)
        assert got == reference(v), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_stats_extremes(dtype):
    fi = torch.finfo(dtype)
    x = torch.tensor([fi.max, -fi.tiny * fi.eps, 0.0, -0.0], dtype=dtype)
    assert run_stats(x) == reference(x)
    assert run_stats(x)[3] == float(fi.max)
    assert run_stats(torch.zeros(5, dtype=dtype)) == (0, 0, 0, 0.0, math.inf)
    assert run_stats(torch.full((5,), math.nan, dtype=dtype)) == (5, 0, 0, 0.0, math.inf)


def test_tensor_stats_large_parallel():
    x = torch.randn(3_000_001)
    x[17] = math.nan
    x[2_999_999] = -math.inf
    assert run_stats(x) == reference(x)
    assert run_stats(x[::7]) == reference(x[::7])
    assert run_stats(x[1:].view(1000, 3000).t()) == reference(x[1:].view(1000, 3000))


def test_tensor_stats_fuzz_layouts():
    """Property-based: random shapes, permutations, slice steps, dtypes and poison."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(
        shape=st.lists(st.integers(0, 7), min_size=0, max_size=5),
        perm_seed=st.integers(0, 10_000),
        steps=st.lists(st.integers(1, 3), min_size=5, max_size=5),
        dtype=st.sampled_from(DTYPES),
        n_bad=st.integers(0, 4),
    )
    def prop(shape, perm_seed, steps, dtype, n_bad):
        g = torch.Generator().manual_seed(perm_seed)
        base = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
        flat = base.view(-1)
        if flat.numel():
            for k in range(n_bad):
                i = int(torch.randint(0, flat.numel(), (1,), generator=g))
                flat[i] = (math.nan, math.inf, -math.inf, 0.0)[k % 4]
        v = base[tuple(slice(None, None, s) for s in steps[: base.dim()])]
        if v.dim() > 1:
            v = v.permute(*torch.randperm(v.dim(), generator=g).tolist())
        assert run_stats(v) == reference(v)

    prop()


def test_tensor_stats_convenience():
    d = nanguard.tensor_stats(torch.tensor([1.0, -4.0, math.nan, math.inf]))
    assert d == {"nan": 1, "posinf": 1, "neginf": 0, "max_abs": 4.0, "min_nonzero_abs": 1.0,
                 "numel": 4}


def test_tensor_stats_opcheck():
    counts, values = new_stats_buffers(4)
    for x in (torch.randn(5, 7), torch.randn(7, 5).t(), torch.randn(0),
              torch.randn(3, dtype=torch.float64)):
        torch.library.opcheck(op, (x, counts, values, 2))


def test_tensor_stats_under_torch_compile():
    counts, values = new_stats_buffers(4)

    def f(x, c, v):
        y = x * 2
        torch.ops.nanguard.tensor_stats_(y, c, v, 1)
        return y + 1

    g = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.tensor([1.0, math.nan, -3.0])
    out = g(x, counts, values)
    assert torch.equal(out.isnan(), torch.tensor([False, True, False]))
    assert counts[1].tolist() == [1, 0, 0] and values[1].tolist() == [6.0, 2.0]


def test_tensor_stats_bad_arguments():
    x = torch.randn(4)
    counts, values = new_stats_buffers(2)
    with pytest.raises(ValueError, match="slot"):
        tensor_stats_(x, counts, values, 2)
    with pytest.raises(ValueError, match="counts"):
        tensor_stats_(x, counts.float(), values, 0)
    with pytest.raises(ValueError, match="values"):
        tensor_stats_(x, counts, values[:, :1].contiguous(), 0)
    with pytest.raises(TypeError, match="x must be float16"):
        tensor_stats_(torch.arange(3), counts, values, 0)
    # the C layer checks again for direct calls
    with pytest.raises(RuntimeError, match="slot 5 is out of range"):
        op(x, counts, values, 5)
    with pytest.raises(RuntimeError, match="slot -1"):
        op(x, counts, values, -1)
    with pytest.raises(RuntimeError, match="counts must be"):
        op(x, values, values, 0)
    with pytest.raises(RuntimeError, match="values must be"):
        op(x, counts, values.float(), 0)
    with pytest.raises(RuntimeError, match="3 slots but values has 2"):
        op(x, torch.zeros(3, 3, dtype=torch.int64), values, 0)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.arange(3), counts, values, 0)



@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_tensor_stats_large(dtype):
    x = (torch.randn(5_000_003, dtype=torch.float64) * 50).to(dtype)
    x[3] = math.nan
    x[4_000_000] = math.inf
    x = x.cuda()
    assert run_stats(x) == reference(x)
    assert run_stats(x[::3]) == reference(x[::3])
