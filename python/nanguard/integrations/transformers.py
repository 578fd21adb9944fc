"""``NanguardCallback`` for ``transformers.Trainer``::

    from nanguard.integrations.transformers import NanguardCallback

    nanguard.patch(model)                       # optional: NaN-safe attention and norms
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NanguardCallback()])
    trainer.train()

What it does, at each optimizer step (``on_pre_optimizer_step``, after the
backward passes of every accumulated micro-batch):

- unscales (under fp16, when accelerate's ``GradScaler`` has not already
  done it), checks and clips the gradients in nanguard's two fused passes;
- when a gradient is NaN or Inf, or the norm overflows, the step is skipped
  and nothing is applied to the weights: under fp16 the scaler's own skip
  (``found_inf``, and the scale backs off), under bf16 and fp32 by leaving no
  gradient for the optimizer to apply;
- :func:`nanguard.watch` (policy ``"record"``) names the first non-finite
  module; a skipped step is logged as a warning on the ``transformers.trainer``
  logger and as an entry of ``trainer.state.log_history``
  (``nanguard_skipped_step``, ``nanguard_first_nonfinite``, ...), and every
  log line gets ``nanguard_skipped_steps`` and ``nanguard_grad_norm``. The
  ``report_to`` integrations (TensorBoard, W&B) run before the callbacks
  given to the Trainer and do not see these; add them after the Trainer is
  built (``report_to="none"``, then ``trainer.add_callback(...)``) to have them.

Step numbers are the Trainer's: a skipped step carries the ``global_step``
the Trainer gives it once done, the ``step`` of its own log line for that
step (the first optimizer step is step 1), in the warning, the watcher's
report, ``log_history`` and ``callback.guard.skipped``.

Resuming (``trainer.train(resume_from_checkpoint=...)``) keeps the guard's
history: the callback is an ``ExportableState``, so each checkpoint's
``trainer_state.json`` holds its step count and skipped-step records (without
the watcher's report text), and the resumed run continues them
(``nanguard_skipped_steps``, ``callback.guard.skipped``, the end-of-training
line). With ``restore_callback_states_from_checkpoint=True`` the Trainer
replaces the callback by a new one built from its saved arguments (find it
in ``trainer.callback_handler.callbacks``); ``watch_kwargs`` that JSON cannot
hold are not among them.

Clipping is done once, by nanguard: the Trainer's own
(``args.max_grad_norm``) is turned off for the run (set to 0, restored at the
end) and its value becomes the callback's unless ``max_grad_norm=`` is given.
The Trainer still logs ``grad_norm`` from its own norm computation.

Under bf16 and fp32 a skipped step still advances the learning-rate
schedule (the Trainer steps it unless accelerate's scaler skipped); under
fp16 it does not, as with the Trainer alone.

``rewind=True`` (or a dict of :class:`nanguard.Rewind` arguments) adds the
recovery policy: a snapshot every ``every`` steps (``on_step_begin``), the
triggers judged at ``on_step_end`` from the step's loss (the model output's
``loss``, averaged over the step's micro-batches) and the guard's gradient
norm, and on a trigger the run goes back to a snapshot, after testing the
step's micro-batches from there (forward and backward through the model, with
the inputs the Trainer gave it). The Trainer's data goes on: the window's
batches are left behind, the Trainer's step counter goes on counting, and
``callback.rewind`` holds the events and the skipped batches (numbered by the
Trainer's step that trained on them). Without a ``loss`` in the model's
output only the gradient triggers apply.
"""

from __future__ import annotations

import json
from typing import Optional

from transformers import TrainerCallback
try:
    from transformers.trainer_callback import ExportableState
except ImportError:  # transformers before 4.41: no callback state in checkpoints
    class ExportableState:  # type: ignore[no-redef]
        pass
from transformers.utils import logging as _hf_logging

from ._guard import StepGuard, ZLoss
from ._rewind import StepInputs, grad_norm_probe, make_rewind, rewind_kwargs

__all__ = ["NanguardCallback"]

_logger = _hf_logging.get_logger("transformers.trainer")


def _scaler_and_optimizer(optimizer):
    """accelerate's ``AcceleratedOptimizer`` holds the GradScaler (fp16) and
    the torch optimizer the scaler steps."""
    scaler = getattr(optimizer, "scaler", None)
    inner = getattr(optimizer, "optimizer", optimizer)
    return scaler, inner


