"""The cause-based early warnings (``nanguard.EarlyWarnings``) on the demo's
model: their lead over divergence and their false alarms, in fp16, bf16 and
fp32, over seeds and learning rates.

Each run is the demo's stock model and loop (GPT-2, 2 layers, width 64, one
head, eager attention, AdamW with no warmup, clip 1.0; fp16 with torch's
GradScaler, bf16 autocast, or fp32) for ``--steps`` steps, with
EarlyWarnings(model, optimizer, scaler) stepped after the backward pass.

A run **diverges** at its first non-finite loss, or, when every loss is
finite but the mean of the last 8 is above the first step's loss (it ends
worse than it began; Wortsman et al.'s criterion uses the final loss too),
at the first step from which every 8-step running mean of the loss stays
above the first step's loss. A
warning's **lead** is the divergence step minus the step of its first
warning (negative: it came late); a warning on a run that does not diverge
is a **false alarm**.

    python bench/bench_instability.py [--seeds 0 1 2 3 4] [--lrs 0.05 0.2 0.5] [--steps 60]

Appends one row per run and one per (dtype, lr, signal) to
bench/results/instability_cpu.jsonl (series runs and summary).
"""

from __future__ import annotations

import argparse
import math
import statistics
import warnings

import torch

import _common  # bench/_common.py
from nanguard import demo
from nanguard.diagnostics import EarlyWarnings
from nanguard.diagnostics._early_warnings import SIGNALS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


def divergence_step(losses):
    """The step the run diverged at (module docstring), or None."""
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            return i
    k = 8
    means = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
    if not means or means[-1] <= losses[0]:
        return None
    below = [i for i, m in enumerate(means) if m <= losses[0]]
    return below[-1] + 1 if below else 0


def run(dtype: str, lr: float, seed: int, steps: int) -> dict:
    cfg = demo.Config(lr=lr, seed=seed, steps=steps, device="cpu")
    model = demo.build_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    dt = DTYPES[dtype]
    scaler = torch.amp.GradScaler("cpu", enabled=dt == torch.float16)
    ew = EarlyWarnings(model, opt, scaler if dt == torch.float16 else None, emit=False)
    data = demo.batches(cfg, demo.corpus())
    losses = []
    for _ in range(steps):
        ids = next(data)
        with torch.autocast("cpu", dtype=dt or torch.float32, enabled=dt is not None):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        ew.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
    ew.remove()
    first = {s: None for s in SIGNALS}
    for w in ew.warnings:
        first[w.signal] = w.step
    return {"dtype": dtype, "lr": lr, "seed": seed, "diverged_at": divergence_step(losses),
            "final_loss": sum(losses[-8:]) / 8, **{f"warn:{s}": first[s] for s in SIGNALS},
            "losses": [x if math.isfinite(x) else str(x) for x in losses]}


def summarize(rows):
    out = []
    for dtype in DTYPES:
        for lr in sorted({r["lr"] for r in rows}):
            group = [r for r in rows if r["dtype"] == dtype and r["lr"] == lr]
            if not group:
                continue
            div = [r for r in group if r["diverged_at"] is not None]
            for s in SIGNALS:
                leads = [r["diverged_at"] - r[f"warn:{s}"] for r in div if r[f"warn:{s}"] is not None]
                out.append({
                    "dtype": dtype, "lr": lr, "signal": s, "runs": len(group), "diverged": len(div),
                    "warned_before": sum(1 for x in leads if x > 0), "missed": len(div) - len(leads),
                    "median_lead": statistics.median(leads) if leads else None,
                    "min_lead": min(leads) if leads else None,
                    "false_alarms": sum(1 for r in group if r["diverged_at"] is None and r[f"warn:{s}"] is not None),
                })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1] if _common.quick() else [0, 1, 2, 3, 4])
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--steps", type=int, default=20 if _common.quick() else 60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(_common.describe())
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in args.dtypes:
            for lr in args.lrs:
                for seed in args.seeds:
                    rows.append(run(dtype, lr, seed, args.steps))
                    print(rows[-1], flush=True)
    params = {"steps": args.steps, "seeds": args.seeds, "lrs": args.lrs}
    _common.write_results("instability_cpu", "runs", rows, [c for c in rows[0] if c != "losses"], params)
    summary = summarize(rows)
    _common.write_results("instability_cpu", "summary", summary, list(summary[0]), params,
                          notes="lead = divergence step - first warning step (> 0: before); false alarms: "
                                "warnings on runs that did not diverge. Divergence: first non-finite loss, or a "
                                "final loss (mean of the last 8) above the first step's.")


if __name__ == "__main__":
    main()
