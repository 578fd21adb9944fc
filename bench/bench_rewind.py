"""Cost of nanguard.Rewind on a healthy run: its snapshots, and its loop.

The case is bench_watch.py's: a Hugging Face Llama training step (2 decoder
layers, hidden 64, 256 and 1024, eager attention; forward, cross-entropy,
backward, nanguard.clip_grad_norm_, AdamW step). At each size:

- ``snapshot_ms``: one snapshot of model + AdamW + RNG to host memory in a
  full ring (the steady state of a run: it refills the evicted snapshot's
  tensors); ``snapshot_fresh_ms`` the same into newly allocated memory (the
  ring's first ``keep``); ``snapshot_disk_ms`` to a file; ``restore_ms`` one
  restore; each the median of repeated calls. ``state_MB`` the bytes a snapshot holds and
  ``bytes_per_param`` the same per parameter (12 for fp32 weights and
  AdamW's two moments, plus the step counts and the generators);
- ``cost_every10`` / ``cost_every100``: the amortised cost per step of a
  snapshot every 10 / 100 steps, ``1 + snapshot_ms / every / step_ms``;
- ``loop_ratio``: the measured end to end, a run of ``--steps`` steps under
  ``Rewind(every=10, keep=3)`` (``rewind.loop`` and ``rewind.step``,
  snapshots included; one run that goes on across the repeats, so that its
  ring is full after the first) against the same loop without it, in
  alternating order, the median of the paired ratios of CPU time.

    python bench/bench_rewind.py [--hidden 64,256,1024] [--steps 20] [--repeats 7]

One thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import nanguard  # noqa: E402
from nanguard.rewind import _snapshot  # noqa: E402
from bench_watch import tiny_llama  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def one_step(m, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    gn = nanguard.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    return loss, gn


def size_row(hidden: int, args) -> dict:
    torch.manual_seed(0)
    base = tiny_llama(hidden, 2, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    models = {k: copy.deepcopy(base) for k in ("plain", "rewind")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k in models:  # AdamW's moments exist from the first step on
        one_step(models[k], opts[k], ids)
    m, opt = models["plain"], opts["plain"]
    n_params = sum(p.numel() for p in m.parameters())
    step_ms = median_ms(lambda: one_step(m, opt, ids), args.repeats)
    snap = _snapshot.capture(m, opt)
    state_bytes = _snapshot.nbytes(snap)
    fresh_ms = median_ms(lambda: _snapshot.capture(m, opt), args.repeats)
    snapshot_ms = median_ms(lambda: _snapshot.capture(m, opt, into=snap), args.repeats)
    restore_ms = median_ms(lambda: _snapshot.restore(snap, m, opt), args.repeats)
    with tempfile.TemporaryDirectory(prefix="nanguard-bench-") as d:
        ring = _snapshot.Ring(2, d)
        disk_ms = median_ms(lambda: ring.add(0, 0, {}, _snapshot.capture(m, opt)), args.repeats)
        ring.clear()

    def plain_run():
        for _ in range(args.steps):
            one_step(models["plain"], opts["plain"], ids)

    rw = nanguard.Rewind(models["rewind"], opts["rewind"], every=10, keep=3)

    def rewind_run():  # the same run goes on: its ring fills, then recycles
        for _ in rw.loop(iter(lambda: ids, None), rw.global_step + args.steps):
            loss, gn = one_step(models["rewind"], opts["rewind"], ids)
            rw.step(loss, gn)

    cpu = {"plain": [], "rewind": []}

    def timed(k, fn):
        def g():
            c0 = time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
        return g

    _common.time_samples({"plain": timed("plain", plain_run), "rewind": timed("rewind", rewind_run)},
                         repeats=args.loop_repeats, warmup=1)
    c = {k: v[1:] for k, v in cpu.items()}
    loop_ratio = statistics.median(b / a for a, b in zip(c["plain"], c["rewind"]))
    return {
        "hidden": hidden, "params_M": n_params / 1e6, "state_MB": state_bytes / 1e6,
        "bytes_per_param": state_bytes / n_params, "step_ms": step_ms, "snapshot_ms": snapshot_ms,
        "snapshot_fresh_ms": fresh_ms, "snapshot_disk_ms": disk_ms, "restore_ms": restore_ms,
        "cost_every10": 1 + snapshot_ms / 10 / step_ms, "cost_every100": 1 + snapshot_ms / 100 / step_ms,
        "loop_ratio": loop_ratio,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="64,256,1024")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3 if _common.quick() else 20)
    ap.add_argument("--repeats", type=int, default=3 if _common.quick() else 15)
    ap.add_argument("--loop-repeats", type=int, default=2 if _common.quick() else 7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(_common.describe())
    rows = []
    for h in [int(x) for x in args.hidden.split(",")]:
        rows.append(size_row(h, args))
        print(rows[-1])
    cols = ["hidden", "params_M", "state_MB", "bytes_per_param", "step_ms", "snapshot_ms", "snapshot_fresh_ms",
            "snapshot_disk_ms",
            "restore_ms", "cost_every10", "cost_every100", "loop_ratio"]
    _common.write_results("rewind_cpu", "sizes", rows, cols,
                          {"steps": args.steps, "repeats": args.repeats, "loop_repeats": args.loop_repeats,
                           "batch": args.batch, "seq": args.seq, "vocab": args.vocab},
                          notes="cost_everyK = 1 + snapshot_ms / K / step_ms (the amortised cost of a snapshot "
                                "every K steps); loop_ratio: a run of `steps` steps under Rewind(every=10) "
                                "against the plain loop, median of paired CPU-time ratios.")


if __name__ == "__main__":
    main()
