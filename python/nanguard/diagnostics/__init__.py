"""``nanguard.diagnostics``: finding where a NaN or Inf comes from, and why.

The documented home of the diagnostic tools' classes; the functions are
also at the top level (``nanguard.watch``, ``nanguard.doctor``, ...).

* :func:`watch` / :class:`Watch`: records a census of every watched module's
  inputs, outputs, output gradients and parameter gradients each step, and
  names the first non-finite one as a :class:`Report` (raised inside a
  :class:`NonFiniteError` under ``policy="raise"``). :class:`TensorStats` is
  the census of one recorded tensor; ``FORWARD``, ``BACKWARD`` and
  ``PARAM_GRAD`` are the values of :attr:`Report.pass_`.
* :func:`check_batch`: the inputs that make a loss NaN (:class:`BatchFinding`,
  :class:`BadBatchError`).
* :func:`doctor`: a training setup audited against the known causes of NaN
  losses (:class:`Finding`).
* ``watch(history=N)``: the magnitude :class:`History` of every module and
  the fp16 early warning (:class:`HeadroomWarning`); ``watch(record_dir=...)``
  saves the first non-finite step, and :func:`replay` runs it again op by op
  and (``triage=True``) under the standard checklist (:class:`ReplayResult`).
* :class:`EarlyWarnings`: cause-based warnings in any precision (attention
  logits, output logits, Adam's update RMS and eps, the loss scale), as
  :class:`InstabilityWarning`.
"""

from __future__ import annotations

from ._batch import BadBatchError, BatchFinding, check_batch
from ._doctor import Finding, doctor, format_findings
from ._early_warnings import EarlyWarnings, InstabilityWarning
from ._history import HeadroomWarning, History
from ._flight_record import RecordError
from ._replay import ReplayResult, StepOutcome, replay
from ._report import BACKWARD, FORWARD, PARAM_GRAD, NonFiniteError, Report, TensorStats
from ._watch import Watch, watch

__all__ = ["watch", "Watch", "Report", "TensorStats", "NonFiniteError", "FORWARD", "BACKWARD",
           "PARAM_GRAD", "check_batch", "BatchFinding", "BadBatchError", "doctor", "Finding",
           "format_findings", "History", "HeadroomWarning", "replay", "ReplayResult", "StepOutcome",
           "RecordError", "EarlyWarnings", "InstabilityWarning"]
