"""Magnitude history and the fp16 early warning.

``watch`` reads each recorded tensor's statistics (``max |x|``, the smallest
non-zero ``|x|``, NaN / +Inf / -Inf counts) once per checked step. A
:class:`History` keeps the last ``N`` steps of them per series (module, pass)
on the host, at no extra device read, and exports them (:meth:`to_csv`,
:meth:`plot`, :meth:`headroom`).

**Early warning.** For a series held in float16 the headroom is
``log2(65504) - log2(max |x|)``, the bits left before fp16's largest finite
value. A :class:`HeadroomWarning` is issued once per series when the
headroom falls below ``warn_bits``, or when the least-squares growth of
``log2 max|x|`` over the last ``window`` steps reaches the ceiling within
``warn_steps`` steps (it then names the step it predicts). bf16 and fp32
have no fp16 ceiling: their series never warn.

**Attention scores.** The overflow that kills fp16 training is often in
``q @ k.T`` inside an attention *function*, whose result no module returns.
Its sound bound is Cauchy-Schwarz per pair of rows: ``|q_i . k_j| <=
|q_i| |k_j|``, so the largest raw score of a head is at most ``max_i |q_i|
* max_j |k_j|`` (row norms over the head's ``d`` dimensions; with grouped
keys, each query head against its key head). For attention modules whose q
and k come from child projections (``q_proj`` / ``k_proj``, GPT-2's fused
``c_attn``, ``query`` / ``key``), :func:`score_sources` finds them and the
watcher computes the bound from the projections' outputs on their device
(one fp32 row-norm reduction per projection output, no extra read: it is
recorded like any tensor and read with the step's statistics); the history
keeps it as the series ``"scores (bound)"`` of the attention module, held
in the projections' dtype. Over all pairs, masked ones included (the
matmul forms them all). The bound is tight when the largest query and key
point the same way, which is how attention logits grow; rotary embeddings
rotate q and k and keep row norms, so it holds through them. A module that
normalises q and k after the projection (QK-norm) is skipped, and a module
whose attention nanguard has patched computes scores in fp32 and gets no
bound.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import itertools
import math
import warnings
from typing import Deque, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

FP16_MAX = float(torch.finfo(torch.float16).max)
SCORE_PASS = "scores (bound)"

Key = Tuple[str, str]  # (module, pass)


class HeadroomWarning(UserWarning):
    """A float16 tensor is within ``bits_left`` bits of fp16's largest finite
    value, or growing towards it (``predicted_step``). ``steps_left`` is the
    growth's estimate of the steps to the ceiling (``inf`` when not
    growing): the warnings of one step come soonest first."""

    def __init__(self, module: str, pass_: str, step: int, bits_left: float, predicted_step: Optional[int],
                 steps_left: float = math.inf):
        self.module, self.pass_, self.step = module, pass_, step
        self.bits_left, self.predicted_step, self.steps_left = bits_left, predicted_step, steps_left
        when = f"; at its growth it overflows around step {predicted_step}" if predicted_step is not None else ""
        super().__init__(f"step {step}: {pass_} of `{module or '<root>'}` is {bits_left:.1f} bits below "
                         f"float16's largest value {FP16_MAX:g}{when}")


@dataclasses.dataclass(slots=True)
class Row:
    """One series' statistics at one step."""

    step: int
    module: str
    pass_: str
    dtype: str
    max_abs: float
    min_nonzero_abs: float
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    #: the loss scale the step's gradients carry (gradient passes; 1 elsewhere)
    loss_scale: float = 1.0

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


def _bits_left(dtype: str, max_abs: float) -> float:
    top = float(torch.finfo(getattr(torch, dtype)).max)
    return math.inf if max_abs <= 0 else math.log2(top) - math.log2(max_abs)


_LOG2_FP16_MAX = math.log2(FP16_MAX)


def _log2_unscaled(r: Row) -> float:
    """log2 max|x| at loss scale 1."""
    return math.log2(r.max_abs) - math.log2(r.loss_scale)


