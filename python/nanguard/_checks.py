"""Argument checks shared by the Python wrappers, and the pieces every op's
registration shares (fake-kernel device checks, the in-place kernel, the
autocast policy).

The wrappers raise TypeError / ValueError naming the argument before any
kernel runs; the C layer checks again so that a direct ``torch.ops.nanguard``
call can never crash the process, and the fake kernels check devices, since
a meta argument sends a call to them instead of to the C layer.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, float_only: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    dtype = t.dtype
    if float_only and dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {dtype}"
        )
    # the is_* flags, not t.device.type: this runs on every call of every op,
    # and each read of t.device builds a new object
    if t.is_cuda:
        if dtype == torch.float64:
            raise TypeError(f"{name}: float64 is supported on the CPU only")
    elif not (t.is_cpu or t.is_meta):
        raise ValueError(f"{name} is on {t.device}; nanguard supports cpu and cuda tensors")


def device_type(t) -> str | None:
    """``t.device.type`` of a tensor, without building the device object for
    the CPU and CUDA ones (each read of ``t.device`` makes a new object, and
    the wrappers ask on every call); None for anything that is not a
    tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    return "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.is_cpu and ref.is_cpu:  # the common case, without two device objects
        return
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_eps(name: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not (eps >= 0.0) or eps == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {eps}")
    return eps


# ---- fake (meta) kernels -------------------------------------------------------
#
# torch.library.register_fake also installs the fake as the Meta kernel, and
# the dispatcher picks Meta when *any* argument is a meta tensor. A meta
# tensor among CPU ones would otherwise run the fake on real tensors and
# return uninitialised memory; these checks make it raise instead, naming the
# argument. Under torch.compile the fakes see FakeTensors whose devices are
# the real ones, so the same checks hold there.


def fake_same_device(op: str, ref_name: str, ref: torch.Tensor, *named) -> None:
    """Raise unless every (name, tensor) in ``named`` is on ``ref``'s device."""
    for name, t in named:
        if t is None:
            continue
        ts = t if isinstance(t, (list, tuple)) else (t,)
        for k, x in enumerate(ts):
            label = f"{name}[{k}]" if isinstance(t, (list, tuple)) else name
            torch._check(
                x.device == ref.device,
                lambda: f"{op}: {label} is on {x.device} but {ref_name} is on {ref.device}; "
                "every tensor argument must be on one device",
            )


def fake_host_tensor(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """A host-side argument (dropout's rng): a CPU tensor, or meta when
    ``ref`` is meta too (shape inference on the meta device)."""
    ok = t.device.type == "cpu" or (t.device.type == "meta" and ref.device.type == "meta")
    torch._check(
        ok,
        lambda: f"{op}: {name} must be a CPU tensor (its values are read on the host), got a "
        f"{t.device} tensor with {ref_name} on {ref.device}",
    )


# ---- in-place ops ---------------------------------------------------------------

_inplace_libs: list = []  # the registrations must live as long as the process


def register_inplace(qualname: str, mutated: dict = None) -> None:
    """The ADInplaceOrView kernel of an op defined in C that writes some of
    its arguments in place (``Tensor(a!)`` in its schema).

    Kernels registered from C have none, so without this PyTorch neither
    bumps the written tensors' version counters (autograd would then use a
    saved tensor's new values silently) nor refuses a write into a leaf that
    requires grad. ``mutated`` maps argument positions to their names (by
    default the arguments the schema marks written); a position may hold a
    list of tensors.
    """
    ns, name = qualname.split("::")
    packet, _, overload = name.partition(".")
    op = getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    if mutated is None:
        names = arg_names(op)
        mutated = {names.index(n): n for n in written_arg_names(op)}
    lib = torch.library.Library(ns, "IMPL")
    _inplace_libs.append(lib)

    def written(args):
        for i, arg_name in mutated.items():
            a = args[i]
            if isinstance(a, (list, tuple)):
                for k, t in enumerate(a):
                    yield f"{arg_name}[{k}]", t
            else:
                yield arg_name, a

    def kernel(keyset, *args):
        if torch.is_grad_enabled():
            for arg_name, t in written(args):
                if t.requires_grad and t.is_leaf:
                    raise RuntimeError(
                        f"a leaf Variable that requires grad is being used in an in-place "
                        f"operation: {qualname} writes {arg_name} in place (call it under "
                        "torch.no_grad(), as optimizers do)"
                    )
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)
        touched = [t for _, t in written(args)]
        if touched:
            torch.autograd.graph.increment_version(touched)
        return out

    lib.impl(name, kernel, "ADInplaceOrView", with_keyset=True)


# ---- calling an op ----------------------------------------------------------------

_BELOW_AUTOGRAD = getattr(torch._C, "_AutoDispatchBelowAutograd", None)
_ANY_REQUIRES_GRAD = getattr(torch._C, "_any_requires_grad", None)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)

