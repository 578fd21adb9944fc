"""The fused gradient guard against the stock mixed-precision step.

Stock: ``scaler.unscale_(opt)`` + ``torch.nn.utils.clip_grad_norm_(params,
max_norm, foreach=True)``: unscale reads and writes every gradient, the norm
reads it again, the clip reads and writes it again (5 passes of traffic).
nanguard: ``scaler.unscale_and_clip_(opt, max_norm)`` (pass 1 reads, pass 2
reads and writes: 3 passes), and the bare ``nanguard.grad_guard.guard_``.

Gradient sets: a 12-layer GPT-2-small (148 tensors, 124.4M values) and 500
small tensors (256..8192 values each), fp32 and bf16 gradients, in the same
process and run. Reports median times, the ratio (stock / nanguard: > 1 means
nanguard is faster) and nanguard's achieved GB/s (3 passes counted) against
this machine's measured copy bandwidth.

The loss scale alternates between 2 and 0.5 and max_norm is huge, so that
the gradients keep their magnitude across repeats while both sides still do
every pass (the stock clip multiplies by 1; nanguard multiplies by the
inverse scale).

    python bench/bench_grad_guard.py [--device cuda] [--repeats 15] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import sys
from collections import defaultdict

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

import nanguard  # noqa: E402
from nanguard.amp import GradScaler  # noqa: E402


def gpt2_small_shapes(layers=12, d=768, vocab=50257, ctx=1024):
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def small_shapes(n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(int(s),) for s in torch.randint(256, 8193, (n,), generator=g)]


def make_params(shapes, dtype, device):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device))
        p.grad = torch.randn(s, dtype=torch.float32, device=device).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3 if _common.quick() else 15)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    bw = _common.copy_bandwidth(dev)
    print(f"copy bandwidth: {bw:.1f} GB/s, threads: {torch.get_num_threads()}")
    rows = []
    max_norm = 1e30
    for set_name, shapes in (("gpt2-small", gpt2_small_shapes()), ("500 small", small_shapes())):
        for dtype in (torch.float32, torch.bfloat16):
            params = make_params(shapes, dtype, dev)
            n = sum(p.numel() for p in params)
            opt = torch.optim.SGD(params, lr=0.0)
            stock = torch.amp.GradScaler(dev)
            ours = GradScaler(dev)
            for s in (stock, ours):
                s.scale(torch.ones((), device=dev))  # creates the scale tensor
            flip = itertools.cycle([2.0, 0.5])

            def run_stock():
                stock._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
                stock._scale.fill_(next(flip))
                stock.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

            def run_ours():
                ours._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
                ours._scale.fill_(next(flip))
                ours.unscale_and_clip_(opt, max_norm)

            grads = [p.grad for p in params]

            def run_guard():
                nanguard.grad_guard.guard_(grads, next(flip), max_norm)

            t = _common.time_fns({"stock": run_stock, "scaler": run_ours, "guard": run_guard},
                                 repeats=args.repeats, device=dev)
            e = torch.tensor([], dtype=dtype).element_size()
            gbps = 3 * n * e / t["scaler"] / 1e9
            rows.append({
                "set": set_name, "tensors": len(params), "values_M": n / 1e6,
                "dtype": str(dtype).replace("torch.", ""),
                "stock_ms": t["stock"] * 1e3, "unscale_and_clip_ms": t["scaler"] * 1e3,
                "guard_ms": t["guard"] * 1e3,
                "ratio": t["stock"] / t["scaler"], "ratio_guard": t["stock"] / t["guard"],
                "nanguard_GBps": gbps, "pct_copy_bw": 100 * gbps / bw,
            })
            print(rows[-1])
            params = opt = grads = None  # free this set before the next one is made
    cols = ["set", "tensors", "values_M", "dtype", "stock_ms", "unscale_and_clip_ms", "guard_ms",
            "ratio", "ratio_guard", "nanguard_GBps", "pct_copy_bw"]
    # a shared machine's load says how far to trust the absolute numbers
    _common.write_results(f"grad_guard_{dev.split(':')[0]}", "main", rows, cols,
                          {"copy_GBps": bw, "repeats": args.repeats,
                           "loadavg_1_5_15": list(os.getloadavg())})


if __name__ == "__main__":
    main()
