"""What makes a run rewind: the triggers and their rules.

- **Non-finite loss.** The forward pass made a NaN or Inf loss. Loss scaling
  does not act on the forward pass, so this is never a GradScaler's ordinary
  overflow: it triggers at once.
- **Non-finite gradients.** With an enabled loss scaler, a step whose scaled
  gradients overflow is the scaler's ordinary backoff (it skips the step and
  halves the scale); it triggers only when ``patience`` steps in a row are
  skipped. Without a scaler (bf16, fp32) nothing backs off, and one such step
  triggers.
- **Spikes** (of the loss, or of the gradient norm before clipping): a value
  at least ``sigma`` standard deviations (7 by default, the threshold of
  OLMo 2's spike score: OLMo et al., 2024, "2 OLMo 2 Furious") above the
  mean of the last ``window`` values of the steps that stood. It is armed
  once ``min_history`` values are in the window, and only upward moves
  count: a loss that falls fast is not a spike.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Dict, List, Optional

__all__ = ["SpikeRule", "Trigger", "NONFINITE_LOSS", "NONFINITE_GRADS", "LOSS_SPIKE", "GRAD_SPIKE"]

NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRADS = "non-finite gradients"
LOSS_SPIKE = "loss spike"
GRAD_SPIKE = "grad-norm spike"


@dataclasses.dataclass
class Trigger:
    """Why a run rewound, and at which step."""

    kind: str  #: one of "non-finite loss", "non-finite gradients", "loss spike", "grad-norm spike"
    step: int  #: the optimizer step that fired it
    batches: List[int]  #: indices (in the data) of the batches of the steps that fired it
    value: float  #: the loss or gradient norm of that step
    detail: str  #: the rule's numbers, in words
    scale: Optional[float] = None  #: the loss scale after the step (non-finite gradients under a scaler)

    def __str__(self) -> str:
        return f"{self.kind} at step {self.step} ({self.detail})"

    def to_state(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["value"] = _json_float(self.value)
        return d


def _json_float(x: float):
    """JSON has no NaN/Inf: they are written as strings."""
    return x if math.isfinite(x) else str(x)


class SpikeRule:
    """``value > mean + sigma * std`` over the last ``window`` values."""

    def __init__(self, name: str, sigma: float, window: int, min_history: int):
        self.name, self.sigma, self.window, self.min_history = name, sigma, window, min_history
        self.values: collections.deque = collections.deque(maxlen=window)

    def check(self, x: Optional[float]) -> Optional[str]:
        """The rule's numbers in words when ``x`` is a spike, else None."""
        if x is None or not math.isfinite(x) or len(self.values) < self.min_history:
            return None
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / (n - 1))
        if x - mean > self.sigma * std:
            k = (x - mean) / std if std > 0 else math.inf
            return (f"{self.name} {x:.4g} is {k:.1f} sigma above the mean {mean:.4g} of the last {n} steps; "
                    f"threshold {self.sigma:g} sigma")
        return None

    def push(self, x: Optional[float]) -> None:
        if x is not None and math.isfinite(x):
            self.values.append(x)

    def state(self) -> List[float]:
        return list(self.values)

    def load(self, values: List[float]) -> None:
        self.values = collections.deque(values, maxlen=self.window)
