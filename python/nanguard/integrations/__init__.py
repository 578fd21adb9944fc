"""One-line integrations with training frameworks.

- :mod:`nanguard.integrations.transformers`: ``NanguardCallback`` for
  ``transformers.Trainer``;
- :mod:`nanguard.integrations.lightning`: ``NanguardCallback`` for
  ``lightning`` (or ``pytorch_lightning``) ``Trainer``.

Each adds :func:`nanguard.watch` and the fused gradient guard
(:func:`nanguard.grad_guard.guard_`) to the framework's own loop: a step
whose gradients hold a NaN or Inf (or whose norm overflows) is skipped and
never applied to the weights, under fp16 with the framework's loss scaler,
bf16 and fp32; gradient clipping is done once, by nanguard; the first
non-finite module and the skip counts go to the framework's logs, under the
framework's own step numbers; the guard's history is kept in the
framework's checkpoints and continues after a resume. A skipped step is a
:class:`nanguard.amp.SkippedStep`.

Nothing here is imported by ``import nanguard``: the frameworks are
optional (``pip install "nanguard[transformers]"`` / ``"nanguard[lightning]"``).
"""

from ..amp import SkippedStep  # noqa: F401  (its home is nanguard.amp; kept importable from here)
from ._guard import StepGuard

__all__ = ["StepGuard"]
