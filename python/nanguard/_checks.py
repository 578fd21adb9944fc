"""Argument checks shared by the Python wrappers.

They raise TypeError / ValueError naming the argument before any kernel runs;
the C layer checks again so that a direct ``torch.ops.nanguard`` call can
never crash the process.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, float_only: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if float_only and t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
        )
    if t.device.type == "cuda" and t.dtype == torch.float64:
        raise TypeError(f"{name}: float64 is supported on the CPU only")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{name} is on {t.device}; nanguard supports cpu and cuda tensors")


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_eps(name: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not (eps >= 0.0) or eps == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {eps}")
    return eps
