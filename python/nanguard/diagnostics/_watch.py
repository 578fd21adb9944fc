"""``nanguard.watch``: which module, in which pass, on which step, made the
first NaN or Inf, and what did its inputs look like.

Every watched module records, in execution order, a census of the tensors it
touches (``torch.ops.nanguard.tensor_stats_``: NaN / +Inf / -Inf counts and
the finite ``max |x|`` / ``min non-zero |x|``) into a stats buffer on the
tensor's device:

* forward: its inputs (a tensor that is the output of a module recorded just
  before reuses that record) and its outputs, found inside tuples, lists,
  dicts and Hugging Face ``ModelOutput``\\ s;
* backward: the gradient arriving at each of its outputs (a tensor hook, so
  in-place operations in the model keep working, which
  ``register_full_backward_hook`` does not allow);
* after backward: each parameter's accumulated gradient.

Nothing is read back until :meth:`Watch.check` (or :meth:`Watch.step`, which
also advances the step counter): the step's counts and magnitudes are copied
to the host asynchronously and the stream is synchronised once. If anything
was non-finite, the first offender in execution order is reported as a
:class:`Report`: module qualified name, class, pass (``"forward"``,
``"backward"``, ``"parameter grad"``), step, the tensor's census and the
census of the inputs it was computed from.

Who made a backward NaN? The gradient hooks see the gradient of each
module's *output*. When the first non-finite gradient is the one arriving at
the output of module ``U``, it was made by whatever consumed that output in
the forward pass: the watcher knows which watched modules did (the forward
records link them) and names the innermost one whose own output gradients
were still finite. When no watched module consumed it (the loss, or
arithmetic in a parent's ``forward``), ``U`` is named with a note.

Inputs that come from outside every watched module (the batch, masks) are
checked for NaN and +Inf only: a ``-inf`` additive attention mask is not an
offence.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import distributed as _dist
from .._tensor_stats import COUNT_FIELDS, VALUE_FIELDS
from ._census import (Call, Kind, Owner, Rec, flatten, is_ancestor, positive_int, recordable,
                       selected, version_of)
from ._forensics import Forensics
from ._report import BACKWARD, FORWARD, PARAM_GRAD, NonFiniteError, Report, TensorStats
from ._sentinel import Sentinel, tensor_stats

__all__ = ["watch", "Watch"]

# the overload's C++ callable itself: OpOverload.__call__ adds a Python frame to every record
_op = torch.ops.nanguard.tensor_stats_.default._op
# The watcher's buffers are its own and no autograd graph holds them, so the
# op is called below ADInplaceOrView: the kernel that would bump their
# version counters is skipped, which costs more than the census of a small
# tensor itself.
_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
_POLICIES = ("raise", "warn", "record")
_MODES = ("eager", "sentinel")
#: sentinel mode with history: one step in this many runs the full census
_CENSUS_EVERY = 32
#: a buffer this large means step() / check() is probably never called
_MANY_SLOTS = 1 << 20
#: without a check, the watcher checks its records itself at a forward of the
#: model once this many forwards or records have piled up (memory stays bounded)
_AUTO_CHECK_FORWARDS = 64
_AUTO_CHECK_RECORDS = 1 << 16


class Watch:
    """Watch ``model`` for the first NaN / Inf.

    Args:
        model: the module to watch (its submodules are watched too).
        mode: ``"eager"`` censuses every watched tensor of every step (the
            report comes from the live step itself); ``"sentinel"`` runs no
            census on a healthy step, only one fused finiteness test of the
            step's losses and parameter gradients at the check, and replays
            a non-finite step at once, in process, under the census and the
            op checker (the report then also names the first aten op and
            autograd node, and says whether the replay reproduced the
            failure). Default: ``"sentinel"`` when ``record_dir`` is given
            (outside torch.distributed, whose collectives one process cannot
            replay), else ``"eager"``.
        loss_fn: sentinel mode: ``loss_fn(output, inputs) -> loss`` for the
            replay, when the model's output has no ``.loss`` (a Hugging Face
            model's); ``inputs`` holds the keyword inputs and the positional
            ones under ``"args"``. Without either, the replay runs the
            forward only.
        census_every: sentinel mode with ``history``: one step in this many
            (default 32) runs the full census for the history; between
            them, the attention-score bounds and the q / k projections'
            outputs are recorded every step where the projections run in
            float16 (the series the fp16 early warning can fire on).
        modules: restrict to modules whose qualified name matches a pattern
            (``fnmatch``: ``"layers.*.self_attn"``) or that are instances of
            a type; a list mixes both. None watches every module.
        every: eager mode: record on every N-th step only (steps are counted
            by :meth:`Watch.step`); the hooks return at once on other steps.
        policy: ``"raise"`` (:class:`NonFiniteError`), ``"warn"`` or
            ``"record"`` (reports collected in ``.records``, up to
            ``max_records``).
        max_records: reports kept in ``.records`` under ``"warn"`` / ``"record"``.
        inputs: also record the inputs of each module (for the report).
        backward: record the gradient arriving at each module output.
        parameters: record each parameter's gradient once accumulated.
        capacity: initial slots of the stats buffer (it doubles when a step
            records more; that is the only time it allocates).
        optimizer: when given, ``optimizer.step()`` first calls
            :meth:`Watch.step`, so a non-finite step raises before it is
            applied.
        process_group: under torch.distributed, the ranks that agree at each
            :meth:`Watch.check` (default: the default group). Reports carry
            the rank; when any rank saw a non-finite value every rank acts in
            the same step (raises under ``policy="raise"``), the others with
            a report naming the ranks that saw it. Every rank of the group
            must call ``step()`` / ``check()`` at the same steps.
        agree: False turns the agreement (one all-reduce per check) off.
        history: keep the last ``history`` checked steps of every module's
            statistics (``w.history``: ``to_csv``, ``plot``, ``headroom``)
            and warn when a float16 tensor nears fp16's largest value
            (:class:`HeadroomWarning`, also in ``w.warnings``): within
            ``warn_bits`` bits, or predicted by its growth to get there
            within ``warn_steps`` steps. 0 (the default) keeps none.
        record_dir: write the first non-finite step's flight record
            (``nanguard-step<N>[-rank<R>].pt``) there, for
            :func:`nanguard.replay`; ``NonFiniteError.replay_path`` names it.
        scaler: the GradScaler in use. The record keeps its loss scale; the
            early warning reads gradients at loss scale 1 (a scaled
            gradient's overflow is the scaler's to back off from); and a
            step non-finite in its gradients only, at a scale above 1 (the
            scaler's ordinary backoff), is reported but not recorded.

    Use as ``with nanguard.watch(model) as w: ...`` (checked and removed on
    exit) or keep the handle: ``w = nanguard.watch(model)``, ``w.step()`` once
    per training step, ``w.remove()`` at the end. When the model's parameters
    change between two forward passes with no ``step()`` / ``check()`` in
    between, a warning says so once, and from then on the watcher checks its
    records itself at each forward, keeping the first non-finite report for
    the next ``check()`` (memory stays bounded either way).
    """

    def __init__(self, model: nn.Module, *, modules=None, every: int = 1, policy: str = "raise",
                 max_records: int = 100, inputs: bool = True, backward: bool = True,
                 parameters: bool = True, capacity: int = 256, optimizer=None,
                 process_group=None, agree: bool = True, history: int = 0, record_dir=None,
                 warn_bits: float = 0.5, warn_steps: int = 4, scaler=None, mode: Optional[str] = None,
                 loss_fn=None, census_every: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        positive_int("every", every)
        if mode is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            mode = "sentinel" if record_dir is not None and not dist else "eager"
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        sentinel = mode == "sentinel"
        if loss_fn is not None and (not sentinel or not callable(loss_fn)):
            raise ValueError("loss_fn: only mode='sentinel' takes it (a callable (output, inputs) -> loss "
                             f"for the replay), got {type(loss_fn).__name__} with mode={mode!r}")
        if census_every is not None:
            if not sentinel:
                raise ValueError("census_every: only mode='sentinel' takes it (eager mode: every=)")
            positive_int("census_every", census_every)
        if sentinel and every != 1:
            raise ValueError(f"every: mode='sentinel' checks every step (got every={every}); "
                             "census_every= sets how often its history runs the full census")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        positive_int("capacity", capacity)
        if not isinstance(agree, bool):
            raise TypeError(f"agree must be a bool, got {type(agree).__name__}")
        self.model = model
        self.mode = mode  #: "eager" or "sentinel"
        self.every = every
        self._census_every = census_every or _CENSUS_EVERY
        self._modules = modules
        self._backward = backward
        self._parameters = parameters
        self.policy = policy
        self.max_records = max_records
        self.records: List[Report] = []  #: reports kept under policy "record" (and "warn")
        self.watched: List[str] = []  #: qualified names of the watched modules
        self._inputs = inputs
        self._capacity = capacity
        self._agree = agree
        self._group = process_group
        self._step = 0
        self._gen = 0  # bumped at every reset: hooks of older graphs stop recording
        self._on = True
        self._bufs: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._used: Dict[torch.device, int] = {}
        self._recs: List[Rec] = []
        self._produced: Dict[int, Tuple[weakref.ref, int, Optional[int]]] = {}  # id -> (ref, record, version)
        self._consumers: Dict[int, List[Call]] = {}  # record -> calls that took it as input
        self._stacks: List[List[Call]] = []  # per watched module: its calls in flight
        self._handles: list = []
        # DTensor parameters (FSDP2, tensor parallel): their gradients are
        # read at check time (FSDP2 accumulates into an unsharded copy, so no
        # hook on the sharded parameter fires)
        self._dparams: List[Tuple[Owner, str, nn.Parameter]] = []
        # a forgotten step(): forwards of the model since the last check, and
        # the version of one trainable parameter at the first of them
        self._forwards = 0
        self._probe_version: Optional[int] = None
        self._pending: Optional[Report] = None  # found by an automatic check
        self._warned = False
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(f"history must be an int >= 0, got {history!r}")
        self._forensics = None
        if history or record_dir is not None or sentinel:
            self._forensics = Forensics(model, history=history, record_dir=record_dir, warn_bits=warn_bits,
                                        warn_steps=warn_steps, scaler=scaler, hold=sentinel,
                                        write_on_observe=not sentinel)
        self._sentinel = Sentinel(self, loss_fn) if sentinel else None
        self._replaying = False  # a sentinel replay runs on the model, under these hooks: record nothing
        # sentinel mode: the census runs on census steps of the history only
        self._on = self._scores_on = not sentinel or history > 0
        self._handles.append(model.register_forward_pre_hook(self._make_root(model)))
        # sentinel mode attaches the census hooks for its census steps only: on
        # the others no module call runs a hook of the census, not even one
        # that returns at once
        self._census_handles: list = []
        self.watched = [name for name, mod in model.named_modules() if selected(name, mod, modules)]
        if not sentinel:
            self._attach(model, modules, backward, parameters, self._handles)
        else:
            self._set_census(self._on)
        if self._forensics is not None:
            if sentinel:  # every step for float16 projections (the early warning's), else on census steps
                def scores_on(t):
                    return not self._replaying and (self._on or (self._scores_on and t.dtype == torch.float16))
            else:
                def scores_on(t):
                    return self._scores_on and not self._replaying
            self._handles += self._forensics.attach_scores(model, self._record, scores_on,
                                                           self._light if sentinel else None)
        if optimizer is not None:
            def before_step(opt, args, kwargs):
                self.step()  # raises under policy "raise": the step is not applied
                return None

            self._handles.append(optimizer.register_step_pre_hook(before_step))

    # ---- hooks ---------------------------------------------------------------------

    def _light(self, t: torch.Tensor, name: str, cls: str) -> None:
        """Sentinel mode between census steps: a q / k projection's output
        joins the history (on a census step the census records it)."""
        if not self._on:
            self._record(t, Kind.OUT, Call(name, cls, self._step), "output")

    def _set_census(self, on: bool) -> None:
        """Sentinel mode: attach the census hooks (``on``) or detach them."""
        if on and not self._census_handles:
            self._stacks.clear()
            self._dparams.clear()
            self._attach(self.model, self._modules, self._backward, self._parameters, self._census_handles)
        elif not on:
            for h in self._census_handles:
                h.remove()
            self._census_handles.clear()

    def _attach(self, model, modules, backward: bool, parameters: bool, handles: list) -> None:
        seen_params = set()
        for name, mod in model.named_modules():
            if not selected(name, mod, modules):
                continue
            cls = type(mod).__name__
            stack: List[Call] = []
            self._stacks.append(stack)
            handles.append(mod.register_forward_pre_hook(self._make_pre(name, cls, stack), with_kwargs=True))
            handles.append(mod.register_forward_hook(self._make_post(stack, backward)))
            if not parameters:
                continue
            owner = Owner(name, cls)
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen_params or not p.requires_grad:
                    continue
                seen_params.add(id(p))
                if _dist.is_dtensor(p):
                    self._dparams.append((owner, pname, p))
                    continue
                handles.append(p.register_post_accumulate_grad_hook(self._make_pgrad(owner, pname)))

    def _make_pre(self, name: str, cls: str, stack: List[Call]):
        def pre(mod, args, kwargs):
            if not self._on:
                return None
            call = Call(name, cls, self._step)
            stack.append(call)
            if self._inputs:
                found: List[Tuple[str, torch.Tensor]] = []
                flatten(args, "input", found)
                if kwargs:
                    for k, v in kwargs.items():
                        flatten(v, k, found)
                for label, t in found:
                    if recordable(t):
                        r, _ = self._record_once(t, Kind.IN, call, label)
                        call.inputs.append((label, r))
                        self._consumers.setdefault(r, []).append(call)
            return None

        return pre

    def _make_post(self, stack: List[Call], backward: bool):
        def post(mod, args, output):
            if not self._on or not stack:  # empty: hooks attached while this call ran
                return None
            call = stack.pop()
            found: List[Tuple[str, torch.Tensor]] = []
            flatten(output, "output", found)
            for label, t in found:
                if not recordable(t):
                    continue
                # an unchanged tensor already recorded (the output of an inner
                # module passed through, or an input returned as is) is not
                # read again, nor hooked twice
                r, new = self._record_once(t, Kind.OUT, call, label)
                if new and backward and t.requires_grad:
                    t.register_hook(self._make_grad(call, label, r))
            return None

        return post

    def _record_once(self, t: torch.Tensor, kind: Kind, call: Call, label: str):
        """(record index, newly recorded?): reuse the record of a tensor
        already recorded and unchanged since (same object, same version)."""
        hit = self._produced.get(id(t))
        version = version_of(t)
        if hit is not None and hit[0]() is t and version is not None and hit[2] == version:
            return hit[1], False
        r = self._record(t, kind, call, label)
        self._produced[id(t)] = (weakref.ref(t), r, version)
        return r, True

    def _make_grad(self, call: Call, label: str, fwd_record: int):
        gen = self._gen
        label = "grad of " + label

        def on_grad(g):
            if self._on and self._gen == gen and g is not None and recordable(g):
                call.grads.append(self._record(g, Kind.GRAD, call, label, fwd_record))
            return None

        return on_grad

    def _make_pgrad(self, owner: Owner, pname: str):
        label = pname + ".grad"

        def on_pgrad(p):
            if self._on and p.grad is not None and recordable(p.grad):
                self._record(p.grad, Kind.PGRAD, owner, label)

        return on_pgrad

    def _make_root(self, model: nn.Module):
        """The pre-hook of the model itself, first of its hooks: notices a
        forgotten step() (a parameter changed since the first forward after
        the last check: an optimizer step happened without one) and bounds
        the records kept without a check."""
        probe = next((p for p in model.parameters() if p.requires_grad), None)

        def root(mod, args):
            if self._sentinel is not None and not self._sentinel._begun and not self._replaying:
                self._sentinel.begin()
            if not self._on:
                return None
            version = None if probe is None else version_of(probe)
            self._forwards += 1
            if self._forwards == 1:
                self._probe_version = version
            elif version != self._probe_version:
                self._warn_forgotten()
                self._auto_check(version)
            elif self._forwards > _AUTO_CHECK_FORWARDS or len(self._recs) >= _AUTO_CHECK_RECORDS:
                self._auto_check(version)
            return None

        return root

    def _warn_forgotten(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            "nanguard.watch: the model's parameters changed between two forward passes with no "
            "w.step() in between, so the records of every step would pile up: call w.step() once "
            "per training step, after backward (or pass optimizer= to nanguard.watch so that "
            "optimizer.step() calls it). Until then the watcher checks its records at each "
            "forward and keeps the first non-finite report for the next w.check() / w.step().",
            RuntimeWarning, stacklevel=3)

    # ---- the buffer ------------------------------------------------------------------

    def _grow(self, dev: torch.device, need: int) -> Tuple[torch.Tensor, torch.Tensor]:
        old = self._bufs.get(dev)
        cap = self._capacity if old is None else old[0].shape[0]
        while cap < need:
            cap *= 2
        if cap >= _MANY_SLOTS and (old is None or old[0].shape[0] < _MANY_SLOTS):
            warnings.warn(f"nanguard.watch has recorded {need} tensors without a check: call "
                          "w.step() (or w.check()) once per training step", RuntimeWarning,
                          stacklevel=4)
        counts = torch.zeros((cap, len(COUNT_FIELDS)), dtype=torch.int64, device=dev)
        values = torch.zeros((cap, len(VALUE_FIELDS)), dtype=torch.float64, device=dev)
        if old is not None:
            n = old[0].shape[0]
            counts[:n].copy_(old[0])
            values[:n].copy_(old[1])
        self._bufs[dev] = (counts, values)
        return counts, values

    def _record(self, t: torch.Tensor, kind: Kind, call, label: str, fwd_record: int = -1,
                dtype: Optional[torch.dtype] = None) -> int:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            t = _dist.local(t)  # a DTensor's census is its local shard's
        dev = t.device
        slot = self._used.get(dev, 0)
        buf = self._bufs.get(dev)
        if buf is None or slot >= buf[0].shape[0]:
            buf = self._grow(dev, slot + 1)
        with _below_autograd():
            _op(t, buf[0], buf[1], slot)
        self._used[dev] = slot + 1
        self._recs.append(Rec(dev, slot, kind, call, label, t.shape, dtype or t.dtype, fwd_record))
        return len(self._recs) - 1

    @property
    def capacity(self) -> Dict[torch.device, int]:
        """Slots allocated per device (grows geometrically, never shrinks)."""
        return {d: b[0].shape[0] for d, b in self._bufs.items()}

    @property
    def num_recorded(self) -> int:
        """Tensors recorded since the last check."""
        return len(self._recs)

    # ---- reading ---------------------------------------------------------------------

    def _reset(self) -> None:
        self._gen += 1
        self._recs.clear()
        self._produced.clear()
        self._consumers.clear()
        for stack in self._stacks:
            stack.clear()
        self._used.clear()
        self._forwards = 0

    def _read(self) -> Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]]:
        """Counts and values of the step on the host: on CUDA both are copied
        asynchronously and the stream is synchronised once."""
        host = {}
        for dev, n in self._used.items():
            if n == 0:
                continue
            counts, values = self._bufs[dev]
            if dev.type == "cuda":
                host[dev] = (counts[:n].to("cpu", non_blocking=True),
                             values[:n].to("cpu", non_blocking=True))
                torch.cuda.current_stream(dev).synchronize()
            else:  # .cpu() of a CPU tensor is the tensor itself: views, used
                # before the next record overwrites them
                host[dev] = (counts[:n].cpu(), values[:n].cpu())
        return host

    def _first_bad(self) -> Tuple[int, int, Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]]]:
        """(index of the first offending record or -1, number of offending
        records, host (counts, values) per device)."""
        host = self._read()
        first, total = -1, 0
        for dev, (c, _) in host.items():
            if not bool(c.any()):  # the usual step: nothing non-finite on this device, one reduction
                continue
            lenient = torch.zeros(c.shape[0], dtype=torch.bool)
            idx = [m.slot for m in self._recs if m.dev == dev and m.kind == Kind.IN]
            if idx:
                lenient[idx] = True
            strict = c.sum(1) > 0
            soft = (c[:, 0] + c[:, 1]) > 0
            bad = torch.where(lenient, soft, strict)
            derived = [m.slot for m in self._recs if m.dev == dev and m.kind == Kind.SCORE]
            if derived:  # a bound computed from recorded outputs: those are the offenders
                bad[derived] = False
            nz = bad.nonzero().flatten()
            total += int(nz.numel())
            if nz.numel():
                slot = int(nz[0])
                g = next(i for i, m in enumerate(self._recs) if m.dev == dev and m.slot == slot)
                if first < 0 or g < first:
                    first = g
        return first, total, host

    def _stats(self, r: int, host, which: Optional[str] = None) -> TensorStats:
        m = self._recs[r]
        c = host[m.dev][0][m.slot].tolist()
        v = host[m.dev][1][m.slot].tolist()
        return TensorStats(which or m.label, tuple(m.shape), m.dtype, int(c[0]), int(c[1]),
                           int(c[2]), float(v[0]), float(v[1]))

    def _finite(self, r: int, host) -> bool:
        m = self._recs[r]
        return int(host[m.dev][0][m.slot].sum()) == 0

    def _report(self, first: int, total: int, host) -> Report:
        m = self._recs[first]
        call = m.call
        if m.kind == Kind.PGRAD:
            return Report(call.name, call.cls, PARAM_GRAD, self._step, self._stats(first, host),
                          [], n_nonfinite=total)
        if m.kind == Kind.OUT:
            ins = [self._stats(r, host, lab) for lab, r in call.inputs]
            return Report(call.name, call.cls, FORWARD, call.step, self._stats(first, host), ins,
                          n_nonfinite=total)
        if m.kind == Kind.IN:
            if call.name == "":
                where = "it came in with the model's inputs (check the batch: nanguard.check_batch)"
            else:
                parent = call.name.rpartition(".")[0]
                where = (f"it was computed by the forward of '{parent or '(the model)'}' itself, "
                         "outside its submodules (or passed in from the model's inputs)")
            return Report(call.name, call.cls, FORWARD, call.step, self._stats(first, host), [],
                          note="this input entered the module already non-finite and no watched "
                               "module produced it: " + where,
                          n_nonfinite=total)
        return self._report_grad(first, total, host)

    def _report_grad(self, first: int, total: int, host) -> Report:
        """A gradient arriving at an output of a call: made by a consumer of
        that output in the forward pass, the innermost one whose own output
        gradients were still finite."""
        m = self._recs[first]
        call = m.call
        cands = []
        for c in self._consumers.get(m.fwd_record, []):
            if c is call:
                continue
            earlier = [g for g in c.grads if g < first]
            if earlier and all(self._finite(g, host) for g in earlier):
                cands.append(c)
        cands = [c for c in cands if not any(is_ancestor(c.name, o.name) for o in cands)]
        if cands:
            c = cands[0]
            lab = next((lab for lab, r in c.inputs if r == m.fwd_record), "input")
            ins = [self._stats(g, host) for g in c.grads if g < first]
            note = ""
            if len(cands) > 1:
                note = "other consumers of the same tensor: " + ", ".join(
                    f"'{o.name or '<root>'}'" for o in cands[1:])
            return Report(c.name, c.cls, BACKWARD, c.step, self._stats(first, host, "grad of " + lab),
                          ins, note=note, n_nonfinite=total)
        return Report(call.name, call.cls, BACKWARD, call.step, self._stats(first, host), [],
                      note="the gradient arriving at this output was made by code outside the "
                           "watched modules that consumed it (the loss, or arithmetic in a "
                           "parent's forward)",
                      n_nonfinite=total)

    def _collect(self) -> Optional[Report]:
        """Read and drop the records: the report of the first non-finite one, or None."""
        if not self._recs:
            return None
        try:
            for owner, pname, p in self._dparams:
                if p.grad is not None and recordable(p.grad):
                    self._record(p.grad, Kind.PGRAD, owner, pname + ".grad")
            first, total, host = self._first_bad()
            report = self._report(first, total, host) if first >= 0 else None
            if self._forensics is not None:
                self._forensics.observe(self._step, self._recs, host, report)
            return report
        finally:
            self._reset()

    def _auto_check(self, version: Optional[int]) -> None:
        """A check with no action, at a forward of the model: the first
        non-finite report waits for the next check(); the current forward is
        the first of the new window."""
        report = self._collect()
        if report is not None:
            if self._pending is None:
                self._pending = report
            else:
                self._pending.n_nonfinite += report.n_nonfinite
        self._forwards = 1
        self._probe_version = version

    def _sentinel_check(self, report: Optional[Report], loss) -> Optional[Report]:
        """Sentinel mode: the step's fused test, and the replay of a
        non-finite step (the census of a census step that found something
        the test did not, such as an Inf absorbed before the loss, stands)."""
        recorder = self._forensics.recorder
        batches = recorder.batches
        try:
            if not batches and loss is None:
                return report
            live = self._sentinel.first_live(batches, loss)
            if live is None:
                return report
            if not batches:  # the loss came in, but no forward was held to replay
                live[0].reproduced = False
                live[0].note = "no forward of the model was seen this step, so nothing was replayed"
                return live[0]
            on = self._on
            self._on = False
            try:
                report, k = self._sentinel.localise(live[0], live[1], batches)
            finally:
                self._on = on
            self._forensics.write(self._step, report, self._forensics.loss_scale(), micro_batch=k)
            return report
        finally:
            recorder.drop()
            self._sentinel._begun = False

    def check(self, loss: Optional[torch.Tensor] = None) -> Optional[Report]:
        """Read what was recorded since the last check (one synchronisation
        per device) and act on the first non-finite tensor, by policy.
        Returns the :class:`Report`, or None when everything was finite.

        ``loss``: the step's loss, checked too (in eager mode a non-finite
        loss with every watched tensor finite is reported as made outside
        the watched modules; in sentinel mode it joins the fused test).

        Under torch.distributed (``process_group``, default: the default
        group) every rank must call it at the same steps: one all-reduce of a
        flag per rank makes every rank act when any rank saw a non-finite
        value, so none of them is left waiting in the next collective."""
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
        group = _dist.agreement_group(self._group) if self._agree and (
            self._on or self._sentinel is not None) else None
        held = self._sentinel is not None and bool(self._forensics.recorder.batches)
        if not self._recs and self._pending is None and group is None and not held and loss is None:
            return None
        report = self._collect()
        if self._pending is not None:
            if report is not None:
                self._pending.n_nonfinite += report.n_nonfinite
            report, self._pending = self._pending, None
        if self._sentinel is not None:
            report = self._sentinel_check(report, loss)
        elif report is None and loss is not None and loss.is_floating_point() and not bool(
                torch.isfinite(loss.detach()).all()):
            report = Report("", type(self.model).__name__, FORWARD, self._step, tensor_stats("loss", loss), [],
                            note="every watched tensor of the step was finite: the loss was made outside "
                                 "the watched modules (the loss function)")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            if report is not None:
                report.rank = rank
            if group is not None:
                bad = _dist.ranks_flagged(group, report is not None)
                if report is not None:
                    report.bad_ranks = bad
                elif bad:
                    report = Report("", "", "", self._step, rank=rank, bad_ranks=bad)
        if report is None:
            return None
        if self.policy != "raise" and len(self.records) < self.max_records:
            self.records.append(report)
        if self.policy == "raise":
            raise NonFiniteError(report)
        if self.policy == "warn":
            warnings.warn(str(report), RuntimeWarning, stacklevel=2)
        return report

    def step(self, loss: Optional[torch.Tensor] = None) -> Optional[Report]:
        """Mark a training-step boundary: :meth:`check` (of ``loss`` too,
        when given), then advance the step counter (eager mode records on
        steps divisible by ``every``; sentinel mode with history runs the
        census on steps divisible by ``census_every``)."""
        try:
            return self.check(loss)
        finally:
            self._step += 1
            if self._sentinel is None:
                self._on = self._scores_on = self._step % self.every == 0
            else:
                self._on = self.history is not None and self._step % self._census_every == 0
                self._set_census(self._on)
            if self._forensics is not None:
                self._forensics.end_step()

    @property
    def step_index(self) -> int:
        return self._step

    @property
    def replays(self) -> int:
        """Sentinel mode: how many non-finite steps were replayed in process."""
        return self._sentinel.replays if self._sentinel is not None else 0

    @property
    def history(self):
        """The magnitude :class:`~nanguard.diagnostics.History` (``history=N``), or None."""
        return self._forensics.history if self._forensics is not None else None

    @property
    def warnings(self) -> list:
        """Every :class:`HeadroomWarning` issued so far."""
        return self._forensics.warnings if self._forensics is not None else []

    # ---- lifetime ----------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self):
        """Inside, the watcher's hooks record nothing and count no forward
        pass: the model can run outside the training step (an evaluation,
        or :class:`nanguard.Rewind`'s data-versus-state test) without
        touching the step's records."""
        rec = self._forensics.recorder if self._forensics is not None else None
        saved = (self._on, self._replaying, rec.paused if rec is not None else None)
        self._on, self._replaying = False, True
        if rec is not None:
            rec.paused = True
        try:
            yield self
        finally:
            self._on, self._replaying = saved[0], saved[1]
            if rec is not None:
                rec.paused = saved[2]

    def remove(self) -> None:
        """Detach every hook and drop pending records (the buffers are freed)."""
        for h in self._handles + self._census_handles:
            h.remove()
        self._handles.clear()
        self._census_handles.clear()
        self._on = False
        self._reset()
        self._pending = None
        self._bufs.clear()
        if self._forensics is not None:
            self._forensics.remove()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.check()
        finally:
            self.remove()


def watch(model: nn.Module, **options) -> Watch:
    return Watch(model, **options)


# one documentation and one signature for both: help(nanguard.watch) lists the arguments
watch.__doc__ = Watch.__doc__
watch.__signature__ = inspect.signature(Watch)
