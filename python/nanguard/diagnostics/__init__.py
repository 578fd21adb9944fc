"""``nanguard.diagnostics``: finding where a NaN or Inf comes from.

The documented home of the diagnostic tools' classes; the functions are
also at the top level (``nanguard.watch``, ...).

* :func:`watch` / :class:`Watch`: records a census of every watched module's
  inputs, outputs, output gradients and parameter gradients each step, and
  names the first non-finite one as a :class:`Report` (raised inside a
  :class:`NonFiniteError` under ``policy="raise"``). :class:`TensorStats` is
  the census of one recorded tensor; ``FORWARD``, ``BACKWARD`` and
  ``PARAM_GRAD`` are the values of :attr:`Report.pass_`.
"""

from __future__ import annotations

from ._report import BACKWARD, FORWARD, PARAM_GRAD, NonFiniteError, Report, TensorStats
from ._watch import Watch, watch

__all__ = ["watch", "Watch", "Report", "TensorStats", "NonFiniteError", "FORWARD", "BACKWARD",
           "PARAM_GRAD"]
