"""Cause-based early warnings: signals from the literature that precede a
divergence in any precision, not only fp16's overflow.

Each signal is computed where it is cheap, kept on the device during the
step, and read back once, with the others, by :meth:`EarlyWarnings.step`
(one host read per step). Each warns once per run, as an
:class:`InstabilityWarning` naming the signal, its value and the rule:

- **attention logit** (``attn_logit=1e4``): the largest attention logit
  ``q . k / sqrt(d)``, bounded per head by Cauchy-Schwarz from the q and k
  projections' row norms (the same bound as the fp16 headroom's score
  series, scaled by ``1/sqrt(d)``: one fp32 row-norm reduction per
  projection output). Wortsman et al. 2023 ("Small-scale proxies for
  large-scale Transformer training instabilities") saw every diverging run's
  largest logit pass 1e4. Warns when the bound reaches it. (No growth
  extrapolation: from initialisation the logits grow by orders of magnitude
  in the first steps of every run, diverging or not.)
- **output logits** (``logz_excess=20``, ``logit_max=50``): the model's
  output logits (``get_output_embeddings()``'s output): the mean ``log Z``
  (logsumexp over the vocabulary, in fp32: one pass over the logits, about
  what the loss's own softmax reads) and the largest ``|logit|``. The same
  paper's output-logit divergence, which z-loss fixes. Warns when ``log Z``
  exceeds ``log V`` (uniform logits) by ``logz_excess`` nats, or a logit's
  magnitude reaches ``logit_max``.
- **Adam update RMS** (``update_rms=5``): for an Adam-family optimizer, the
  largest per-tensor ``sqrt(mean(g^2 / v_hat))``, with ``v_hat`` the second
  moment this step's update divides by (Wortsman et al. 2023, "Stable and
  low-precision training for large-scale vision-language models": spikes of
  it precede loss spikes). One pass over the gradients and ``exp_avg_sq``.
  Its ceiling is ``sqrt((1 - b2^t) / (1 - b2))`` (a gradient that dwarfs the
  history): 31.6 for ``b2 = 0.999``, 4.5 for ``0.95``, so lower the
  threshold for a small ``b2``.
- **gradient RMS at Adam's eps** (``eps_ratio=10``): the smallest
  per-tensor ``sqrt(mean(v_hat))`` below ``eps_ratio * eps``: the update of
  that tensor is damped by ``eps`` rather than normalised (same paper).
- **loss-scale collapse** (``scale_min=1``, ``backoffs=5``): the loss scale
  falls to ``scale_min`` or backs off ``backoffs`` steps in a row, as in
  OPT-175B's logbook (run 11). Read from the ``scaler``.

Call :meth:`step` once per optimizer step, after the backward pass(es)
(and the scaler's unscale, if any) and before ``optimizer.step()``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Deque, Dict, List, Optional

import torch
from torch import nn

from ._history import head_norms, score_bound, score_sources

__all__ = ["EarlyWarnings", "InstabilityWarning", "SIGNALS"]

ATTN, LOGZ, LOGIT, UPDATE, EPS, SCALE = ("attention logit", "output log Z", "output logit", "Adam update RMS",
                                        "gradient RMS at eps", "loss scale")
SIGNALS = (ATTN, LOGZ, LOGIT, UPDATE, EPS, SCALE)


class InstabilityWarning(UserWarning):
    """A signal that precedes divergence crossed its threshold (or, for the
    attention logit, is growing towards it): ``signal``, ``step``, ``value``,
    ``threshold``, ``where`` (the module or parameter, "" for the model)."""

    def __init__(self, signal: str, step: int, value: float, threshold: float, detail: str, where: str = ""):
        self.signal, self.step, self.value, self.threshold, self.where = signal, step, value, threshold, where
        at = f" in `{where}`" if where else ""
        super().__init__(f"step {step}: {signal}{at} is {value:.4g}; {detail}")


@dataclasses.dataclass
class _Attn:
    name: str
    q: str
    k: str
    head_dim: int
    width: Optional[int]


def _adam_like(optimizer) -> bool:
    return optimizer is not None and all("betas" in g and "eps" in g for g in optimizer.param_groups)


class EarlyWarnings:
    """The signals of the module docstring for one model (and optimizer and
    scaler, when given); thresholds as keyword arguments (None turns a
    signal off).

    ``warnings`` lists the warnings issued; ``series`` holds each signal's
    last ``window`` values.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, scaler=None, *,
                 attn_logit: Optional[float] = 1e4, logz_excess: Optional[float] = 20.0,
                 logit_max: Optional[float] = 50.0, update_rms: Optional[float] = 5.0,
                 eps_ratio: Optional[float] = 10.0, scale_min: Optional[float] = 1.0, backoffs: Optional[int] = 5,
                 window: int = 64, emit: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler must be a GradScaler or None, got {type(scaler).__name__}")
        for name, v in (("attn_logit", attn_logit), ("logz_excess", logz_excess), ("logit_max", logit_max),
                        ("update_rms", update_rms), ("eps_ratio", eps_ratio), ("scale_min", scale_min)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ValueError(f"{name} must be a number > 0, or None to turn the signal off; got {v!r}")
        for name, v in (("backoffs", backoffs), ("window", window)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "window" else 1)):
                raise ValueError(f"{name} must be an int >= {2 if name == 'window' else 1}, got {v!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.thresholds = {ATTN: attn_logit, LOGZ: logz_excess, LOGIT: logit_max, UPDATE: update_rms,
                           EPS: eps_ratio, SCALE: scale_min}
        self.backoffs, self.window, self.emit = backoffs, window, emit
        self.warnings: List[InstabilityWarning] = []
        self.series: Dict[str, Deque] = {s: collections.deque(maxlen=window) for s in SIGNALS}
        self._warned = set()
        self._step = 0
        self._acc: Dict[str, torch.Tensor] = {}  # this step's device values
        self._logz_n = 0
        self._prev_scale: Optional[float] = None
        self._backoff_run = 0
        self._handles = []
        mods = dict(model.named_modules())
        if attn_logit is not None:
            for name, src in score_sources(model).items():
                a = _Attn(name, src.q, src.k, src.head_dim, src.width)
                if src.q == src.k:
                    self._handles.append(mods[src.q].register_forward_hook(self._fused(a)))
                else:
                    pend: Dict[str, torch.Tensor] = {}
                    for role, child in (("q", src.q), ("k", src.k)):
                        self._handles.append(mods[child].register_forward_hook(self._split(a, role, pend)))
        self._vocab = None
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        if isinstance(head, nn.Module) and (logz_excess is not None or logit_max is not None):
            self._handles.append(head.register_forward_hook(self._logits))
        self._adam = _adam_like(optimizer) and (update_rms is not None or eps_ratio is not None)

    # ---- forward hooks: the step's values, on the device ---------------------------------

    def _max_into(self, key: str, v: torch.Tensor) -> None:
        v = v.detach().float().reshape(())
        cur = self._acc.get(key)
        self._acc[key] = v if cur is None else torch.maximum(cur, v.to(cur.device))

    def _bound(self, a: _Attn, qn: torch.Tensor, kn: torch.Tensor) -> None:
        self._max_into(ATTN, score_bound(qn, kn) / math.sqrt(a.head_dim))

    def _fused(self, a: _Attn):
        def hook(_m, _args, out):
            if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.shape[-1] < 2 * a.width:
                return None
            with torch.no_grad():
                qn, kn = head_norms(out[..., :a.width], a.head_dim), head_norms(out[..., a.width:2 * a.width],
                                                                                 a.head_dim)
                if qn is not None and kn is not None:
                    self._bound(a, qn, kn)
            return None
        return hook

    def _split(self, a: _Attn, role: str, pend: Dict[str, torch.Tensor]):
        other = "k" if role == "q" else "q"

        def hook(_m, _args, out):
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return None
            with torch.no_grad():
                n = head_norms(out, a.head_dim)
                mate = pend.pop(other, None) if n is not None else None
                if n is None:
                    return None
                if mate is None:
                    pend[role] = n
                    return None
                qn, kn = (n, mate) if role == "q" else (mate, n)
                if qn.device == kn.device:
                    self._bound(a, qn, kn)
            return None
        return hook

    def _logits(self, _m, _args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            return None
        with torch.no_grad():
            x = out.detach().float()
            self._vocab = x.shape[-1]
            lz = torch.logsumexp(x, dim=-1).mean()
            cur = self._acc.get(LOGZ)
            self._acc[LOGZ] = lz if cur is None else cur + lz.to(cur.device)
            self._logz_n += 1
            self._max_into(LOGIT, x.abs().amax())
        return None

    # ---- the step -----------------------------------------------------------------------

    def _adam_values(self) -> Dict[str, torch.Tensor]:
        """Per tensor, with v_hat the second moment this step's update
        divides by: max sqrt(mean(g^2 / v_hat)) and min sqrt(mean(v_hat)) / eps."""
        upd, low = [], []
        with torch.no_grad():
            for g in self.optimizer.param_groups:
                b2, eps = g["betas"][1], g["eps"]
                for p in g["params"]:
                    if p.grad is None or p.grad.numel() == 0 or p.grad.is_sparse:
                        continue
                    st = self.optimizer.state.get(p) or {}
                    grad = p.grad.detach().float()
                    v = st.get("exp_avg_sq")
                    t = int(st["step"]) + 1 if "step" in st else 1
                    g2 = grad * grad
                    u = g2 * (1 - b2) if v is None else v.float() * b2 + g2 * (1 - b2)
                    vhat = u / (1 - b2 ** t)
                    upd.append(torch.sqrt((g2 / vhat.clamp_min(torch.finfo(torch.float32).tiny)).mean()))
                    low.append(torch.sqrt(vhat.mean()) / eps)
        out = {}
        if upd and self.thresholds[UPDATE] is not None:
            out[UPDATE] = torch.stack([x.to(upd[0].device) for x in upd]).amax()
        if low and self.thresholds[EPS] is not None:
            out[EPS] = torch.stack([x.to(low[0].device) for x in low]).amin()
        return out

    def step(self) -> List[InstabilityWarning]:
        """Read this step's signals (one host read), apply the rules, reset
        for the next step; the warnings issued now (each also
        ``warnings.warn``-ed unless ``emit=False``)."""
        vals = dict(self._acc)
        if LOGZ in vals:
            vals[LOGZ] = vals[LOGZ] / self._logz_n
        if self._adam:
            vals.update(self._adam_values())
        self._acc, self._logz_n = {}, 0
        keys = list(vals)
        host = torch.stack([vals[k].to(vals[keys[0]].device) for k in keys]).tolist() if keys else []
        got = dict(zip(keys, host))
        if self.scaler is not None and self.scaler.is_enabled() and (self.thresholds[SCALE] is not None
                                                                     or self.backoffs is not None):
            got[SCALE] = float(self.scaler.get_scale())
        new = []
        for sig, v in got.items():
            if not math.isfinite(v):
                continue  # a non-finite step is the watcher's business, not a warning's
            self.series[sig].append((self._step, v))
            w = None if sig in self._warned else self._rule(sig, v)
            if w is not None:
                self._warned.add(sig)
                new.append(w)
        self._step += 1
        self.warnings += new
        if self.emit:
            for w in new:
                warnings.warn(w, stacklevel=2)
        return new

    def _rule(self, sig: str, v: float) -> Optional[InstabilityWarning]:
        thr, step = self.thresholds[sig], self._step
        if thr is None and sig != SCALE:
            return None  # turned off (its value is still in the series)
        if sig == ATTN:
            if v >= thr:
                return InstabilityWarning(sig, step, v, thr, f"at or above {thr:g}, where every diverging run of "
                                          f"Wortsman et al. 2023 had been (a Cauchy-Schwarz bound)")
            return None
        if sig == LOGZ:
            base = math.log(self._vocab) if self._vocab else 0.0
            if v - base >= thr:
                return InstabilityWarning(sig, step, v, thr, f"{v - base:.1f} nats above log V = {base:.2f} "
                                          f"(uniform logits); threshold {thr:g} (z-loss keeps log Z near 0)")
            return None
        if sig == LOGIT:
            return InstabilityWarning(sig, step, v, thr, f"at or above {thr:g}") if v >= thr else None
        if sig == UPDATE:
            return InstabilityWarning(sig, step, v, thr, f"a tensor's RMS of g^2/v_hat is above {thr:g} (about 1 "
                                      f"when gradients are steady); such spikes precede loss spikes") \
                if v >= thr else None
        if sig == EPS:
            return InstabilityWarning(sig, step, v, thr, f"a tensor's gradient RMS is {v:.3g} x Adam's eps, below "
                                      f"{thr:g} x: its update is damped by eps") if v < thr else None
        if sig == SCALE:
            prev, self._prev_scale = self._prev_scale, v
            if prev is not None and v < prev:
                self._backoff_run += 1
            elif prev is not None and v > prev:
                self._backoff_run = 0
            if thr is not None and v <= thr:
                return InstabilityWarning(sig, step, v, thr, f"the loss scale fell to {v:g} (<= {thr:g})")
            if self.backoffs is not None and self._backoff_run >= self.backoffs:
                return InstabilityWarning(sig, step, v, self.backoffs, f"{self._backoff_run} backoffs in a row: the "
                                          f"loss scale is collapsing")
            return None
        return None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
