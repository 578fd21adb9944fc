"""``NanguardCallback`` for a Lightning ``Trainer`` (``lightning.pytorch``,
or ``pytorch_lightning`` when only that is installed)::

    from nanguard.integrations.lightning import NanguardCallback

    trainer = lightning.pytorch.Trainer(precision="bf16-mixed", gradient_clip_val=1.0,
                                        callbacks=[NanguardCallback()])

What it does, at each optimizer step (``on_before_optimizer_step``: after the
closure's backward pass, and under ``"16-mixed"`` after Lightning's scaler
has unscaled the gradients):

- checks and clips the gradients in nanguard's two fused passes;
- when a gradient is NaN or Inf, or the norm overflows, the step is skipped
  and nothing is applied to the weights: under ``16-mixed`` through the
  scaler's own ``found_inf`` (the scaler skips the step and backs the scale
  off), under ``bf16-mixed`` / ``32-true`` by leaving no gradient for the
  optimizer to apply;
- :func:`nanguard.watch` (policy ``"record"``) names the first non-finite
  module: a skipped step is logged as a warning on the
  ``lightning.pytorch.callbacks.nanguard`` logger (``pytorch_lightning.callbacks.nanguard``
  for ``pytorch_lightning``), and ``nanguard/skipped_steps``
  and ``nanguard/grad_norm`` are logged as metrics (``self.log``) at every
  training batch.

Clipping is done once, by nanguard: the Trainer's ``gradient_clip_val``
(norm clipping) becomes the callback's unless ``max_grad_norm=`` is given,
and is set to None for the run (restored at the end). Value clipping
(``gradient_clip_algorithm="value"``) is refused.

Step numbers are the ones Lightning's loggers use: a skipped step carries
the step its batch's metrics are logged under (TensorBoard's, W&B's or the
CSV logger's ``step``; 0 for the first optimizer step, and the same number
for every optimizer of a batch), in the warning, the watcher's report and
``callback.guard.skipped``. ``trainer.global_step`` reads one more once the
step is done.

Resuming (``trainer.fit(..., ckpt_path=...)``) keeps the guard's history:
the callback's ``state_dict`` (its step count and skipped-step records,
without the watcher's report text) is saved in Lightning's checkpoints and
restored before training starts again.

``rewind=True`` (or a dict of :class:`nanguard.Rewind` arguments) adds the
recovery policy (automatic optimization, one optimizer, no gradient
accumulation): a snapshot every ``every`` steps (``on_train_batch_start``),
the triggers judged at ``on_train_batch_end`` from ``training_step``'s loss
and the guard's gradient norm, and on a trigger the run goes back to a
snapshot after testing the batch from there (``training_step`` and a
backward pass, under the precision plugin's autocast). Lightning's data goes
on: the window's batches are left behind, ``trainer.global_step`` goes on
counting, and ``callback.rewind`` holds the events and the skipped batches
(numbered by ``trainer.global_step`` when they ran).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # only the older package name is installed
    from pytorch_lightning import Callback as _Callback

from ._guard import StepGuard, ZLoss
from ._rewind import grad_norm_probe, make_rewind, rewind_kwargs

__all__ = ["NanguardCallback", "PLNanguardCallback"]  # noqa: F822 (PLNanguardCallback: module __getattr__)


def _logger_name(callback_base: type) -> str:
    """The framework's own logger tree: ``lightning.pytorch`` or ``pytorch_lightning``."""
    pkg = "pytorch_lightning" if callback_base.__module__.startswith("pytorch_lightning") else "lightning.pytorch"
    return pkg + ".callbacks.nanguard"


