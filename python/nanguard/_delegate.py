"""When ``safe_sdpa`` may hand a call to one of PyTorch's fused attention
kernels, and the call itself.

A fused kernel is used only where its result is, by construction, the one
nanguard's own kernel defines (docs/attention.md, "Delegation to PyTorch's
fused kernels", gives the reason of every row with the PyTorch source it
rests on):

- scores, running max and sum in fp32 (fp64 for fp64): true of PyTorch's
  CPU flash kernel (``at::opmath_type`` accumulators) and of the CUDA flash
  and memory-efficient kernels (fp32 tensor-core accumulators);
- no fully masked row can exist: no ``attn_mask`` (whether a mask masks a
  whole row is data, known only by reading it), at least one key, and
  causal masking aligned top-left as nanguard's (row ``i`` always sees key
  0);
- nothing nanguard computes and the kernel does not: no ``max_score`` /
  ``softcap``, no dropout (nanguard's Philox mask is the same on the CPU and
  CUDA; a fused kernel draws its own);
- no finite input whose finite result the kernel could turn into inf: no
  float16 backward (the fused backwards round the score gradient dS to the
  input dtype; nanguard rescales it).

The call is the fused op's Python face (``torch.ops.aten.*``), under
PyTorch's own autograd formula: its backward consumes its own ``logsumexp``,
which is the quantity nanguard's ``lse`` is (natural-log sum of exp of the
scaled scores, fp32, ``[B, H, L]``), and ``torch.compile`` / inductor know
these ops.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from . import distributed as _dist

__all__ = ["BACKENDS", "choose", "fused_forward", "fused_attention"]

#: the values of ``safe_sdpa(backend=...)``
BACKENDS = ("auto", "nanguard", "fused", "fused-if-allowed")

#: ``auto`` delegates on a device type only where the fused kernel was
#: measured faster than nanguard's there. CPU: PyTorch's CPU flash kernel is
#: slower than nanguard's AVX-512 / AVX2 kernels (docs/attention.md,
#: "Measured"). CUDA: flash / memory-efficient are FlashAttention-2 class.
PREFER_FUSED = {"cpu": False, "cuda": True}

_ENV = "NANGUARD_SDPA_BACKEND"


def _default_from_env() -> str:
    value = os.environ.get(_ENV, "auto").strip() or "auto"
    if value not in ("auto", "nanguard", "fused-if-allowed"):
        raise ValueError(
            f"{_ENV}={value!r}: expected 'auto', 'nanguard' or 'fused-if-allowed' (the strict "
            "'fused' is a per-call choice: safe_sdpa(..., backend='fused'))"
        )
    return value


#: the backend of a ``safe_sdpa`` call that passes ``backend=None``
DEFAULT = _default_from_env()

#: how many calls took each fused kernel (eager calls only; for the test
#: suite's summary of a run with delegation on)
counts = {"cpu_flash": 0, "flash": 0, "efficient": 0}


def check_backend(backend) -> str:
    if backend is None:
        return DEFAULT
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or None, got {backend!r}")
    return backend


# ---- the table -------------------------------------------------------------------
#
# Each condition is (argument it is about, test, reason). The test takes the
# call's facts (a dict) and returns True where the fused kernel is exactly
# safe_sdpa. A forced backend="fused" that fails one raises ValueError naming
# the argument and the reason.


def _facts(q, k, v, attn_mask, dropout_p, is_causal, scale, max_score, softcap):
    dev = q.device.type
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return {
        "device": dev, "dtype": q.dtype, "grad": grad,
        "B": q.shape[0], "Hq": q.shape[1], "Hkv": k.shape[1], "L": q.shape[2], "S": k.shape[2],
        "E": q.shape[3], "Ev": v.shape[3], "mask": attn_mask is not None, "dropout_p": dropout_p,
        "is_causal": is_causal, "scale": scale, "max_score": max_score, "softcap": softcap,
        "dtensor": _dist.any_dtensor((q, k, v)),
    }


_COMMON = (
    ("query", lambda f: f["device"] in ("cpu", "cuda"), "fused kernels exist for cpu and cuda tensors only"),
    ("query", lambda f: not f["dtensor"], "DTensor inputs keep nanguard's op and its sharding strategies"),
    ("attn_mask", lambda f: not f["mask"],
     "a mask may mask every key of a row, which only reading it would tell (a host sync, a graph "
     "break); PyTorch's CPU flash kernel gives such a row lse 0 instead of -inf, CUDA flash takes no "
     "mask, and finfo.min is 'masked' to nanguard but an ordinary number to PyTorch"),
    ("key", lambda f: f["L"] > 0 and f["S"] > 0 and f["B"] > 0 and f["Hq"] > 0,
     "no keys (S = 0) makes every row fully masked; PyTorch's CPU flash kernel divides by its key "
     "block size, which is 0 then (SIGFPE for L = 0 or S = 0)"),
    ("max_score", lambda f: f["max_score"] == 0.0, "no fused kernel clamps the scores"),
    ("softcap", lambda f: f["softcap"] == 0.0, "PyTorch's fused ops take no soft-cap"),
    ("dropout_p", lambda f: f["dropout_p"] == 0.0,
     "a fused kernel draws its own dropout mask, not nanguard's Philox [seed, offset] stream: CPU "
     "and CUDA would no longer drop the same elements, so dropout is not delegated"),
    ("value", lambda f: f["E"] == f["Ev"],
     "the fused kernels need one head dim for query, key and value"),
    ("query", lambda f: not (f["dtype"] == torch.float16 and f["grad"]),
     "float16 with gradients: the fused backwards round the score gradient dS to float16 before "
     "the dq / dk products, so |dS| > 65504 becomes inf where nanguard rescales it"),
)

_CPU = (
    ("query", lambda f: f["dtype"] in (torch.float32, torch.float64, torch.bfloat16, torch.float16),
     "the CPU flash kernel's dtypes"),
    ("key", lambda f: f["S"] >= 64,
     "the CPU flash kernel takes a row's max over a key block as vector maxima (which propagate "
     "NaN) plus a scalar tail through std::max (which drops it), and zeroes a row whose max is "
     "-inf as fully masked: with fewer keys than one vector (16 floats on AVX-512, up to 64 on "
     "SVE) a row of NaN scores came out 0, the NaN hidden; 64 keys fill a vector on every ISA"),
)


def _cuda_cc(device) -> Tuple[int, int]:
    p = torch.cuda.get_device_properties(device)
    return p.major, p.minor


_CUDA_COMMON = (
    ("scale", lambda f: f["scale"] > 0.0,
     "FlashAttention-2 takes a row's running max over the unscaled scores and scales it after "
     "(softmax.h): with scale <= 0 that is not the max of the scaled scores and exp can overflow"),
)

_FLASH = (
    ("query", lambda f: f["dtype"] in (torch.float16, torch.bfloat16), "flash runs float16 / bfloat16"),
    ("query", lambda f: f["E"] % 8 == 0 and f["E"] <= 256, "flash head dims: multiples of 8 up to 256"),
    ("is_causal", lambda f: not f["is_causal"] or f["L"] == f["S"],
     "FlashAttention-2 aligns a causal mask bottom-right when L != S (PyTorch refuses it, "
     "check_flash_causal_non_square_seqlens); nanguard aligns it top-left"),
    ("query", lambda f: f["Hq"] % f["Hkv"] == 0, "grouped-query heads"),
    ("query", lambda f: (8, 0) <= f["cc"] <= (9, 0)
     and not (f["cc"] > (8, 0) and f["grad"] and f["E"] > 192),
     "flash on sm80 - sm90 (sm86 / sm89 train only head dims <= 192)"),
)

_EFFICIENT = (
    ("query", lambda f: f["dtype"] in (torch.float32, torch.float16, torch.bfloat16),
     "memory-efficient runs float32 / float16 / bfloat16"),
    ("query", lambda f: f["E"] % (4 if f["dtype"] == torch.float32 else 8) == 0,
     "memory-efficient head dims: multiples of 8 (4 for float32)"),
    ("query", lambda f: f["cc"] >= (5, 0), "memory-efficient on sm50 and newer"),
)


def _failures(rows, f) -> List[Tuple[str, str]]:
    return [(arg, why) for arg, test, why in rows if not test(f)]


def choose(q, k, v, attn_mask, dropout_p, is_causal, scale, max_score, softcap, backend,
           device_type: Optional[str] = None) -> Optional[str]:
    """The fused kernel to run (``"cpu_flash"``, ``"flash"``, ``"efficient"``)
    or None for nanguard's own. ``q``, ``k``, ``v`` are safe_sdpa's 4-d
    ``[B, H, L, E]`` views; ``max_score`` / ``softcap`` 0.0 means off;
    ``device_type`` is ``q.device.type`` where the caller has it.
    ``backend="fused"`` raises ValueError naming the first argument that
    rules the fused kernels out."""
    if device_type is None:
        device_type = q.device.type
    if backend == "nanguard" or (backend == "auto" and not PREFER_FUSED.get(device_type, False)):
        return None  # decided by the device alone: no facts gathered on this per-call path
    f = _facts(q, k, v, attn_mask, dropout_p, is_causal, scale, max_score, softcap)
    fails = _failures(_COMMON, f)
    kernel = None
    if not fails and f["device"] == "cpu":
        fails = _failures(_CPU, f)
        kernel = "cpu_flash"
    elif not fails:
        f["cc"] = _cuda_cc(q.device)
        fails = _failures(_CUDA_COMMON, f)
        if not fails:
            flash, eff = _failures(_FLASH, f), _failures(_EFFICIENT, f)
            kernel = "flash" if not flash else "efficient" if not eff else None
            fails = [] if kernel else flash[:1] + eff[:1]
    if fails:
        if backend == "fused":
            arg, why = fails[0]
            more = "".join(f"; {a}: {w}" for a, w in fails[1:])
            raise ValueError(
                f"backend='fused' cannot run this call exactly as nanguard's kernel would ({arg}: "
                f"{why}{more}); pass backend='auto' to fall back to nanguard's kernel"
            )
        return None
    return kernel


# ---- the call ----------------------------------------------------------------------


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * group, S, D], query head h reading kv
    head h // group (a stride-0 view when Hkv = 1)."""
    if group == 1:
        return t
    B, H, S, D = t.shape
    if H == 1:
        return t.expand(B, group, S, D)
    return t.repeat_interleave(group, dim=1)


