"""The composite path: every nanguard op written in PyTorch operations.

nanguard's C kernels run on the CPU (``libnanguard.so``) and on CUDA
(``libnanguard_cuda.so``, built only where nvcc was). Everywhere else (MPS,
XPU, a PrivateUse1 backend, CUDA without the CUDA library, or any device when
the core library cannot be loaded at all) the ops run these functions, which
keep the kernels' numerics contract: fp32 scores and statistics, fully masked
rows giving 0 with zero gradients, clamp and soft-cap, fp32 norm statistics
with no 0/0, and the guard's skip and clip semantics with no host sync.

They are registered at the dispatcher's ``CompositeExplicitAutograd`` key,
the kernel of every backend that has no kernel of its own. A C kernel
registered for the CPU or CUDA key takes precedence, so the path a call
takes depends on its device alone; the autograd formulas and fake kernels
registered by the Python layer are the same on both paths.

Each kernel runs with autocast turned off on its tensors' devices. A
dispatcher kernel's own calls dispatch from the top again, so under
``torch.autocast`` a composite ``q @ k.T`` in fp32 would run as an fp16
matmul: the very overflow the op exists to prevent. A C kernel calls no
operator, so it needs nothing of the kind.

When the core library is not loaded (``NANGUARD_COMPOSITE=1``, or a platform
where it cannot be built or loaded) the schemas, which the C library would
define, are defined here from the same strings (``SCHEMAS``; a test compares
them with the library's), and the composite kernels then serve the CPU too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

__all__ = ["SCHEMAS", "KERNELS", "register", "path"]

_SDPA_PARAMS = "float dropout_p, bool is_causal, float scale, float max_score, float softcap, Tensor rng"

#: every schema, in the order libnanguard.so defines them (ops/ops.h, NG_ALL_SCHEMAS)
SCHEMAS = (
    "stable_layernorm(Tensor input, float eps, bool rms) -> (Tensor, Tensor, Tensor)",
    "stable_layernorm.weight(Tensor input, Tensor weight, float eps, bool rms) "
    "-> (Tensor, Tensor, Tensor)",
    "stable_layernorm.bias(Tensor input, Tensor bias, float eps, bool rms) "
    "-> (Tensor, Tensor, Tensor)",
    "stable_layernorm.weight_bias(Tensor input, Tensor weight, Tensor bias, float eps, "
    "bool rms) -> (Tensor, Tensor, Tensor)",
    "stable_layernorm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, "
    "bool rms, bool with_bias) -> (Tensor, Tensor)",
    "stable_layernorm_backward.weight(Tensor grad_out, Tensor input, Tensor weight, "
    "Tensor mean, Tensor rstd, bool rms, bool with_bias) -> (Tensor, Tensor, Tensor)",
    "grad_guard_reduce(Tensor[] grads, Tensor inv_scale, float norm_type) -> Tensor",
    "grad_guard_apply_(Tensor(a!)[] grads, Tensor inv_scale, Tensor stats, "
    "Tensor(b!) found_inf, float max_norm, float norm_type) -> Tensor",
    "fused_unscale_clip_(Tensor(a!)[] grads, Tensor inv_scale, Tensor(b!) found_inf, "
    "float max_norm, float norm_type) -> (Tensor, Tensor)",
    "safe_sdpa(Tensor query, Tensor key, Tensor value, " + _SDPA_PARAMS + ") -> (Tensor, Tensor)",
    "safe_sdpa.masked(Tensor query, Tensor key, Tensor value, Tensor attn_mask, " + _SDPA_PARAMS
    + ") -> (Tensor, Tensor)",
    "safe_sdpa_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor lse, " + _SDPA_PARAMS + ") -> (Tensor, Tensor, Tensor)",
    "safe_sdpa_backward.masked(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor attn_mask, Tensor out, Tensor lse, " + _SDPA_PARAMS + ") -> (Tensor, Tensor, Tensor)",
    "tensor_stats_(Tensor x, Tensor(a!) counts, Tensor(b!) values, int slot) -> ()",
)

#: overload name ("safe_sdpa.masked") -> its composite kernel
KERNELS: dict = {}
for _stem in ("layernorm", "grad_guard", "attention", "tensor_stats"):
    KERNELS.update(importlib.import_module(f"{__name__}.{_stem}").KERNELS)

#: whether autocast is on for any device type (one C call; the per-device
#: test below only when it is)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _without_autocast(fn):
    """``fn`` run with autocast off on every device type of its tensor arguments."""

    @functools.wraps(fn)
    def run(*args):
        if not _any_autocast():
            return fn(*args)
        devices = set()
        for a in args:
            # a list's tensors share one device (the ops that take one refuse
            # a mix), so its first tells
            for t in a[:1] if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    devices.add(t.device.type)
        with contextlib.ExitStack() as stack:
            for d in devices:
                if torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d):
                    stack.enter_context(torch.autocast(d, enabled=False))
            return fn(*args)

    return run


_libs: list = []  # the registrations must live as long as the process
_defined = False


def register(define: bool) -> None:
    """Register every composite kernel (once); with ``define``, first define
    the schemas (the core library is not loaded)."""
    global _defined
    if _libs:
        return
    if define:
        lib = torch.library.Library("nanguard", "DEF")
        _libs.append(lib)
        for schema in SCHEMAS:
            lib.define(schema)
        _defined = True
    lib = torch.library.Library("nanguard", "IMPL")
    _libs.append(lib)
    for name, fn in KERNELS.items():
        lib.impl(name, _without_autocast(fn), "CompositeExplicitAutograd")


def schemas_defined_here() -> bool:
    """Whether the schemas come from this module (no core library)."""
    return _defined


#: the device types ``nanguard.info()`` reports, with their dispatch keys
DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU", "privateuseone": "PrivateUse1"}


def path(op: str, device_type: str) -> str:
    """``"kernel"`` (a C kernel of nanguard's), ``"composite"`` or ``"none"``
    for ``op`` (``"nanguard::safe_sdpa.masked"``) on ``device_type``."""
    key = DEVICE_KEYS.get(device_type, device_type)
    if torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
        # a direct registration: the C library's, unless the schemas are ours
        return "composite" if _defined else "kernel"
    if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd"):
        return "composite"
    return "none"
