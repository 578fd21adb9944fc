"""Plan, apply and undo: which modules of a model change and into what
(:func:`_plan`), changing them in place and recording how to undo it
(:func:`_patch_model`), undoing it exactly (:func:`_undo`), and patching a
model class so that its new instances are patched (:func:`_patch_class`)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from ..layernorm import StableLayerNorm, StableRMSNorm
from ..nn import SafeMultiheadAttention, UnsupportedModuleError, _no_fastpath_hook
from ._activations import _act_replacement
from ._hf_attention import _OPTS_ATTR, _outermost_hf, _patch_hf_attention, _register
from ._norm_forms import _is_norm_like, _norm_replacement
from ._qk_norm import add_qk_norms
from ._wrappers import _hf_pretrained_base, unwrap

#: attribute of the (unwrapped) model holding its :class:`_Record`
_PATCH_ATTR = "_nanguard_patch"


@dataclasses.dataclass
class PatchSummary:
    """What :func:`nanguard.patch` did. ``patched`` counts changed modules
    per ``"Old -> New"``; ``skipped`` maps a module (qualified name), a class,
    or ``"attention"`` to the reason it was left untouched; ``wrappers``
    lists the wrappers the model was found inside, outermost first."""

    model_type: str
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)
    attn_implementation: Optional[Tuple[str, str]] = None  #: (before, after)
    wrappers: List[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        where = f" (inside {' > '.join(self.wrappers)})" if self.wrappers else ""
        lines = [f"nanguard.patch: {self.model_type}{where}"]
        if self.attn_implementation:
            lines.append(f"  attention implementation: {self.attn_implementation[0]} -> {self.attn_implementation[1]}")
        for k, n in self.patched.items():
            lines.append(f"  {n:4d} x {k}")
        for k, why in self.skipped.items():
            lines.append(f"  left untouched: {k} ({why})")
        if not self.patched and not self.attn_implementation:
            lines.append("  nothing patched")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The options of one :func:`nanguard.patch` call (validated): a second
    call with equal options is a no-op, one with other options re-patches."""

    attention: bool = True
    norm: bool = True
    activation: bool = True
    max_score: Optional[float] = None
    softcap: Optional[float] = None
    qk_norm: bool = False


@dataclasses.dataclass
class _Change:
    """One module to change in place: it gets class ``new`` and the instance
    attributes ``attrs`` (both undone by :func:`_undo`)."""

    module: nn.Module
    qualname: str
    new: type
    attrs: Dict[str, object] = dataclasses.field(default_factory=dict)
    #: add the no-op pre-hook that keeps TransformerEncoderLayer's fused fast path off
    fastpath_hook: bool = False


@dataclasses.dataclass
class _Record:
    """Everything needed to undo a patch, kept on the model (not a module,
    not in ``state_dict``)."""

    opts: _Options
    summary: PatchSummary
    #: (module, its class before, the instance attributes added)
    classes: List[Tuple[nn.Module, type, List[str]]] = dataclasses.field(default_factory=list)
    #: handles of the hooks added
    hooks: list = dataclasses.field(default_factory=list)
    #: (config, its _attn_implementation_internal before)
    configs: List[Tuple[object, object]] = dataclasses.field(default_factory=list)
    #: attention modules given the max_score / softcap options (_OPTS_ATTR)
    opts_on: List[nn.Module] = dataclasses.field(default_factory=list)
    #: (object, attribute, value before) to restore
    attrs: List[Tuple[object, str, object]] = dataclasses.field(default_factory=list)
    #: (module, name) of the submodules added (qk_norm)
    modules_added: List[Tuple[nn.Module, str]] = dataclasses.field(default_factory=list)

    def __setstate__(self, state):
        # a patched model loaded in a new process (torch.load): its configs
        # name nanguard's attention, which must be registered there too
        self.__dict__.update(state)
        if self.configs:
            _register()


# ---- plan ------------------------------------------------------------------------------------------


def _plan(model: nn.Module, summary: PatchSummary, opts: _Options) -> List[_Change]:
    """A :class:`_Change` for every module to change; modules that look like
    candidates but match no known form go to ``summary.skipped``. Nothing is
    changed here."""
    plan = []
    for qual, child in model.named_modules():
        if child is model or _is_ours(child):
            continue
        try:
            change = _change_for(child, qual, opts)
        except UnsupportedModuleError as e:
            summary.skipped[qual] = f"{type(child).__name__}: {e}"
            continue
        if change is None:
            continue
        if "forward" in child.__dict__ and "_old_forward" not in child.__dict__:
            # a forward replaced on the instance would keep running the old code
            summary.skipped[qual] = f"{type(child).__name__}: its forward is replaced on the instance"
            continue
        plan.append(change)
    return plan


def _change_for(child: nn.Module, qual: str, opts: _Options) -> Optional[_Change]:
    """The change ``child`` needs under ``opts``, None when it is not a
    candidate; raises :class:`UnsupportedModuleError` for a candidate that
    cannot be converted exactly."""
    leaf = not any(True for _ in child.children())
    if isinstance(child, nn.MultiheadAttention):
        if not opts.attention:
            return None
        SafeMultiheadAttention._check_convertible(child)
        return _Change(child, qual, SafeMultiheadAttention, {"max_score": opts.max_score, "softcap": opts.softcap},
                       fastpath_hook=True)
    if leaf and _is_norm_like(child):
        if not opts.norm:
            return None
        new, _ = _norm_replacement(child)
        return _Change(child, qual, new, {"eps_floor": None} if new in (StableLayerNorm, StableRMSNorm) else {})
    if leaf and opts.activation and "gelu" in type(child).__name__.lower() \
            and not list(child.parameters(recurse=False)):
        new = _act_replacement(child)
        return None if new is None else _Change(child, qual, new)
    return None


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("nanguard")


