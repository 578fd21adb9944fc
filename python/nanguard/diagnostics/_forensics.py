"""What ``nanguard.watch(history=N, record_dir=path)`` adds to the watcher:
the magnitude history with the fp16 early warning (``_history``), fed from
the statistics each check already brought to the host, and the flight
recorder (``_flight_recorder``), which writes the first non-finite step for
:func:`nanguard.replay`."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from .. import distributed as _dist
from ._history import SCORE_PASS, History, Row, ScoreSource, head_norms, score_bound, score_sources
from ._flight_recorder import FlightRecorder
from ._census import Kind, Owner, Rec
from ._report import BACKWARD, FORWARD, PARAM_GRAD, Report

_DTYPE = {d: str(d).removeprefix("torch.") for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
_PASS = {Kind.OUT: FORWARD, Kind.GRAD: BACKWARD, Kind.PGRAD: PARAM_GRAD, Kind.SCORE: SCORE_PASS}


class Forensics:
    def __init__(self, model: nn.Module, *, history: int, record_dir, warn_bits: float, warn_steps: int,
                 scaler=None, hold: bool = False, write_on_observe: bool = True):
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler must be a GradScaler (with get_scale()), got {type(scaler).__name__}")
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.history = History(history, warn_bits=warn_bits, warn_steps=warn_steps) if history else None
        # hold: keep the step's micro-batches even without a directory (sentinel mode replays them)
        self.recorder = FlightRecorder(model, record_dir, rank=rank) if record_dir is not None or hold else None
        self.write_on_observe = write_on_observe  # eager mode writes the record of the report it observes
        self.scaler = scaler
        self._pending: List[Dict[str, torch.Tensor]] = []  # per split q / k pair: a half not yet paired

    def attach_scores(self, model: nn.Module, record: Callable, on: Callable[[torch.Tensor], bool],
                      light: Optional[Callable] = None) -> list:
        """Forward hooks on the q and k projections of each eager attention
        module (:func:`score_sources`) that record the bound on its raw
        scores through ``record(t, kind, owner, label, dtype=...)`` (the
        watcher's census, read with the step's statistics) while ``on(t)``
        (``t``: the projection's output).
        ``light(t, name, cls)``, when given, is called with each
        projection's output in the same hook (sentinel mode records it
        between its census steps: q or k overflows fp16 before their
        product when the weights grow). Returns the hook handles."""
        if self.history is None:
            return []
        mods = dict(model.named_modules())
        handles = []
        for attn, src in score_sources(model).items():
            owner = Owner(attn, type(mods[attn]).__name__)
            pending: Dict[str, torch.Tensor] = {}  # q's or k's head norms, until the other comes
            self._pending.append(pending)
            if src.q == src.k:
                handles.append(mods[src.q].register_forward_hook(
                    _fused_hook(src, owner, record, on, light, (src.q, type(mods[src.q]).__name__))))
            else:
                for role, child in (("q", src.q), ("k", src.k)):
                    handles.append(mods[child].register_forward_hook(
                        _split_hook(role, src, owner, pending, record, on, light,
                                    (child, type(mods[child]).__name__))))
        return handles

    def rows(self, recs: List[Rec], host: Dict[torch.device, tuple], loss_scale: float = 1.0,
             step: int = 0) -> List[Row]:
        """The step's records as history rows (module outputs, output
        gradients, parameter gradients and attention-score bounds; a
        module's inputs are other modules' outputs or the batch)."""
        lists = {dev: (c.tolist(), v.tolist()) for dev, (c, v) in host.items()}
        rows = []
        for r in recs:
            pass_ = _PASS.get(r.kind)
            if pass_ is None or r.dev not in lists:
                continue
            c, v = lists[r.dev][0][r.slot], lists[r.dev][1][r.slot]
            scale = loss_scale if r.kind in (Kind.GRAD, Kind.PGRAD) else 1.0
            rows.append(Row(step, r.call.name, pass_, _DTYPE[r.dtype], v[0], v[1], c[0], c[1], c[2], scale))
        return rows

    def observe(self, step: int, recs: List[Rec], host, report: Optional[Report]) -> None:
        """One checked step: feed the history; write the flight record of the
        first non-finite step (its path goes into ``report.replay_path``)."""
        scale = self.loss_scale()
        if self.history is not None:
            self.history.add(step, self.rows(recs, host, scale or 1.0, step))
        if self.write_on_observe and report is not None and self.recorder is not None:
            self.write(step, report, scale)
            self.recorder.drop()

    def write(self, step: int, report: Report, scale: Optional[float], micro_batch: int = 0) -> None:
        """Write the flight record of a non-finite step (not of the
        GradScaler's backoff) and name it in ``report.replay_path``."""
        if self.recorder is None or self.recorder.directory is None or self._backoff(report, scale):
            return
        hist = [_as_dict(r) for r in self.history.rows()] if self.history is not None else None
        path = self.recorder.write(step=step, micro_batch=micro_batch, report=str(report), history=hist,
                                   loss_scale=scale)
        report.replay_path = path or self.recorder.path

    def loss_scale(self) -> Optional[float]:
        return None if self.scaler is None else float(self.scaler.get_scale())

    @staticmethod
    def _backoff(report: Report, scale: Optional[float]) -> bool:
        """A step non-finite in its gradients only, at a loss scale above 1:
        the GradScaler skips it and lowers the scale (its ordinary backoff,
        most often in the first steps), so it does not spend the one
        record: the step that kills the run comes later."""
        return scale is not None and scale > 1.0 and report.pass_ in (BACKWARD, PARAM_GRAD)

    def end_step(self) -> None:
        for pending in self._pending:  # a q without its k (or k without q) never pairs across steps
            pending.clear()
        if self.recorder is not None:
            self.recorder.drop()

    @property
    def warnings(self) -> list:
        return self.history.warnings if self.history is not None else []

    def remove(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()


def _as_dict(r: Row) -> dict:
    return {"step": r.step, "module": r.module, "pass": r.pass_, "dtype": r.dtype, "max_abs": r.max_abs,
            "min_nonzero_abs": r.min_nonzero_abs, "nan": r.nan, "posinf": r.posinf, "neginf": r.neginf,
            "loss_scale": r.loss_scale}


def _bound_of(out) -> Optional[torch.Tensor]:
    t = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    return _dist.local(t)


def _fused_hook(src: ScoreSource, owner: Owner, record: Callable, on: Callable[[torch.Tensor], bool], light, me):
    w = src.width

    def hook(_m, _args, out):
        t = _bound_of(out)
        if t is None or not on(t) or t.shape[-1] < 2 * w:
            return None
        if light is not None:
            light(t, *me)
        with torch.no_grad():
            qn, kn = head_norms(t[..., :w], src.head_dim), head_norms(t[..., w:2 * w], src.head_dim)
            if qn is not None and kn is not None:
                record(score_bound(qn, kn), Kind.SCORE, owner, SCORE_PASS, dtype=t.dtype)
        return None

    return hook


def _split_hook(role: str, src: ScoreSource, owner: Owner, pending: Dict[str, torch.Tensor], record: Callable,
                on: Callable[[torch.Tensor], bool], light, me):
    other = "k" if role == "q" else "q"

    def hook(_m, _args, out):
        t = _bound_of(out)
        if t is None or not on(t):
            return None
        if light is not None:
            light(t, *me)
        with torch.no_grad():
            n = head_norms(t, src.head_dim)
            if n is None:
                return None
            mate = pending.pop(other, None)
            if mate is None:  # the first of the two: wait for the other
                pending[role] = n
                return None
            qn, kn = (n, mate) if role == "q" else (mate, n)
            if qn.device == kn.device:
                record(score_bound(qn, kn), Kind.SCORE, owner, SCORE_PASS, dtype=t.dtype)
        return None

    return hook
