"""``tensor_stats_`` in PyTorch operations.

The composite path of ops/tensor_stats.c and kernels/tensor_stats.c, with
their arithmetic (kernels/tensor_stats_math.h). Row ``slot`` of the buffers
is overwritten, nothing else is touched:

    counts[slot] = NaN, +Inf, -Inf                               (int64, exact)
    values[slot] = max |x| over finite x (0 when none),
                   min |x| over finite non-zero x (+inf when none)   (float64)

As in the C, everything is decided on the IEEE bit patterns, never on
converted values: with ``a = bits & ~sign`` and ``E`` the dtype's exponent
mask, NaN is ``a > E``, Inf is ``a == E``, finite is ``a < E``, and for finite
values ``|x|`` orders as ``a`` does, so the two magnitudes are an integer max
and min (exact, independent of the reduction order, and unaffected by a
device that flushes subnormals in float arithmetic). The winning magnitude
bits are reinterpreted in the dtype and widened to float64, which holds them
exactly. Any layout is read as it is (an expanded view counts an element
once per position, as the C does). Nothing is read back to the host.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check, dtype_name

_OP = "nanguard::tensor_stats_"

# buffer layout (NG_TS_* in kernels/tensor_stats_math.h)
NCOUNTS, NVALUES = 3, 2

#: dtype -> (integer dtype of its width, exponent mask E); the sign is the top bit
_BITS = {
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def _check_args(x, counts, values, slot) -> None:
    for name, t, floating in (("x", x, True), ("counts", counts, False), ("values", values, True)):
        check(t.layout == torch.strided, _OP, lambda: f"{name} must be a strided (dense) tensor")
        check(
            not floating or t.dtype in FLOAT_DTYPES,
            _OP,
            lambda: f"{name} must be float16, bfloat16, float32 or float64 (got {dtype_name(t.dtype)})",
        )
    for name, t in (("values", values), ("counts", counts)):
        check(
            t.device == x.device,
            _OP,
            lambda: f"{name} is on {t.device} but x is on {x.device}; both must be on the same device",
        )
    check(
        values.dtype == torch.float64 and values.dim() == 2 and values.shape[1] == NVALUES
        and values.is_contiguous(),
        _OP,
        lambda: f"values must be a contiguous float64 tensor of shape [slots, {NVALUES}]",
    )
    check(
        counts.dtype == torch.int64 and counts.dim() == 2 and counts.shape[1] == NCOUNTS
        and counts.is_contiguous(),
        _OP,
        lambda: f"counts must be a contiguous int64 tensor of shape [slots, {NCOUNTS}]",
    )
    check(
        counts.shape[0] == values.shape[0],
        _OP,
        lambda: f"counts has {counts.shape[0]} slots but values has {values.shape[0]}; they must match",
    )
    check(
        0 <= slot < counts.shape[0],
        _OP,
        lambda: f"slot {slot} is out of range for a buffer of {counts.shape[0]} slots",
    )


def tensor_stats_(x, counts, values, slot):
    _check_args(x, counts, values, slot)
    if x.numel() == 0:
        counts[slot].zero_()
        values[slot, 0] = 0.0
        values[slot, 1] = float("inf")
        return
    int_dtype, e = _BITS[x.dtype]
    bits = x.view(int_dtype)
    # |x| as bits; the mask fits the signed type, so a >= 0
    a = bits & torch.iinfo(int_dtype).max
    is_inf = a == e
    finite = a < e
    nan = (a > e).sum()
    pinf = (is_inf & (bits >= 0)).sum()
    ninf = (is_inf & (bits < 0)).sum()
    max_bits = torch.where(finite, a, 0).amax()
    # E stands for "none": no finite magnitude reaches it, and as a float it is +inf
    min_bits = torch.where(finite & (a != 0), a, e).amin()
    max_abs = max_bits.view(x.dtype).to(torch.float64)
    min_abs = min_bits.view(x.dtype).to(torch.float64)
    counts[slot].copy_(torch.stack((nan, pinf, ninf)))
    values[slot].copy_(torch.stack((max_abs, min_abs)))


KERNELS = {"tensor_stats_": tensor_stats_}