# ---- apply / undo ----------------------------------------------------------------------------------


def _patch_model(wrapped: nn.Module, opts: _Options) -> PatchSummary:
    """:func:`nanguard.patch` of a model (``opts`` validated). A model
    patched with the same options is left as it is and its summary returned;
    one patched with other options is unpatched first. A failure part-way
    undoes every change made."""
    model, chain = unwrap(wrapped)
    record = getattr(model, _PATCH_ATTR, None)
    if record is not None:
        if record.opts == opts:
            return record.summary
        _unpatch_model(model)
    base = _hf_pretrained_base()
    is_hf = base is not None and isinstance(model, base)
    if is_hf:
        mtype = f"{getattr(model.config, 'model_type', '?')} ({type(model).__name__})"
    else:
        mtype = type(model).__name__
    record = _Record(opts, PatchSummary(model_type=mtype, wrappers=chain))
    try:
        for change in _plan(model, record.summary, opts):
            _apply_change(change, record)
        if opts.attention:
            _patch_attention(model, record, base, is_hf)
        if opts.qk_norm:
            add_qk_norms(model, record, record.summary)
    except Exception:
        _undo(record)
        raise
    object.__setattr__(model, _PATCH_ATTR, record)
    return record.summary


def _apply_change(change: _Change, record: _Record) -> None:
    m, old, new = change.module, type(change.module), change.new
    record.classes.append((m, old, list(change.attrs)))
    m.__dict__.update(change.attrs)
    m.__class__ = new
    if change.fastpath_hook:
        record.hooks.append(m.register_forward_pre_hook(_no_fastpath_hook))
    if "_old_forward" in m.__dict__:
        # accelerate's device hooks call the bound forward they kept
        record.attrs.append((m, "_old_forward", m.__dict__["_old_forward"]))
        m._old_forward = new.forward.__get__(m)
    key = f"{old.__name__} -> {new.__name__}"
    record.summary.patched[key] = record.summary.patched.get(key, 0) + 1


def _patch_attention(model: nn.Module, record: _Record, base: Optional[type], is_hf: bool) -> None:
    """Attention beyond ``nn.MultiheadAttention``: transformers' attention
    implementation of ``model`` (or of the transformers models it holds),
    and ``nn.TransformerEncoder``'s nested-tensor path turned off."""
    opts, summary = record.opts, record.summary
    if is_hf:
        _patch_hf_attention(model, record, summary, opts.max_score, opts.softcap)
        return
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
            # its nested-tensor inference path bypasses self_attn's forward
            record.attrs.append((m, "use_nested_tensor", m.use_nested_tensor))
            m.use_nested_tensor = False
    if base is not None:
        # transformers models held by a module of the user's (a LightningModule, a custom head)
        for qual, sub in _outermost_hf(model, base):
            _patch_hf_attention(sub, record, summary, opts.max_score, opts.softcap, where=qual)


def _undo(record: _Record) -> None:
    for h in record.hooks:
        h.remove()
    for m, name in reversed(record.modules_added):
        delattr(m, name)
    for obj, attr, value in reversed(record.attrs):
        setattr(obj, attr, value)
    for m, old, added in reversed(record.classes):
        m.__class__ = old
        for k in added:
            m.__dict__.pop(k, None)
    for config, impl in record.configs:
        config._attn_implementation_internal = impl
    for m in record.opts_on:
        m.__dict__.pop(_OPTS_ATTR, None)


def _unpatch_model(wrapped: nn.Module) -> None:
    model, _ = unwrap(wrapped)
    record = getattr(model, _PATCH_ATTR, None)
    if record is None:
        return
    _undo(record)
    model.__dict__.pop(_PATCH_ATTR, None)


# ---- classes ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _ClassPatch:
    own: Optional[Callable]  # the class's own post_init (None: inherited)
    opts: _Options
    summary: PatchSummary


_CLASS_PATCHES: "weakref.WeakKeyDictionary[type, _ClassPatch]" = weakref.WeakKeyDictionary()


def _patch_class(cls: type, opts: _Options) -> PatchSummary:
    """Wrap ``cls.post_init`` (which every transformers model calls at the end
    of ``__init__``) so each new instance is patched; ``unpatch(cls)`` removes
    the wrapper. A class patched with the same options is left as it is;
    with other options its wrapper is replaced."""
    base = _hf_pretrained_base()
    if base is None or not issubclass(cls, base):
        raise TypeError(f"patch(cls) supports transformers PreTrainedModel subclasses, got {cls.__name__}")
    entry = _CLASS_PATCHES.get(cls)
    if entry is not None:
        if entry.opts == opts:
            return entry.summary
        _unpatch_class(cls)
    mtype = getattr(getattr(cls, "config_class", None), "model_type", "?")
    summary = PatchSummary(model_type=f"{mtype} ({cls.__name__}, class)")
    own = cls.__dict__.get("post_init")
    original = cls.post_init

    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if isinstance(self, cls) and getattr(self, _PATCH_ATTR, None) is None:
            _patch_model(self, opts)
        return out

    post_init.__wrapped__ = original
    cls.post_init = post_init
    _CLASS_PATCHES[cls] = _ClassPatch(own, opts, summary)
    summary.patched[f"{cls.__name__} instances built from now on"] = 1
    return summary


def _unpatch_class(cls: type) -> None:
    entry = _CLASS_PATCHES.pop(cls, None)
    if entry is None:
        return
    if entry.own is None:
        del cls.post_init
    else:
        cls.post_init = entry.own
