"""``nanguard.Rewind``: a training run that rewinds and recovers by itself.

Skipping a non-finite step keeps the weights finite, but not the run alive
when the weights themselves have drifted into a region every later step
overflows from. Rewind recovers the way large runs do by hand (PaLM went
back about 100 steps and skipped the batches of the window; OPT-175B
restarted from checkpoints with a lower learning rate), automatically::

    rewind = nanguard.Rewind(model, optimizer, scaler=scaler, every=50)
    for step, batch in rewind.loop(data, steps=10_000):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        grad_norm = scaler.unscale_and_clip_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        rewind.step(loss, grad_norm)    # after the optimizer step

1. **Snapshots**: every ``every`` steps, the model, optimizer, scaler,
   scheduler and RNG states are copied to host memory (or to ``directory``);
   the last ``keep`` are kept (:mod:`nanguard.rewind._snapshot`). The batches
   drawn since the oldest snapshot are held by reference.
2. **Triggers**: a non-finite loss; non-finite gradients (``patience`` steps
   in a row under an enabled scaler, whose single overflows are its ordinary
   backoff; one step without); a loss spike (``loss_spike`` sigma above the
   rolling mean) and, when asked, a gradient-norm spike
   (:mod:`nanguard.rewind._triggers`).
3. **The data-versus-state test**: the run goes back to the newest snapshot
   taken before the trigger, and runs each batch of the steps that fired it
   from there (through the user's own loop; every such probe step is undone
   afterwards). A batch that fails again from the earlier state is blamed on
   the **data**; when every batch is fine there, the **state** the run had
   drifted into is blamed.
4. **Recovery** (``action``):

   ============================ ==============================================
   ``"auto"`` (default)         skip the batches blamed on the data; when the
                                state is blamed, lower the learning rate by
                                ``lr_factor``
   ``"skip"``                   skip every batch of the window (from the
                                snapshot to the trigger), as PaLM did
   ``"lower_lr"``               lower the learning rate by ``lr_factor``, and
                                skip the batches blamed on the data
   ``"skip_and_lower_lr"``      both
   ============================ ==============================================

   The run then goes on from the snapshot: the window's other batches are
   replayed in order, then new ones are drawn. If a trigger fires again
   before the run has passed the step that fired the last one, it goes back
   one snapshot further (and acts again; from the oldest snapshot, it can
   only lower the learning rate again). When nothing is left to try (no
   older snapshot with ``action="skip"``, or a failure at the first snapshot
   that comes back), or after ``max_rewinds`` rewinds in all, it raises
   :class:`RewindError`. It never loops.

The skipped batches (their step, their index in the data, what blamed them)
and every rewind are written to ``log_path`` as JSON; ``skip_batches=`` that
file (or a list of indices) makes a resumed run skip them too.

Reads per step: the loss (and the gradient norm when given) and, with an
enabled scaler, its scale; that is one host read where the loop logs its
loss anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .. import distributed as _dist
from . import _snapshot
from ._triggers import GRAD_SPIKE, LOSS_SPIKE, NONFINITE_GRADS, NONFINITE_LOSS, SpikeRule, Trigger

KINDS = (GRAD_SPIKE, LOSS_SPIKE, NONFINITE_GRADS, NONFINITE_LOSS)  # ranks agree on the last of these that fired

__all__ = ["Rewind", "RewindError", "RewindEvent", "StepRecord", "Trigger"]

ACTIONS = ("auto", "skip", "lower_lr", "skip_and_lower_lr")
DATA, STATE, WINDOW, UNTESTED = "data", "state", "window", "untested"


class RewindError(RuntimeError):
    """The run could not recover: the failure came back with no older
    snapshot left, or the run rewound ``max_rewinds`` times."""

    def __init__(self, message: str, events: List["RewindEvent"]):
        super().__init__(message)
        self.events = events


@dataclasses.dataclass
class StepRecord:
    """One optimizer step of the run as it stands (rewound steps are gone)."""

    step: int
    batch: int  #: the batch's index in the data
    loss: Optional[float]  #: None when the loop gave no loss
    grad_norm: Optional[float]
    skipped: bool  #: the optimizer step was skipped (a loss scaler's backoff)


@dataclasses.dataclass
class Probe:
    """One batch of the data-versus-state test, run from the earlier state."""

    batch: int
    loss: Optional[float]
    failed: bool
    why: str  #: what failed again, or "" when it was fine


@dataclasses.dataclass
class RewindEvent:
    """One rewind: what fired, where the run went back to, what was blamed
    and what was done."""

    trigger: Trigger
    restored_step: int  #: the snapshot the run went back to (optimizer steps done)
    blame: str  #: "data", "state" or "untested" (no earlier snapshot to test from)
    probes: List[Probe]
    skipped_batches: List[int]  #: batch indices skipped from now on
    lr_scale: float  #: the run's learning-rate factor after this rewind (1.0: unchanged)
    attempt: int  #: 1 for a new failure; 2, 3, ... when the same one came back

    def __str__(self) -> str:
        tested = ", ".join(f"batch {p.batch} {'fails again: ' + p.why if p.failed else 'finite'}"
                           for p in self.probes)
        did = []
        if self.skipped_batches:
            did.append(f"skipping batch{'es' if len(self.skipped_batches) > 1 else ''} "
                       + ", ".join(map(str, self.skipped_batches)))
        if self.lr_scale != 1.0:
            did.append(f"learning rate x{self.lr_scale:g} of the original")
        again = f" (attempt {self.attempt})" if self.attempt > 1 else ""
        return (f"nanguard.Rewind: {self.trigger}; rewound to step {self.restored_step}{again}; "
                f"from there {tested or 'nothing to test'}: {self.blame} blamed; "
                f"{'; '.join(did) or 'no change'}")

    def to_state(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["trigger"] = self.trigger.to_state()
        d["probes"] = [dict(dataclasses.asdict(p), loss=_json_float(p.loss)) for p in self.probes]
        return d


def _json_float(x: Optional[float]):
    return x if x is None or math.isfinite(x) else str(x)


def _host_float(x, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(x.shape)}")
        return float(x.detach().float().item())
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(x).__name__}")
    return float(x)


def _positive_int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def _sigma(v, name: str) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < float(v) < math.inf):
        raise ValueError(f"{name} must be a number of standard deviations > 0, or None to turn it off; got {v!r}")
    return float(v)


def _read_skip_list(skip_batches) -> List[int]:
    if skip_batches is None:
        return []
    if isinstance(skip_batches, (str, os.PathLike)):
        with open(skip_batches) as f:
            doc = json.load(f)
        return [int(d["batch"]) for d in doc.get("skipped_batches", [])]
    out = []
    for i in skip_batches:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"skip_batches must hold batch indices (ints >= 0), got {i!r}")
        out.append(i)
    return out


class Rewind:
    """A recovery policy for a training loop: snapshots, triggers, the
    data-versus-state test, and a rewind that skips data or lowers the
    learning rate. See the module docstring for the rules.

    Args:
        model, optimizer: what the loop trains.
        scaler: the loop's ``torch.amp.GradScaler`` (or nanguard's), if any:
            its state is part of every snapshot, and its skipped steps are
            its ordinary backoff until ``patience`` come in a row.
        scheduler: the LR scheduler, if any: part of every snapshot, and its
            ``base_lrs`` are lowered with the learning rate.
        every: take a snapshot every this many optimizer steps (from step 0).
        keep: how many snapshots to keep (the ring). Going back further than
            ``keep * every`` steps is impossible.
        directory: keep the snapshots as files here instead of host memory.
        patience: consecutive skipped steps under an enabled scaler that
            trigger a rewind.
        loss_spike: sigma of the loss-spike rule (None: off).
        grad_spike: sigma of the gradient-norm spike rule (None, the
            default: off; gradient norms spike in healthy runs too).
        window, min_history: the spike rules' rolling window, and how many
            values it needs before it is armed.
        action: what a rewind does: "auto", "skip", "lower_lr" or
            "skip_and_lower_lr" (module docstring).
        lr_factor: the learning rate is multiplied by this each time it is
            lowered (0.5 by default).
        max_rewinds: give up (:class:`RewindError`) after this many rewinds.
        log_path: write the skipped batches and the rewinds here as JSON.
        skip_batches: batch indices (or a ``log_path`` file of an earlier
            run) never to train on.
        probe: for :meth:`begin`-driven loops: ``probe(batch)`` runs the
            batch's forward and backward and returns its loss, or
            ``(loss, grad_norm)``, or None when it cannot.
        process_group: under torch.distributed, the ranks that rewind
            together (default: all): when one rank's rule fires, every rank
            rewinds to the same snapshot, and the data is blamed when any
            rank's batch fails again (each rank skips its own). One small
            all-reduce per step, and one per rewind.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 scaler: Optional[torch.amp.GradScaler] = None, scheduler=None, every: int = 100,
                 keep: int = 3, directory: Optional[Union[str, os.PathLike]] = None, patience: int = 3,
                 loss_spike: Optional[float] = 7.0, grad_spike: Optional[float] = None, window: int = 100,
                 min_history: int = 20, action: str = "auto", lr_factor: float = 0.5, max_rewinds: int = 10,
                 log_path: Optional[Union[str, os.PathLike]] = None,
                 skip_batches: Union[None, str, os.PathLike, Iterable[int]] = None,
                 probe: Optional[Callable[[Any], Any]] = None, process_group=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "base_lrs")):
            raise TypeError(f"scheduler must be a torch.optim.lr_scheduler.LRScheduler or None, "
                            f"got {type(scheduler).__name__}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(map(repr, ACTIONS))}; got {action!r}")
        if isinstance(lr_factor, bool) or not isinstance(lr_factor, (int, float)) or not 0 < lr_factor < 1:
            raise ValueError(f"lr_factor must be a number in (0, 1), got {lr_factor!r}")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path or None, got {type(directory).__name__}")
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be a callable (batch -> loss, or (loss, grad_norm)), got "
                            f"{type(probe).__name__}")
        if log_path is not None and not isinstance(log_path, (str, os.PathLike)):
            raise TypeError(f"log_path must be a path or None, got {type(log_path).__name__}")
        self._group = _dist.agreement_group(process_group)
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.every = _positive_int(every, "every")
        self.keep = _positive_int(keep, "keep")
        self.patience = _positive_int(patience, "patience")
        self.max_rewinds = _positive_int(max_rewinds, "max_rewinds", 0)
        window = _positive_int(window, "window", 2)
        min_history = _positive_int(min_history, "min_history", 2)
        if min_history > window:
            raise ValueError(f"min_history ({min_history}) must be <= window ({window})")
        ls, gs = _sigma(loss_spike, "loss_spike"), _sigma(grad_spike, "grad_spike")
        self._loss_rule = SpikeRule("loss", ls, window, min_history) if ls is not None else None
        self._grad_rule = SpikeRule("gradient norm", gs, window, min_history) if gs is not None else None
        self.action = action
        self.lr_factor = float(lr_factor)
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self._ring = _snapshot.Ring(self.keep, os.fspath(directory) if directory is not None else None)
        self._skip: Dict[int, Dict[str, Any]] = {
            i: {"step": None, "batch": i, "blame": "earlier run", "trigger": ""} for i in _read_skip_list(skip_batches)}
        self.global_step = 0  #: optimizer steps of the run as it stands
        self.lr_scale = 1.0  #: the learning rate's factor against the original (lowered by rewinds)
        self.history: List[StepRecord] = []  #: the steps of the run as it stands
        self.events: List[RewindEvent] = []  #: every rewind, oldest first
        self.snapshot_seconds = 0.0  #: wall time spent taking snapshots
        self._streak = 0  # consecutive skipped steps
        self._held: Dict[int, Any] = {}  # batch index -> batch, since the oldest snapshot
        self._replay: collections.deque = collections.deque()  # batch indices to run again
        self._drawn = 0  # batches drawn from the data so far
        self._current: Optional[Tuple[int, Any]] = None
        self._observed = True
        self._scale_before: Optional[float] = None
        self._probe: Optional[Dict[str, Any]] = None  # the data-versus-state test under way
        self._incident: Optional[Tuple[int, int, int]] = None  # (trigger step, restored step, attempt)
        self._probe_fn = probe
        self._driver: Optional[str] = None  # "loop" (loop()) or "external" (begin())
        self._next_index = 0  # external: the index the next batch gets by default

    # ---- what happened ------------------------------------------------------------------

    @property
    def rewinds(self) -> int:
        return len(self.events)

    @property
    def probing(self) -> bool:
        """True while the loop runs the data-versus-state test: the step
        will be undone, whatever it computes."""
        return self._probe is not None

    @property
    def skipped_batches(self) -> List[Dict[str, Any]]:
        """Every batch skipped: its step, its index in the data, what blamed
        it ("data", "window", "untested" or "earlier run") and the trigger."""
        return list(self._skip.values())

    def summary(self) -> str:
        blames = collections.Counter(e.blame for e in self.events)
        if not self.events:
            return "nanguard.Rewind: no rewind"
        return (f"nanguard.Rewind: {self.rewinds} rewind{'s' if self.rewinds > 1 else ''} "
                f"({', '.join(f'{n} {b}' for b, n in blames.items())} blamed), "
                f"{len(self._skip)} batch{'es' if len(self._skip) != 1 else ''} skipped, "
                f"learning rate x{self.lr_scale:g} of the original")

    def current_lr(self) -> List[float]:
        """The optimizer's learning rates now, one per param group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # ---- the loop -----------------------------------------------------------------------

    def loop(self, data: Iterable[Any], steps: int) -> Iterator[Tuple[int, Any]]:
        """Yield ``(step, batch)`` until the run has ``steps`` optimizer
        steps that stand (or the data runs out). ``data`` is any iterable of
        batches, one per optimizer step (a list of micro-batches if the loop
        accumulates gradients); it is iterated once, and the batches of the
        window are held by reference to be replayed. Call :meth:`step` once
        per batch, after the optimizer step."""
        steps = _positive_int(steps, "steps", 0)
        self._set_driver("loop")
        it = iter(data)
        while self.global_step < steps:
            if self._probe is None and self.global_step % self.every == 0 \
                    and self._ring.get(self.global_step) is None:
                self._snapshot()
            nxt = self._next_batch(it)
            if nxt is None:
                break
            self._current, self._observed = nxt, False
            self._scale_before = self._scale()
            yield self.global_step, nxt[1]
            if not self._observed:
                raise RuntimeError("nanguard.Rewind.loop: call rewind.step(loss) once per batch, after the "
                                   "optimizer step")
        self._write_log()

    def begin(self, batch: Any, index: Optional[int] = None) -> None:
        """For a loop that :meth:`loop` cannot drive (a framework's callbacks):
        the step about to run trains on ``batch`` (held by reference for the
        data-versus-state test), numbered ``index`` (default: one more than
        the last). Takes the snapshot when one is due. Call :meth:`step`
        after its optimizer step, as with :meth:`loop`. Such a run cannot
        replay batches: after a rewind it goes on with the loop's next
        batches, and the window's batches are left behind (listed as
        "window"); the test runs each batch through ``probe``."""
        self._set_driver("external")
        if self._current is not None and not self._observed:
            raise RuntimeError("nanguard.Rewind.begin: the previous batch has no rewind.step(loss) yet")
        idx = self._next_index if index is None else int(index)
        self._next_index = idx  # the snapshot's cursor: this batch is the first it has not trained on
        if self.global_step % self.every == 0 and self._ring.get(self.global_step) is None:
            self._snapshot()
        self._next_index = idx + 1
        self._held[idx] = batch
        for i in [i for i in self._held if i < idx - self.patience]:  # only the trigger's batches are probed
            del self._held[i]
        self._current, self._observed = (idx, batch), False
        self._scale_before = self._scale()

    def _set_driver(self, kind: str) -> None:
        if self._driver not in (None, kind):
            raise RuntimeError("nanguard.Rewind: drive it with loop() or with begin()/step(), not both")
        self._driver = kind

    def step(self, loss, grad_norm=None, *, skipped: Optional[bool] = None) -> bool:
        """Report the step just taken: its ``loss`` (None when the loop has
        none to give: only the gradient triggers apply), and optionally its
        gradient norm (before clipping) and whether its optimizer step was
        skipped (default: inferred from the scaler's scale, or from a
        non-finite ``grad_norm`` without one). True when the step stands;
        False when the run rewound (or the step was a probe of the
        data-versus-state test) and the loop goes on from an earlier state."""
        if self._current is None or self._observed:
            raise RuntimeError("nanguard.Rewind.step: call it once per batch of rewind.loop(...), "
                               "after the optimizer step")
        self._observed = True
        lv = _host_float(loss, "loss") if loss is not None else None
        gv = _host_float(grad_norm, "grad_norm") if grad_norm is not None else None
        if skipped is None:
            skipped = self._infer_skipped(gv)
        elif not isinstance(skipped, bool):
            raise TypeError(f"skipped must be a bool or None, got {type(skipped).__name__}")
        idx = self._current[0]
        if self._probe is not None:
            self._probe_done(idx, lv, gv, skipped)
            return False
        trig = self._check(idx, lv, gv, skipped)
        if self._group is not None:
            trig = self._agree(trig, idx, lv, gv)
        if trig is None:
            self.history.append(StepRecord(self.global_step, idx, lv, gv, skipped))
            if not skipped:
                for rule, v in ((self._loss_rule, lv), (self._grad_rule, gv)):
                    if rule is not None:
                        rule.push(v)
            self.global_step += 1
            return True
        self._start(trig)
        return False

    # ---- internals ------------------------------------------------------------------------

    def _scale(self) -> Optional[float]:
        if self.scaler is not None and self.scaler.is_enabled():
            return float(self.scaler.get_scale())
        return None

    def _infer_skipped(self, gv: Optional[float]) -> bool:
        if gv is not None and not math.isfinite(gv):
            return True
        # update() backs the scale off only after a skipped step (at a min_scale floor, pass skipped=)
        return self._scale_before is not None and self._scale() < self._scale_before

    def _next_batch(self, it) -> Optional[Tuple[int, Any]]:
        if self._probe is not None:
            idx = self._probe["queue"].popleft()
            return idx, self._held[idx]
        while self._replay:
            idx = self._replay.popleft()
            if idx not in self._skip:
                return idx, self._held[idx]
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return None
            idx = self._drawn
            self._drawn += 1
            if idx in self._skip:
                continue
            self._held[idx] = batch
            return idx, batch

    def _cursor(self) -> int:
        """Index of the next batch the run will train on: the first one
        still to be replayed, else the next one to draw."""
        if self._driver == "external":
            return self._next_index
        return next((i for i in self._replay if i not in self._skip), self._drawn)

    def _run_state(self) -> Dict[str, Any]:
        return {"lr_scale": self.lr_scale, "streak": self._streak, "history": len(self.history),
                "loss_rule": self._loss_rule.state() if self._loss_rule else None,
                "grad_rule": self._grad_rule.state() if self._grad_rule else None}

    def _snapshot(self) -> None:
        t0 = time.perf_counter()
        state = _snapshot.capture(self.model, self.optimizer, self.scaler, self.scheduler, into=self._ring.recycle())
        self._ring.add(self.global_step, self._cursor(), self._run_state(), state)
        if self._driver == "loop":
            oldest = self._ring.oldest_cursor()
            for i in [i for i in self._held if i < oldest]:
                del self._held[i]
        self.snapshot_seconds += time.perf_counter() - t0

    def _restore(self, entry: _snapshot.Entry) -> None:
        _snapshot.restore(entry.load(), self.model, self.optimizer, self.scaler, self.scheduler)
        run = entry.run
        ratio = self.lr_scale / run["lr_scale"]
        if ratio != 1.0:
            self._scale_lr(ratio)
        self._streak = run["streak"]
        del self.history[run["history"]:]
        if self._loss_rule:
            self._loss_rule.load(run["loss_rule"])
        if self._grad_rule:
            self._grad_rule.load(run["grad_rule"])
        self.global_step = entry.step

    def _scale_lr(self, factor: float) -> None:
        for g in self.optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in g:
                    if isinstance(g[key], torch.Tensor):
                        g[key].mul_(factor)
                    else:
                        g[key] = g[key] * factor
        if self.scheduler is not None:
            self.scheduler.base_lrs = [b * factor for b in self.scheduler.base_lrs]
            if hasattr(self.scheduler, "_last_lr"):
                self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def _check(self, idx: int, lv: Optional[float], gv: Optional[float], skipped: bool) -> Optional[Trigger]:
        step = self.global_step
        if lv is not None and not math.isfinite(lv):
            return Trigger(NONFINITE_LOSS, step, [idx], lv, f"loss {lv}")
        if skipped:
            self._streak += 1
            if self._scale_before is None or self._streak >= self.patience:
                n = self._streak
                recent = [r.batch for r in self.history[len(self.history) - (n - 1):]] if n > 1 else []
                detail = (f"{n} skipped steps in a row" if self._scale_before is not None
                          else "no loss scaler to back off")
                return Trigger(NONFINITE_GRADS, step, recent + [idx], math.nan if gv is None else gv, detail,
                               scale=self._scale())
            return None
        self._streak = 0
        for kind, rule, v in ((LOSS_SPIKE, self._loss_rule, lv), (GRAD_SPIKE, self._grad_rule, gv)):
            why = rule.check(v) if rule is not None else None
            if why is not None:
                return Trigger(kind, step, [idx], v, why)
        return None

    def _agree(self, trig: Optional[Trigger], idx: int, lv: Optional[float], gv: Optional[float]) -> Optional[Trigger]:
        """Under torch.distributed: every rank rewinds when one rank's rule
        fires (one all-reduce of the trigger's kind per step). Each rank
        then tests its own current batch, so every rank runs as many probe
        steps (and so as many collectives) as the others."""
        code = KINDS.index(trig.kind) + 1 if trig is not None else 0
        (top,) = _dist.max_over_ranks(self._group, [code])
        if top == 0:
            return None
        if trig is None:
            v = lv if lv is not None else (gv if gv is not None else math.nan)
            return Trigger(KINDS[top - 1], self.global_step, [idx], v, "fired on another rank")
        trig.batches = [idx]
        return trig

    def _fails_again(self, trig: Trigger, lv: Optional[float], gv: Optional[float], skipped: bool) -> str:
        """Why a probe of a batch of ``trig`` failed from the earlier state
        ("" when it did not). The test is the trigger's own rule."""
        if lv is not None and not math.isfinite(lv):
            return f"loss {lv}"
        if trig.kind == NONFINITE_GRADS and skipped:
            return "non-finite gradients"
        if trig.kind == LOSS_SPIKE and self._loss_rule is not None:
            return self._loss_rule.check(lv) or ""
        if trig.kind == GRAD_SPIKE and self._grad_rule is not None:
            return self._grad_rule.check(gv) or ""
        return ""

    def _start(self, trig: Trigger) -> None:
        """A trigger fired: pick the snapshot, and start the test from it."""
        if len(self.events) >= self.max_rewinds:
            raise RewindError(f"nanguard.Rewind: {trig}, after {len(self.events)} rewinds (max_rewinds="
                              f"{self.max_rewinds}); giving up. Last: {self.events[-1] if self.events else '-'}",
                              self.events)
        attempt, before = 1, trig.step
        if self._incident is not None and trig.step <= self._incident[0] + self.every:
            attempt, before = self._incident[2] + 1, self._incident[1]  # came back: go further back
        entry = self._ring.newest_before(before)
        testable = entry is not None
        if entry is None and attempt > 1 and self.action != "skip" and self._ring.get(before) is not None:
            entry, testable = self._ring.get(before), True  # the oldest one, again: with a lower learning rate
        if entry is None:
            if attempt > 1 or self._ring.get(trig.step) is None:
                raise RewindError(
                    f"nanguard.Rewind: {trig}; it came back after rewinding to step {before} and no older "
                    f"snapshot is kept (keep={self.keep}, every={self.every}): cannot recover", self.events)
            entry = self._ring.get(trig.step)  # failed at the first snapshot: nothing earlier to test from
        self._incident = (max(trig.step, self._incident[0]) if attempt > 1 else trig.step, entry.step, attempt)
        self._restore(entry)
        self._probe_scale(trig)
        queue = collections.deque(b for b in trig.batches if b in self._held) if testable else collections.deque()
        self._probe = {"trigger": trig, "entry": entry, "queue": queue, "results": [], "attempt": attempt}
        if self._driver == "external":
            if self._probe_fn is None:
                queue.clear()  # nothing can run the batches again: untested
            if not queue:
                self._finish()
            while queue:
                idx = queue.popleft()
                got = self._call_probe(self._held[idx])
                if got is None:  # the probe could not run this batch: untested
                    self._restore(entry)
                    if not queue:
                        self._finish()
                    continue
                lv, gv = got
                self._probe_done(idx, lv, gv, gv is not None and not math.isfinite(gv), last=not queue)
        elif not queue:
            self._finish()

    def _call_probe(self, batch) -> Optional[Tuple[float, Optional[float]]]:
        out = self._probe_fn(batch)
        if out is None:
            return None
        loss, gn = out if isinstance(out, tuple) else (out, None)
        return _host_float(loss, "probe's loss"), (None if gn is None else _host_float(gn, "probe's grad_norm"))

    def _probe_done(self, idx: int, lv: float, gv: Optional[float], skipped: bool,
                    last: Optional[bool] = None) -> None:
        p = self._probe
        why = self._fails_again(p["trigger"], lv, gv, skipped)
        p["results"].append(Probe(idx, lv, bool(why), why))
        self._restore(p["entry"])  # undo the probe's optimizer step
        if p["queue"] if last is None else not last:
            self._probe_scale(p["trigger"])
        else:
            self._finish()

    def _probe_scale(self, trig: Trigger) -> None:
        """Probe gradients at a loss scale no larger than the trigger's: an
        overflow at the snapshot's (larger) scale is only the scaler's
        ordinary backoff, not a batch failing again."""
        if trig.kind == NONFINITE_GRADS and trig.scale is not None and self._scale() > trig.scale:
            self.scaler.update(new_scale=trig.scale)

    def _finish(self) -> None:
        """The test is done: blame, act, and go on from the snapshot."""
        p, self._probe = self._probe, None
        trig, entry, probes = p["trigger"], p["entry"], p["results"]
        failed = any(q.failed for q in probes)
        if self._group is not None:  # data when any rank's batch failed again; each skips its own
            failed = bool(_dist.max_over_ranks(self._group, [int(failed)])[0])
        if not probes:
            blame = UNTESTED
        else:
            blame = DATA if failed else STATE
        blamed = [q.batch for q in probes if q.failed] if probes else list(trig.batches)
        skip: Dict[int, str] = {}
        if self.action in ("skip", "skip_and_lower_lr") or self._driver == "external":
            # external: the loop goes on with its next batches, the window's are left behind
            skip.update({i: WINDOW for i in range(entry.cursor, max(trig.batches) + 1) if i not in self._skip})
        if blame != STATE:
            skip.update({i: blame for i in blamed})
        # a failure that came back is the state's, whatever the batch did: lower the rate too
        lower = self.action in ("lower_lr", "skip_and_lower_lr") or (
            self.action == "auto" and (blame == STATE or p["attempt"] > 1))
        for i, why in sorted(skip.items()):
            self._skip[i] = {"step": trig.step, "batch": i, "blame": why, "trigger": trig.kind}
        if lower:
            self.lr_scale *= self.lr_factor
            self._scale_lr(self.lr_factor)
        self._ring.drop_after(entry.step)
        if self._driver == "loop":
            self._replay = collections.deque(i for i in sorted(self._held)
                                             if i >= entry.cursor and i not in self._skip)
        self.events.append(RewindEvent(trig, entry.step, blame, probes, sorted(skip), self.lr_scale,
                                       p["attempt"]))
        self._write_log()

    def _write_log(self) -> None:
        if self.log_path is None:
            return
        doc = {"skipped_batches": self.skipped_batches, "rewinds": [e.to_state() for e in self.events],
               "lr_scale": self.lr_scale, "global_step": self.global_step}
        tmp = self.log_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.log_path)

    def close(self) -> None:
        """Write the log, delete the snapshots (their files with
        ``directory``) and drop the held batches; the events stay."""
        self._write_log()
        self._ring.clear()
        self._held.clear()

    def __repr__(self) -> str:
        return (f"Rewind(every={self.every}, keep={self.keep}, action={self.action!r}, step={self.global_step}, "
                f"rewinds={self.rewinds}, lr_scale={self.lr_scale:g})")
