"""Smoke test of an installed nanguard wheel (scripts/wheel_smoke.sh runs it).

Run with ``python -I`` from outside the source tree, in a virtual environment
that holds only torch and the wheel: it proves that the package and both C
libraries come from the installed wheel, that the CPU kernels (not the
composite path) answer, and that each kind of op gives the reference's
numbers: safe_sdpa forward and backward, stable_layernorm, fused_unscale_clip_.
Prints the CUDA library's path last, for the fatbin check that follows.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import torch
import torch.nn.functional as F

import nanguard
from nanguard import _lib


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise SystemExit(f"wheel smoke: FAIL: {msg}")
    print(f"ok  {msg}")


def close(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    return bool(torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol))


def main() -> None:
    pkg = pathlib.Path(nanguard.__file__).resolve().parent
    prefix = pathlib.Path(sys.prefix).resolve()
    check(prefix in pkg.parents, f"nanguard imported from the environment ({pkg})")
    check(not (pkg.parent / "pyproject.toml").exists(), "nanguard is not a source tree")
    check(_lib.composite_only() is None, f"the C library is loaded (composite reason: {_lib.composite_only()})")
    core = pathlib.Path(_lib.loaded()["libnanguard.so"]).resolve()
    check(core == pkg / "lib" / "libnanguard.so", f"libnanguard.so loaded from the wheel ({core})")
    cuda = pkg / "lib" / "libnanguard_cuda.so"
    check(cuda.is_file(), f"libnanguard_cuda.so installed beside it ({cuda})")
    if torch.version.cuda is not None:
        check(_lib.loaded().get("libnanguard_cuda.so") == str(cuda), "libnanguard_cuda.so loaded (CUDA torch)")

    torch.manual_seed(0)
    # safe_sdpa: a padding mask with one fully masked row, forward and backward
    # against fp64 PyTorch attention (the masked row: zeros, zero gradient)
    q, k, v = (torch.randn(2, 3, 17, 32, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 17, 17, dtype=torch.bool)
    mask[1, :, 5, :] = False
    out = nanguard.functional.safe_sdpa(q, k, v, attn_mask=mask)
    dout = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    live = mask.clone()
    live[1, :, 5, :] = True  # the reference attends there; its row is then zeroed
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=live)
    ref = ref * mask.any(-1, keepdim=True)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    check(close(out, ref, 1e-5, 1e-4), "safe_sdpa forward matches fp64 attention")
    check(bool((out[1, :, 5] == 0).all()), "safe_sdpa gives zeros on the fully masked row")
    check(all(close(g, r, 1e-4, 1e-3) for g, r in ((gq, rq), (gk, rk), (gv, rv))),
          "safe_sdpa backward matches fp64 attention")

    # stable_layernorm through nanguard.functional.layer_norm, weight and bias,
    # with one constant row (variance 0)
    x = torch.randn(9, 200)
    x[3] = 7.0
    w, b = torch.randn(200), torch.randn(200)
    y = nanguard.functional.layer_norm(x, 200, w, b, eps=1e-5)
    yr = F.layer_norm(x.double(), (200,), w.double(), b.double(), eps=1e-5)
    check(close(y, yr, 1e-5, 1e-4), "stable_layernorm matches fp64 layer_norm")

    # fused_unscale_clip_: unscale by 1/1024 and clip to max_norm 1
    grads = [torch.randn(1000) * 1024, torch.randn(33, 7) * 1024]
    want = [g.double() / 1024 for g in grads]
    norm = math.sqrt(sum(float((g * g).sum()) for g in want))
    want = [g * min(1.0, 1.0 / (norm + 1e-6)) for g in want]
    inv_scale = torch.tensor([1.0 / 1024])
    found_inf = torch.zeros(1)
    torch.ops.nanguard.fused_unscale_clip_(grads, inv_scale, found_inf, 1.0, 2.0)
    check(float(found_inf) == 0.0, "fused_unscale_clip_ finds every gradient finite")
    check(all(close(g, r, 1e-6, 1e-4) for g, r in zip(grads, want)), "fused_unscale_clip_ unscales and clips")
    bad = [torch.ones(4), torch.tensor([1.0, float("nan")])]
    torch.ops.nanguard.fused_unscale_clip_(bad, inv_scale, found_inf, 1.0, 2.0)
    check(float(found_inf) == 1.0 and bool((bad[0] == 1).all()), "fused_unscale_clip_ skips a NaN step unwritten")

    info = subprocess.run([sys.executable, "-I", "-m", "nanguard", "info"], capture_output=True, text=True)
    print(info.stdout, end="")
    if info.returncode != 0:
        print(info.stderr, end="")
    check(info.returncode == 0, "python -m nanguard info exits 0")
    check(f"loaded libnanguard.so: {core}" in info.stdout, "python -m nanguard info names the wheel's library")
    print(f"cuda_library={cuda}")


if __name__ == "__main__":
    main()