#: op (an OpOverload) -> its autograd formula as a ``torch.autograd.Function``,
#: for eager calls that record a gradient (``register_autograd``)
_EAGER_FUNCTION: dict = {}

#: tensor types an eager Function call takes as they are; anything else (a
#: DTensor, a FakeTensor, another subclass) goes through the dispatcher
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def register_autograd(op, backward, setup_context=None) -> None:
    """``torch.library.register_autograd(op, backward, setup_context=...)``,
    and the same formula as a ``torch.autograd.Function`` for
    :func:`call_op`'s eager calls that record a gradient.

    The dispatcher's autograd kernel for a formula registered from Python
    (``torch/_library/autograd.py``) rebuilds the op's argument list from its
    schema on every call (``fill_defaults``, which asks the schema for its
    argument list once per argument) before it calls ``setup_context``:
    with the generated ``autograd.Function`` around it, about 55 us of
    Python on each recorded call of ``safe_sdpa``, twice the op itself on a
    small input. The Function runs the same
    ``setup_context`` and ``backward`` on the same positional arguments
    (``call_op`` passes every argument of the schema), with the op below the
    autograd layer as its forward, as that kernel's forward does."""
    torch.library.register_autograd(op, backward, setup_context=setup_context)
    if setup_context is None:
        return

    # forward(ctx, *args), with setup_context called from it: a Function with
    # a setup_context staticmethod has apply() bind its arguments through
    # inspect.signature on every call, which costs what is saved here
    def forward(ctx, *args):
        with _BELOW_AUTOGRAD():
            output = op(*args)
        setup_context(ctx, args, output)
        return output

    name = "".join(w.capitalize() for w in op._schema.name.split("::")[1].split("_"))
    overload = op._schema.overload_name
    _EAGER_FUNCTION[op] = type(
        f"{name}{overload.capitalize()}Function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


def _plain_args(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    return True


def call_op(op, *args):
    """``op(*args)`` (``op`` an ``OpOverload`` whose autograd formula is
    registered with :func:`register_autograd`, ``args`` every argument of
    its schema, positionally) by the shortest eager path.

    Where no gradient can be recorded (grad mode off, or no argument
    requires grad), the op runs below the autograd layer, as the autograd
    kernel itself would (``torch/_library/autograd.py``, with the same
    test), minus that kernel's Python: about 8 us a call, as much as a small
    op's whole kernel. Where one is recorded, on plain tensors and outside
    functorch transforms, the op's formula runs as its
    ``torch.autograd.Function`` (``register_autograd``). Traced calls
    (``torch.compile``, ``torch.export``), tensor subclasses and functorch
    transforms go through the dispatcher unchanged."""
    if (
        torch.compiler.is_compiling()  # first: the tracer cannot call the tests below
        or _BELOW_AUTOGRAD is None
        or _ANY_REQUIRES_GRAD is None
    ):
        return op(*args)
    if not (torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(*args)):
        with _BELOW_AUTOGRAD():
            return op(*args)
    fn = _EAGER_FUNCTION.get(op)
    if (
        fn is not None
        and _FUNCTORCH_ACTIVE is not None
        and not _FUNCTORCH_ACTIVE()
        and _plain_args(args)
    ):
        return fn.apply(*args)
    return op(*args)


# ---- autocast -------------------------------------------------------------------

#: dtypes autocast casts; float64 (and every non-float dtype) is left alone
AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)

#: (aten op, device type) -> whether PyTorch's op has an autocast kernel
#: there, read once at import (a plain dict lookup traces under torch.compile).
_HAS_AUTOCAST = {
    (op, dev): torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + op, key)
    for op in ("layer_norm", "rms_norm", "scaled_dot_product_attention")
    for dev, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA"))
}


