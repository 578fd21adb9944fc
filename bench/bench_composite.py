"""Speed of the composite path (every op in PyTorch operations, what a
device without nanguard kernels runs) against the stock PyTorch ops it
replaces, on the CPU.

The process runs with ``NANGUARD_COMPOSITE=1``, so no C library is loaded
and every nanguard op takes its composite path; PyTorch's own ops are
timed in the same process, interleaved (``_common.time_samples``). Rows:

- ``layernorm``: ``nanguard.nn.StableLayerNorm`` / ``StableRMSNorm`` against
  ``torch.nn.LayerNorm`` / ``RMSNorm``, forward + backward, fp32 and bf16;
- ``attention``: ``nanguard.functional.safe_sdpa`` against
  ``torch.nn.functional.scaled_dot_product_attention`` (causal), forward +
  backward, fp32 and bf16;
- ``guard``: ``nanguard.clip_grad_norm_`` against
  ``torch.nn.utils.clip_grad_norm_`` over a GPT-2's gradients, clipped
  (max_norm 1e-3, below their norm: both sides read and write them all);
- ``train_step``: the demo's GPT-2 (hidden 64 and 256) one training step,
  patched against stock.

``ratio`` is the median of the paired per-repeat ratios (nanguard / stock).

    python bench/bench_composite.py [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ["NANGUARD_COMPOSITE"] = "1"  # before nanguard is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import nanguard  # noqa: E402
from nanguard import _demo_model  # noqa: E402


def _fwd_bwd(fn, *inputs):
    def run():
        out = fn(*inputs)
        out.float().sum().backward()
        for t in inputs:
            t.grad = None
    return run


def _row(kind: str, case: str, dtype: torch.dtype, ours, stock, repeats: int) -> dict:
    s = _common.time_samples({"nanguard": ours, "stock": stock}, repeats=repeats, warmup=2)
    ratio, q1, q3 = _common.paired_ratio(s, "nanguard", "stock")
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in s.items()}
    return {"kind": kind, "case": case, "dtype": str(dtype).removeprefix("torch."),
            "nanguard_ms": med["nanguard"], "stock_ms": med["stock"], "ratio": ratio, "q1": q1, "q3": q3}


def norm_rows(repeats):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows_, cols in ((4096, 256), (1024, 1024)):
            for rms in (False, True):
                x = torch.randn(rows_, cols, dtype=dtype, requires_grad=True)
                if rms:
                    ours, stock = nanguard.nn.StableRMSNorm(cols, eps=1e-6), torch.nn.RMSNorm(cols, eps=1e-6)
                else:
                    ours, stock = nanguard.nn.StableLayerNorm(cols), torch.nn.LayerNorm(cols)
                ours, stock = ours.to(dtype), stock.to(dtype)
                rows.append(_row("rmsnorm" if rms else "layernorm", f"{rows_}x{cols}", dtype,
                                 _fwd_bwd(ours, x), _fwd_bwd(stock, x), repeats))
                print(rows[-1])
    return rows


def attention_rows(repeats):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, L, E in ((4, 4, 128, 64), (1, 8, 512, 64)):
            q, k, v = (torch.randn(B, H, L, E, dtype=dtype, requires_grad=True) for _ in range(3))
            ours = _fwd_bwd(lambda a, b, c: nanguard.functional.safe_sdpa(a, b, c, is_causal=True), q, k, v)
            stock = _fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)
            rows.append(_row("attention", f"B{B} H{H} L{L} E{E} causal", dtype, ours, stock, repeats))
            print(rows[-1])
    return rows


def guard_and_step_rows(repeats):
    rows = []
    for hidden in (64, 256):
        cfg = _demo_model.Config(n_embd=hidden, n_head=max(1, hidden // 64), device="cpu")
        data = _demo_model.batches(cfg, _demo_model.corpus())
        ids = next(data)
        stock_m = _demo_model.build_model(cfg)
        ours_m = _demo_model.build_model(cfg)
        nanguard.patch(ours_m)
        stock_m(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in stock_m.parameters()]
        params = list(stock_m.parameters())
        rows.append(_row("guard", f"GPT-2 h{hidden} grads ({sum(g.numel() for g in grads) / 1e6:.2f} M)",
                         torch.float32,
                         lambda: nanguard.clip_grad_norm_(params, 1e-3),
                         lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=True), repeats))
        print(rows[-1])
        opts = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (stock_m, ours_m)}

        def step(m, clip):
            opts[m].zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
            clip(m.parameters(), cfg.max_norm)
            opts[m].step()

        rows.append(_row("train_step", f"GPT-2 h{hidden} batch {cfg.batch} seq {cfg.seq}", torch.float32,
                         lambda: step(ours_m, nanguard.clip_grad_norm_),
                         lambda: step(stock_m, torch.nn.utils.clip_grad_norm_), repeats))
        print(rows[-1])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3 if _common.quick() else 30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert nanguard._lib.composite_only(), "the C library was loaded: the composite path is not what runs"
    print(_common.describe())
    rows = norm_rows(args.repeats) + attention_rows(args.repeats) + guard_and_step_rows(args.repeats)
    cols = ["kind", "case", "dtype", "nanguard_ms", "stock_ms", "ratio", "q1", "q3"]
    _common.write_results("composite_cpu", "composite", rows, cols,
                          {"repeats": args.repeats, "threads": args.threads},
                          notes="The composite path (NANGUARD_COMPOSITE=1: no C library) against the stock "
                                "PyTorch op it replaces, forward + backward; ratio = median of paired "
                                "per-repeat ratios nanguard / stock, q1-q3 their quartiles.")


if __name__ == "__main__":
    main()
