"""The fp16 early warning of ``nanguard.watch(history=N)`` on the demo's
training run: for each seed, the step of the first HeadroomWarning and of
the first non-finite loss (the lead), the module each names, and the
warnings issued by runs that stay finite (false alarms): the demo's nanguard
run (fp16, patched, gradient guard), the stock model in fp32 and in bf16
autocast.

    python bench/bench_early_warning.py [--seeds 0 1 2 3 4] [--steps 60]

Writes bench/results/early_warning_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import warnings

import torch

import nanguard
from nanguard import demo


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def run(seed: int, steps: int, mode: str) -> dict:
    """mode: "stock" (fp16, eager attention, torch's GradScaler), "nanguard"
    (fp16, patched, nanguard's GradScaler), "fp32", "bf16" (stock model)."""
    cfg = demo.Config(seed=seed, steps=steps, device="cpu")
    model = demo.build_model(cfg).train()
    if mode == "nanguard":
        nanguard.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    fp16 = mode in ("stock", "nanguard")
    scaler = (nanguard.amp.GradScaler if mode == "nanguard" else torch.amp.GradScaler)("cpu", enabled=fp16)
    w = nanguard.watch(model, history=64, policy="record", parameters=False)
    data = demo.batches(cfg, demo.corpus())
    first_bad = None
    for step in range(steps):
        ids = next(data)
        ctx = torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16, enabled=mode != "fp32")
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w.step()
        if mode == "nanguard":
            scaler.unscale_and_clip_(opt, max_norm=cfg.max_norm)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        scaler.step(opt)
        scaler.update()
        if first_bad is None and not math.isfinite(loss.item()):
            first_bad = step
        if first_bad is not None and step >= first_bad + 2:
            break
    report = w.records[0] if w.records else None
    ws = w.warnings
    w.remove()
    return {"seed": seed, "mode": mode, "first_nonfinite": first_bad,
            "first_nonfinite_module": report.module if report is not None and first_bad is not None else None,
            "warnings": [{"step": x.step, "module": x.module, "pass": x.pass_, "bits_left": round(x.bits_left, 2),
                          "predicted_step": x.predicted_step} for x in ws]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "early_warning_cpu"))
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in args.seeds:
        for mode in ("stock", "nanguard", "fp32", "bf16"):
            r = run(seed, args.steps, mode)
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "steps": args.steps, "threads": 1}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "runs": rows}, f, indent=1)
    lines = [f"# fp16 early warning on the demo run ({meta['cpu']}, torch {meta['torch']}, one thread)", "",
             "| seed | stock: first warning (module) | stock: first non-finite | lead (steps) | false alarms: "
             "nanguard fp16 / fp32 / bf16 |", "|---|---|---|---|---|"]
    for seed in args.seeds:
        by = {r["mode"]: r for r in rows if r["seed"] == seed}
        s = by["stock"]
        fw = s["warnings"][0] if s["warnings"] else None
        fb = s["first_nonfinite"]
        lead = fb - fw["step"] if fw and fb is not None else None
        fa = " / ".join(str(len(by[m]["warnings"])) for m in ("nanguard", "fp32", "bf16"))
        lines.append(f"| {seed} | {fw['step'] if fw else '-'} ({fw['module'] + ' ' + fw['pass'] if fw else '-'}) | "
                     f"{fb if fb is not None else 'none'} ({s['first_nonfinite_module']}) | "
                     f"{lead if lead is not None else '-'} | {fa} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
