"""The framework-independent part of the integrations: one guarded step.

:meth:`StepGuard.guard` runs after the backward pass(es) of an optimizer
step and before the optimizer: it unscales (when a loss scaler has not done
it yet), checks and clips the gradients in nanguard's two fused passes, reads
the watcher once, and when anything is non-finite makes sure the optimizer
step does not happen:

- with an enabled ``torch.amp.GradScaler`` (fp16), the scaler's per-optimizer
  state is given the guard's ``found_inf`` flags, exactly as its own
  ``unscale_`` would, so ``scaler.step`` skips the step and ``scaler.update``
  backs the scale off;
- without one (bf16, fp32), every gradient is set to ``None``: PyTorch's
  optimizers leave a parameter without a gradient untouched (no update, no
  weight decay, no moment update), so the step applies nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterable, List, Optional

import torch
from torch import nn

from .. import _scaler_state
from .. import grad_guard as _gg
from ..amp import SkippedStep
from ..diagnostics import watch as _watch

__all__ = ["StepGuard", "ZLoss"]


def _check_max_norm(max_grad_norm) -> float:
    if max_grad_norm is None:
        return math.inf
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
        raise TypeError(f"max_grad_norm must be a float or None, got {type(max_grad_norm).__name__}")
    v = float(max_grad_norm)
    if not v >= 0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 or None: no clipping), got {max_grad_norm}")
    return v if v > 0 else math.inf


class StepGuard:
    """Watch + fused gradient guard for one model and its optimizer steps.

    Args:
        max_grad_norm: clip the global gradient norm to this (None or 0: no
            clipping, the gradients are still checked).
        norm_type: 2.0 or ``inf``.
        watch: attach :func:`nanguard.watch` (policy ``"record"``) to name
            the first non-finite module of a skipped step.
        watch_kwargs: more arguments for :func:`nanguard.watch`.

    A skipped step is recorded as a :class:`nanguard.amp.SkippedStep` whose
    ``step`` is the number passed to :meth:`guard` (the framework's own), or
    the count of :meth:`guard` calls before it when none is passed.
    :meth:`state_dict` / :meth:`load_state_dict` carry the count and the
    records across a checkpoint.
    """

    def __init__(self, max_grad_norm: Optional[float] = None, norm_type: float = 2.0, watch: bool = True,
                 watch_kwargs: Optional[dict] = None):
        self.validate_args(max_grad_norm, norm_type, watch, watch_kwargs)
        self.max_grad_norm = _check_max_norm(max_grad_norm)
        self.norm_type = float(norm_type)
        self.use_watch = watch
        self.watch_kwargs = dict(watch_kwargs or {})
        self.watcher = None
        self.steps = 0  #: optimizer steps guarded
        self.skipped: List[SkippedStep] = []  #: steps skipped, oldest first
        self.last_grad_norm: Optional[float] = None  #: norm of the unscaled gradients of the last step
        self.last_skipped = False  #: the last step was made a no-op

    @staticmethod
    def watch_kwargs_with(watch: bool, watch_kwargs: Optional[dict], record_dir) -> Optional[dict]:
        """``watch_kwargs`` with ``record_dir`` added (the callbacks' ``record_dir=``)."""
        if record_dir is None:
            return watch_kwargs
        if not watch:
            raise ValueError("record_dir needs watch=True: the watcher finds the non-finite step it records")
        if not isinstance(record_dir, (str, os.PathLike)):
            raise TypeError(f"record_dir must be a path, got {type(record_dir).__name__}")
        return {**(watch_kwargs or {}), "record_dir": os.fspath(record_dir)}

    @staticmethod
    def validate_args(max_grad_norm: Optional[float] = None, norm_type: float = 2.0, watch: bool = True,
                      watch_kwargs: Optional[dict] = None) -> None:
        """Raise the ``TypeError`` / ``ValueError`` the constructor would
        raise for these arguments (the callbacks check theirs when built,
        and build their guard when training starts)."""
        _check_max_norm(max_grad_norm)
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) \
                or float(norm_type) not in (2.0, math.inf):
            raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
        if not isinstance(watch, bool):
            raise TypeError(f"watch must be a bool, got {type(watch).__name__}")
        if watch_kwargs is not None and not isinstance(watch_kwargs, dict):
            raise TypeError(f"watch_kwargs must be a dict or None, got {type(watch_kwargs).__name__}")

    # ---- lifetime ----------------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if self.use_watch and self.watcher is None:
            kw = dict(policy="record")
            kw.update(self.watch_kwargs)
            self.watcher = _watch(model, **kw)

    def detach(self) -> None:
        if self.watcher is not None:
            self.watcher.remove()
            self.watcher = None

    # ---- one step -----------------------------------------------------------------------

    def guard(self, parameters: Iterable[torch.Tensor], optimizer: Optional[torch.optim.Optimizer] = None,
              scaler: Optional[torch.amp.GradScaler] = None, step: Optional[int] = None) -> bool:
        """Unscale / check / clip the gradients of ``parameters`` in place;
        True when the step may go ahead, False when it was made a no-op
        (see the module docstring). ``optimizer`` is the torch optimizer the
        ``scaler`` steps (needed when a scaler is enabled). ``step`` numbers
        the step in the records and reports (default: :attr:`steps`)."""
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        use_scaler = scaler is not None and scaler.is_enabled()
        inv_scale, found_inf, state = 1.0, None, None
        if use_scaler:
            if optimizer is None:
                raise ValueError("optimizer is required with an enabled scaler")
            # already unscaled: the framework's own norm computation ran unscale_ (inv None)
            inv, found_inf, state = _scaler_state.begin_unscale(scaler, optimizer, allow_unscaled=True)
            inv_scale = 1.0 if inv is None else inv
        index = self.steps if step is None else int(step)
        self.steps += 1
        if grads:
            total, stats, found_inf = _gg.guard_(grads, inv_scale, self.max_grad_norm, self.norm_type,
                                                 found_inf=found_inf)
            _, nan, inf, first_bad = stats.tensor.tolist()  # the step's one host read
            norm = float(total.item())
            finite = nan == 0 and inf == 0 and math.isfinite(norm)
        else:
            nan = inf = 0
            first_bad, norm, finite = -1, 0.0, True
        if use_scaler:
            _scaler_state.end_unscale(state, found_inf)  # no gradient: no flag, as unscale_ leaves it
        report = self.watcher.step() if self.watcher is not None else None
        self.last_grad_norm = norm
        self.last_skipped = not finite
        if finite:
            return True
        rec = SkippedStep(index, int(nan), int(inf), int(first_bad), scaler.get_scale() if use_scaler else None)
        if report is not None and report.tensor is not None:
            report = dataclasses.replace(report, step=index)  # the report speaks of the same step number
            rec.module, rec.module_class, rec.pass_, rec.report = report.module, report.cls, report.pass_, str(report)
        self.skipped.append(rec)
        if not use_scaler:
            for p in params:
                p.grad = None
        return False

    # ---- what happened ----------------------------------------------------------------

    def summary(self) -> dict:
        """Counts for the framework's logs."""
        last = self.skipped[-1] if self.skipped else None
        return {
            "steps": self.steps,
            "skipped": len(self.skipped),
            "skipped_nan": sum(1 for s in self.skipped if s.cause == "nan"),
            "skipped_inf": sum(1 for s in self.skipped if s.cause == "inf"),
            "skipped_norm_overflow": sum(1 for s in self.skipped if s.cause == "norm overflow"),
            "last_skip_module": last.module if last else "",
        }

    def summary_line(self) -> str:
        """The end-of-training line of the callbacks' logs; "" when no step
        was skipped."""
        s = self.summary()
        if not s["skipped"]:
            return ""
        return (f"nanguard: {s['skipped']} of {s['steps']} optimizer steps skipped ({s['skipped_nan']} NaN, "
                f"{s['skipped_inf']} Inf, {s['skipped_norm_overflow']} norm overflow)")

    @staticmethod
    def skip_message(rec: SkippedStep) -> str:
        """A skipped step's log message: its line, then the watcher's report."""
        return str(rec) + (f"\n{rec.report}" if rec.report else "")

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The steps guarded and the skipped steps' records (without their
        report text), as plain Python values: JSON-safe, for the Trainer's
        ``trainer_state.json`` as for a Lightning checkpoint."""
        return {"steps": self.steps, "skipped": [r.to_state() for r in self.skipped]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: the counts, :attr:`skipped` and
        :meth:`summary` go on from the saved ones."""
        self.steps = int(state["steps"])
        self.skipped = [SkippedStep.from_state(d) for d in state["skipped"]]