def _logged_step(trainer) -> int:
    """The step Lightning's loggers record the current batch's metrics under
    (``fit_loop.epoch_loop._batches_that_stepped``, which Lightning's own
    LearningRateMonitor and DeviceStatsMonitor log with); ``global_step``
    when a Lightning version has no such counter."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    n = getattr(loop, "_batches_that_stepped", None)
    return trainer.global_step if n is None else int(n)


class _Guarded:
    """Watch + fused gradient guard for a Lightning ``Trainer``.

    Args:
        max_grad_norm: clip to this global norm; None (default) takes the
            Trainer's ``gradient_clip_val``; 0 checks without clipping.
        watch: name the first non-finite module with :func:`nanguard.watch`.
        watch_kwargs: more arguments for :func:`nanguard.watch`.
        record_dir: save the first non-finite step there for
            :func:`nanguard.replay` (``watch(record_dir=...)``, sentinel
            watching by default: ``watch_kwargs={"mode": "eager"}`` for a
            census of every step).
        rewind: True, or a dict of :class:`nanguard.Rewind` arguments
            (``every``, ``keep``, ``directory``, ``patience``, ``loss_spike``,
            ``grad_spike``, ``window``, ``min_history``, ``action``,
            ``lr_factor``, ``max_rewinds``, ``log_path``): recover by
            rewinding (module docstring); ``callback.rewind`` is the policy.
        z_loss: add ``nanguard.z_loss(logits, z_loss)`` to the ``loss`` of
            the Hugging Face model(s) inside the LightningModule (over the
            ``attention_mask``'s positions), e.g. ``1e-4``; logged as
            ``nanguard/z_loss``.

    ``callback.guard.skipped`` lists the skipped steps
    (:class:`nanguard.amp.SkippedStep`, numbered as Lightning's loggers
    number them) and ``callback.guard.summary()`` the counts; both continue
    across a resume from a checkpoint.
    """

    def __init__(self, max_grad_norm: Optional[float] = None, watch: bool = True,
                 watch_kwargs: Optional[dict] = None, record_dir=None, rewind=None, z_loss=None):
        super().__init__()
        watch_kwargs = StepGuard.watch_kwargs_with(watch, watch_kwargs, record_dir)
        StepGuard.validate_args(max_grad_norm, watch=watch, watch_kwargs=watch_kwargs)
        self._rewind_kw = rewind_kwargs(rewind)
        self.rewind = None  #: the nanguard.Rewind policy of the run (rewind=)
        self.z_loss = ZLoss(z_loss) if z_loss is not None else None  #: the z-loss hooks (z_loss=)
        self._own_norm = max_grad_norm
        self._watch, self._watch_kwargs = watch, watch_kwargs
        self.guard: Optional[StepGuard] = None
        self._saved_clip = None
        self._trainer = None
        self._restored: Optional[dict] = None  # from a checkpoint, for the guard of the next fit

    # ---- checkpoints: Lightning's Callback.state_dict / load_state_dict ------------------

    def state_dict(self) -> dict:
        """The guard's step count and skipped-step records
        (:meth:`~nanguard.integrations.StepGuard.state_dict`), for Lightning's checkpoints."""
        if self.guard is not None:
            return {"guard": self.guard.state_dict()}
        return {"guard": self._restored} if self._restored else {}

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning restores callbacks before on_fit_start, which builds the guard
        self._restored = state_dict.get("guard")

    # ---- events ------------------------------------------------------------------------

    def on_fit_start(self, trainer, pl_module) -> None:
        clip = trainer.gradient_clip_val
        if clip is not None and str(getattr(trainer, "gradient_clip_algorithm", "norm")).lower().endswith("value"):
            raise ValueError("NanguardCallback clips the gradient norm; gradient_clip_algorithm='value' "
                             "would clip a second time: use gradient_clip_algorithm='norm'")
        norm = self._own_norm if self._own_norm is not None else clip
        self.guard = StepGuard(norm, watch=self._watch, watch_kwargs=self._watch_kwargs)
        if self._restored:
            self.guard.load_state_dict(self._restored)
            self._restored = None
        self._trainer, self._saved_clip = trainer, clip
        trainer.gradient_clip_val = None  # one clipping, by nanguard
        self.guard.attach(pl_module)
        if self.z_loss is not None:
            self.z_loss.attach(pl_module)
        if self._rewind_kw is not None:
            self.rewind = self._make_rewind(trainer, pl_module)

    def _make_rewind(self, trainer, pl_module):
        if not pl_module.automatic_optimization:
            raise ValueError("NanguardCallback(rewind=...) needs automatic optimization: under manual "
                             "optimization the LightningModule steps its optimizers itself")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"NanguardCallback(rewind=...) supports one optimizer, the module has "
                             f"{len(trainer.optimizers)}")
        if getattr(trainer, "accumulate_grad_batches", 1) != 1:
            raise ValueError("NanguardCallback(rewind=...) does not support accumulate_grad_batches > 1")
        optimizer = trainer.optimizers[0]
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        scheduler = configs[0].scheduler if len(configs) == 1 else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def run(batch):
            with trainer.precision_plugin.forward_context():
                out = pl_module.training_step(batch, 0)
            loss = out.get("loss") if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):
                return None
            loss.backward()
            return loss

        probe = grad_norm_probe(params, run, self.guard)
        return make_rewind(self._rewind_kw, pl_module, optimizer, scaler, scheduler, probe)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.rewind is not None:
            self.rewind.begin(batch, index=trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.guard.guard(params, optimizer=optimizer, scaler=scaler, step=_logged_step(trainer)):
            logging.getLogger(self._log_name).warning(StepGuard.skip_message(self.guard.skipped[-1]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.guard is None:
            return
        pl_module.log("nanguard/skipped_steps", float(len(self.guard.skipped)), on_step=True, on_epoch=False)
        if self.guard.last_grad_norm is not None:
            pl_module.log("nanguard/grad_norm", float(self.guard.last_grad_norm), on_step=True, on_epoch=False)
        if self.z_loss is not None and self.z_loss.last is not None:
            pl_module.log("nanguard/z_loss", float(self.z_loss.last), on_step=True, on_epoch=False)
        if self.rewind is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            n = self.rewind.rewinds
            self.rewind.step(loss if isinstance(loss, torch.Tensor) else None, self.guard.last_grad_norm,
                             skipped=self.guard.last_skipped)
            if self.rewind.rewinds > n:
                logging.getLogger(self._log_name).warning(str(self.rewind.events[-1]))
            pl_module.log("nanguard/rewinds", float(self.rewind.rewinds), on_step=True, on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore()
        line = self.guard.summary_line() if self.guard is not None else ""
        if line:
            logging.getLogger(self._log_name).warning(line)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._trainer is not None:
            self._trainer.gradient_clip_val = self._saved_clip
            self._trainer = None
        if self.guard is not None:
            self.guard.detach()
        if self.rewind is not None:
            self.rewind.close()  # the snapshots; the events and skipped batches stay
        if self.z_loss is not None:
            self.z_loss.detach()


class NanguardCallback(_Guarded, _Callback):
    __doc__ = _Guarded.__doc__
    _log_name = _logger_name(_Callback)


def __getattr__(name):
    # pytorch_lightning's Trainer accepts only its own Callback subclasses: when
    # both packages are installed, PLNanguardCallback is the one for it
    if name == "PLNanguardCallback":
        from pytorch_lightning import Callback as _PLCallback

        if _PLCallback is _Callback:
            cls = NanguardCallback
        else:
            cls = type("PLNanguardCallback", (_Guarded, _PLCallback),
                       {"__doc__": _Guarded.__doc__, "__module__": __name__, "_log_name": _logger_name(_PLCallback)})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