def fused_forward(kernel: str, q, k, v, is_causal: bool, scale: float):
    """(out, lse) of the fused kernel, lse as nanguard's ops return it:
    ``[B, Hq, L]``, the natural-log sum of exp of the scaled scores, fp32
    (fp64 for fp64 inputs). ``k`` / ``v`` may have fewer heads than ``q``
    (a divisor). Differentiable in out through PyTorch's own formulas."""
    group = q.shape[1] // k.shape[1]
    aten = torch.ops.aten
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kernel == "cpu_flash":
        # The CPU kernel indexes key heads by the query head (older releases
        # have no grouped-query path): repeat kv heads for it. Its GEMMs need
        # a unit stride in the head dim.
        k, v = (_repeat_kv(t if t.stride(-1) == 1 else t.contiguous(), group) for t in (k, v))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse
    if kernel == "flash":  # grouped-query heads natively
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return res[0], res[1]
    if kernel == "efficient":
        q = q.contiguous()
        k, v = (_repeat_kv(t, group).contiguous() for t in (k, v))
        res = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
        return res[0], res[1][..., : q.shape[2]]  # lse rows are padded to a multiple of 32
    raise ValueError(f"unknown fused kernel {kernel!r}")


def fused_attention(kernel: str, q, k, v, is_causal: bool, scale: float) -> torch.Tensor:
    """safe_sdpa's output through the fused kernel."""
    if not torch.compiler.is_compiling():
        counts[kernel] += 1
    return fused_forward(kernel, q, k, v, is_causal, scale)[0]
