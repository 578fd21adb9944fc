"""What ``nanguard.watch(history=N, record_dir=path)`` adds to the watcher:
the magnitude history with the fp16 early warning (``_history``), fed from
the statistics each check already brought to the host, and the flight
recorder (``_recorder``), which writes the first non-finite step for
:func:`nanguard.replay`."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from ._history import History, Row, score_sources
from ._recorder import FlightRecorder
from ._records import Kind, Rec
from ._report import BACKWARD, FORWARD, PARAM_GRAD, Report

_PASS = {Kind.OUT: FORWARD, Kind.GRAD: BACKWARD, Kind.PGRAD: PARAM_GRAD}


class Forensics:
    def __init__(self, model: nn.Module, *, history: int, record_dir, warn_bits: float, warn_steps: int,
                 scaler=None):
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler must be a GradScaler (with get_scale()), got {type(scaler).__name__}")
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.history = History(history, warn_bits=warn_bits, warn_steps=warn_steps,
                               scores=score_sources(model)) if history else None
        self.recorder = FlightRecorder(model, record_dir, rank=rank) if record_dir is not None else None
        self.scaler = scaler

    def rows(self, recs: List[Rec], host: Dict[torch.device, tuple]) -> List[Row]:
        """The step's records as history rows (module outputs, output
        gradients and parameter gradients; a module's inputs are other
        modules' outputs or the batch)."""
        lists = {dev: (c.tolist(), v.tolist()) for dev, (c, v) in host.items()}
        rows = []
        for r in recs:
            pass_ = _PASS.get(r.kind)
            if pass_ is None or r.dev not in lists:
                continue
            c, v = lists[r.dev][0][r.slot], lists[r.dev][1][r.slot]
            rows.append(Row(0, r.call.name, pass_, str(r.dtype).removeprefix("torch."), float(v[0]), float(v[1]),
                            int(c[0]), int(c[1]), int(c[2])))
        return rows

    def observe(self, step: int, recs: List[Rec], host, report: Optional[Report]) -> None:
        """One checked step: feed the history; write the flight record of the
        first non-finite step (its path goes into ``report.replay_path``)."""
        rows = self.rows(recs, host) if self.history is not None else []
        if self.history is not None:
            self.history.add(step, rows)
        if self.recorder is not None and report is not None:
            scale = None if self.scaler is None else float(self.scaler.get_scale())
            hist = [_as_dict(r) for r in self.history.rows()] if self.history is not None else None
            path = self.recorder.step_done(step=step, nonfinite=True, report=str(report), history=hist,
                                           loss_scale=scale)
            report.replay_path = path or self.recorder.path

    def end_step(self) -> None:
        if self.recorder is not None:
            self.recorder.step_done(step=-1, nonfinite=False)

    @property
    def warnings(self) -> list:
        return self.history.warnings if self.history is not None else []

    def remove(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()


def _as_dict(r: Row) -> dict:
    return {"step": r.step, "module": r.module, "pass": r.pass_, "dtype": r.dtype, "max_abs": r.max_abs,
            "min_nonzero_abs": r.min_nonzero_abs, "nan": r.nan, "posinf": r.posinf, "neginf": r.neginf}
