"""The fp16 early warning of ``nanguard.watch(history=N)`` on the demo's
training run: for each seed, the step of the first HeadroomWarning and of
the first non-finite loss (the lead), the module each names, and the
warnings issued by runs that stay finite (false alarms): the demo's nanguard
run (fp16, patched, gradient guard), the stock model in fp32 and in bf16
autocast. The watcher is given the run's GradScaler (``scaler=``) and the
stock run's ``record_dir=``: its failing step is replayed, and the layer of
the replay's first op (the first value made non-finite from finite inputs)
is the layer the first warning must name.

    python bench/bench_early_warning.py [--seeds 0 1 2 3 4] [--steps 60] [--mode sentinel]

Every run watches in ``--mode`` (default sentinel: no per-step census, the
score bounds and q / k projections every step). Appends to
bench/results/early_warning_cpu.jsonl (series seeds_sentinel; seeds for
--mode eager).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import warnings

import torch

import _common  # bench/_common.py
import nanguard
from nanguard import demo


def layer(module: str) -> str:
    """The transformer block a module belongs to (``transformer.h.1``)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if module.startswith("transformer.h.") else module


def run(seed: int, steps: int, mode: str, record_dir: str, watch_mode: str = "sentinel") -> dict:
    """mode: "stock" (fp16, eager attention, torch's GradScaler), "nanguard"
    (fp16, patched, nanguard's GradScaler), "fp32", "bf16" (stock model).
    The stock run's first non-finite step is recorded and replayed: the
    op checker's first op names where the overflow happened."""
    cfg = demo.Config(seed=seed, steps=steps, device="cpu")
    model = demo.build_model(cfg).train()
    if mode == "nanguard":
        nanguard.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    fp16 = mode in ("stock", "nanguard")
    scaler = (nanguard.amp.GradScaler if mode == "nanguard" else torch.amp.GradScaler)("cpu", enabled=fp16)
    rec = os.path.join(record_dir, f"seed{seed}") if mode == "stock" else None
    w = nanguard.watch(model, history=64, policy="record", parameters=False, scaler=scaler if fp16 else None,
                       record_dir=rec, mode=watch_mode)
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
    report = next((r for r in w.records if r.step == first_bad), None)
    ws = w.warnings
    w.remove()
    out = {"seed": seed, "mode": mode, "first_nonfinite": first_bad,
           "first_nonfinite_module": report.module if report is not None else None,
           "warnings": [{"step": x.step, "module": x.module, "pass": x.pass_, "bits_left": round(x.bits_left, 2),
                         "predicted_step": x.predicted_step} for x in ws]}
    if report is not None and getattr(report, "replay_path", None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = nanguard.replay(report.replay_path)
        out.update(recorded_step=int(os.path.basename(report.replay_path).split("step")[1].split(".")[0].split("-")[0]),
                   first_op=res.first_op, first_op_module=res.module, first_op_pass=res.pass_)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mode", choices=("sentinel", "eager"), default="sentinel",
                   help="nanguard.watch's mode for every run (sentinel: no per-step census)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    tmp = tempfile.mkdtemp(prefix="nanguard-early-warning-")
    for seed in args.seeds:
        for mode in ("stock", "nanguard", "fp32", "bf16"):
            r = run(seed, args.steps, mode, tmp, args.mode)
            rows.append(r)
            print(json.dumps(r), flush=True)
    table = []
    for seed in args.seeds:
        by = {r["mode"]: r for r in rows if r["seed"] == seed}
        s = by["stock"]
        fw = s["warnings"][0] if s["warnings"] else None
        fb = s["first_nonfinite"]
        where = s.get("first_op_module") or s["first_nonfinite_module"]
        op = None
        if s.get("first_op"):
            op = f"{s['first_op']} ({s.get('first_op_module')}, {s.get('first_op_pass')})"
        table.append({
            "seed": seed,
            "first_warning": f"{fw['step']} ({fw['module']} {fw['pass']})" if fw else None,
            "first_nonfinite": f"{fb if fb is not None else 'none'} ({s['first_nonfinite_module']})",
            "replay_first_op": op,
            "lead_steps": fb - fw["step"] if fw and fb is not None else None,
            "same_layer": bool(fw and where and layer(fw["module"]) == layer(where)),
            "false_alarms": " / ".join(str(len(by[m]["warnings"])) for m in ("nanguard", "fp32", "bf16")),
            "runs": [by[m] for m in ("stock", "nanguard", "fp32", "bf16")],
        })
    notes = ("watch(history=64, scaler=..., mode=...) with its defaults, one thread. first_warning: the stock "
             "fp16 run's "
             "first warning (step, module, pass); first_nonfinite: its first non-finite loss (watch's module); "
             "replay_first_op: the first op the replay of the recorded step names (module, pass), whose layer "
             "same_layer compares with the warning's; lead_steps: steps from the warning to the non-finite "
             "loss; false_alarms: warnings on the nanguard fp16 / fp32 / bf16 runs, which stay finite. "
             "runs: every run's record.")
    cols = ["seed", "first_warning", "first_nonfinite", "replay_first_op", "lead_steps", "same_layer",
            "false_alarms"]
    _common.write_results("early_warning_cpu", "seeds" if args.mode == "eager" else "seeds_sentinel", table, cols,
                          {"steps": args.steps, "mode": args.mode}, notes=notes,
                          dry=False)


if __name__ == "__main__":
    main()
