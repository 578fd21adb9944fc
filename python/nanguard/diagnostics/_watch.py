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

import fnmatch
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import distributed as _dist
from .._tensor_stats import COUNT_FIELDS, VALUE_FIELDS

__all__ = ["watch", "Watch", "Report", "TensorStats", "NonFiniteError"]

_op = torch.ops.nanguard.tensor_stats_.default
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICES = ("cpu", "cuda")

FORWARD = "forward"
BACKWARD = "backward"
PARAM_GRAD = "parameter grad"
_POLICIES = ("raise", "warn", "record")
#: a buffer this large means step() / check() is probably never called
_MANY_SLOTS = 1 << 20

# record kinds
_OUT = 0  # output of a module call (forward)
_IN = 1  # input of a module call not produced by a watched module (forward)
_GRAD = 2  # gradient arriving at an output of a module call
_PGRAD = 3  # accumulated parameter gradient


@dataclass
class TensorStats:
    """The census of one recorded tensor."""

    which: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nan: int
    posinf: int
    neginf: int
    max_abs: float  #: over finite values; 0 when there is none
    min_nonzero_abs: float  #: over finite values; inf when there is none

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        head = f"{self.which}: shape {tuple(self.shape)} {dt}: "
        if self.finite:
            bad = "all finite"
        else:
            bad = f"{self.nan} NaN, {self.posinf} +Inf, {self.neginf} -Inf"
        mn = "none" if math.isinf(self.min_nonzero_abs) else f"{self.min_nonzero_abs:.3g}"
        return head + f"{bad}; finite max|x| {self.max_abs:.3g}, min non-zero |x| {mn}"