class NanguardCallback(TrainerCallback, ExportableState):
    """Watch + fused gradient guard for ``transformers.Trainer``.

    Args:
        max_grad_norm: clip to this global norm; None (default) takes the
            Trainer's ``args.max_grad_norm``; 0 checks without clipping.
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
        z_loss: add ``nanguard.z_loss(logits, z_loss)`` to the model
            output's ``loss`` (over the ``attention_mask``'s positions), e.g.
            ``1e-4``; logged as ``nanguard_z_loss``.

    After training, ``callback.guard.skipped`` lists the skipped steps
    (:class:`nanguard.amp.SkippedStep`, numbered as the Trainer numbers
    them) and ``callback.guard.summary()`` the counts; both continue across
    a resume from a checkpoint.
    """

    def __init__(self, max_grad_norm: Optional[float] = None, watch: bool = True,
                 watch_kwargs: Optional[dict] = None, record_dir=None, rewind=None, z_loss=None):
        watch_kwargs = StepGuard.watch_kwargs_with(watch, watch_kwargs, record_dir)
        StepGuard.validate_args(max_grad_norm, watch=watch, watch_kwargs=watch_kwargs)
        self._rewind_kw = rewind_kwargs(rewind)
        self.rewind = None  #: the nanguard.Rewind policy of the run (rewind=)
        self._inputs: Optional[StepInputs] = None
        self._z_coeff = z_loss
        self.z_loss = ZLoss(z_loss) if z_loss is not None else None  #: the z-loss hooks (z_loss=)
        self._own_norm = max_grad_norm
        self._watch, self._watch_kwargs = watch, watch_kwargs
        self.guard: Optional[StepGuard] = None
        self._saved_norm = None
        self._args = None

    # ---- checkpoints: TrainerState.stateful_callbacks ---------------------------------

    def state(self) -> dict:
        """What the Trainer writes into each checkpoint's ``trainer_state.json``
        (``ExportableState``): the constructor's arguments and the guard's
        :meth:`~nanguard.integrations.StepGuard.state_dict`."""
        args = {"max_grad_norm": self._own_norm, "watch": self._watch}
        if self._watch_kwargs is not None and _json_safe(self._watch_kwargs):
            args["watch_kwargs"] = self._watch_kwargs
        if self._rewind_kw is not None and _json_safe(self._rewind_kw):
            args["rewind"] = self._rewind_kw
        if self._z_coeff is not None:
            args["z_loss"] = self._z_coeff
        return {"args": args, "attributes": {"guard_state": self.guard.state_dict() if self.guard else None}}

    def _resumed_state(self, state) -> Optional[dict]:
        """The guard state of the checkpoint this run resumed from: the
        Trainer loads ``trainer_state.json`` (its ``global_step`` > 0) before
        ``on_train_begin``; a fresh run starts at 0."""
        if state.global_step <= 0:
            return None
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if not isinstance(saved, dict):  # absent, or several callbacks of this class
            return None
        return (saved.get("attributes") or {}).get("guard_state")

    # ---- events ------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        norm = self._own_norm if self._own_norm is not None else args.max_grad_norm
        self.guard = StepGuard(norm, watch=self._watch, watch_kwargs=self._watch_kwargs)
        resumed = self._resumed_state(state)
        if resumed:
            self.guard.load_state_dict(resumed)
        # one clipping, by nanguard: the Trainer's is off for the run
        self._args, self._saved_norm = args, args.max_grad_norm
        args.max_grad_norm = 0.0
        if model is not None:
            self.guard.attach(model)
            if self.z_loss is not None:
                self.z_loss.attach(model)
        if self._rewind_kw is not None and model is not None and optimizer is not None:
            scaler, inner = _scaler_and_optimizer(optimizer)
            self._inputs = StepInputs(model)
            params = [p for g in inner.param_groups for p in g["params"]]
            self.rewind = make_rewind(self._rewind_kw, model, inner, scaler, lr_scheduler,
                                      grad_norm_probe(params, self._inputs.run, self.guard))

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rewind is not None:  # the Trainer numbers this step global_step + 1 once done
            self.rewind.begin(self._inputs.begin(), index=state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.rewind is None:
            return
        n = self.rewind.rewinds
        self.rewind.step(self._inputs.loss(), self.guard.last_grad_norm, skipped=self.guard.last_skipped)
        if self.rewind.rewinds > n:
            ev = self.rewind.events[-1]
            _logger.warning(str(ev))
            state.log_history.append({
                "step": state.global_step,
                "nanguard_rewind": ev.trigger.kind,
                "nanguard_rewound_to": ev.restored_step,
                "nanguard_blame": ev.blame,
                "nanguard_lr_scale": ev.lr_scale,
                "nanguard_rewinds": self.rewind.rewinds,
            })

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        scaler, inner = _scaler_and_optimizer(optimizer)
        params = [p for g in inner.param_groups for p in g["params"]]
        # the Trainer counts this step once it is done: it is global_step + 1 in its logs
        step = state.global_step + 1
        if not self.guard.guard(params, optimizer=inner, scaler=scaler, step=step):
            rec = self.guard.skipped[-1]
            _logger.warning(StepGuard.skip_message(rec))
            state.log_history.append({
                "step": step,
                "nanguard_skipped_step": step,
                "nanguard_cause": rec.cause,
                "nanguard_first_nonfinite": rec.module if rec.module_class else "",
                "nanguard_first_nonfinite_class": rec.module_class,
                "nanguard_first_nonfinite_pass": rec.pass_,
                "nanguard_skipped_steps": len(self.guard.skipped),
            })

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.guard is not None:
            extra = {"nanguard_skipped_steps": len(self.guard.skipped)}
            if self.guard.last_grad_norm is not None:
                extra["nanguard_grad_norm"] = self.guard.last_grad_norm
            if self.z_loss is not None and self.z_loss.last is not None:
                extra["nanguard_z_loss"] = float(self.z_loss.last)
            logs.update(extra)
            # the Trainer appended this line to log_history before calling back
            if state.log_history and state.log_history[-1].get("step") == state.global_step \
                    and "nanguard_skipped_step" not in state.log_history[-1]:
                state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        if self._args is not None:
            self._args.max_grad_norm = self._saved_norm
            self._args = None
        if self.guard is not None:
            self.guard.detach()
            line = self.guard.summary_line()
            if line:
                _logger.warning(line)
        if self._inputs is not None:
            self._inputs.remove()
            self._inputs = None
        if self.z_loss is not None:
            self.z_loss.detach()
        if self.rewind is not None:
            self.rewind.close()  # the snapshots; the events and skipped batches stay
            if self.rewind.rewinds:
                _logger.warning(self.rewind.summary())


def _json_safe(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
