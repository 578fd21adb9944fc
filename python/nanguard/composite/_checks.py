"""Argument checks shared by the composite kernels.

The C kernels validate every argument again behind the Python wrappers, so
that a direct call of an op (not through the wrappers) can never crash or give a silently
wrong answer; the composite kernels keep that promise with the same
messages, raised as ``RuntimeError`` (what a failing C check raises).
"""

from __future__ import annotations

from typing import Callable, Union

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: float32's largest value, and the largest positive number it rounds to 0
#: (half its smallest subnormal: a tie, to even)
FLT_MAX = float(torch.finfo(torch.float32).max)
FP32_ZERO = 2.0**-150

#: device types where a value is read on the host without waiting for a
#: device queue: the composite kernels' shortcuts that read one (the guard's
#: CPU road, the mask's key trimming, LayerNorm's fused-kernel row check) are
#: taken there only, and every other device takes the road that reads nothing
READ_FREE = frozenset({"cpu"})


def read_free(device: torch.device) -> bool:
    """Whether reading a value of a tensor on ``device`` costs no wait
    (READ_FREE, looked up at each call)."""
    return device.type in READ_FREE


def check(cond: bool, op: str, msg: Union[str, Callable[[], str]]) -> None:
    """Raise ``op: msg`` unless cond; a message with values in it is passed
    as a function, so that a passing check formats nothing."""
    if not cond:
        raise RuntimeError(f"{op}: {msg() if callable(msg) else msg}")


def dtype_name(dtype: torch.dtype) -> str:
    """``float16``, as the C kernels' messages spell a dtype."""
    return str(dtype).removeprefix("torch.")


def check_device_dtype(op: str, name: str, t: torch.Tensor) -> None:
    """A floating tensor nanguard takes (any device: the composite path has
    no device of its own)."""
    check(
        t.dtype in FLOAT_DTYPES,
        op,
        lambda: f"{name} must be float16, bfloat16, float32 or float64 (got {dtype_name(t.dtype)})",
    )


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation and statistics dtype: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32