def _slope(points: List[Tuple[int, float]]) -> float:
    """Least-squares slope of (step, value) points."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return 0.0 if sxx == 0 else sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


@dataclasses.dataclass(frozen=True)
class ScoreSource:
    """Where an attention module's q and k come from: ``q`` and ``k`` name
    the producing children (the same one for a fused projection, whose
    output holds q in ``[..., :width]`` and k in ``[..., width:2 * width]``),
    ``head_dim`` the row length of one head."""

    q: str
    k: str
    head_dim: int
    width: Optional[int] = None  # fused projections only


def score_sources(model: nn.Module) -> Dict[str, ScoreSource]:
    """Attention modules whose q and k come from child projections:
    ``{module: ScoreSource}``. Only modules whose scores are formed by an
    fp16-able matmul of the projections' outputs count: transformers'
    ``eager`` attention (or a module without a transformers config), no
    QK-norm, no cross-attention; SDPA, flash and nanguard's own attention
    (``nanguard.patch``) keep scores in fp32."""
    out: Dict[str, ScoreSource] = {}
    for name, m in model.named_modules():
        d = getattr(m, "head_dim", None)
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if not isinstance(d, int) or d < 1 or impl not in (None, "eager") or getattr(m, "is_cross_attention", False):
            continue
        kids = dict(m.named_children())
        if any(n in kids for n in ("q_norm", "k_norm", "query_norm", "key_norm")):
            continue  # q and k normalised after the projection: not their outputs' norms
        pre = f"{name}." if name else ""
        if "q_proj" in kids and "k_proj" in kids:
            out[name] = ScoreSource(pre + "q_proj", pre + "k_proj", d)
        elif "query" in kids and "key" in kids:
            out[name] = ScoreSource(pre + "query", pre + "key", d)
        elif "c_attn" in kids and isinstance(getattr(m, "split_size", None), int):  # GPT-2: q, k, v fused
            out[name] = ScoreSource(pre + "c_attn", pre + "c_attn", d, m.split_size)
    return out


def head_norms(x: torch.Tensor, head_dim: int) -> Optional[torch.Tensor]:
    """The largest row norm of each head of a projection's output
    ``[..., heads * head_dim]``, in fp32 (shape ``[heads]``); None when the
    output is empty or not split into heads of ``head_dim``."""
    if x.numel() == 0 or x.shape[-1] % head_dim:
        return None
    n = torch.linalg.vector_norm(x.unflatten(-1, (-1, head_dim)), dim=-1, dtype=torch.float32)
    return n.reshape(-1, n.shape[-1]).amax(0)


def score_bound(qn: torch.Tensor, kn: torch.Tensor) -> torch.Tensor:
    """``max_h max|q_i| * max|k_j|`` over query heads ``h`` and their key
    head (grouped-query attention: query head ``h`` reads key head
    ``h // (H / G)``); a 1-element fp32 tensor on their device."""
    h, g = qn.numel(), kn.numel()
    if h % g:  # not a grouping: every query head against every key head
        return (qn.amax() * kn.amax()).reshape(1)
    return (qn.view(g, h // g) * kn.view(g, 1)).amax().reshape(1)


class History:
    """The last ``steps`` checked steps of every series, with the fp16 early
    warning. ``add`` takes one step's rows and returns the warnings it
    raised (also issued with ``warnings.warn`` and kept in ``warnings``)."""

    def __init__(self, steps: int, *, warn_bits: float = 2.0, warn_steps: int = 5, window: int = 4,
                 predict_bits: float = 2.0):
        for name, v, lo in (("history", steps, 1), ("window", window, 2), ("warn_steps", warn_steps, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        for name, v in (("warn_bits", warn_bits), ("predict_bits", predict_bits)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        self.steps, self.warn_bits, self.warn_steps, self.window = steps, float(warn_bits), warn_steps, window
        self.predict_bits = float(predict_bits)
        self._series: Dict[Key, Deque[Row]] = collections.defaultdict(lambda: collections.deque(maxlen=steps))
        self._warned: set = set()
        self.warnings: List[HeadroomWarning] = []
        self.first_nonfinite: Optional[int] = None

    def add(self, step: int, rows: Iterable[Row]) -> List[HeadroomWarning]:
        """One checked step's rows (a gradient row's ``loss_scale`` says
        which scale its magnitudes carry)."""
        merged: Dict[Key, Row] = {}
        for r in rows:  # a module called twice in a step: its largest magnitude, its counts summed
            if r.step != step:
                r = dataclasses.replace(r, step=step)
            k = (r.module, r.pass_)
            m = merged.get(k)
            # the rows are kept as given (none is changed in place: a merge is a new row)
            merged[k] = r if m is None else dataclasses.replace(
                m, max_abs=max(m.max_abs, r.max_abs), min_nonzero_abs=min(m.min_nonzero_abs, r.min_nonzero_abs),
                nan=m.nan + r.nan, posinf=m.posinf + r.posinf, neginf=m.neginf + r.neginf)
        new = []
        for k, r in merged.items():
            self._series[k].append(r)
            if r.nonfinite and self.first_nonfinite is None:
                self.first_nonfinite = step
            w = self._check(k)
            if w is not None:
                new.append(w)
        # within a step, the most urgent first: those at the ceiling now, then the soonest predicted
        new.sort(key=lambda w: (w.bits_left >= self.warn_bits, w.steps_left, w.bits_left))
        for w in new:
            warnings.warn(w, stacklevel=3)
        self.warnings.extend(new)
        return new

    def _check(self, key: Key) -> Optional[HeadroomWarning]:
        """A series' warning, once: ``bits`` below fp16's ceiling (at loss
        scale 1 for gradients: a scaled gradient's overflow is the scaler's
        to back off from), or within ``predict_bits`` and growing to the
        ceiling within ``warn_steps`` steps (least squares over the last
        ``window`` steps)."""
        series = self._series[key]
        last = series[-1]
        if last.dtype != "float16" or key in self._warned or last.nonfinite or last.max_abs <= 0:
            return None
        bits = _LOG2_FP16_MAX - _log2_unscaled(last)
        eta = math.inf
        if bits < self.predict_bits and len(series) >= self.window:
            pts = [(r.step, _log2_unscaled(r)) for r in itertools.islice(reversed(series), self.window)
                   if r.max_abs > 0 and not r.nonfinite]
            if len(pts) >= self.window:
                slope = _slope(pts)
                if slope > 0:
                    eta = bits / slope
        predicted = last.step + max(1, math.ceil(eta)) if eta <= self.warn_steps else None
        if bits >= self.warn_bits and predicted is None:
            return None
        self._warned.add(key)
        return HeadroomWarning(key[0], key[1], last.step, bits, predicted, eta)

    # ---- export -------------------------------------------------------------------------------

    def rows(self) -> List[Row]:
        return sorted((r for s in self._series.values() for r in s), key=lambda r: (r.step, r.module, r.pass_))

    def to_csv(self, path: str) -> None:
        fields = [f.name for f in dataclasses.fields(Row)]
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([n.rstrip("_") for n in fields])
            for r in self.rows():
                w.writerow([getattr(r, n) for n in fields])

    def headroom(self) -> Dict[Key, float]:
        """Bits left to the dtype's largest finite value, per series, at its
        last step (``-inf`` once non-finite)."""
        out = {}
        for k, s in self._series.items():
            r = s[-1]
            out[k] = -math.inf if r.nonfinite else _bits_left(r.dtype, r.max_abs)
        return out

    def plot(self, path: str) -> None:
        """A heatmap of log2 max|x|, series by step, with float16's ceiling
        (log2 65504 = 16.0) on the colour bar and the first non-finite step
        marked; needs matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = sorted(self._series)
        steps = sorted({r.step for s in self._series.values() for r in s})
        col = {s: i for i, s in enumerate(steps)}
        grid = [[math.nan] * len(steps) for _ in keys]
        for i, k in enumerate(keys):
            for r in self._series[k]:
                grid[i][col[r.step]] = math.log2(r.max_abs) if r.max_abs > 0 and not r.nonfinite else math.nan
        fig, ax = plt.subplots(figsize=(max(6, len(steps) * 0.25), max(3, len(keys) * 0.22)))
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
        cb = fig.colorbar(im, ax=ax)
        cb.set_label("log2 max|x|")
        cb.ax.axhline(math.log2(FP16_MAX), color="red")
        ax.set_yticks(range(len(keys)), [f"{m or '<root>'} {p}" for m, p in keys], fontsize=6)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6)
        ax.set_xlabel("step")
        if self.first_nonfinite is not None and self.first_nonfinite in col:
            ax.axvline(col[self.first_nonfinite], color="red", linestyle="--", label="first non-finite")
            ax.legend(loc="upper left", fontsize=6)
        ax.set_title("magnitude history (red: float16's 65504; dashed: first non-finite step)", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