def autocast_active(aten_op: str, device_type: str) -> bool:
    """True when autocast is on for ``device_type`` and PyTorch's own
    ``aten::<aten_op>`` has an autocast kernel there, i.e. when the op a
    nanguard function replaces would have its inputs cast right now."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return False
    return _HAS_AUTOCAST[(aten_op, device_type)]


def autocast_to(t, dtype: torch.dtype):
    """``t`` cast to ``dtype`` the way autocast casts an argument (float16,
    bfloat16 and float32 tensors only)."""
    if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_ELIGIBLE and t.dtype != dtype:
        return t.to(dtype)
    return t


# ---- op schemas -------------------------------------------------------------------
#
# The schema each op registers from C (ops/ops.h) is the one description of
# its arguments. The fake kernels, the autograd formulas and the DTensor
# sharding strategies read arguments by their schema names through these
# helpers, so adding an argument to an op changes its schema and its
# implementation, and nothing that restates the argument list by position.


def arg_names(op) -> tuple:
    """The names of ``op``'s arguments (an ``OpOverload``), in stack order."""
    return _schema_info(op)[0]


def tensor_arg_names(op) -> tuple:
    """The names of ``op``'s ``Tensor`` arguments (not ``Tensor[]``)."""
    return _schema_info(op)[1]


def written_arg_names(op) -> tuple:
    """The names of the arguments ``op`` writes in place (``Tensor(a!)``)."""
    return _schema_info(op)[2]


_SCHEMA_INFO: dict = {}


def _schema_info(op):
    key = (op._schema.name, op._schema.overload_name)
    info = _SCHEMA_INFO.get(key)
    if info is None:
        args = op._schema.arguments
        info = (
            tuple(a.name for a in args),
            tuple(a.name for a in args if isinstance(a.type, torch.TensorType)),
            tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write),
        )
        _SCHEMA_INFO[key] = info
    return info


def bind(op, args, kwargs=None) -> dict:
    """``{name: value}`` for a call of ``op`` with ``args`` (and ``kwargs``)."""
    names = arg_names(op)
    if len(args) > len(names):
        raise TypeError(f"{op._schema.name} takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    if kwargs:
        bound.update(kwargs)
    return bound


def call_args(op, values: dict) -> list:
    """``op``'s positional arguments, each taken from ``values`` by name."""
    missing = [n for n in arg_names(op) if n not in values]
    if missing:
        raise KeyError(f"{op._schema.name}: no value for argument(s) {missing}")
    return [values[n] for n in arg_names(op)]


def per_arg(op, values: dict, default=None) -> tuple:
    """One entry per argument of ``op``: ``values[name]``, or ``default`` for
    arguments ``values`` does not name (autograd's gradient tuple, a sharding
    strategy's input placements)."""
    return tuple(values.get(n, default) for n in arg_names(op))


def tensor_placements(op, placements: dict) -> list:
    """A DTensor sharding strategy's input placements for ``op``: the
    placement ``placements`` gives each Tensor argument by name, None for the
    others. Raises naming a Tensor argument that has none."""
    missing = [n for n in tensor_arg_names(op) if n not in placements]
    if missing:
        raise KeyError(f"{op._schema.name}: no placement for tensor argument(s) {missing}")
    tensors = set(tensor_arg_names(op))
    return [placements[n] if n in tensors else None for n in arg_names(op)]
