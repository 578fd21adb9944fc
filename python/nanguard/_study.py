"""``nanguard.study`` / ``python -m nanguard study``: why some seeds diverge,
measured on a model by short training runs over a grid.

Three questions, each answered from the runs and no further:

1. **Seed attribution.** A grid of initialisation seeds x data-order seeds,
   each run the same loop. Which runs diverge and at which step; how much of
   the variance of "diverged" the init seed, the data order and the rest
   explain (a two-way decomposition of sums of squares, without
   replication: the rest is interaction and noise together), with a
   bootstrap interval over the seeds; and, from each diverging run's
   :class:`nanguard.Rewind` data-versus-state test (its failing batch run
   again from the last snapshot before it, 1-5 steps earlier), whether the
   batch or the state was to blame.
2. **Early predictors.** For each signal of :class:`nanguard.EarlyWarnings`
   (attention-logit bound, output log Z, Adam's update RMS) and the gradient
   norm and loss scale, its largest value over the first ``k`` steps as a
   predictor of divergence by the end: ROC AUC (0.5: no better than chance),
   for each ``k``, over the runs still finite at step ``k``.
3. **LR sensitivity** (Wortsman et al. 2023): over a learning-rate sweep,
   ``mean_lr [min(final loss, initial loss)] - min_lr final loss``, for the
   baseline and each fix (qk-norm, z-loss, soft-cap, warmup, the residual
   init rescale, ``nanguard.patch``). Lower is more robust.

A run **diverges** at its first non-finite loss, or, all finite, when its
last 8 losses average above its first one (at the first step from which
every 8-step mean stays above the first loss).

Runs execute in parallel processes, one thread each; each finished run is
appended to ``<out>/runs.jsonl`` and a restarted study skips it. Under
``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) the runs are dealt out over the
ranks, each writing its own file; rank 0 writes the report once all are in.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["study", "StudyConfig", "divergence_step", "roc_auc", "seed_decomposition", "lr_sensitivity",
           "FIXES", "SIGNALS"]

#: a predictor is ranked only with at least this many runs in each class
MIN_CLASS = 3
FIXES = ("baseline", "qk_norm", "z_loss", "softcap", "warmup", "init_rescale", "patch")
#: signal -> (where it comes from, whether larger is worse)
SIGNALS = {"attention logit": True, "output log Z": True, "Adam update RMS": True, "grad norm": True,
           "loss scale": False}


@dataclasses.dataclass
class StudyConfig:
    """What :func:`study` runs, with the demo's loop: fp16 autocast with
    torch's GradScaler (or bf16 / fp32), AdamW without warmup, clip 1.0.

    ``model``: the demo's GPT-2 (``"gpt2"``), a Llama of the same size
    (``"llama"``), a transformers config (``AutoModelForCausalLM.from_config``
    after ``torch.manual_seed(init_seed)``), or a callable
    ``model(init_seed) -> causal LM`` (called with ``input_ids=`` and
    ``labels=``, returning ``.loss`` and ``.logits``). ``data``: None for the
    demo's byte-level batches of ``argparse.py``, or a callable
    ``data(data_seed) -> iterator of input_ids batches``. Callables must be
    importable (module-level functions): the runs execute in other
    processes."""

    model: object = "gpt2"
    data: object = None
    init_seeds: int = 8
    data_seeds: int = 8
    steps: int = 40
    lr: float = 0.2  #: the seed grid's learning rate
    lrs: Tuple[float, ...] = (0.01, 0.03, 0.1, 0.2, 0.3)  #: the sensitivity sweep
    fixes: Tuple[str, ...] = FIXES
    ks: Tuple[int, ...] = (3, 5, 8, 12)  #: predictor horizons
    dtype: str = "fp16"
    sweep_seeds: int = 3  #: seeds per (fix, learning rate) of the sweep (init and data seed alike)

    @classmethod
    def quick(cls, **kw) -> "StudyConfig":
        """A grid that finishes on 2 CPU cores in a few minutes."""
        base = dict(init_seeds=3, data_seeds=3, steps=24, lrs=(0.03, 0.1, 0.3), ks=(3, 5, 8), sweep_seeds=1)
        base.update(kw)
        return cls(**base)


# ---- the statistics ---------------------------------------------------------------------------


def divergence_step(losses: Sequence[float]) -> Optional[int]:
    """The step a run diverged at (module docstring), or None."""
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            return i
    k = 8
    if len(losses) < k:
        return None
    means = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
    if means[-1] <= losses[0]:
        return None
    below = [i for i, m in enumerate(means) if m <= losses[0]]
    return below[-1] + 1 if below else 0


def roc_auc(pos: Sequence[float], neg: Sequence[float]) -> Optional[float]:
    """P(a positive's score > a negative's), ties counting half (the
    Mann-Whitney form of the ROC AUC); None when a class is empty."""
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _fractions(grid: List[List[float]]) -> Tuple[float, float, float]:
    rows, cols = len(grid), len(grid[0])
    grand = sum(map(sum, grid)) / (rows * cols)
    total = sum((x - grand) ** 2 for r in grid for x in r)
    if total == 0:
        return math.nan, math.nan, math.nan
    ss_i = cols * sum((sum(r) / cols - grand) ** 2 for r in grid)
    ss_d = rows * sum((sum(grid[i][j] for i in range(rows)) / rows - grand) ** 2 for j in range(cols))
    return ss_i / total, ss_d / total, (total - ss_i - ss_d) / total


def seed_decomposition(grid: List[List[float]], boot: int = 1000, seed: int = 0) -> Dict[str, object]:
    """Shares of the variance of ``grid[init][data]`` (1.0 diverged, 0.0
    not) explained by the init seed, the data seed and the rest, with 5-95%
    bootstrap intervals (init and data seeds resampled with replacement)."""
    point = _fractions(grid)
    rng = random.Random(seed)
    rows, cols = len(grid), len(grid[0])
    samples = []
    for _ in range(boot):
        ri = [rng.randrange(rows) for _ in range(rows)]
        cj = [rng.randrange(cols) for _ in range(cols)]
        f = _fractions([[grid[i][j] for j in cj] for i in ri])
        if not math.isnan(f[0]):
            samples.append(f)

    def interval(k):
        if len(samples) < 20:
            return None
        v = sorted(s[k] for s in samples)
        return (v[int(0.05 * (len(v) - 1))], v[int(0.95 * (len(v) - 1))])

    return {"init": point[0], "data": point[1], "rest": point[2],
            "init_90": interval(0), "data_90": interval(1), "rest_90": interval(2), "bootstrap": len(samples)}


def lr_sensitivity(final: Dict[float, float], initial: float) -> Optional[float]:
    """Wortsman et al.'s ``E_lr[min(final, initial)] - min_lr final``; a
    non-finite final loss counts as the initial loss."""
    if not final:
        return None
    clipped = [min(v, initial) if math.isfinite(v) else initial for v in final.values()]
    return sum(clipped) / len(clipped) - min(clipped)


# ---- one run ----------------------------------------------------------------------------------


def _build(cfg: StudyConfig, init_seed: int):
    from . import _demo_model as demo

    if callable(cfg.model):
        return cfg.model(init_seed)
    if not isinstance(cfg.model, str):  # a transformers config
        from transformers import AutoModelForCausalLM

        torch.manual_seed(init_seed)
        return AutoModelForCausalLM.from_config(cfg.model)
    dcfg = demo.Config(seed=init_seed, device="cpu")
    if cfg.model == "gpt2":
        return demo.build_model(dcfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(init_seed)
    lc = LlamaConfig(vocab_size=256, hidden_size=dcfg.n_embd, intermediate_size=4 * dcfg.n_embd,
                     num_hidden_layers=dcfg.n_layer, num_attention_heads=dcfg.n_head,
                     max_position_embeddings=dcfg.seq, attn_implementation="eager")
    return LlamaForCausalLM(lc)


def run_one(cfg: StudyConfig, init_seed: int, data_seed: int, lr: float, fix: str, rewind: bool) -> dict:
    """One training run: per-step losses and signals, its divergence step,
    and (``rewind``) its first rewind's blame (the run stops there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(cfg, init_seed, data_seed, lr, fix, rewind)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: StudyConfig, init_seed: int, data_seed: int, lr: float, fix: str, rewind: bool) -> dict:
    import warnings

    from . import _demo_model as demo
    from ._losses import z_loss
    from ._stability import rescale_residual_init, warmup
    from .diagnostics import EarlyWarnings
    from .patching import patch
    from .rewind import Rewind, RewindError

    model = _build(cfg, init_seed).train()
    if fix == "init_rescale":  # on GPT-2, whose own init already has it, this applies it a second time
        rescale_residual_init(model)
    if fix in ("qk_norm", "patch", "softcap"):
        opts = {"qk_norm": dict(attention=False, norm=False, activation=False, qk_norm=True),
                "patch": {}, "softcap": dict(norm=False, activation=False, softcap=30.0)}[fix]
        patch(model, **opts)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = warmup(opt, max(1, cfg.steps // 4)) if fix == "warmup" else None
    fp16 = cfg.dtype == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    ew = EarlyWarnings(model, opt, scaler if fp16 else None, emit=False)
    rw = Rewind(model, opt, scaler=scaler, scheduler=sched, every=5, keep=2, loss_spike=None,
                         max_rewinds=1) if rewind else None
    data = cfg.data(data_seed) if cfg.data is not None else demo.batches(demo.Config(seed=data_seed), demo.corpus())
    losses, sig = [], {s: [] for s in SIGNALS}
    blame, blamed_step, failing = None, None, None
    ctx = dict(device_type="cpu", dtype=torch.float16 if fp16 else torch.bfloat16, enabled=cfg.dtype != "fp32")
    steps = rw.loop(data, cfg.steps) if rw is not None else ((i, next(data)) for i in range(cfg.steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _, ids in steps:
            with torch.autocast(**ctx):
                out = model(input_ids=ids, labels=ids)
            loss = out.loss
            if fix == "z_loss":
                loss = loss + z_loss(out.logits, 1e-4)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            ew.step()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if sched is not None:
                sched.step()
            lv = float(out.loss)
            if rw is not None:
                try:
                    stands = rw.step(lv, gn)
                except RewindError:
                    stands = True
                if not stands and failing is None:
                    failing = lv  # the trigger's step; the next is the data-versus-state probe
                if rw.events:  # the probe is done: its blame, and the run's failing step, then stop
                    blame, blamed_step = rw.events[0].blame, rw.events[0].trigger.step
                    losses.append(failing)
                    break
                if not stands:
                    continue
            losses.append(lv)
            last = {k: d[-1][1] for k, d in ew.series.items() if d}
            for s in ("attention logit", "output log Z", "Adam update RMS"):
                sig[s].append(last.get(s, math.nan))
            sig["grad norm"].append(float(gn))
            sig["loss scale"].append(float(scaler.get_scale()) if fp16 else 1.0)
    ew.remove()
    if rw is not None:
        rw.close()
    return {"init_seed": init_seed, "data_seed": data_seed, "lr": lr, "fix": fix,
            "diverged_at": blamed_step if blame is not None else divergence_step(losses),
            "blame": blame, "blamed_step": blamed_step,
            "initial_loss": losses[0] if losses else math.nan,
            "final_loss": sum(losses[-8:]) / len(losses[-8:]) if losses and len(losses) >= cfg.steps else math.nan,
            "losses": losses, "signals": sig}


# ---- the study --------------------------------------------------------------------------------


def _jobs(cfg: StudyConfig) -> List[Tuple[str, dict]]:
    jobs = []
    for i in range(cfg.init_seeds):
        for j in range(cfg.data_seeds):
            jobs.append((f"grid/{cfg.lr:g}/{i}/{j}", dict(init_seed=i, data_seed=j, lr=cfg.lr, fix="baseline",
                                                         rewind=True)))
    for fix in cfg.fixes:
        for lr in cfg.lrs:
            for seed in range(cfg.sweep_seeds):
                jobs.append((f"lr/{fix}/{lr:g}/{seed}", dict(init_seed=seed, data_seed=seed, lr=lr, fix=fix,
                                                             rewind=False)))
    return jobs


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _unjson(x):
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, dict):
        return {k: _unjson(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unjson(v) for v in x]
    return x


def _load(paths: List[str]) -> Dict[str, dict]:
    done = {}
    for p in paths:
        if os.path.exists(p):
            with open(p) as f:
                for line in f:
                    if line.strip():
                        d = _unjson(json.loads(line))
                        done[d["key"]] = d
    return done


def _work(args):
    cfg, key, kw = args
    return key, run_one(cfg, **kw)


def _progress(n: int, total: int, t0: float, key: str) -> None:
    width = 30
    fill = int(width * n / max(total, 1))
    line = f"[{'#' * fill}{'.' * (width - fill)}] {n}/{total} runs  {time.perf_counter() - t0:5.0f} s  {key}"
    if sys.stderr.isatty():
        print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def study(cfg: Optional[StudyConfig] = None, out: str = "nanguard_study", workers: Optional[int] = None,
          progress: bool = True) -> dict:
    """Run (or resume) the study of ``cfg`` into the folder ``out``; write
    ``runs.jsonl``, ``study.json``, ``study.md`` and the plots; return the
    summary (``study.json``'s content)."""
    cfg = cfg or StudyConfig()
    if not isinstance(cfg, StudyConfig):
        raise TypeError(f"cfg must be a nanguard.StudyConfig, got {type(cfg).__name__}")
    bad = [f for f in cfg.fixes if f not in FIXES]
    if bad:
        raise ValueError(f"fixes: unknown {bad}; choose from {', '.join(FIXES)}")
    for name in ("init_seeds", "data_seeds", "steps"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not cfg.lrs or any(not 0 < lr < math.inf for lr in cfg.lrs):
        raise ValueError(f"lrs must be learning rates > 0, got {cfg.lrs!r}")
    if isinstance(cfg.model, str) and cfg.model not in ("gpt2", "llama"):
        raise ValueError(f"model must be 'gpt2', 'llama', a transformers config or a callable; got {cfg.model!r}")
    if not isinstance(cfg.model, str) and not callable(cfg.model) and not hasattr(cfg.model, "model_type"):
        raise TypeError(f"model must be 'gpt2', 'llama', a transformers config or a callable; got "
                        f"{type(cfg.model).__name__}")
    if cfg.data is not None and not callable(cfg.data):
        raise TypeError(f"data must be None or a callable data(seed) -> batches, got {type(cfg.data).__name__}")
    if cfg.dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype must be fp16, bf16 or fp32; got {cfg.dtype!r}")
    os.makedirs(out, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    paths = [os.path.join(out, "runs.jsonl" if world == 1 else f"runs.rank{r}.jsonl") for r in range(world)]
    done = _load(paths)
    jobs = [j for n, j in enumerate(_jobs(cfg)) if n % world == rank and j[0] not in done]
    total = len(_jobs(cfg))
    workers = workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    with open(paths[rank], "a") as f:
        def record(key, res):
            res["key"] = key
            done[key] = res
            f.write(json.dumps(_json_safe(res)) + "\n")
            f.flush()
            if progress:
                _progress(sum(1 for k in done if k in dict(_jobs(cfg))), total, t0, key)

        if workers == 1:
            for key, kw in jobs:
                record(key, run_one(cfg, **kw))
        else:
            ctx = __import__("multiprocessing").get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                for key, res in pool.map(_work, [(cfg, k, kw) for k, kw in jobs]):
                    record(key, res)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    if rank != 0:
        return {}
    while world > 1 and len(_load(paths)) < total:  # the other ranks' runs
        time.sleep(5)
    return report(cfg, _load(paths), out)


# ---- the report -------------------------------------------------------------------------------


def _summarise(cfg: StudyConfig, runs: Dict[str, dict]) -> dict:
    grid = [[runs[f"grid/{cfg.lr:g}/{i}/{j}"] for j in range(cfg.data_seeds)] for i in range(cfg.init_seeds)]
    div = [[1.0 if r["diverged_at"] is not None else 0.0 for r in row] for row in grid]
    flat = [r for row in grid for r in row]
    blames = {b: sum(1 for r in flat if r["blame"] == b) for b in ("data", "state", "untested")}
    by_data, same, pairs = {}, 0, 0
    for j in range(cfg.data_seeds):
        steps = [r["diverged_at"] for r in (grid[i][j] for i in range(cfg.init_seeds)) if r["diverged_at"] is not None]
        by_data[j] = sorted(steps)
        for a in range(len(steps)):  # two init seeds, one data order: the same batch at the same step
            for b in range(a + 1, len(steps)):
                pairs += 1
                same += steps[a] == steps[b]
    auc = {}
    for s, worse_up in SIGNALS.items():
        auc[s] = {}
        for k in cfg.ks:
            pos, neg = [], []
            for r in flat:
                if r["diverged_at"] is not None and r["diverged_at"] < k:
                    continue  # already diverged: nothing to predict
                if len(r["signals"][s]) < k:
                    continue  # the run stopped before step k
                v = [x for x in r["signals"][s][:k] if math.isfinite(x)]  # a scaler's overflow steps: inf
                if not v:
                    continue
                score = max(v) if worse_up else -min(v)
                (pos if r["diverged_at"] is not None else neg).append(score)
            auc[s][k] = {"auc": roc_auc(pos, neg), "diverged": len(pos), "finite": len(neg)}
    sens = {}
    for fix in cfg.fixes:
        per_seed = []
        for seed in range(cfg.sweep_seeds):
            rs = {lr: runs[f"lr/{fix}/{lr:g}/{seed}"] for lr in cfg.lrs}
            per_seed.append(lr_sensitivity({lr: r["final_loss"] for lr, r in rs.items()},
                                           rs[cfg.lrs[0]]["initial_loss"]))

        def mean_final(lr, clip=False):
            v = []
            for seed in range(cfg.sweep_seeds):
                r = runs[f"lr/{fix}/{lr:g}/{seed}"]
                x, init = r["final_loss"], runs[f"lr/{fix}/{cfg.lrs[0]:g}/{seed}"]["initial_loss"]
                v.append((min(x, init) if math.isfinite(x) else init) if clip else x)
            return sum(v) / len(v)  # unclipped: NaN when a seed's run ended NaN

        sens[fix] = {"sensitivity": sum(per_seed) / len(per_seed), "per_seed": per_seed,
                     "final_loss": {f"{lr:g}": mean_final(lr) for lr in cfg.lrs},
                     "clipped_loss": {f"{lr:g}": mean_final(lr, clip=True) for lr in cfg.lrs}}
    conf = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    conf["model"], conf["data"] = _name(cfg.model), _name(cfg.data) if cfg.data is not None else "demo"
    return {"config": conf, "diverged": int(sum(map(sum, div))), "runs": len(flat),
            "divergence_steps": [[r["diverged_at"] for r in row] for row in grid],
            "decomposition": seed_decomposition(div) if 0 < sum(map(sum, div)) < len(flat) else None,
            "blame": blames, "divergence_steps_by_data_seed": by_data,
            "same_batch_pairs": {"same": same, "pairs": pairs}, "auc": auc, "lr_sensitivity": sens}


def _name(x) -> str:
    if isinstance(x, str):
        return x
    if callable(x):
        return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', type(x).__name__)}"
    return f"{type(x).__name__} ({getattr(x, 'model_type', '?')})"


def _paragraph(s: dict) -> str:
    cfg = s["config"]
    parts = [f"{s['diverged']} of {s['runs']} runs ({cfg['init_seeds']} init x {cfg['data_seeds']} data seeds, "
             f"{cfg['model']}, {cfg['dtype']}, lr {cfg['lr']:g}, {cfg['steps']} steps) diverged."]
    d = s["decomposition"]
    if d:
        parts.append(f"Of the variance of divergence, the init seed explains {d['init']:.0%}"
                     + (f" (90% {d['init_90'][0]:.0%}-{d['init_90'][1]:.0%})" if d["init_90"] else "")
                     + f", the data order {d['data']:.0%}"
                     + (f" ({d['data_90'][0]:.0%}-{d['data_90'][1]:.0%})" if d["data_90"] else "")
                     + f", and their interaction with noise {d['rest']:.0%}.")
    else:
        parts.append("With every run (or none) diverging, nothing is left to attribute.")
    sb = s["same_batch_pairs"]
    if sb["pairs"]:
        parts.append(f"Of {sb['pairs']} pairs of diverging runs that share a data order, {sb['same']} diverged at "
                     f"the same step (on the same batch).")
    b = s["blame"]
    if sum(b.values()):
        parts.append(f"Running each failing batch again from the last snapshot before it (1-5 steps earlier) "
                     f"blamed the state {b['state']} times and the batch {b['data']} times.")
    best = []
    for sig, byk in s["auc"].items():
        for k, v in byk.items():
            if v["auc"] is not None and min(v["diverged"], v["finite"]) >= MIN_CLASS:
                best.append((v["auc"], sig, k, v))
    if not best:
        parts.append(f"Too few diverging or finite runs (fewer than {MIN_CLASS} of one) to rank the early "
                     f"predictors.")
    else:
        a, sig, k, v = max(best)
        parts.append(f"The best early predictor was the {sig} over the first {k} steps (ROC AUC {a:.2f} on "
                     f"{v['diverged']} diverging and {v['finite']} finite runs).")
    sens = {f: v for f, v in s["lr_sensitivity"].items() if v["sensitivity"] is not None}
    if "baseline" in sens:
        order = sorted(sens.items(), key=lambda kv: kv[1]["sensitivity"])
        n = cfg["sweep_seeds"]
        parts.append(f"LR sensitivity (lower is more robust; mean over {n} seed{'s' if n > 1 else ''}"
                     + (", range in brackets" if n > 1 else "") + "): "
                     + ", ".join(f"{f} {v['sensitivity']:.2f}"
                                 + (f" [{min(v['per_seed']):.2f}-{max(v['per_seed']):.2f}]" if n > 1 else "")
                                 for f, v in order) + ".")
    parts.append("These are measurements of this small model on this loop, not predictions for a large one.")
    return " ".join(parts)


def _plots(cfg: StudyConfig, s: dict, out: str) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files: List[str] = []

    def save(fig, name):
        fig.tight_layout()
        files.append(os.path.join(out, name))
        fig.savefig(files[-1])
        plt.close(fig)

    steps = [[cfg.steps if v is None else v for v in row] for row in s["divergence_steps"]]
    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    im = ax.imshow(steps, cmap="viridis", vmin=0, vmax=cfg.steps)
    ax.set_xlabel("data-order seed")
    ax.set_ylabel("init seed")
    ax.set_title(f"divergence step ({cfg.steps} = finite)")
    fig.colorbar(im)
    save(fig, "divergence_grid.png")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for sig, byk in s["auc"].items():
        pts = [(k, v["auc"]) for k, v in byk.items() if v["auc"] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=sig)
    ax.axhline(0.5, color="grey", linestyle=":")
    ax.set_xlabel("first k steps")
    ax.set_ylabel("ROC AUC for divergence")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # no signal could be ranked (too few runs of one class)
        ax.text(0.5, 0.6, "too few diverging or finite runs to rank a signal", ha="center",
                transform=ax.transAxes, fontsize=9)
    save(fig, "predictors.png")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for fix, v in s["lr_sensitivity"].items():
        lrs = [float(x) for x in v["clipped_loss"]]
        ax.plot(lrs, list(v["clipped_loss"].values()), marker="o", label=f"{fix} ({v['sensitivity']:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("min(final, initial) loss, mean of seeds")
    ax.set_title("LR sensitivity per fix (in the legend: lower is more robust)", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, "lr_sensitivity.png")
    return files


def report(cfg: StudyConfig, runs: Dict[str, dict], out: str) -> dict:
    from ._info import cpu_model

    s = _summarise(cfg, runs)
    s["summary"] = _paragraph(s)
    s["machine"] = {"cpu": cpu_model()["model"], "torch": torch.__version__, "cores": os.cpu_count()}
    s["plots"] = _plots(cfg, s, out)
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump(_json_safe({**s, "runs_detail": list(runs.values())}), f)
    lines = [f"# nanguard study: {_name(cfg.model)}, {cfg.dtype}", "",
             f"{s['machine']['cpu']}, torch {s['machine']['torch']}, one thread per run.", "",
             s["summary"], "", "## Divergence step per run",
             "", "| init \\ data | " + " | ".join(str(j) for j in range(cfg.data_seeds)) + " |",
             "|---|" + "---|" * cfg.data_seeds]
    for i, row in enumerate(s["divergence_steps"]):
        lines.append(f"| {i} | " + " | ".join("-" if v is None else str(v) for v in row) + " |")
    lines += ["", "## Early predictors (ROC AUC; diverging / finite runs)", "",
              "| signal | " + " | ".join(f"first {k}" for k in cfg.ks) + " |", "|---|" + "---|" * len(cfg.ks)]
    for sig, byk in s["auc"].items():
        cells = [("-" if v["auc"] is None else f"{v['auc']:.2f}") + f" ({v['diverged']}/{v['finite']})"
                 for v in byk.values()]
        lines.append(f"| {sig} | " + " | ".join(cells) + " |")
    lines += ["", f"## LR sensitivity (mean over {cfg.sweep_seeds} seeds; final loss: mean of the seeds' last 8 "
              f"steps, nan when a seed's run ended non-finite)", "",
              "| fix | sensitivity | per seed | " + " | ".join(f"lr {lr:g}" for lr in cfg.lrs)
              + " |", "|---|---|---|" + "---|" * len(cfg.lrs)]
    for fix, v in s["lr_sensitivity"].items():
        sv = "-" if v["sensitivity"] is None else f"{v['sensitivity']:.3f}"
        ps = " ".join(f"{x:.2f}" for x in v["per_seed"])
        lines.append(f"| {fix} | {sv} | {ps} | " + " | ".join(
            f"{x:.3f}" if math.isfinite(x) else "nan" for x in v["final_loss"].values()) + " |")
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return s


def _callable_arg(p, flag: str, spec: str):
    """``module:function`` of the command line, imported; argparse's error
    (exit 2, naming ``flag``) where it is not one."""
    import importlib

    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        p.error(f"{flag}: expected module:function, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        p.error(f"{flag}: cannot import {mod!r} ({e})")
    for part in fn.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            p.error(f"{flag}: {mod!r} has no {fn!r}")
    if not callable(obj):
        p.error(f"{flag}: {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def _model_arg(p, spec: str):
    if spec in ("gpt2", "llama"):
        return spec
    if os.path.isdir(spec) or os.path.isfile(spec):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(spec)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--model: {spec!r} is not a transformers config ({e})")
    if ":" in spec:
        return _callable_arg(p, "--model", spec)
    p.error(f"--model: expected gpt2, llama, a transformers config (a config.json or a folder holding one) "
            f"or module:function; got {spec!r} (no such file or folder)")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m nanguard study", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="a 3 x 3 grid and 3 learning rates (minutes on 2 cores)")
    p.add_argument("--model", default="gpt2",
                   help="gpt2 (the demo's), llama (a Llama of its size), a transformers config (a config.json "
                        "or a folder holding one), or module:function, a model factory model(init_seed) -> "
                        "causal LM (the current folder is importable)")
    p.add_argument("--data", help="module:function, data(data_seed) -> iterator of input_ids batches "
                                  "(default: the demo's byte-level batches)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--init-seeds", type=int)
    p.add_argument("--data-seeds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float, help="the seed grid's learning rate")
    p.add_argument("--fixes", help=f"comma-separated, from {','.join(FIXES)} (default: all)")
    p.add_argument("--lrs", help="comma-separated learning rates of the sensitivity sweep")
    p.add_argument("--out", default="nanguard_study")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the study needs transformers: pip install 'nanguard[transformers]'", file=sys.stderr)
        return 2
    model = _model_arg(p, args.model)
    data = _callable_arg(p, "--data", args.data) if args.data else None
    kw = {k: v for k, v in dict(model=model, data=data, dtype=args.dtype, init_seeds=args.init_seeds,
                                data_seeds=args.data_seeds, steps=args.steps, lr=args.lr).items() if v is not None}
    if args.fixes:
        kw["fixes"] = tuple(f.strip() for f in args.fixes.split(","))
    if args.lrs:
        kw["lrs"] = tuple(float(x) for x in args.lrs.split(","))
    cfg = StudyConfig.quick(**kw) if args.quick else StudyConfig(**kw)
    t0 = time.perf_counter()
    s = study(cfg, args.out, workers=args.workers)
    if s:
        print(s["summary"])
        print(f"report: {os.path.join(args.out, 'study.md')}  data: {os.path.join(args.out, 'study.json')}  "
              f"plots: {', '.join(s['plots'])}  ({time.perf_counter() - t0:.0f} s)")
    return 0
