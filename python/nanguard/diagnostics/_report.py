"""What :func:`nanguard.watch` reports: the census of a recorded tensor
(:class:`TensorStats`), the first non-finite tensor of a checked step
(:class:`Report`) and the error raised under ``policy="raise"``
(:class:`NonFiniteError`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

__all__ = ["TensorStats", "Report", "NonFiniteError", "FORWARD", "BACKWARD", "PARAM_GRAD"]

#: the values of :attr:`Report.pass_`
FORWARD = "forward"
BACKWARD = "backward"
PARAM_GRAD = "parameter grad"


@dataclass
class TensorStats:
    """The census of one recorded tensor."""

    which: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nan: int
    posinf: int
    neginf: int
    max_abs: float  #: over finite values; 0 when there is none
    min_nonzero_abs: float  #: over finite values; inf when there is none

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        head = f"{self.which}: shape {tuple(self.shape)} {dt}: "
        if self.finite:
            bad = "all finite"
        else:
            bad = f"{self.nan} NaN, {self.posinf} +Inf, {self.neginf} -Inf"
        mn = "none" if math.isinf(self.min_nonzero_abs) else f"{self.min_nonzero_abs:.3g}"
        return head + f"{bad}; finite max|x| {self.max_abs:.3g}, min non-zero |x| {mn}"


@dataclass
class Report:
    """The first non-finite tensor of a checked step."""

    module: str  #: qualified name ("" is the watched model itself)
    cls: str  #: class name of the module
    pass_: str  #: "forward", "backward" or "parameter grad"; "" when another rank saw it
    step: int
    #: None when this rank saw only finite values and another rank did not
    tensor: Optional[TensorStats] = None
    inputs: List[TensorStats] = field(default_factory=list)
    note: str = ""
    #: how many recorded tensors of the step were non-finite in all
    n_nonfinite: int = 1
    #: this process's rank in the default group (None without torch.distributed)
    rank: Optional[int] = None
    #: under rank agreement: every rank (global ranks) that saw a non-finite value this step
    bad_ranks: List[int] = field(default_factory=list)
    #: the flight record of the first non-finite step (``watch(record_dir=...)``), for nanguard.replay
    replay_path: Optional[str] = None
    #: sentinel mode: did the in-process replay of the step reproduce the
    #: failure (None: the step was not replayed, its own census found it)
    reproduced: Optional[bool] = None
    #: sentinel mode: which forward of the step (micro-batch, 0 the first) failed
    micro_batch: Optional[int] = None
    #: sentinel mode: the first aten op that made a non-finite value from
    #: finite inputs in the replay ("aten::bmm"), its autograd node for a
    #: backward op ("AddmmBackward0") and where it ran (``FirstNonFinite.where``)
    op: Optional[str] = None
    node: Optional[str] = None
    op_where: Optional[str] = None

    @property
    def name(self) -> str:
        return self.module or "<root>"

    @property
    def local(self) -> bool:
        """Did this rank see the non-finite value itself?"""
        return self.tensor is not None

    def __str__(self) -> str:
        on = "" if self.rank is None else f" on rank {self.rank}"
        if self.tensor is None:
            return (f"non-finite value at step {self.step} on rank(s) {self.bad_ranks} (their "
                    f"reports name the module); rank {self.rank} saw only finite values")
        mb = "" if self.micro_batch is None else f", micro-batch {self.micro_batch}"
        lines = [
            f"first non-finite value at step {self.step}{mb}, {self.pass_} pass, in module "
            f"'{self.name}' ({self.cls}){on}",
            f"  {self.tensor}",
        ]
        if self.op_where:
            lines.append(f"  first op to make it from finite inputs: {self.op_where}")
        if self.reproduced is False:
            lines.append("  the in-process replay of the step stayed finite: this is the live step's "
                         "first non-finite tensor, not localised")
        others = [r for r in self.bad_ranks if r != self.rank]
        if others:
            lines.append(f"  also non-finite this step on rank(s) {others}")
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.inputs:
            lines.append("  computed from:")
            lines.extend(f"    {s}" for s in self.inputs)
        if self.n_nonfinite > 1:
            lines.append(f"  ({self.n_nonfinite} recorded tensors of this step were non-finite; "
                         "this is the first in execution order)")
        if self.replay_path:
            lines.append(f"  the step is saved in {self.replay_path}: "
                         f"python -m nanguard replay {self.replay_path} --triage")
        return "\n".join(lines)


class NonFiniteError(RuntimeError):
    """Raised by :meth:`Watch.check` under ``policy="raise"``; ``.report``
    holds the :class:`Report`."""

    def __init__(self, report: Report):
        self.report = report
        super().__init__(str(report))

    @property
    def replay_path(self) -> Optional[str]:
        """Where ``watch(record_dir=...)`` saved the failing step, or None."""
        return self.report.replay_path
