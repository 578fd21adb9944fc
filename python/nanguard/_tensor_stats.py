"""Non-finite census of a tensor: the Python face of
``torch.ops.nanguard.tensor_stats_``.

One pass over a tensor of any floating dtype and layout gives its NaN,
+Inf and -Inf counts (exact) and, over its finite values, ``max |x|`` and the
smallest non-zero ``|x|`` (to see underflow coming). The op writes them into
one slot of a preallocated pair of buffers on the tensor's device, with no
host synchronisation and no allocation, so a watcher can record thousands of
tensors per step and read them all with one copy:

* ``counts``: int64 ``[slots, 3]``: NaN, +Inf, -Inf
* ``values``: float64 ``[slots, 2]``: max |x| over finite values (0 when there
  is none), min non-zero |x| over finite values (+inf when there is none)

Both magnitudes are exact (float64 holds every fp16 / bf16 / fp32 value), and
the result does not depend on thread count or launch configuration.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from . import _checks

__all__ = ["tensor_stats", "tensor_stats_", "new_stats_buffers", "COUNT_FIELDS", "VALUE_FIELDS"]

COUNT_FIELDS = ("nan", "posinf", "neginf")
VALUE_FIELDS = ("max_abs", "min_nonzero_abs")

_op = torch.ops.nanguard.tensor_stats_.default


@torch.library.register_fake("nanguard::tensor_stats_")
def _fake(x, counts, values, slot):
    _checks.fake_same_device("nanguard::tensor_stats_", "x", x, ("counts", counts), ("values", values))
    return None


# counts and values are written in place: version counters and the leaf check
_checks.register_inplace("nanguard::tensor_stats_", {1: "counts", 2: "values"})


def new_stats_buffers(slots: int, device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """A zeroed ``(counts, values)`` pair with ``slots`` rows on ``device``."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    counts = torch.zeros((slots, len(COUNT_FIELDS)), dtype=torch.int64, device=device)
    values = torch.zeros((slots, len(VALUE_FIELDS)), dtype=torch.float64, device=device)
    return counts, values


def _check_x(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{name} is on {x.device}; nanguard supports cpu and cuda tensors")


def tensor_stats_(x: torch.Tensor, counts: torch.Tensor, values: torch.Tensor, slot: int) -> None:
    """Write the census of ``x`` into row ``slot`` of ``counts`` / ``values``
    (layout in the module docstring; :func:`new_stats_buffers` makes them).
    Asynchronous on CUDA; never allocates."""
    _check_x("x", x)
    for name, buf, dtype, width in (("counts", counts, torch.int64, 3),
                                    ("values", values, torch.float64, 2)):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dtype != dtype or buf.dim() != 2 or buf.shape[1] != width or not buf.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape [slots, {width}], got "
                f"{buf.dtype} {tuple(buf.shape)}"
            )
        _checks.check_same_device(name, buf, "x", x)
    if counts.shape[0] != values.shape[0]:
        raise ValueError(f"counts has {counts.shape[0]} slots but values has {values.shape[0]}")
    if isinstance(slot, bool) or not isinstance(slot, int):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    if not 0 <= slot < counts.shape[0]:
        raise ValueError(f"slot {slot} is out of range for a buffer of {counts.shape[0]} slots")
    with torch.no_grad():
        _op(x.detach(), counts, values, slot)


def tensor_stats(x: torch.Tensor) -> Dict[str, float]:
    """The census of one tensor as a dict (synchronises: for interactive use;
    :func:`nanguard.watch` records many tensors and reads them once)."""
    _check_x("x", x)
    if x.device.type == "meta":
        raise ValueError("x is on meta: a meta tensor has no values to count")
    counts, values = new_stats_buffers(1, x.device)
    tensor_stats_(x, counts, values, 0)
    c = counts[0].tolist()
    v = values[0].tolist()
    out: Dict[str, float] = dict(zip(COUNT_FIELDS, (int(k) for k in c)))
    out.update(zip(VALUE_FIELDS, v))
    out["numel"] = x.numel()
    return out
