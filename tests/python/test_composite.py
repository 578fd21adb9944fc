"""The composite path (nanguard.composite): its registration, its dispatch
for devices without a nanguard kernel, the import without a C library, and
the layernorm kernels against the C ones and the fp64 reference.

The op suites (test_attention.py, test_layernorm.py, test_grad_guard.py, ...)
run again on the composite path under NANGUARD_COMPOSITE=1 (scripts/test.sh);
test_composite_attention.py and test_composite_grad_guard.py compare those
kernels with the C ones call by call.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import COMPOSITE_ONLY, assert_close, requires_kernels

import nanguard
from nanguard import composite
from nanguard.composite import layernorm as comp_ln



def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.nanguard, packet), overload or "default")


def test_every_schema_has_a_composite_kernel():
    names = {s.split("(", 1)[0] for s in composite.SCHEMAS}
    assert names == set(composite.KERNELS)
    ops = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("nanguard::")}
    assert {n if "." in n else n for n in names} == {n.removesuffix(".default") for n in ops}


@requires_kernels
def test_schemas_equal_the_c_librarys():
    """SCHEMAS defines the ops when the core library is absent: it must say
    what libnanguard.so says, or the Python layer would register its
    autograd and fakes against other signatures on such a machine."""
    for schema in composite.SCHEMAS:
        name = schema.split("(", 1)[0]
        theirs = str(_op(name)._schema)
        assert theirs == "nanguard::" + schema, (theirs, schema)


def test_paths_per_device():
    d = nanguard.info(as_dict=True)
    for name, paths in d["op_paths"].items():
        assert set(paths) == set(composite.DEVICE_KEYS)
        for dev in ("mps", "xpu", "privateuseone"):
            assert paths[dev] == "composite", (name, dev)
        if COMPOSITE_ONLY:
            assert paths["cpu"] == paths["cuda"] == "composite"
            assert d["ops"][name] == []
        else:
            assert paths["cpu"] == "kernel"
            has_cuda_lib = "libnanguard_cuda.so" in d["libraries"]
            assert paths["cuda"] == ("kernel" if has_cuda_lib else "composite")


def _via(key: str, name: str, *args):
    """Call op ``name`` through the kernel the dispatcher holds for ``key``
    (for "XPU": what an XPU tensor would run) on CPU tensors."""
    ks = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return _op(name).redispatch(ks, *args)


@pytest.mark.parametrize("key", ["XPU", "MPS", "PrivateUse1"])
def test_a_device_without_kernels_dispatches_to_the_composite(key):
    """The dispatcher's table entry of a device type with no nanguard kernel
    is the composite kernel: called through it, the op gives what the
    composite function gives."""
    x = torch.randn(4, 33, dtype=torch.float32)
    w, b = torch.randn(33), torch.randn(33)
    got = _via(key, "stable_layernorm.weight_bias", x, w, b, 1e-5, False)
    want = comp_ln.layernorm_weight_bias(x, w, b, 1e-5, False)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    q = torch.randn(1, 2, 5, 8)
    rng = torch.zeros(2, dtype=torch.int64)
    out, lse = _via(key, "safe_sdpa", q, q, q, 0.0, True, 8**-0.5, 0.0, 0.0, rng)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    grads = [torch.tensor([1.0, float("inf")]), torch.ones(3)]
    found = torch.zeros(1)
    _via(key, "fused_unscale_clip_", grads, torch.ones(1), found, 1.0, 2.0)
    assert found.item() == 1.0


def _ref_norm(x, w, b, eps, rms):
    x64 = x.double()
    if rms:
        y = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    else:
        m = x64.mean(-1, keepdim=True)
        y = (x64 - m) * torch.rsqrt(((x64 - m) ** 2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("params_f32", [False, True])
def test_layernorm_matches_fp64_and_the_c_kernel(dtype, rms, params_f32):
    if params_f32 and dtype in (torch.float32, torch.float64):
        pytest.skip("fp32 parameters are for 16-bit inputs")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 3, 70, generator=g) * 3 + 0.5).to(dtype)
    pdt = torch.float32 if params_f32 else dtype
    w = (torch.randn(70, generator=g) + 1).to(pdt)
    b = None if rms else torch.randn(70, generator=g).to(pdt)
    args = (x, w, b, 1e-5, rms) if b is not None else (x, w, 1e-5, rms)
    name = "stable_layernorm.weight_bias" if b is not None else "stable_layernorm.weight"
    y, mean, rstd = comp_ln.KERNELS[name](*args)
    assert y.dtype == dtype and y.is_contiguous() and rstd.dtype == composite._checks.stat_dtype(dtype)
    assert_close(y, _ref_norm(x, w, b, 1e-5, rms), "layernorm", dtype)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    grads = comp_ln.layernorm_backward_weight(dy, x, w, mean, rstd, rms, b is not None)
    # fp64 reference gradient by autograd of the fp64 formula
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    _ref_norm(x64, w64, b64, 1e-5, rms).backward(dy.double())
    assert_close(grads[0], x64.grad, "layernorm_grad", dtype, scale=float(x64.grad.abs().max()))
    assert_close(grads[1], w64.grad, "layernorm_grad", dtype, scale=float(w64.grad.abs().max()))
    if b is not None:
        assert_close(grads[2], b64.grad, "layernorm_grad", dtype, scale=float(b64.grad.abs().max()))
    if not COMPOSITE_ONLY:
        cy, cmean, crstd = _op(name)(*args)
        assert_close(y, cy, "layernorm", dtype)
        torch.testing.assert_close(rstd, crstd, rtol=1e-5, atol=0)
        cgrads = torch.ops.nanguard.stable_layernorm_backward.weight(dy, x, w, cmean, crstd, rms, b is not None)
        for k, (got, want) in enumerate(zip(grads, cgrads)):
            assert got.dtype == want.dtype and got.shape == want.shape, k
            top = float(want.detach().abs().max()) if want.numel() else 0.0
            assert_close(got, want, "layernorm_grad", dtype, scale=1 + top)


def test_layernorm_degenerate_rows():
    """Constant rows give the bias exactly (eps 0 included: rstd 0, no 0/0);
    a row whose fp32 squares overflow is still normalized; a NaN or Inf row
    is NaN and only that row."""
    x = torch.tensor([[2.5] * 8, [0.0] * 8, [3e30, -3e30] * 4, [1.0] * 7 + [float("inf")]])
    b = torch.arange(8.0)
    y, _, rstd = comp_ln.layernorm_bias(x, b, 0.0, False)
    torch.testing.assert_close(y[0], b, rtol=0, atol=0)
    torch.testing.assert_close(y[1], b, rtol=0, atol=0)
    assert rstd[0] == 0 and rstd[1] == 0
    torch.testing.assert_close(y[2], torch.tensor([1.0, -1.0] * 4) + b, rtol=1e-6, atol=1e-6)
    assert torch.isnan(y[3]).all()
    y, _, _ = comp_ln.layernorm(torch.zeros(2, 4), 0.0, True)
    assert (y == 0).all()


@pytest.mark.parametrize("case", ["offset", "near_constant", "constant_eps", "huge", "tiny_eps0"])
def test_layernorm_fused_path_is_only_taken_where_it_is_exact(case):
    """On the CPU the composite LayerNorm runs ATen's fused kernel when every
    row passes its check, else the exact formulas. Each case holds one row
    the fused kernel gets wrong next to healthy rows: the whole call must be
    as accurate as the kernels' tolerance, and the check must refuse it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64)
    eps = 1e-5
    if case == "offset":  # |mean| * rstd = 1e3: fused error ~1e-4, exact ~5e-7
        x[1] = 1e3 + x[1]
    elif case == "near_constant":  # var << eps: fused gives noise around b
        x[1] = 0.3 + 1e-6 * x[1]
    elif case == "constant_eps":
        x[1] = 0.01
    elif case == "huge":  # rstd 1e-19: fused backward's rstd^3 underflows
        x[1] = 1e19 * x[1]
    else:  # eps 0, variance 1e-30: rstd 1e15, its cube overflows fp32
        eps = 0.0
        x[1] = 1e-15 * x[1]
    x = x.float()
    w, b = torch.randn(64, generator=g) + 1, torch.randn(64, generator=g)
    y, mean, rstd = comp_ln.layernorm_weight_bias(x, w, b, eps, False)
    assert not comp_ln._fused_rows_ok(mean, rstd, eps)
    assert comp_ln._fused_rows_ok(mean[[0, 2, 3]], rstd[[0, 2, 3]], eps)
    assert_close(y, _ref_norm(x, w, b, eps, False), "layernorm", torch.float32)
    if case == "constant_eps":
        torch.testing.assert_close(y[1], b, rtol=0, atol=0)
    dy = torch.randn(x.shape, generator=g)
    dx, dw, db = comp_ln.layernorm_backward_weight(dy, x, w, mean, rstd, False, True)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    _ref_norm(x64, w64, b64, eps, False).backward(dy.double())
    for got, want in ((dx, x64.grad), (dw, w64.grad), (db, b64.grad)):
        assert_close(got, want, "layernorm_grad", torch.float32, scale=float(want.abs().max()))


