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
Its sound bound from module outputs is Cauchy-Schwarz per head:
``|q . k| <= d * max|q| * max|k|`` over a head of ``d`` dimensions. For
attention modules whose q and k come from child projections (``q_proj`` /
``k_proj``, GPT-2's fused ``c_attn``), :func:`score_sources` finds them and
the history adds a derived series ``"scores (bound)"`` for the module,
held in the projections' dtype. The bound is at most ``d`` times the true
maximum, so it warns early rather than late; a module whose attention
nanguard has patched computes scores in fp32 and gets no bound.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
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
    value, or growing towards it (``predicted_step``)."""

    def __init__(self, module: str, pass_: str, step: int, bits_left: float, predicted_step: Optional[int]):
        self.module, self.pass_, self.step = module, pass_, step
        self.bits_left, self.predicted_step = bits_left, predicted_step
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

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


def _bits_left(dtype: str, max_abs: float) -> float:
    top = float(torch.finfo(getattr(torch, dtype)).max)
    return math.inf if max_abs <= 0 else math.log2(top) - math.log2(max_abs)


def _slope(points: List[Tuple[int, float]]) -> float:
    """Least-squares slope of (step, value) points."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return 0.0 if sxx == 0 else sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


def score_sources(model: nn.Module) -> Dict[str, Tuple[List[str], int]]:
    """Attention modules whose q and k come from child projections:
    ``{module: ([q/k producing children], head_dim)}``. Only modules whose
    scores are formed by an fp16-able matmul count: transformers' ``eager``
    attention (or a module without a transformers config); SDPA, flash and
    nanguard's own attention (``nanguard.patch``) keep scores in fp32."""
    out: Dict[str, Tuple[List[str], int]] = {}
    for name, m in model.named_modules():
        d = getattr(m, "head_dim", None)
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if not isinstance(d, int) or impl not in (None, "eager"):
            continue
        kids = dict(m.named_children())
        if "q_proj" in kids and "k_proj" in kids:
            src = ["q_proj", "k_proj"]
        elif "c_attn" in kids:  # GPT-2: q, k and v in one output
            src = ["c_attn"]
        elif "query" in kids and "key" in kids:
            src = ["query", "key"]
        else:
            continue
        out[name] = ([f"{name}.{s}" if name else s for s in src], d)
    return out


class History:
    """The last ``steps`` checked steps of every series, with the fp16 early
    warning. ``add`` takes one step's rows and returns the warnings it
    raised (also issued with ``warnings.warn`` and kept in ``warnings``)."""

    def __init__(self, steps: int, *, warn_bits: float = 2.0, warn_steps: int = 5, window: int = 4,
                 predict_bits: float = 4.0, scores: Optional[Dict[str, Tuple[List[str], int]]] = None):
        for name, v, lo in (("history", steps, 1), ("window", window, 2), ("warn_steps", warn_steps, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        for name, v in (("warn_bits", warn_bits), ("predict_bits", predict_bits)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        self.steps, self.warn_bits, self.warn_steps, self.window = steps, float(warn_bits), warn_steps, window
        self.predict_bits = float(predict_bits)
        self.scores = scores or {}
        self._series: Dict[Key, Deque[Row]] = collections.defaultdict(lambda: collections.deque(maxlen=steps))
        self._warned: set = set()
        self.warnings: List[HeadroomWarning] = []
        self.first_nonfinite: Optional[int] = None

    def add(self, step: int, rows: Iterable[Row]) -> List[HeadroomWarning]:
        merged: Dict[Key, Row] = {}
        for r in rows:  # a module called twice in a step: its largest magnitude, its counts summed
            k = (r.module, r.pass_)
            if k in merged:
                m = merged[k]
                m.max_abs = max(m.max_abs, r.max_abs)
                m.min_nonzero_abs = min(m.min_nonzero_abs, r.min_nonzero_abs)
                m.nan, m.posinf, m.neginf = m.nan + r.nan, m.posinf + r.posinf, m.neginf + r.neginf
            else:
                merged[k] = dataclasses.replace(r, step=step)
        merged.update(self._score_rows(step, merged))
        new = []
        for k, r in merged.items():
            self._series[k].append(r)
            if r.nonfinite and self.first_nonfinite is None:
                self.first_nonfinite = step
            w = self._check(k)
            if w is not None:
                new.append(w)
        new.sort(key=lambda w: w.bits_left)  # within a step, the most urgent first
        for w in new:
            warnings.warn(w, stacklevel=3)
        self.warnings.extend(new)
        return new

    def _score_rows(self, step: int, rows: Dict[Key, Row]) -> Dict[Key, Row]:
        out = {}
        for attn, (sources, d) in self.scores.items():
            src = [rows.get((s, "forward")) for s in sources]
            if any(r is None for r in src):
                continue
            m = [r.max_abs for r in src]
            bound = d * (m[0] * m[1] if len(m) == 2 else m[0] ** 2)
            nonfin = sum(r.nonfinite for r in src)
            out[(attn, SCORE_PASS)] = Row(step, attn, SCORE_PASS, src[0].dtype, bound, 0.0, nan=nonfin)
        return out

    def _check(self, key: Key) -> Optional[HeadroomWarning]:
        series = self._series[key]
        last = series[-1]
        if last.dtype != "float16" or key in self._warned or last.nonfinite or last.max_abs <= 0:
            return None
        bits = _bits_left("float16", last.max_abs)
        predicted = None
        pts = [(r.step, math.log2(r.max_abs)) for r in list(series)[-self.window:] if r.max_abs > 0 and
               not r.nonfinite]
        if len(pts) >= self.window and bits < self.predict_bits:
            slope = _slope(pts)
            if slope > 0 and bits / slope <= self.warn_steps:
                predicted = last.step + max(1, math.ceil(bits / slope))
        if bits >= self.warn_bits and predicted is None:
            return None
        self._warned.add(key)
        return HeadroomWarning(key[0], key[1], last.step, bits, predicted)

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
