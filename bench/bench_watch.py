"""Cost of finding the first NaN: nanguard.watch against what people use
instead, on a small transformer training step.

One step = zero_grad, forward (token embedding, nn.TransformerEncoder, LM
head), cross-entropy, backward, AdamW step. Variants, each on its own copy of
the same model, timed interleaved in the same process:

  plain      no instrumentation
  watch      nanguard.watch(model) on every module: forward outputs and
             inputs, output gradients, parameter gradients; w.step() per step
             (one device-to-host read)
  isnan      a forward hook on every module calling torch.isnan(t).any() on
             each output (a host sync per module, forward only)
  anomaly    torch.autograd.set_detect_anomaly(True) around forward+backward
             (backward only, traces every op)

Reports the median step time of each (wall clock, and the process's CPU
time of the same calls, which other processes on a shared machine do not
stretch) and its ratio to plain (the target for watch is <= 1.10).

    python bench/bench_watch.py [--layers 4] [--d-model 256] [--seq 128] [--batch 8]
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

import nanguard  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, mask):
        return self.head(self.norm(self.encoder(self.embed(ids), mask=mask, is_causal=True)))


def isnan_hooks(model):
    def hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            ts = [out]
        elif isinstance(out, (tuple, list)):
            ts = [t for t in out if isinstance(t, torch.Tensor)]
        else:
            ts = []
        for t in ts:
            if t.is_floating_point() and torch.isnan(t).any():
                raise RuntimeError(f"NaN in {type(mod).__name__}")

    return [m.register_forward_hook(hook) for m in model.modules()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5 if _common.quick() else 40)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = TinyLM(args.vocab, args.d_model, args.heads, args.layers, 4 * args.d_model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    mask = nn.Transformer.generate_square_subsequent_mask(args.seq)
    loss_fn = nn.CrossEntropyLoss()

    models = {k: copy.deepcopy(base) for k in ("plain", "watch", "isnan", "anomaly")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    w = nanguard.watch(models["watch"])
    isnan_hooks(models["isnan"])
    n_modules = sum(1 for _ in base.modules())

    def make_step(k):
        m, opt = models[k], opts[k]

        def step():
            opt.zero_grad(set_to_none=True)
            if k == "anomaly":
                with torch.autograd.set_detect_anomaly(True):
                    loss = loss_fn(m(ids, mask).flatten(0, 1), labels.flatten())
                    loss.backward()
            else:
                loss = loss_fn(m(ids, mask).flatten(0, 1), labels.flatten())
                loss.backward()
            if k == "watch":
                w.step()
            opt.step()

        return step

    fns = {k: make_step(k) for k in models}
    # Wall-clock medians from _common, and the process's CPU time of the same
    # calls: on a shared machine other processes stretch wall time, not this
    # process's CPU time (with one thread the two agree on an idle machine).
    cpu: dict[str, list[float]] = {k: [] for k in fns}

    def cpu_timed(k, f):
        def g():
            c0 = time.process_time()
            f()
            cpu[k].append(time.process_time() - c0)

        return g

    warmup = 3
    t = _common.time_fns({k: cpu_timed(k, f) for k, f in fns.items()}, repeats=args.repeats,
                         warmup=warmup)
    tc = {k: statistics.median(v[warmup:]) for k, v in cpu.items()}
    # count what one step records (w.step() resets, so stop before it)
    models["watch"].zero_grad()
    loss_fn(models["watch"](ids, mask).flatten(0, 1), labels.flatten()).backward()
    recorded = w.num_recorded
    w.step()
    rows = []
    for k in models:
        rows.append({
            "variant": k,
            "step_ms": t[k] * 1e3,
            "ratio_vs_plain": t[k] / t["plain"],
            "cpu_ms": tc[k] * 1e3,
            "cpu_ratio_vs_plain": tc[k] / tc["plain"],
        })
    config = {
        "layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
        "batch": args.batch, "vocab": args.vocab, "modules": n_modules,
        "threads": torch.get_num_threads(),
        "tensors_recorded_per_step": recorded, "repeats": args.repeats,
    }
    print(config)
    _common.write_results("watch_cpu", rows, ["variant", "step_ms", "ratio_vs_plain", "cpu_ms",
                                              "cpu_ratio_vs_plain"],
                          {"config": config})


if __name__ == "__main__":
    main()
