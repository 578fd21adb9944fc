"""Cost of finding the first NaN: nanguard.watch against what people use
instead, on a small transformer training step, and across model sizes.

Default (``--sizes``): a Hugging Face Llama training step (2 decoder layers,
hidden 64, 256 and 1024, eager attention; forward, cross-entropy, backward,
nanguard.clip_grad_norm_, AdamW step) with the gradient guard alone against
the same step with nanguard.watch(model) on every module and w.step(). Each
size times both in alternating order per repeat, and reports the medians and
the median of the paired ratios (watch / guard), for wall clock and for the
process's CPU time (which other processes on a shared machine do not
stretch). Series sizes (sizes_history, sizes_record with --history, --record)
of bench/results/watch_cpu.jsonl.

    python bench/bench_watch.py [--hidden 64,256,1024] [--seq 64] [--batch 4]

``--mode sentinel``: the watched variant is ``watch(mode="sentinel")`` with
the --history / --record options (no per-step census: one fused finiteness
test of the losses and gradients per step, and the census on one step in
``census_every``), against the guard alone; series sizes_sentinel*.

``--floor``: where a watched step's time goes, at each size: the bytes the
census reads per step and the time its calls take in the step (each call
of the op timed where it runs, so a tensor a GEMM has just written and left
out of the caches is read at the rate it really is), against the step; and
the same alternating loop with the census replaced by a no-op, which leaves
what the hooks and the bookkeeping cost. Series floor.

    python bench/bench_watch.py --floor [--hidden 64,256,1024]

``--compare``: the older comparison on a TransformerEncoder LM, series
variants:

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

Reports the median step time of each (wall clock and CPU time) and its
ratio to plain.

    python bench/bench_watch.py --compare [--layers 4] [--d-model 256] [--seq 128] [--batch 8]

Both run on one thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

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


def cpu_timed(samples: List[float], fn: Callable[[], object]) -> Callable[[], None]:
    """fn, appending the process CPU time of each call to samples."""
    def g():
        c0 = time.process_time()
        fn()
        samples.append(time.process_time() - c0)

    return g


# ---- the comparison with isnan hooks and detect_anomaly -------------------------------------


def compare(args) -> None:
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

    def make_step(k):
        m, opt = models[k], opts[k]

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autograd.set_detect_anomaly(k == "anomaly"):
                loss = loss_fn(m(ids, mask).flatten(0, 1), labels.flatten())
                loss.backward()
            if k == "watch":
                w.step()
            opt.step()

        return step

    cpu: Dict[str, List[float]] = {k: [] for k in models}
    warmup = 3
    t = _common.time_fns({k: cpu_timed(cpu[k], make_step(k)) for k in models},
                         repeats=args.repeats, warmup=warmup)
    tc = {k: statistics.median(v[warmup:]) for k, v in cpu.items()}
    models["watch"].zero_grad()  # count what one step records (w.step() resets)
    loss_fn(models["watch"](ids, mask).flatten(0, 1), labels.flatten()).backward()
    recorded = w.num_recorded
    w.step()
    rows = [{"variant": k, "step_ms": t[k] * 1e3, "ratio_vs_plain": t[k] / t["plain"],
             "cpu_ms": tc[k] * 1e3, "cpu_ratio_vs_plain": tc[k] / tc["plain"]} for k in models]
    config = {
        "layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
        "batch": args.batch, "vocab": args.vocab, "modules": sum(1 for _ in base.modules()),
        "threads": torch.get_num_threads(), "tensors_recorded_per_step": recorded,
        "repeats": args.repeats,
    }
    print(config)
    _common.write_results("watch_cpu", "variants", rows, ["variant", "step_ms", "ratio_vs_plain", "cpu_ms",
                                              "cpu_ratio_vs_plain"], {"config": config})


# ---- watch against the guard alone, across model sizes --------------------------------------


def tiny_llama(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64),
                      max_position_embeddings=1024)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def llama_case(hidden: int, args, kinds: List[str]):
    """The Llama case at one size: (base model, batch, a deep copy and an
    AdamW per kind, the paired repeats)."""
    torch.manual_seed(0)
    base = tiny_llama(hidden, args.layers_llama, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch_llama, args.seq_llama))
    models = {k: copy.deepcopy(base) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    repeats = args.repeats_llama or max(8, min(40, int(40 * 128 / hidden)))
    return base, ids, models, opts, repeats


def guarded_step(m, opt, w, ids, before: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """One step of the case: forward, loss, backward, nanguard.clip_grad_norm_,
    w.step() (when watched), AdamW; before() first."""
    def step():
        before()
        opt.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
        nanguard.clip_grad_norm_(m.parameters(), 1.0)
        if w is not None:
            w.step()
        opt.step()

    return step


def size_row(hidden: int, args) -> dict:
    """Paired, alternating timing of the guarded step with and without watch.
    With --history / --record, a third variant (watch with those on) runs in
    the same alternating loop, so that what they add to plain watch is a
    same-process ratio too."""
    extra = {}
    if args.history:
        extra["history"] = args.history
    if args.record:
        extra["record_dir"] = tempfile.mkdtemp(prefix="nanguard-bench-")
    sentinel = args.mode == "sentinel"
    kinds = ["guard", "watch"] + (["forensics"] if extra and not sentinel else [])
    base, ids, models, opts, repeats = llama_case(hidden, args, kinds)
    if sentinel:  # the one watched variant: sentinel mode with the options given
        watchers = {"watch": nanguard.watch(models["watch"], mode="sentinel", **extra)}
    else:
        watchers = {"watch": nanguard.watch(models["watch"])}
    if extra and not sentinel:
        watchers["forensics"] = nanguard.watch(models["forensics"], **extra)
    cpu: Dict[str, List[float]] = {k: [] for k in kinds}
    warmup = 2
    steps = {k: cpu_timed(cpu[k], guarded_step(models[k], opts[k], watchers.get(k), ids)) for k in kinds}
    wall = _common.time_samples(steps, repeats, warmup)
    w = watchers["watch"]
    models["watch"].zero_grad()  # count what one step records (w.step() resets)
    models["watch"](input_ids=ids, labels=ids).loss.backward()
    recorded = w.num_recorded
    w.step()
    for x in watchers.values():
        x.remove()
    c = {k: v[warmup:] for k, v in cpu.items()}
    last = kinds[-1]

    def ratio(samples, a, b):
        return statistics.median(y / x for x, y in zip(samples[a], samples[b]))

    row = {
        "hidden": hidden, "params_M": sum(p.numel() for p in base.parameters()) / 1e6,
        "modules": len(w.watched), "records": recorded, "repeats": repeats,
        "guard_ms": statistics.median(wall["guard"]) * 1e3, "watch_ms": statistics.median(wall[last]) * 1e3,
        "ratio": ratio(wall, "guard", last),
        "guard_cpu_ms": statistics.median(c["guard"]) * 1e3, "watch_cpu_ms": statistics.median(c[last]) * 1e3,
        "cpu_ratio": ratio(c, "guard", last),
    }
    if extra and not sentinel:  # plain watch in the same loop, and what history / record add to it
        row.update(plain_watch_cpu_ratio=ratio(c, "guard", "watch"), added_cpu_ratio=ratio(c, "watch", last),
                   added_ratio=ratio(wall, "watch", last))
    return row


def floor_row(hidden: int, args) -> dict:
    """The census's share of a watched step (history and the recorder on, as
    ``--history 64 --record``), measured two ways in one alternating loop:
    the sum of the census calls' own times, and the step with the census
    replaced by a no-op (what is left is the hooks' Python)."""
    from nanguard.diagnostics import _watch

    kinds = ["guard", "watch", "no_census"]
    _, ids, models, opts, repeats = llama_case(hidden, args, kinds)
    watchers = {k: nanguard.watch(models[k], history=64, record_dir=tempfile.mkdtemp(prefix="nanguard-bench-"))
                for k in kinds[1:]}
    real = _watch._op
    census_ns: List[int] = []
    census_bytes: List[int] = []

    def timed(t, counts, values, slot):
        t0 = time.perf_counter_ns()
        real(t, counts, values, slot)
        census_ns.append(time.perf_counter_ns() - t0)
        census_bytes.append(t.numel() * t.element_size())

    ops = {"guard": real, "watch": timed, "no_census": lambda *a: None}

    def use(k):
        def before():
            _watch._op = ops[k]

        return before

    cpu: Dict[str, List[float]] = {k: [] for k in kinds}
    warmup = 2
    steps = {k: cpu_timed(cpu[k], guarded_step(models[k], opts[k], watchers.get(k), ids, use(k))) for k in kinds}
    try:
        _common.time_samples(steps, repeats, warmup)
    finally:
        _watch._op = real
        for w in watchers.values():
            w.remove()
    c = {k: v[warmup:] for k, v in cpu.items()}
    steps = repeats + warmup
    guard = statistics.median(c["guard"])
    per_step_ms = sum(census_ns) / steps / 1e6
    per_step_mb = sum(census_bytes) / steps / 1e6

    def ratio(a, b):
        return statistics.median(y / x for x, y in zip(c[a], c[b]))

    return {"hidden": hidden, "repeats": repeats, "guard_cpu_ms": guard * 1e3,
            "census_calls": len(census_ns) // steps, "census_MB": per_step_mb, "census_ms": per_step_ms,
            "census_GBps": per_step_mb / per_step_ms if per_step_ms else 0.0,
            "census_share": per_step_ms / (guard * 1e3),
            "watch_cpu_ratio": ratio("guard", "watch"), "no_census_cpu_ratio": ratio("guard", "no_census")}


def floor(args) -> None:
    rows = []
    for h in (int(v) for v in args.hidden.split(",")):
        rows.append(floor_row(h, args))
        print(rows[-1], flush=True)
    config = {"layers": args.layers_llama, "seq": args.seq_llama, "batch": args.batch_llama,
              "vocab": args.vocab, "threads": torch.get_num_threads(), "watch_kwargs": {"history": 64,
              "record_dir": True}, "load_average_after": os.getloadavg() if hasattr(os, "getloadavg") else None}
    _common.write_results("watch_cpu", "floor", rows,
                          ["hidden", "repeats", "guard_cpu_ms", "census_calls", "census_MB", "census_ms",
                           "census_GBps", "census_share", "watch_cpu_ratio", "no_census_cpu_ratio"],
                          {"config": config})


def sizes(args) -> None:
    rows = []
    for h in (int(v) for v in args.hidden.split(",")):
        rows.append(size_row(h, args))
        print(rows[-1], flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    config = {"layers": args.layers_llama, "seq": args.seq_llama, "batch": args.batch_llama,
              "vocab": args.vocab, "threads": torch.get_num_threads(), "cpu_model": _common.cpu_model(),
              "load_average_after": load}
    print(config)
    config["watch_kwargs"] = {"mode": args.mode, "history": args.history, "record_dir": bool(args.record)}
    name = ("sizes" + ("_sentinel" if args.mode == "sentinel" else "") + ("_history" if args.history else "")
            + ("_record" if args.record else ""))
    cols = ["hidden", "params_M", "modules", "records", "repeats", "guard_ms", "watch_ms", "ratio",
            "guard_cpu_ms", "watch_cpu_ms", "cpu_ratio"]
    if (args.history or args.record) and args.mode == "eager":
        cols += ["plain_watch_cpu_ratio", "added_cpu_ratio", "added_ratio"]
    _common.write_results("watch_cpu", name, rows, cols, {"config": config})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compare", action="store_true",
                   help="the TransformerEncoder comparison with isnan hooks and detect_anomaly")
    p.add_argument("--floor", action="store_true",
                   help="the census's bytes and time per watched step, and the step without the census")
    p.add_argument("--hidden", default="64,256,1024", help="Llama hidden sizes (default and --floor modes)")
    p.add_argument("--history", type=int, default=0, help="watch(history=N): the magnitude history and early warning")
    p.add_argument("--record", action="store_true", help="watch(record_dir=...): the flight recorder")
    p.add_argument("--mode", choices=("eager", "sentinel"), default="eager",
                   help="sentinel: the watched variant is watch(mode='sentinel', ...) (no per-step census), "
                        "timed against the guard alone")
    p.add_argument("--layers-llama", type=int, default=2)
    p.add_argument("--seq-llama", type=int, default=64)
    p.add_argument("--batch-llama", type=int, default=4)
    p.add_argument("--repeats-llama", type=int, default=5 if _common.quick() else 0,
                   help="paired repeats per size (0: 40 at hidden 64, 20 at 256, 8 at 1024)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5 if _common.quick() else 40)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compare:
        compare(args)
    elif args.floor:
        floor(args)
    else:
        sizes(args)


if __name__ == "__main__":
    main()
