"""Sentinel watching (``watch(mode="sentinel")``): a healthy step pays for
no census; a non-finite step is replayed at once, in process, to localise it.

On a healthy step the watcher holds what the flight recorder holds (each
micro-batch's inputs by reference, its RNG state, grad mode and autocast
settings, its output's ``.loss``) and, at the check, tests what the step
already computed: the held losses, the loss passed to ``check`` / ``step``
and every parameter's gradient. Gradients that a guard pass of the step
covered (``nanguard.clip_grad_norm_``, ``guard_``, the GradScaler's
``unscale_and_clip_``: ``grad_guard._verdicts``) are judged by its NaN / Inf
counts, still on the device; the others by one ``torch._foreach_norm`` per
device and dtype. Everything is summed per device and read once. A failed
test is confirmed tensor by tensor (the norm of huge finite values can
overflow): only a step with a NaN or Inf in one of them is replayed.

The replay runs on the watched model itself (no copy), which at the check
still holds the weights the step started from (``check`` runs before the
optimizer step, and nanguard's gradient guard never applies a non-finite
step); the live model, its gradients and the RNG are left as the step left
them (gradients set aside and buffers saved, put back after). It runs
each micro-batch in order from its own RNG state and
autocast settings:

1. under the eager census (:class:`~nanguard.diagnostics.Watch` in eager
   mode, with the same ``modules`` / ``inputs`` / ``backward`` options and
   parameter gradients), checked after each micro-batch: its report names
   the module, pass, step and micro-batch as eager watching of the live step
   would have;
2. the micro-batch that failed, again under the op checker (``_opcheck``):
   the first aten op and autograd node that made a non-finite value from
   finite inputs. Not for the GradScaler's backoff steps, which are
   reported but neither op-checked nor recorded.

The loss of the replay is ``loss_fn(output, inputs)`` (default: the
output's ``.loss``) times the scaler's loss scale; without one, the replay
runs the forward only. A replay that stays finite (nondeterministic kernels,
a loss the replay cannot rebuild, state outside the model) says so: the
report then names the live step's first non-finite tensor (the loss, or a
parameter gradient in ``named_parameters`` order) with ``reproduced`` False.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import nullcontext
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from .. import distributed as _dist
from .._tensor_stats import tensor_stats as _census
from ..grad_guard import _verdicts
from ._flight_record import FlightRecord, StepStart, output_loss, restore_rng
from ._flight_recorder import MicroBatch
from ._report import FORWARD, PARAM_GRAD, Report, TensorStats
from ._step import Step, default_loss


def _zero_if_finite(t: torch.Tensor) -> torch.Tensor:
    """0 (fp64) when every element of ``t`` is finite, else NaN, in one op
    (the sum of a few losses)."""
    return t.detach().double().sum() * 0.0


def fused_finite(tensors: List[torch.Tensor], verdicts=()) -> bool:
    """Is every tensor finite, and did every guard verdict find none
    non-finite? One fused norm per device and dtype group (norms times 0:
    0 when finite), the verdicts' NaN / Inf counts, one host read per
    device. False can be a false alarm (the norm of huge finite values
    overflows): the caller confirms tensor by tensor."""
    groups, zeros = {}, {}
    for t in tensors:
        if t.numel() == 1 and t.device.type == "cpu":  # a loss on the CPU: reading it costs no sync
            if not math.isfinite(t.item()):
                return False
        elif t.numel() <= 16:  # a loss: no norm needed
            zeros.setdefault(t.device, []).append(_zero_if_finite(t))
        else:
            groups.setdefault((t.device, t.dtype == torch.float64), []).append(t)
    for (dev, f64), ts in groups.items():
        norms = torch._foreach_norm(ts, 2.0, dtype=torch.float64 if f64 else torch.float32)
        zeros.setdefault(dev, []).append(torch.stack(norms).double().sum() * 0.0)
    for stats in verdicts:  # [norm_acc, nan, inf, first_bad]: counts 0, accumulator finite
        if stats.device.type == "cpu":
            acc, nan, inf = stats[:3].tolist()
            if nan or inf or not math.isfinite(acc):
                return False
        else:
            zeros.setdefault(stats.device, []).append(stats[1] + stats[2] + stats[0] * 0.0)
    return all(float(torch.stack(z).sum()) == 0.0 for z in zeros.values())


def tensor_stats(which: str, t: torch.Tensor) -> TensorStats:
    """The census of one tensor (the census op eager watching records with),
    read at once: a report's, so once per report."""
    s = _census(t.detach())
    return TensorStats(which, tuple(t.shape), t.dtype, s["nan"], s["posinf"], s["neginf"], s["max_abs"],
                       s["min_nonzero_abs"])


