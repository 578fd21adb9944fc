"""The CPU attention kernels of two builds of nanguard, A/B, in alternating
processes: for a kernel change that must not change speed.

    python bench/bench_attention_ab.py --before DIR_A --after DIR_B \
        [--rounds 8] [--isa avx512,avx2] [--threads 1]

DIR_A / DIR_B are build directories holding libnanguard.so (what
NANGUARD_LIB_DIR selects). The cases are bench_attention.py's CPU cases,
smaller: forward+backward (B=4, H=8, L=S=256, D=64), forward only under
inference_mode (L=S=512) and one decode step (q [8, 32, 1, 128] against a
KV cache of 2048 over 8 kv heads, a boolean padding mask), each in fp32 and
bf16. Each round starts one child process per (ISA path, build), the builds'
order alternating between rounds, and each child reports the median of a few
calls per case, in CPU seconds of the process (time.process_time: time spent
waiting for a core that other work holds does not count, so on a shared
machine this is far steadier than wall-clock time; with --threads 1 it is the
kernel's time). The table gives per case the median over rounds of both and
their ratio after / before (< 1: after is faster), with the smallest and
largest per-round ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ["fwd_bwd", "fwd", "decode"]
DTYPES = ["float32", "bfloat16"]


def child(repeats: int) -> None:
    import torch

    from nanguard.functional import safe_sdpa

    out = {}
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        g = torch.Generator().manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(dt)

        q, k, v = (rnd(4, 8, 256, 64).requires_grad_() for _ in range(3))

        def fwd_bwd():
            safe_sdpa(q, k, v).sum().backward()

        qf, kf, vf = (rnd(4, 8, 512, 64) for _ in range(3))

        def fwd():
            with torch.inference_mode():
                safe_sdpa(qf, kf, vf)

        qd, kd, vd = rnd(8, 32, 1, 128), rnd(8, 8, 2048, 128), rnd(8, 8, 2048, 128)
        mask = torch.ones(8, 1, 1, 2048, dtype=torch.bool)
        mask[::2, ..., 3 * 2048 // 4:] = False

        def decode():
            with torch.inference_mode():
                safe_sdpa(qd, kd, vd, attn_mask=mask, enable_gqa=True)

        for name, fn in (("fwd_bwd", fwd_bwd), ("fwd", fwd), ("decode", decode)):
            fn()
            ts = []
            for _ in range(repeats):
                t0 = time.process_time()
                fn()
                ts.append(time.process_time() - t0)
            out[f"{name}/{dt_name}"] = statistics.median(ts)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=False)
    p.add_argument("--after", required=False)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="calls per case in one child")
    p.add_argument("--isa", default="avx512,avx2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        child(args.repeats)
        return
    builds = {"before": args.before, "after": args.after}
    res: dict = {}
    for rnd in range(args.rounds):
        for isa in args.isa.split(","):
            for side in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                env = dict(os.environ, NANGUARD_LIB_DIR=builds[side], NANGUARD_CPU_ISA=isa)
                cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats),
                       "--threads", str(args.threads)]
                r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
                for case, t in r.items():
                    res.setdefault((isa, case), {}).setdefault(side, []).append(t)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"threads {args.threads}, {args.rounds} rounds x {args.repeats} calls "
          "(CPU ms of the process: median over rounds)")
    print("| ISA | case | before ms | after ms | after/before | per-round ratio min..max |")
    print("|---|---|---:|---:|---:|---|")
    for (isa, case), d in res.items():
        b, a = d["before"], d["after"]
        ratios = sorted(x / y for x, y in zip(a, b))
        print(f"| {isa} | {case} | {1e3 * statistics.median(b):.1f} | {1e3 * statistics.median(a):.1f} | "
              f"{statistics.median(ratios):.3f} | {ratios[0]:.2f}..{ratios[-1]:.2f} |")


if __name__ == "__main__":
    main()