class ZLoss:
    """The callbacks' ``z_loss=``: forward hooks that add
    :func:`nanguard.z_loss` of the output logits to the ``loss`` of every
    Hugging Face model in the trained module (the outermost modules with
    ``get_output_embeddings`` and a ``config``; a LightningModule's inner
    model), where the output carries both ``loss`` and ``logits``. Positions
    are those of the ``attention_mask`` the model was called with (all when
    none). ``last`` is the last z-loss added (detached)."""

    def __init__(self, coeff):
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 < coeff < math.inf:
            raise ValueError(f"z_loss must be a coefficient > 0 (1e-4 is PaLM's), or None; got {coeff!r}")
        self.coeff = float(coeff)
        self.last: Optional[torch.Tensor] = None
        self._handles: list = []

    @staticmethod
    def targets(model: nn.Module) -> List[nn.Module]:
        prefixes: List[str] = []
        found: List[nn.Module] = []
        for name, m in model.named_modules():
            if any(name.startswith(p) for p in prefixes):
                continue  # inside a model already found (its own inner base model)
            if callable(getattr(m, "get_output_embeddings", None)) and hasattr(m, "config"):
                found.append(m)
                prefixes.append(name + "." if name else "")
        return found

    def attach(self, model: nn.Module) -> None:
        for m in self.targets(model):
            self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))

    def _hook(self, module, args, kwargs, out):
        from .._losses import z_loss

        if not torch.is_grad_enabled() or not isinstance(out, dict):
            return None
        loss, logits = out.get("loss"), out.get("logits")
        if not isinstance(loss, torch.Tensor) or not isinstance(logits, torch.Tensor):
            return None
        mask = kwargs.get("attention_mask")
        mask = mask.bool() if isinstance(mask, torch.Tensor) and mask.shape == logits.shape[:-1] else None
        z = z_loss(logits, self.coeff, mask=mask)
        out["loss"] = loss + z.to(loss.dtype)
        self.last = z.detach()
        return out

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