class Sentinel:
    """The sentinel half of a :class:`Watch`: ``watch`` is the live watcher
    (its options, its forensics' recorder and scaler)."""

    def __init__(self, watch, loss_fn: Optional[Callable]):
        self.w = watch
        self.loss_fn = loss_fn
        self.replays = 0  #: steps replayed so far
        self._seq0, self._begun = 0, False  # the guard's sequence number at the step's first forward
        self.params: List[Tuple[str, str, str, nn.Parameter]] = []  # (module, class, name, parameter)
        seen = set()
        for mname, mod in watch.model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    self.params.append((mname, type(mod).__name__, pname, p))

    # ---- the healthy step's test -------------------------------------------------------

    def begin(self) -> None:
        """The step's first forward: guard verdicts from here on are its own."""
        self._seq0 = _verdicts.sequence()
        self._begun = True

    def first_live(self, batches: List[MicroBatch], loss) -> Optional[Tuple[Report, int]]:
        """None when the step's losses and gradients are finite; else a
        report naming its first non-finite one (the loss of micro-batch k, or
        a parameter gradient) and the micro-batch to record. Gradients a
        guard pass of the step covered are not read again: its verdict
        stands for them."""
        losses = [(k, mb.loss) for k, mb in enumerate(batches) if mb.loss is not None]
        if isinstance(loss, torch.Tensor):
            losses.append((max(len(batches) - 1, 0), loss.detach()))
        losses = [(k, t) for k, t in losses if t.is_floating_point()]
        grads = []
        for mname, cls, pname, p in self.params:
            g = p.grad
            if g is not None and g.is_floating_point() and g.numel():
                grads.append((mname, cls, pname, g if type(g) is torch.Tensor else _dist.local(g)))
        verdicts = _verdicts.since(self._seq0) if self._begun else []
        covered = frozenset().union(*(ids for _, ids in verdicts)) if verdicts else frozenset()
        unread = [g for *_, g in grads if id(g) not in covered]
        tensors = [t for _, t in losses] + unread
        if (not tensors and not verdicts) or fused_finite(tensors, [stats for stats, _ in verdicts]):
            return None
        # confirm, tensor by tensor, and name the first
        entry = batches[0].name if batches else ""
        entry_cls = type(batches[0].module).__name__ if batches else type(self.w.model).__name__
        for k, t in losses:
            if not bool(torch.isfinite(t).all()):
                return Report(entry, entry_cls, FORWARD, self.w.step_index, tensor_stats("loss", t), []), k
        for mname, cls, pname, g in grads:
            if not bool(torch.isfinite(g).all()):
                return Report(mname, cls, PARAM_GRAD, self.w.step_index, tensor_stats(pname + ".grad", g), []), 0
        return None

    # ---- the replay --------------------------------------------------------------------

    def localise(self, live: Report, k_live: int, batches: List[MicroBatch]) -> Tuple[Report, int]:
        """Replay the step under the census, then its failing micro-batch
        under the op checker; (the report, the micro-batch to record)."""
        w = self.w
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            live.note = ("not replayed: under torch.distributed a replay in one process cannot run the "
                         "step's collectives; mode=\"eager\" censuses the live step itself")
            return live, k_live
        self.replays += 1
        scale = w._forensics.loss_scale()
        saved = StepStart.capture(w._forensics.recorder.device()).rng
        w._forensics.recorder.paused = True
        w._replaying = True
        self._error = None
        try:
            report, k = self._census_replay(batches, scale)
            if report is None:
                live.reproduced = False
                live.note = self._error or _unreproduced_note(self.loss_fn, w._forensics.scaler, batches)
                return live, k_live
            report.reproduced = True
            if not w._forensics._backoff(report, scale):
                self.op_check(report, batches[k], k, scale)
            return report, k
        finally:
            w._replaying = False
            w._forensics.recorder.paused = False
            restore_rng(saved)

    @contextlib.contextmanager
    def _on_live(self):
        """The live model, its gradients set aside and its buffers saved, for
        one replay: at the check it still holds the step's start weights, so
        no copy of the model is made (a large model's memory is not doubled).
        The live watcher's hooks on it do nothing while ``_replaying``; the
        gradients and buffers are put back afterwards."""
        model = self.w.model
        params = list(model.parameters())
        grads = [p.grad for p in params]
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        for p in params:
            p.grad = None
        try:
            yield model
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _run(self, entry: nn.Module, mb: MicroBatch, scale: Optional[float]) -> Optional[torch.Tensor]:
        restore_rng(mb.start.rng)
        ac = mb.start.autocast
        ctx = torch.autocast(ac["device_type"], dtype=getattr(torch, ac["dtype"])) if ac else nullcontext()
        with torch.set_grad_enabled(mb.grad):
            with ctx:
                out = entry(*mb.args, **mb.kwargs)
                if self.loss_fn is not None:
                    loss = self.loss_fn(out, {"args": mb.args, **mb.kwargs})
                else:
                    loss = output_loss(out)
            if mb.grad and isinstance(loss, torch.Tensor) and loss.requires_grad:
                (loss.float() * scale if scale is not None else loss).backward()
        return loss.detach() if isinstance(loss, torch.Tensor) else None

    def _census_replay(self, batches: List[MicroBatch], scale: Optional[float]) -> Tuple[Optional[Report], int]:
        with self._on_live() as model:
            return self._census_replay_on(model, batches, scale)

    def _census_replay_on(self, model: nn.Module, batches: List[MicroBatch],
                          scale: Optional[float]) -> Tuple[Optional[Report], int]:
        w = self.w
        # the watcher's own class in eager mode, with the user's options: the report eager watching names
        inner = type(w)(model, mode="eager", modules=w._modules, policy="record", max_records=1,
                        inputs=w._inputs, backward=w._backward, parameters=w._parameters, capacity=w._capacity,
                        agree=False)
        inner._step = w.step_index
        try:
            for k, mb in enumerate(batches):
                try:
                    loss = self._run(model.get_submodule(mb.name), mb, scale)
                except Exception as e:  # a replay that cannot run is not a localisation
                    self._error = f"the replay raised {type(e).__name__}: {e}"
                    return None, k
                report = inner.check()
                if report is None:
                    report = self._unwatched(model, mb, k, loss)
                if report is not None:
                    if len(batches) > 1:  # a step of one forward has no micro-batch to name
                        report.micro_batch = k
                    return report, k
            return None, 0
        finally:
            inner.remove()

    def _unwatched(self, model: nn.Module, mb: MicroBatch, k: int, loss) -> Optional[Report]:
        """The replay's census (with the watcher's ``modules`` /
        ``parameters`` options) saw nothing, but its loss or gradients are
        non-finite: a failure outside the watched tensors, named as the
        live test names it."""
        copies = dict(model.named_modules())
        grads = []
        for mname, cls, pname, _ in self.params:
            g = copies[mname]._parameters.get(pname).grad if mname in copies else None
            if g is not None and g.is_floating_point() and g.numel():
                grads.append((mname, cls, pname, g))
        tensors = ([loss] if isinstance(loss, torch.Tensor) and loss.is_floating_point() else []) + [
            g for *_, g in grads]
        if not tensors or fused_finite(tensors):
            return None
        note = "outside the watched tensors (modules= / parameters= / inputs= / backward= of nanguard.watch)"
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and not bool(torch.isfinite(loss).all()):
            return Report(mb.name, type(copies[mb.name]).__name__, FORWARD, self.w.step_index,
                          tensor_stats("loss", loss), [], note="the loss is non-finite " + note)
        for mname, cls, pname, g in grads:
            if not bool(torch.isfinite(g).all()):
                return Report(mname, cls, PARAM_GRAD, self.w.step_index, tensor_stats(pname + ".grad", g), [],
                              note="a parameter gradient is non-finite " + note)
        return None

    def op_check(self, report: Report, mb: MicroBatch, k: int, scale: Optional[float]) -> None:
        """Name the first aten op and autograd node of micro-batch ``k``
        (run alone, from the step's weights) in ``report``."""
        with self._on_live() as model:
            self._op_check_on(model, report, mb, k, scale)

    def _op_check_on(self, model: nn.Module, report: Report, mb: MicroBatch, k: int,
                     scale: Optional[float]) -> None:
        entry = model.get_submodule(mb.name)
        rec = FlightRecord(step=report.step, rank=None, args=mb.args, kwargs=mb.kwargs, rng=mb.start.rng,
                           state={}, sharding={}, training=entry.training, autocast=mb.start.autocast,
                           loss_scale=scale, model=None, report=None, history=None, recorded_nonfinite=True,
                           entry=mb.name, versions={}, micro_batch=k)
        loss_fn = self.loss_fn or default_loss
        with torch.set_grad_enabled(mb.grad):
            outcome = Step(rec, entry, loss_fn).run(model=entry, strict=False)
        first = outcome.first
        if first is None:
            return
        if first.module is not None and mb.name:  # the op checker names modules inside the entry
            first.module = mb.name + ("." + first.module if first.module else "")
        report.op, report.node, report.op_where = first.op, first.node, first.where()


def _unreproduced_note(loss_fn, scaler, batches: List[MicroBatch]) -> str:
    why = []
    if loss_fn is None and batches and all(mb.loss is None for mb in batches):
        why.append("the model's output has no .loss, so the replay ran the forward only: pass "
                   "loss_fn=(output, inputs) -> loss to nanguard.watch")
    if scaler is None:
        why.append("no scaler= was given, so the replay ran at loss scale 1")
    why.append("nondeterministic kernels or state outside the model and its inputs can also make a "
               "replay differ; mode=\"eager\" censuses the live step itself")
    return "not reproduced by the in-process replay: " + "; ".join(why)
