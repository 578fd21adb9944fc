"""``nanguard.info()``: what is loaded, where each op runs and, on the CPU,
which code path (instruction set) each op's kernel takes on this machine."""

from __future__ import annotations

import ctypes
import os
import platform

import torch

from . import _lib
from ._version import __version__

#: CPU flags (as /proc/cpuinfo spells them) that decide a kernel path or
#: PyTorch's own: the x86 SIMD widths, and half-precision arithmetic.
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16",
)

#: The kernel family (a key of the C library's ng_cpu_info) behind each op.
_FAMILY_PREFIXES = (
    ("safe_sdpa", "attention"),
    ("stable_layernorm", "layernorm"),
    ("grad_guard_", "grad_guard"),
    ("fused_unscale_clip_", "grad_guard"),
    ("tensor_stats", "tensor_stats"),
)

_DTYPES = ("f32", "bf16", "f16", "f64")


def _ops() -> list[str]:
    """Every ``nanguard::`` operator overload the dispatcher knows."""
    names = sorted(
        n for n in torch._C._dispatch_get_all_op_names() if n.startswith("nanguard::")
    )
    return names


def op_family(name: str) -> str | None:
    """``"nanguard::safe_sdpa.masked"`` -> ``"attention"`` (None if unknown)."""
    base = name.split("::", 1)[-1]
    for prefix, family in _FAMILY_PREFIXES:
        if base.startswith(prefix):
            return family
    return None


def cpu_model() -> dict:
    """The CPU's model name and which of ISA_FLAGS it has (Linux:
    /proc/cpuinfo; elsewhere the model from platform and no flags)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = set(val.split())
                if model and flags:
                    break
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": [f for f in ISA_FLAGS if f in flags],
    }


def cpu_paths() -> dict:
    """What the loaded core library reports of its CPU code paths:
    ``supported``, ``active`` (instruction set in use), ``requested``
    (NANGUARD_CPU_ISA), ``capped`` (active is narrower than supported) and
    ``paths`` {family: {dtype: text}}. A library too old to export
    ng_cpu_info gives the instruction set only (ng_cpu_isa_*), or
    ``{"error": ...}``."""
    path = _lib.loaded().get("libnanguard.so")
    if not path:
        return {"error": "libnanguard.so not loaded"}
    lib = ctypes.CDLL(path)
    out: dict = {"paths": {}}
    try:
        fn = lib.ng_cpu_info
        fn.restype = ctypes.c_char_p
        text = fn().decode()
    except AttributeError:  # an older build: the instruction set only
        try:
            lib.ng_cpu_isa_name.restype = ctypes.c_char_p
            lib.ng_cpu_isa_name.argtypes = [ctypes.c_int]
            out["supported"] = lib.ng_cpu_isa_name(lib.ng_cpu_isa_supported()).decode()
            out["active"] = lib.ng_cpu_isa_name(lib.ng_cpu_isa_active()).decode()
        except AttributeError:
            return {"error": f"{path} reports no CPU path (no ng_cpu_info)"}
        text = "requested=" + os.environ.get("NANGUARD_CPU_ISA", "")
    for line in text.splitlines():
        key, _, val = line.partition("=")
        if "." in key:
            family, dtype = key.split(".", 1)
            out["paths"].setdefault(family, {})[dtype] = val
        elif key:
            out[key] = val
    # the x86 paths are ordered; aarch64 has baseline and neon
    order = ("baseline", "neon") if out.get("supported") == "neon" else ("baseline", "avx2", "avx512")
    if out.get("active") in order and out.get("supported") in order:
        out["capped"] = order.index(out["active"]) < order.index(out["supported"])
    return out


def _path_summary(paths: dict) -> str:
    """{dtype: text} -> "f32 avx512; bf16, f16 avx512, widened ...; f64 avx2",
    dtypes with the same text grouped."""
    groups: dict[str, list[str]] = {}
    for dt in _DTYPES:
        if dt in paths:
            groups.setdefault(paths[dt], []).append(dt)
    return "; ".join(f"{', '.join(dts)} {text}" for text, dts in groups.items())


def info(as_dict: bool = False):
    """Print (or return, with ``as_dict=True``) versions, loaded libraries,
    the CPU (model, ISA flags, the kernels' code path) and, for each op, the
    devices it has kernels for and its CPU path."""
    from . import composite

    op_paths = {name: {dev: composite.path(name, dev) for dev in composite.DEVICE_KEYS} for name in _ops()}
    ops = {name: [dev for dev, p in paths.items() if p == "kernel"] for name, paths in op_paths.items()}

    cpu = {**cpu_model(), **cpu_paths()}
    op_cpu_paths = {}
    for name, devs in ops.items():
        fam = op_family(name)
        if "cpu" in devs and fam in cpu.get("paths", {}):
            op_cpu_paths[name] = cpu["paths"][fam]
    d = {
        "nanguard": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "min_torch": "%d.%d" % _lib.MIN_TORCH,
        "libraries": _lib.loaded(),
        "library_errors": _lib.errors(),
        "cpu": cpu,
        "ops": ops,
        "op_paths": op_paths,
        "composite_reason": _lib.composite_only(),
        "op_cpu_paths": op_cpu_paths,
    }
    if as_dict:
        return d
    print(f"nanguard {d['nanguard']}  (torch {d['torch']}, needs >= {d['min_torch']})")
    print(f"CUDA: torch built with {d['torch_cuda'] or 'none'}, available: {d['cuda_available']}")
    for lib, path in d["libraries"].items():
        print(f"loaded {lib}: {path}")
    for lib, err in d["library_errors"].items():
        print(f"not loaded {lib}: {err}")
    if d["composite_reason"]:
        print(f"no C library ({d['composite_reason']}): every op on every device runs its composite path")
    print(f"CPU: {cpu['model']}; flags: {' '.join(cpu['flags']) or '-'}")
    if "error" in cpu:
        print(f"CPU kernels: unknown ({cpu['error']})")
    else:
        why = "the widest this CPU supports"
        if cpu.get("capped"):
            by = f"NANGUARD_CPU_ISA={cpu['requested']}" if cpu.get("requested") else "ng_cpu_isa_set"
            why = f"capped by {by}; this CPU supports {cpu.get('supported')}"
        print(f"CPU kernels: {cpu.get('active')} ({why})")
    print("ops (kernel: nanguard's C kernel; composite: PyTorch operations, the same numerics):")
    width = max((len(n) for n in ops), default=0)
    for name, paths in op_paths.items():
        groups: dict[str, list[str]] = {}
        for dev, p in paths.items():
            groups.setdefault(p, []).append(dev)
        where = "; ".join(f"{p} on {', '.join(devs)}" for p, devs in groups.items())
        path = op_cpu_paths.get(name)
        tail = f"  [cpu: {_path_summary(path)}]" if path else ""
        print(f"  {name:<{width}}  {where}{tail}")
    return None
