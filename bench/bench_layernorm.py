"""stable_layernorm against torch.nn.functional.layer_norm / rms_norm.

Forward and forward+backward, fp32 and bf16, shapes (4096x1024, 8192x4096,
16384x768), in the same process and run. Reports median times, the ratio
(PyTorch time / nanguard time: > 1 means nanguard is faster) and achieved
GB/s against this machine's measured copy bandwidth.

    python bench/bench_layernorm.py [--device cuda] [--repeats 30]
"""

from __future__ import annotations

import argparse
import sys
import pathlib

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

from nanguard.functional import layer_norm, rms_norm  # noqa: E402

SHAPES = [(4096, 1024), (8192, 4096), (16384, 768)]


def bytes_moved(rows, cols, dtype, backward):
    """Minimum traffic: forward reads x, writes y; backward also reads x, dy
    and writes dx (parameters and statistics are negligible)."""
    e = torch.tensor([], dtype=dtype).element_size()
    return rows * cols * e * (2 + (3 if backward else 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5 if _common.quick() else 30)
    args = p.parse_args()
    dev = args.device
    bw = _common.copy_bandwidth(dev)
    print(f"copy bandwidth: {bw:.1f} GB/s, threads: {torch.get_num_threads()}")
    rows_out = []
    for kind in ("layernorm", "rmsnorm"):
        for dtype in (torch.float32, torch.bfloat16):
            for rows, cols in SHAPES:
                x = torch.randn(rows, cols, device=dev, dtype=dtype)
                w = torch.randn(cols, device=dev, dtype=dtype)
                b = torch.randn(cols, device=dev, dtype=dtype)
                gy = torch.randn_like(x)
                if kind == "layernorm":
                    ours = lambda t: layer_norm(t, (cols,), w, b)  # noqa: E731
                    theirs = lambda t: F.layer_norm(t, (cols,), w, b)  # noqa: E731
                else:
                    ours = lambda t: rms_norm(t, (cols,), w, 1e-6)  # noqa: E731
                    theirs = lambda t: F.rms_norm(t, (cols,), w, 1e-6)  # noqa: E731
                for mode in ("fwd", "fwd+bwd"):
                    if mode == "fwd":
                        fns = {
                            "nanguard": lambda: ours(x),
                            "torch": lambda: theirs(x),
                        }
                    else:
                        xg = x.detach().requires_grad_()
                        wg = w  # parameter grads are part of a real backward
                        w.requires_grad_(True)
                        if kind == "layernorm":
                            b.requires_grad_(True)

                        def fb(f, xg=xg):
                            y = f(xg)
                            y.backward(gy)
                            xg.grad = None
                            wg.grad = None
                            b.grad = None

                        fns = {"nanguard": lambda: fb(ours), "torch": lambda: fb(theirs)}
                    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                        t = _common.time_fns(fns, repeats=args.repeats, device=dev)
                    w.requires_grad_(False)
                    b.requires_grad_(False)
                    nb = bytes_moved(rows, cols, dtype, mode != "fwd")
                    row = {
                        "op": kind,
                        "dtype": str(dtype).replace("torch.", ""),
                        "shape": f"{rows}x{cols}",
                        "mode": mode,
                        "nanguard_ms": t["nanguard"] * 1e3,
                        "torch_ms": t["torch"] * 1e3,
                        "ratio": t["torch"] / t["nanguard"],
                        "nanguard_GBps": nb / t["nanguard"] / 1e9,
                        "pct_copy_bw": 100 * nb / t["nanguard"] / 1e9 / bw,
                    }
                    rows_out.append(row)
                    print(row, flush=True)
    _common.write_results(
        f"layernorm_{dev}",
        "main",
        rows_out,
        ["op", "dtype", "shape", "mode", "nanguard_ms", "torch_ms", "ratio", "nanguard_GBps", "pct_copy_bw"],
        {"copy_bandwidth_GBps": bw},
    )


if __name__ == "__main__":
    main()