@dataclass
class Report:
    """The first non-finite tensor of a checked step."""

    module: str  #: qualified name ("" is the watched model itself)
    cls: str  #: class name of the module
    pass_: str  #: "forward", "backward" or "parameter grad"; "" when another rank saw it
    step: int
    #: None when this rank saw only finite values and another rank did not
    tensor: Optional[TensorStats] = None
    inputs: List[TensorStats] = field(default_factory=list)
    note: str = ""
    #: how many recorded tensors of the step were non-finite in all
    n_nonfinite: int = 1
    #: this process's rank in the default group (None without torch.distributed)
    rank: Optional[int] = None
    #: under rank agreement: every rank (global ranks) that saw a non-finite value this step
    bad_ranks: List[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.module or "<root>"

    @property
    def local(self) -> bool:
        """Did this rank see the non-finite value itself?"""
        return self.tensor is not None

    def __str__(self) -> str:
        on = "" if self.rank is None else f" on rank {self.rank}"
        if self.tensor is None:
            return (f"non-finite value at step {self.step} on rank(s) {self.bad_ranks} (their "
                    f"reports name the module); rank {self.rank} saw only finite values")
        lines = [
            f"first non-finite value at step {self.step}, {self.pass_} pass, in module "
            f"'{self.name}' ({self.cls}){on}",
            f"  {self.tensor}",
        ]
        others = [r for r in self.bad_ranks if r != self.rank]
        if others:
            lines.append(f"  also non-finite this step on rank(s) {others}")
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.inputs:
            lines.append("  computed from:")
            lines.extend(f"    {s}" for s in self.inputs)
        if self.n_nonfinite > 1:
            lines.append(f"  ({self.n_nonfinite} recorded tensors of this step were non-finite; "
                         "this is the first in execution order)")
        return "\n".join(lines)


class NonFiniteError(RuntimeError):
    """Raised by :meth:`Watch.check` under ``policy="raise"``; ``.report``
    holds the :class:`Report`."""

    def __init__(self, report: Report):
        self.report = report
        super().__init__(str(report))


def _flatten(obj, label: str, out: List[Tuple[str, torch.Tensor]], depth: int = 0) -> None:
    """(label, tensor) for every tensor inside obj (tuples, lists, dicts,
    ModelOutput), at most 4 levels deep."""
    if isinstance(obj, torch.Tensor):
        out.append((label, obj))
    elif depth >= 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"{label}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for k, v in obj.items():
            _flatten(v, f"{label}[{k!r}]", out, depth + 1)


def _version(t: torch.Tensor):
    """The in-place version counter; None for inference tensors, which have
    none (their records are then never reused)."""
    return None if t.is_inference() else t._version


def _unchanged(hit, t: torch.Tensor) -> bool:
    """hit = (weakref, record, version) or None: is it a record of t, and t
    not modified in place since?"""
    return hit is not None and hit[0]() is t and hit[2] is not None and hit[2] == _version(t)


def _recordable(t: torch.Tensor) -> bool:
    return (
        t.dtype in _FLOAT
        and t.layout == torch.strided
        and t.device.type in _DEVICES
        and (type(t) is torch.Tensor or type(t) is nn.Parameter or _dist.is_dtensor(t))
    )


class _Call:
    """One invocation of a watched module."""

    __slots__ = ("name", "cls", "step", "inputs", "outputs", "grads")

    def __init__(self, name: str, cls: str, step: int):
        self.name = name
        self.cls = cls
        self.step = step
        self.inputs: List[Tuple[str, int]] = []  # (label, record)
        self.outputs: List[Tuple[str, int]] = []
        self.grads: List[int] = []  # records of gradients at its outputs


def _is_ancestor(a: str, b: str) -> bool:
    """Is module name a a strict ancestor of module name b?"""
    return a != b and (a == "" or b.startswith(a + "."))


class Watch:
    """Handle returned by :func:`watch`: a context manager, and
    :meth:`check` / :meth:`step` / :meth:`remove`."""

    def __init__(self, model: nn.Module, modules=None, every: int = 1, policy: str = "raise",
                 max_records: int = 100, inputs: bool = True, backward: bool = True,
                 parameters: bool = True, capacity: int = 256, optimizer=None,
                 process_group=None, agree: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.model = model
        self.every = every
        self.policy = policy
        self.max_records = max_records
        self.records: List[Report] = []  #: reports kept under policy "record" (and "warn")
        self._inputs = inputs
        self._capacity = capacity
        self._step = 0
        self._gen = 0  # bumped at every reset: hooks of older graphs stop recording
        self._on = True
        self._bufs: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._used: Dict[torch.device, int] = {}
        # per record: (device, slot, kind, call or None, label, shape, dtype, extra)
        self._meta: List[tuple] = []
        self._calls: List[_Call] = []
        self._produced: Dict[int, Tuple[Any, int, int]] = {}  # id -> (weakref, record, version)
        self._consumers: Dict[int, List[_Call]] = {}  # record -> calls that took it as input
        self._stack: Dict[int, List[_Call]] = {}  # id(module) -> calls in flight
        self._handles: list = []
        self.watched: List[str] = []  #: qualified names of the watched modules
        # DTensor parameters (FSDP2, tensor parallel): their gradients are
        # read at check time (FSDP2 accumulates into an unsharded copy, so no
        # hook on the sharded parameter fires)
        self._dparams: List[Tuple[str, str, str, nn.Parameter]] = []
        if not isinstance(agree, bool):
            raise TypeError(f"agree must be a bool, got {type(agree).__name__}")
        self._agree = agree
        self._group = process_group
        self._attach(model, modules, backward, parameters)
        if optimizer is not None:
            def before_step(opt, args, kwargs):
                self.step()  # raises under policy "raise": the step is not applied
                return None

            self._handles.append(optimizer.register_step_pre_hook(before_step))

    # ---- hooks ---------------------------------------------------------------------

    def _select(self, name: str, mod: nn.Module, modules) -> bool:
        if modules is None:
            return True
        if isinstance(modules, (str, type)):
            modules = [modules]
        for m in modules:
            if isinstance(m, type) and isinstance(mod, m):
                return True
            if isinstance(m, str) and (fnmatch.fnmatchcase(name, m) or name == m):
                return True
        return False

    def _attach(self, model, modules, backward: bool, parameters: bool) -> None:
        seen_params = set()
        for name, mod in model.named_modules():
            if not self._select(name, mod, modules):
                continue
            self.watched.append(name)
            cls = type(mod).__name__
            self._handles.append(mod.register_forward_pre_hook(self._make_pre(name, cls),
                                                               with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._make_post(backward),
                                                           with_kwargs=True))
            if not parameters:
                continue
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen_params or not p.requires_grad:
                    continue
                seen_params.add(id(p))
                if _dist.is_dtensor(p):
                    self._dparams.append((name, cls, pname, p))
                    continue
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._make_pgrad(name, cls, pname)))

    def _make_pre(self, name: str, cls: str):
        def pre(mod, args, kwargs):
            if not self._on:
                return None
            call = _Call(name, cls, self._step)
            self._calls.append(call)
            self._stack.setdefault(id(mod), []).append(call)
            if self._inputs:
                found: List[Tuple[str, torch.Tensor]] = []
                _flatten(args, "input", found)
                if kwargs:
                    for k, v in kwargs.items():
                        _flatten(v, k, found)
                for label, t in found:
                    if not _recordable(t):
                        continue
                    r, _ = self._record_once(t, _IN, call, label)
                    call.inputs.append((label, r))
                    self._consumers.setdefault(r, []).append(call)
            return None

        return pre

    def _make_post(self, backward: bool):
        def post(mod, args, kwargs, output):
            if not self._on:
                return None
            stack = self._stack.get(id(mod))
            if not stack:  # hooks attached while this call was running
                return None
            call = stack.pop()
            found: List[Tuple[str, torch.Tensor]] = []
            _flatten(output, "output", found)
            for label, t in found:
                if not _recordable(t):
                    continue
                # an unchanged tensor already recorded (the output of an inner
                # module passed through, or an input returned as is) is not
                # read again, nor hooked twice
                r, new = self._record_once(t, _OUT, call, label)
                call.outputs.append((label, r))
                if new and backward and t.requires_grad:
                    t.register_hook(self._make_grad(call, label, r))
            return None

        return post

    def _record_once(self, t: torch.Tensor, kind: int, call: _Call, label: str):
        """(record index, newly recorded?): reuse the record of a tensor
        already recorded and unchanged since (same object, same version)."""
        hit = self._produced.get(id(t))
        if _unchanged(hit, t):
            return hit[1], False
        r = self._record(t, kind, call, label)
        self._produced[id(t)] = (weakref.ref(t), r, _version(t))
        return r, True

    def _make_grad(self, call: _Call, label: str, fwd_record: int):
        gen = self._gen

        def on_grad(g):
            if self._on and self._gen == gen and g is not None and _recordable(g):
                r = self._record(g, _GRAD, call, "grad of " + label, fwd_record)
                call.grads.append(r)
            return None

        return on_grad

    def _make_pgrad(self, name: str, cls: str, pname: str):
        def on_pgrad(p):
            if self._on and p.grad is not None and _recordable(p.grad):
                self._record(p.grad, _PGRAD, (name, cls), pname + ".grad")

        return on_pgrad

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

    def _record(self, t: torch.Tensor, kind: int, call, label: str, extra: int = -1) -> int:
        t = _dist.local(t)  # a DTensor's census is its local shard's
        dev = t.device
        slot = self._used.get(dev, 0)
        buf = self._bufs.get(dev)
        if buf is None or slot >= buf[0].shape[0]:
            buf = self._grow(dev, slot + 1)
        _op(t, buf[0], buf[1], slot)
        self._used[dev] = slot + 1
        self._meta.append((dev, slot, kind, call, label, t.shape, t.dtype, extra))
        return len(self._meta) - 1

    @property
    def capacity(self) -> Dict[torch.device, int]:
        """Slots allocated per device (grows geometrically, never shrinks)."""
        return {d: b[0].shape[0] for d, b in self._bufs.items()}

    @property
    def num_recorded(self) -> int:
        """Tensors recorded since the last check."""
        return len(self._meta)

    # ---- reading ---------------------------------------------------------------------

    def _reset(self) -> None:
        self._gen += 1
        self._meta.clear()
        self._calls.clear()
        self._produced.clear()
        self._consumers.clear()
        self._stack.clear()
        self._used.clear()

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
            lenient = torch.zeros(c.shape[0], dtype=torch.bool)
            idx = [m[1] for m in self._meta if m[0] == dev and m[2] == _IN]
            if idx:
                lenient[idx] = True
            strict = c.sum(1) > 0
            soft = (c[:, 0] + c[:, 1]) > 0
            bad = torch.where(lenient, soft, strict)
            nz = bad.nonzero().flatten()
            total += int(nz.numel())
            if nz.numel():
                slot = int(nz[0])
                g = next(i for i, m in enumerate(self._meta) if m[0] == dev and m[1] == slot)
                if first < 0 or g < first:
                    first = g
        return first, total, host

    def _stats(self, r: int, host, which: Optional[str] = None) -> TensorStats:
        dev, slot, kind, call, label, shape, dtype, extra = self._meta[r]
        c = host[dev][0][slot].tolist()
        v = host[dev][1][slot].tolist()
        return TensorStats(which or label, tuple(shape), dtype, int(c[0]), int(c[1]), int(c[2]),
                           float(v[0]), float(v[1]))

    def _finite(self, r: int, host) -> bool:
        dev, slot = self._meta[r][0], self._meta[r][1]
        return int(host[dev][0][slot].sum()) == 0

    def _report(self, first: int, total: int, host) -> Report:
        dev, slot, kind, call, label, shape, dtype, extra = self._meta[first]
        st = lambda r, which=None: self._stats(r, host, which)  # noqa: E731
        if kind == _PGRAD:
            name, cls = call
            return Report(name, cls, PARAM_GRAD, self._step, st(first), [], n_nonfinite=total)
        if kind == _OUT:
            ins = [st(r, lab) for lab, r in call.inputs]
            return Report(call.name, call.cls, FORWARD, call.step, st(first), ins,
                          n_nonfinite=total)
        if kind == _IN:
            if call.name == "":
                where = "it came in with the model's inputs (check the batch: nanguard.check_batch)"
            else:
                parent = call.name.rpartition(".")[0]
                where = (f"it was computed by the forward of '{parent or '(the model)'}' itself, "
                         "outside its submodules (or passed in from the model's inputs)")
            return Report(call.name, call.cls, FORWARD, call.step, st(first), [],
                          note="this input entered the module already non-finite and no watched "
                               "module produced it: " + where,
                          n_nonfinite=total)
        # a gradient arriving at an output of `call`: made by a consumer of that output
        cands = []
        for c in self._consumers.get(extra, []):
            if c is call:
                continue
            earlier = [g for g in c.grads if g < first]
            if earlier and all(self._finite(g, host) for g in earlier):
                cands.append(c)
        cands = [c for c in cands if not any(_is_ancestor(c.name, o.name) for o in cands)]
        if cands:
            c = cands[0]
            lab = next((lab for lab, r in c.inputs if r == extra), "input")
            ins = [st(g) for g in c.grads if g < first]
            note = ""
            if len(cands) > 1:
                note = "other consumers of the same tensor: " + ", ".join(
                    f"'{o.name or '<root>'}'" for o in cands[1:])
            return Report(c.name, c.cls, BACKWARD, c.step, st(first, "grad of " + lab), ins,
                          note=note, n_nonfinite=total)
        return Report(call.name, call.cls, BACKWARD, call.step, st(first), [],
                      note="the gradient arriving at this output was made by code outside the "
                           "watched modules that consumed it (the loss, or arithmetic in a "
                           "parent's forward)",
                      n_nonfinite=total)

    def _agree_group(self):
        """The process group whose ranks agree at each check, or None."""
        if not self._agree or not torch.distributed.is_available():
            return None
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        group = self._group if self._group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _ranks_bad(self, group, bad: bool) -> List[int]:
        """One all-reduce: the global ranks of the group that saw a non-finite value."""
        import torch.distributed as dist

        dev = torch.device("cpu")
        if "nccl" in str(dist.get_backend(group)).lower():
            dev = torch.device("cuda", torch.cuda.current_device())
        flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=dev)
        flags[dist.get_rank(group)] = int(bad)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
        ranks = dist.get_process_group_ranks(group)
        return [ranks[i] for i in flags.cpu().nonzero().flatten().tolist()]

    def check(self) -> Optional[Report]:
        """Read what was recorded since the last check (one synchronisation
        per device) and act on the first non-finite tensor, by policy.
        Returns the :class:`Report`, or None when everything was finite.

        Under torch.distributed (``process_group``, default: the default
        group) every rank must call it at the same steps: one all-reduce of a
        flag per rank makes every rank act when any rank saw a non-finite
        value, so none of them is left waiting in the next collective."""
        group = self._agree_group() if self._on else None
        if not self._meta and group is None:
            return None
        report = None
        try:
            if self._meta:
                for name, cls, pname, p in self._dparams:
                    if p.grad is not None and _recordable(p.grad):
                        self._record(p.grad, _PGRAD, (name, cls), pname + ".grad")
                first, total, host = self._first_bad()
                report = self._report(first, total, host) if first >= 0 else None
        finally:
            self._reset()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            if report is not None:
                report.rank = rank
            if group is not None:
                bad = self._ranks_bad(group, report is not None)
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

    def step(self) -> Optional[Report]:
        """Mark a training-step boundary: :meth:`check`, then advance the
        step counter (recording is on for steps divisible by ``every``)."""
        try:
            return self.check()
        finally:
            self._step += 1
            self._on = self._step % self.every == 0

    @property
    def step_index(self) -> int:
        return self._step

    # ---- lifetime ----------------------------------------------------------------------

    def remove(self) -> None:
        """Detach every hook and drop pending records (the buffers are freed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._on = False
        self._reset()
        self._bufs.clear()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.check()
        finally:
            self.remove()


def watch(model: nn.Module, *, modules: Union[None, str, type, Sequence[Union[str, type]]] = None,
          every: int = 1, policy: str = "raise", max_records: int = 100, inputs: bool = True,
          backward: bool = True, parameters: bool = True, optimizer=None,
          capacity: int = 256, process_group=None, agree: bool = True) -> Watch:
    """Watch ``model`` for the first NaN / Inf.

    Args:
        model: the module to watch (its submodules are watched too).
        modules: restrict to modules whose qualified name matches a pattern
            (``fnmatch``: ``"layers.*.self_attn"``) or that are instances of
            a type; a list mixes both. None watches every module.
        every: record on every N-th step only (steps are counted by
            :meth:`Watch.step`); the hooks return at once on other steps.
        policy: ``"raise"`` (:class:`NonFiniteError`), ``"warn"`` or
            ``"record"`` (reports collected in ``.records``, up to
            ``max_records``).
        inputs: also record the inputs of each module (for the report).
        backward: record the gradient arriving at each module output.
        parameters: record each parameter's gradient once accumulated.
        optimizer: when given, ``optimizer.step()`` first calls
            :meth:`Watch.step`, so a non-finite step raises before it is
            applied.
        capacity: initial slots of the stats buffer (it doubles when a step
            records more; that is the only time it allocates).
        process_group: under torch.distributed, the ranks that agree at each
            :meth:`Watch.check` (default: the default group). Reports carry
            the rank; when any rank saw a non-finite value every rank acts in
            the same step (raises under ``policy="raise"``), the others with
            a report naming the ranks that saw it. Every rank of the group
            must call ``step()`` / ``check()`` at the same steps.
        agree: False turns the agreement (one all-reduce per check) off.

    Use as ``with nanguard.watch(model) as w: ...`` (checked and removed on
    exit) or keep the handle: ``w = nanguard.watch(model)``, ``w.step()`` once
    per training step, ``w.remove()`` at the end.
    """
    return Watch(model, modules=modules, every=every, policy=policy, max_records=max_records,
                 inputs=inputs, backward=backward, parameters=parameters, capacity=capacity,
                 optimizer=optimizer, process_group=process_group, agree=agree)