def test_layernorm_empty_shapes():
    for shape in [(0, 5), (3, 0), (0,)]:
        x = torch.randn(shape)
        y, mean, rstd = comp_ln.layernorm_weight_bias(x, torch.ones(shape[-1]), torch.zeros(shape[-1]), 1e-5, False)
        assert y.shape == x.shape and mean.shape == x.shape[:-1] and rstd.shape == x.shape[:-1]
        dx, dw, db = comp_ln.layernorm_backward_weight(x, x, torch.ones(shape[-1]), mean, rstd, False, True)
        assert dx.shape == x.shape and (dw == 0).all() and (db == 0).all()


def test_layernorm_bad_arguments_name_the_argument():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="weight must have shape \\[4\\]"):
        comp_ln.layernorm_weight(x, torch.ones(5), 1e-5, False)
    with pytest.raises(RuntimeError, match="bias is not supported with rms=True"):
        comp_ln.layernorm_bias(x, torch.ones(4), 1e-5, True)
    with pytest.raises(RuntimeError, match="eps must be a finite number"):
        comp_ln.layernorm(x, -1.0, False)
    with pytest.raises(RuntimeError, match="input must be float16, bfloat16"):
        comp_ln.layernorm(x.long(), 1e-5, False)
    _, mean, rstd = comp_ln.layernorm(x, 1e-5, False)
    with pytest.raises(RuntimeError, match="rstd must be the float32 statistics"):
        comp_ln.layernorm_backward(x, x, mean, rstd[:2], False, False)


