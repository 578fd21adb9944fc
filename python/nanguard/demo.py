"""``python -m nanguard demo``: one small Hugging Face causal LM trained
three times under the same seed and the same fp16 mixed-precision loop:
stock, stock under :class:`nanguard.Rewind`, and with nanguard's patch and
gradient guard, side by side.

The failure is the one nanguard exists for, produced for real, nothing
injected:

- **fp16 autocast** (``torch.autocast(dtype=torch.float16)`` with a loss
  scaler), on the CPU or on CUDA when present;
- **transformers' eager attention** (``attn_implementation="eager"``: the
  reference implementation, and what transformers falls back to whenever
  SDPA cannot serve a model or a feature such as ``output_attentions``). It
  forms ``q @ k.T`` with an fp16 matmul;
- **no warmup and a high learning rate** (AdamW at ``lr=0.2`` from step 0):
  the "attention logit growth" instability, which small models reproduce at
  high learning rates (Wortsman et al., 2023, "Small-scale proxies for
  large-scale Transformer training instabilities"). The raw scores ``q . k``
  grow as the *product* of two activations, so they pass fp16's 65504 while
  every activation is still small. The step it happens at depends on the
  CPU's fp16 kernels (the trajectory is chaotic): at ``lr=0.1`` a 2-core
  AVX2 machine overflowed at step 29 while an AVX-512 one stayed finite for
  80 steps; at ``lr=0.2`` the latter overflows at step 20, and so do seeds
  1 and 2 by steps 15 and 10.

From that step on the stock model's scores hold ``inf``, softmax turns them
into NaN, and the loss is NaN; the loss scaler skips every step and halves
its scale towards 0, so training is dead. The patched model
(``nanguard.patch``: attention through ``safe_sdpa``, which keeps scores in
fp32, the norms through ``stable_layernorm``, GPT-2's fp16-fragile
``gelu_new`` through PyTorch's fused tanh GELU) with the gradient guard
(``nanguard.amp.GradScaler.unscale_and_clip_``) sees exactly the same
weights, data and loop, and keeps learning. ``nanguard.watch`` names the
module where the stock run first went non-finite. The third run changes
nothing in the stock model or loop; :class:`nanguard.Rewind` snapshots it
every 5 steps, and when its loss goes NaN it goes back, finds the batch
finite from the earlier state (the state is to blame, not the data) and
lowers the learning rate until the run gets through.

The data is bytes of text that ships with Python itself (the source of the
standard library's ``argparse`` module): a byte-level language model,
nothing downloaded.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
import warnings
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from ._demo_model import Config, batches, build_model, corpus  # noqa: F401  (the demo's model and data)
from .functional import layer_norm, rms_norm

#: the survival test trains the stock model until its loss is NaN (at most
#: this many steps), then both a few steps further
SURVIVAL_MAX_STEPS = 80


@dataclasses.dataclass
class Run:
    name: str
    losses: List[float] = dataclasses.field(default_factory=list)
    grad_norms: List[float] = dataclasses.field(default_factory=list)
    skipped: List[int] = dataclasses.field(default_factory=list)  #: cumulative skipped steps
    report: Optional[object] = None  #: first recorded nanguard.watch report (else the first), if any
    history: Optional[object] = None  #: nanguard.watch's magnitude history (the stock run)
    patch_summary: Optional[object] = None
    rewind: Optional[object] = None  #: the nanguard.Rewind policy of a run with rewind
    seconds: float = 0.0


# ---- the training loop -----------------------------------------------------------------------


def train(cfg: Config, patched: bool, progress: Optional[Callable[[str], None]] = print,
          use_watch: bool = True, stop: Optional[Callable[[Run], bool]] = None,
          record_dir: Optional[str] = None, watch_mode: Optional[str] = None, rewind: bool = False) -> Run:
    """Train from the same seed on the same batches. Stock: the textbook
    fp16 loop (``GradScaler.unscale_`` then ``clip_grad_norm_``). nanguard:
    ``nanguard.patch(model)`` and ``GradScaler.unscale_and_clip_``. With
    ``record_dir``, the watcher keeps the magnitude history and saves the
    first non-finite step there. ``watch_mode``: ``nanguard.watch``'s
    ``mode`` (default: sentinel with ``record_dir``, else eager). With
    ``rewind``, the loop runs under :class:`nanguard.Rewind` (a snapshot
    every ``cfg.rewind_every`` steps): the run's curves are those of the
    steps that stood, and ``run.rewind`` is the policy with its events."""
    import nanguard

    run = Run(("nanguard" if patched else "stock") + ("+rewind" if rewind else ""))
    model = build_model(cfg).train()
    if patched:
        run.patch_summary = nanguard.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    dev = torch.device(cfg.device).type
    if patched:
        scaler = nanguard.amp.GradScaler(dev)
    else:
        scaler = torch.amp.GradScaler(dev)
    watcher = None
    if use_watch and hasattr(nanguard, "watch"):
        extra = dict(history=64, record_dir=record_dir, scaler=scaler) if record_dir is not None else {}
        watcher = nanguard.watch(model, policy="record", parameters=False, mode=watch_mode, **extra)
    data = batches(cfg, corpus())
    rw = nanguard.Rewind(model, opt, scaler=scaler, every=cfg.rewind_every, keep=4) if rewind else None
    steps = rw.loop(data, cfg.steps) if rw is not None else ((i, next(data)) for i in range(cfg.steps))
    skipped = 0
    t0 = time.perf_counter()
    for step, ids in steps:
        ids = ids.to(cfg.device)
        with torch.autocast(dev, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if watcher is not None:  # before the optimizer step: a saved step keeps the weights it started from
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", nanguard.HeadroomWarning)  # kept in watcher.warnings
                rep = watcher.step()
            # keep the first report, or the first recorded one after a GradScaler backoff's
            if rep is not None and (run.report is None or (run.report.replay_path is None and rep.replay_path)):
                run.report = rep
        scale_before = scaler.get_scale()
        if patched:
            gn = scaler.unscale_and_clip_(opt, max_norm=cfg.max_norm)
        else:
            scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        scaler.step(opt)
        scaler.update()
        if rw is not None and not rw.step(loss, gn):
            continue  # rewound: the run goes on from an earlier snapshot
        if scaler.get_scale() < scale_before:  # update() backs off only after a skipped step
            skipped += 1
        run.losses.append(float(loss.item()))
        run.grad_norms.append(float(gn.item()))
        run.skipped.append(skipped)
        if progress is not None and (step % 10 == 9 or step == cfg.steps - 1):
            progress(f"  [{run.name:8s}] step {step + 1:3d}/{cfg.steps}  loss {run.losses[-1]:7.4f}  "
                     f"skipped {skipped:3d}  {time.perf_counter() - t0:5.1f} s")
        if stop is not None and stop(run):
            break
    run.seconds = time.perf_counter() - t0
    if rw is not None:  # the steps that stood
        run.rewind = rw
        run.losses = [r.loss for r in rw.history]
        run.grad_norms = [r.grad_norm for r in rw.history]
        run.skipped = [sum(r.skipped for r in rw.history[: i + 1]) for i in range(len(rw.history))]
    if watcher is not None:
        run.history = watcher.history
        watcher.remove()
    return run


# ---- reporting ---------------------------------------------------------------------------------


def _f(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def verdict(run: Run) -> str:
    bad = [i for i, x in enumerate(run.losses) if not math.isfinite(x)]
    fin = [x for x in run.losses if math.isfinite(x)]
    if bad:
        return (f"NaN loss from step {bad[0] + 1} ({len(bad)} of {len(run.losses)} steps non-finite); "
                f"{_steps(run.skipped[-1])} skipped, training stalled at loss {_f(fin[-1]) if fin else 'nan'}")
    k = max(1, len(fin) // 5)
    first, last = sum(fin[:k]) / k, sum(fin[-k:]) / k
    trend = "decreasing" if last < first else "not decreasing"
    return (f"finite at every step; loss {_f(fin[0])} -> {_f(fin[-1])} "
            f"(mean of first/last {k}: {first:.3f} -> {last:.3f}, {trend}); {_steps(run.skipped[-1])} skipped")


def rewind_verdict(run: Run) -> str:
    """The verdict of a run with rewind, with what the rewinds did."""
    rw = run.rewind
    blames = ", ".join(f"{e.blame} blamed at step {e.trigger.step}" for e in rw.events)
    lr = ", ".join(f"{x:g}" for x in rw.current_lr())
    return (f"{verdict(run)}; {rw.rewinds} rewind{'s' if rw.rewinds != 1 else ''}"
            f"{' (' + blames + ')' if blames else ''}, {len(rw.skipped_batches)} batches skipped, "
            f"learning rate ended at {lr} (x{rw.lr_scale:g})")


def _runs(stock: Run, ours: Run, rewound: Optional[Run]) -> List[Run]:
    return [stock] + ([rewound] if rewound is not None else []) + [ours]


def table(stock: Run, ours: Run, rewound: Optional[Run] = None) -> List[str]:
    runs = _runs(stock, ours, rewound)
    names = [r.name for r in runs]
    lines = [f"{'step':>5}  " + "  ".join(f"{n + ' loss':>18}" for n in names) + "  "
             + f"{'skipped (' + '/'.join(names) + ')':>26}  {'grad norm (' + ' / '.join(names) + ')':>40}"]
    n = len(stock.losses)
    every = max(1, n // 20)
    for i in range(n):
        if i % every and i != n - 1 and not (math.isfinite(stock.losses[i - 1]) and not math.isfinite(stock.losses[i])):
            continue
        lines.append(f"{i + 1:5d}  " + "  ".join(f"{_f(r.losses[i]):>18}" for r in runs) + "  "
                     + f"{' / '.join(str(r.skipped[i]) for r in runs):>26}  "
                     + f"{' / '.join(f'{r.grad_norms[i]:.4g}' for r in runs):>40}")
    return lines


def write_csv(path: str, stock: Run, ours: Run, rewound: Optional[Run] = None) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        head = ["step", "stock_loss", "nanguard_loss", "stock_skipped", "nanguard_skipped",
                "stock_grad_norm", "nanguard_grad_norm"]
        if rewound is not None:
            head += ["rewind_loss", "rewind_skipped", "rewind_grad_norm"]
        w.writerow(head)
        for i in range(len(stock.losses)):
            row = [i + 1, stock.losses[i], ours.losses[i], stock.skipped[i], ours.skipped[i],
                   stock.grad_norms[i], ours.grad_norms[i]]
            if rewound is not None:
                row += [rewound.losses[i], rewound.skipped[i], rewound.grad_norms[i]]
            w.writerow(row)


def plot(path: str, stock: Run, ours: Run, cfg: Config, rewound: Optional[Run] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(stock.losses) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, ours.losses, label="nanguard (patched, gradient guard)", color="tab:green")
    if rewound is not None:
        rw = rewound.rewind
        ax.plot(steps, rewound.losses, label=f"stock + nanguard.Rewind ({rw.rewinds} rewinds, "
                f"lr x{rw.lr_scale:g})", color="tab:blue")
        for e in rw.events:
            ax.axvline(e.trigger.step + 1, color="tab:blue", alpha=0.25, linestyle=":")
    ax.plot(steps, [x if math.isfinite(x) else float("nan") for x in stock.losses], label="stock", color="tab:red")
    fin = [x for r in _runs(stock, ours, rewound) for x in r.losses if math.isfinite(x)]
    top = max(fin) if fin else 1.0
    bad = [s for s, x in zip(steps, stock.losses) if not math.isfinite(x)]
    if bad:
        ax.scatter(bad, [top] * len(bad), marker="x", color="tab:red", label="stock loss NaN")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT-2 ({cfg.n_layer} layers, {cfg.n_embd} wide), fp16 autocast, AdamW lr={cfg.lr}, no warmup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- op-level cases (kept short) ----------------------------------------------------------------------


def _fmt(t: torch.Tensor) -> str:
    t = t.float()
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    if nan or inf:
        return f"{nan} NaN, {inf} Inf"
    return f"finite, max |y| = {t.abs().max().item():.4g}"


def norm_cases() -> list[tuple[str, str, str]]:
    """(case, stock result, nanguard result) for the normalization failures."""
    g = torch.Generator().manual_seed(0)
    rows = []
    x = torch.full((4, 64), 0.5)
    rows.append(("LayerNorm, constant rows, eps=0",
                 _fmt(F.layer_norm(x, (64,), eps=0.0)), _fmt(layer_norm(x, (64,), eps=0.0))))
    z = torch.zeros(4, 64)
    rows.append(("RMSNorm, all-zero rows, eps=0",
                 _fmt(F.rms_norm(z, (64,), eps=0.0)), _fmt(rms_norm(z, (64,), eps=0.0))))
    h = (6.0e4 + 5000 * torch.rand(4, 64, generator=g)).clamp(max=65504).half()
    hand = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    rows.append(("RMSNorm in fp16, |x| ~ 6e4 (x^2 overflows)", _fmt(hand), _fmt(rms_norm(h, (64,), eps=1e-6))))
    x = torch.randn(4, 64, generator=g)
    x[1, 3] = float("nan")
    ours = layer_norm(x, (64,))
    rows.append(("NaN in row 1 (must stay NaN, rows 0,2,3 finite)",
                 _fmt(F.layer_norm(x, (64,))[1]),
                 f"row 1: {_fmt(ours[1])}; others: {_fmt(ours[[0, 2, 3]])}"))
    return rows


def print_norm_cases() -> None:
    rows = norm_cases()
    w = [max(len(r[i]) for r in rows + [("case", "stock PyTorch", "nanguard")]) for i in range(3)]
    print(f"{'case':<{w[0]}}  {'stock PyTorch':<{w[1]}}  nanguard")
    for case, stock, ours in rows:
        print(f"{case:<{w[0]}}  {stock:<{w[1]}}  {ours}")


# ---- main ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanguard demo", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--steps", type=int, default=Config.steps, help="training steps per run (default %(default)s)")
    p.add_argument("--lr", type=float, default=Config.lr, help="AdamW learning rate, no warmup (default %(default)s)")
    p.add_argument("--device", default=Config.device, help="cpu or cuda (default %(default)s)")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--out", default=".", help="folder for nanguard_demo.png and nanguard_demo.csv")
    p.add_argument("--no-watch", action="store_true", help="do not run nanguard.watch")
    p.add_argument("--ops", action="store_true", help="also print the op-level normalization cases")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the demo needs transformers: pip install 'nanguard[transformers]' (scripts/setup.sh does)",
              file=sys.stderr)
        return 2
    import nanguard

    cfg = Config(steps=args.steps, lr=args.lr, device=args.device, seed=args.seed)
    t0 = time.perf_counter()
    print(f"nanguard {nanguard.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {cfg.device}")
    print(f"GPT-2 byte-level LM ({cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads), batch "
          f"{cfg.batch} x {cfg.seq} bytes of argparse.py, fp16 autocast + loss scaling, AdamW lr={cfg.lr} "
          f"with no warmup, clip {cfg.max_norm}, seed {cfg.seed}, {cfg.steps} steps")
    print("stock: attn_implementation='eager' as built; nanguard: the same model after nanguard.patch(model), "
          "GradScaler.unscale_and_clip_")
    record_dir = os.path.join(args.out, "nanguard_demo_records")
    stock = train(cfg, patched=False, use_watch=not args.no_watch,
                  record_dir=None if args.no_watch else record_dir)
    rewound = train(cfg, patched=False, use_watch=False, rewind=True)
    ours = train(cfg, patched=True, use_watch=not args.no_watch)
    print()
    print(ours.patch_summary)
    print()
    for line in table(stock, ours, rewound):
        print(line)
    print()
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "nanguard_demo.csv")
    png_path = os.path.join(args.out, "nanguard_demo.png")
    write_csv(csv_path, stock, ours, rewound)
    plot(png_path, stock, ours, cfg, rewound)
    if stock.report is not None:
        print("nanguard.watch on the stock run (it counts steps from 0):")
        print(stock.report)
    elif not args.no_watch and hasattr(nanguard, "watch"):
        print("nanguard.watch on the stock run: every watched tensor finite")
    if not args.no_watch and hasattr(nanguard, "watch"):
        print("nanguard.watch on the nanguard run: "
              + ("every watched tensor finite" if ours.report is None else str(ours.report).splitlines()[0]))
    print()
    for e in rewound.rewind.events:
        print(f"on the stock+rewind run: {e}")
    print(f"verdict stock: {verdict(stock)}")
    print(f"verdict stock+rewind: {rewind_verdict(rewound)}")
    print(f"verdict nanguard: {verdict(ours)}")
    files = f"table: {csv_path}  plot: {png_path}"
    if stock.history is not None:
        heat = os.path.join(args.out, "nanguard_demo_history.png")
        stock.history.plot(heat)
        files += f"  magnitudes: {heat}"
        if stock.history.warnings:
            w = stock.history.warnings[0]
            print(f"early warning on the stock run: {w}")
    if stock.report is not None and getattr(stock.report, "replay_path", None):
        print(f"replaying the stock run's failing step with triage: python -m nanguard replay "
              f"{stock.report.replay_path} --triage")
        res = nanguard.replay(stock.report.replay_path, triage=True)
        print(f"verdict replay: {res.verdict}")
    print(f"{files}  ({time.perf_counter() - t0:.0f} s)")
    if args.ops:
        print()
        print_norm_cases()
    return 0