@pytest.mark.parametrize("key", ["XPU", "CPU"])
def test_composite_kernels_ignore_autocast(key):
    """Under torch.autocast the composite kernels still compute in fp32. A
    dispatcher kernel's own calls dispatch from the top again, so without
    autocast turned off inside them q @ k.T would run as an fp16 matmul:
    here it overflows (60 * 60 * 64 > 65504) and every row is NaN. The CPU
    key is the composite's only in composite mode; with the C library it is
    the C kernel, which must agree."""
    torch.manual_seed(0)
    q = (60 + torch.rand(1, 2, 6, 64)).half()
    k = (60 + torch.rand(1, 2, 6, 64)).half()
    v = torch.randn(1, 2, 6, 64).half()
    rng = torch.zeros(2, dtype=torch.int64)
    args = (q, k, v, 0.0, True, 0.125, 0.0, 0.0, rng)
    with torch.autocast("cpu", dtype=torch.float16):
        assert (q @ k.transpose(-1, -2)).isinf().all()  # what the kernel must not do
        out, lse = _via(key, "safe_sdpa", *args)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           scale=0.125)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # fp16 output: one rounding of a value |v| <= 4 (2^-9 relative), plus the fp32 softmax's
    # error amplified by score differences of up to ~100 (about 1e-5 relative)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=2e-3)


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, **env),
    )


_TRAIN = """
import torch, nanguard
from nanguard import _demo_model as dm, _lib
print("REASON", _lib.composite_only())
cfg = dm.Config(steps=3, batch=4, seq=16, n_embd=32, device="cpu")
model = dm.build_model(cfg)
print("PATCHED", nanguard.patch(model).total > 0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = dm.batches(cfg, dm.corpus())
with nanguard.watch(model) as w:
    for step in range(cfg.steps):
        ids = next(data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        nanguard.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad()
        w.step()
print("LOSS", float(loss))
print(nanguard.info(as_dict=True)["op_paths"]["nanguard::safe_sdpa"]["cpu"])
"""


def test_import_and_train_without_a_loadable_c_library(tmp_path):
    """A libnanguard.so the platform cannot load (here: not an ELF file)
    leaves `import nanguard` working on the composite path, with one warning
    naming the reason; patch, watch and the guard then run through it."""
    (tmp_path / "libnanguard.so").write_bytes(b"not a shared library")
    out = _child(_TRAIN, {"NANGUARD_LIB_DIR": str(tmp_path), "NANGUARD_COMPOSITE": "0"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PATCHED True" in out.stdout and "\ncomposite\n" in out.stdout, out.stdout
    assert out.stderr.count("LibraryUnavailableWarning") == 1, out.stderr
    assert "the C library could not be loaded" in out.stderr and str(tmp_path) in out.stderr
    loss = float(out.stdout.split("LOSS ")[1].split()[0])
    assert loss == loss and loss < 10


def test_composite_on_purpose_warns_nothing():
    out = _child(_TRAIN, {"NANGUARD_COMPOSITE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REASON NANGUARD_COMPOSITE=1" in out.stdout
    assert "LibraryUnavailableWarning" not in out.stderr
