"""NaN-safe scaled dot-product attention: the Python face of
``torch.ops.nanguard.safe_sdpa``.

``safe_sdpa`` takes the arguments of ``torch.nn.functional.scaled_dot_product_attention``
and computes the same thing flash-style (the ``[L, S]`` score matrix is never
stored), with scores, running max and sum in fp32 (fp64 for fp64 inputs). It
cannot create a NaN from finite inputs:

- a query row whose every key is masked (bool ``False``, ``-inf``, or the
  dtype's lowest finite value as Hugging Face writes it) gives output 0 and
  zero gradients;
- fp16 scores that would overflow 65504 are never formed in fp16;
- optional guards: ``max_score`` clamps the scaled scores to ``±max_score``,
  ``softcap`` applies ``softcap * tanh(s / softcap)`` (Gemma-2), each with its
  true gradient.

A NaN or Inf in ``query``, ``key`` or ``value`` still reaches the outputs it
affects: nothing real is hidden.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import nn

from . import _checks, _lib
from . import _delegate
from . import distributed as _dist
from .composite._checks import FLT_MAX, FP32_ZERO, dtype_name

__all__ = ["safe_sdpa", "SafeAttention"]

_ops = torch.ops.nanguard

_MAX_HEAD_DIM = _lib.attention_max_head_dim()  # NG_ATTN_MAX_HEAD_DIM, kernels/attention.h


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# The four overloads, and each forward's backward. Every argument is read by
# its schema name (ops/ops.h, NG_ATTENTION_SCHEMAS): nothing below restates
# an argument list by position.
_FORWARDS = (_ops.safe_sdpa.default, _ops.safe_sdpa.masked)
_BACKWARD = {
    _ops.safe_sdpa.default: _ops.safe_sdpa_backward.default,
    _ops.safe_sdpa.masked: _ops.safe_sdpa_backward.masked,
}


# ---- fake (meta) kernels ----------------------------------------------------


def _fake_out(query, value):
    B, H, L, _ = query.shape
    out = query.new_empty((B, H, L, value.shape[-1]))
    lse = query.new_empty((B, H, L), dtype=_lse_dtype(query.dtype))
    return out, lse


def _fake_grads(query, key, value):
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(value, memory_format=torch.contiguous_format),
    )


def _make_fake(op, backward: bool):
    """Shapes, dtypes and device checks of one overload: every Tensor
    argument on query's device, rng on the host."""

    def fake(*args):
        a = _checks.bind(op, args)
        query = a["query"]
        named = [(n, a[n]) for n in _checks.tensor_arg_names(op) if n not in ("query", "rng")]
        _checks.fake_same_device(op._schema.name, "query", query, *named)
        _checks.fake_host_tensor(op._schema.name, "rng", a["rng"], "query", query)
        if backward:
            return _fake_grads(query, a["key"], a["value"])
        return _fake_out(query, a["value"])

    return fake


for _fwd, _bwd in _BACKWARD.items():
    torch.library.register_fake(_fwd)(_make_fake(_fwd, False))
    torch.library.register_fake(_bwd)(_make_fake(_bwd, True))


# ---- autograd ---------------------------------------------------------------


def _make_setup(op):
    tensors = _checks.tensor_arg_names(op)

    def setup_context(ctx, inputs, output):
        a = _checks.bind(op, inputs)
        mask = a.get("attn_mask")
        if mask is not None and mask.requires_grad:
            raise RuntimeError(
                "nanguard.safe_sdpa: attn_mask requires grad; gradients with respect to an "
                "attention mask are not supported (pass attn_mask.detach())"
            )
        out, lse = output
        # lse is the softmax's normaliser, an output for the backward only:
        # marked so, it does not claim a gradient it would never get.
        ctx.mark_non_differentiable(lse)
        # Every tensor argument is saved (rng too: the backward regenerates
        # the forward's dropout mask from the same [seed, offset] values),
        # then out and lse; the scalars are kept by name.
        ctx.save_for_backward(*(a[n] for n in tensors), out, lse)
        ctx.scalars = {n: v for n, v in a.items() if n not in tensors}

    return setup_context


def _make_backward(op):
    tensors = _checks.tensor_arg_names(op)
    bwd = _BACKWARD[op]

    def backward(ctx, grad_out, _grad_lse):
        values = dict(zip(tensors + ("out", "lse"), ctx.saved_tensors), **ctx.scalars)
        values["grad_out"] = grad_out.contiguous()
        dq, dk, dv = _checks.call_op(bwd, *_checks.call_args(bwd, values))
        return _checks.per_arg(op, {"query": dq, "key": dk, "value": dv})

    return backward


for _fwd in _FORWARDS:
    _checks.register_autograd(_fwd, _make_backward(_fwd), setup_context=_make_setup(_fwd))


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "nanguard.safe_sdpa: double backward (gradients of gradients, e.g. autograd.grad with "
        "create_graph=True then backward) is not supported, as in FlashAttention. "
        "nanguard.functional.layer_norm and rms_norm (nanguard.nn.StableLayerNorm, "
        "StableRMSNorm) do support it; for attention use "
        "torch.nn.functional.scaled_dot_product_attention where it is needed"
    )


for _bwd in _BACKWARD.values():
    torch.library.register_autograd(_bwd, _no_double_backward)


# ---- DTensor ----------------------------------------------------------------------


def _make_sharding(op):
    """safe_sdpa's DTensor strategies for one overload and mesh dimension:
    replicated; sharded on batch (dim 0); sharded on heads (dim 1) when query
    and key/value heads divide by the mesh size (a single key/value head
    stays replicated, its gradient Partial). The mask follows query where its
    dim is full-size, and is replicated where it broadcasts."""
    backward = op in _BACKWARD.values()

    def strategies(*args, **kwargs):
        from torch.distributed.tensor import Partial, Replicate, Shard

        a = _checks.bind(op, args, kwargs)
        q, k, mask = a["query"], a["key"], a.get("attn_mask")
        B, Hq, Hkv, n = q.shape[0], q.shape[1], k.shape[1], q.mesh.size()
        R = Replicate()

        def build(qp, kvp, maskp, outp, lsep, dkvp):
            ins = {"query": qp, "key": kvp, "value": kvp, "attn_mask": maskp, "grad_out": qp,
                   "out": outp, "lse": lsep, "rng": R}
            outs = [qp, dkvp, dkvp] if backward else [outp, lsep]
            return outs, _checks.tensor_placements(op, ins)

        res = [build(R, R, R, R, R, R)]
        mb = mask is not None and mask.shape[0] == B and B > 1
        res.append(build(Shard(0), Shard(0), Shard(0) if mb else R, Shard(0), Shard(0), Shard(0)))
        if Hq % n == 0 and (Hkv == 1 or Hkv % n == 0):
            kvp = R if Hkv == 1 else Shard(1)
            dkvp = Partial() if Hkv == 1 else Shard(1)
            mh = mask is not None and mask.shape[1] == Hq and Hq > 1
            res.append(build(Shard(1), kvp, Shard(1) if mh else R, Shard(1), Shard(1), dkvp))
        return res

    return strategies


for _fwd, _bwd in _BACKWARD.items():
    _dist.sharding_strategy(_fwd, _make_sharding(_fwd))
    _dist.sharding_strategy(_bwd, _make_sharding(_bwd))


def _dtensor_args(query, key, value, attn_mask, dropout_p, rng):
    """For DTensor attention inputs: register the strategies and make the
    mask and the dropout seed replicated DTensors on query's mesh (they are
    the same on every rank). Dropout is refused: the same seed on every
    shard would drop the same pattern in every shard, which is not the
    unsharded computation."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, DTensor):
            raise TypeError(f"query is a DTensor but {name} is not: pass DTensors on one mesh")
        if t.device_mesh != query.device_mesh:
            raise ValueError(f"{name} is on another device mesh than query")
    if dropout_p > 0.0:
        raise ValueError(
            "dropout_p > 0 is not supported with DTensor inputs (every shard would draw the same "
            "dropout mask); pass dropout_p=0.0, or call safe_sdpa on local tensors"
        )
    _dist.register_sharding_strategies()
    mesh = query.device_mesh
    rep = [Replicate()] * mesh.ndim
    rng = DTensor.from_local(rng, mesh, rep, run_check=False)
    if attn_mask is not None and not isinstance(attn_mask, DTensor):
        attn_mask = DTensor.from_local(attn_mask, mesh, rep, run_check=False)
    return attn_mask, rng


# ---- functional API ---------------------------------------------------------


def _check_guard(name: str, value) -> float:
    """None / off -> 0.0 (the ops' "off"); else a finite float > 0."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    value = float(value)
    if not (value > 0.0) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0 (or None for off), got {value}")
    return value


def _check_fp32_scalars(dtype: torch.dtype, scale: float, max_score: float, softcap: float) -> None:
    """fp16 / bf16 / fp32 inputs are scored in fp32: a scale or soft-cap past
    its largest value would be inf there (NaN scores), and a guard it rounds
    to 0 would be off."""
    name = dtype_name(dtype)
    if abs(float(scale)) > FLT_MAX:
        raise ValueError(f"scale must be at most {FLT_MAX:g} in magnitude for {name} inputs "
                         f"(their scores are float32), got {scale}")
    if softcap > FLT_MAX:
        raise ValueError(f"softcap must be at most {FLT_MAX:g} for {name} inputs "
                         f"(their scores are float32), got {softcap}")
    for arg, value in (("max_score", max_score), ("softcap", softcap)):
        if 0.0 < value <= FP32_ZERO:
            raise ValueError(f"{arg} {value} is 0 in float32 (the scores of {name} inputs), "
                             f"which would turn it off; pass None for off")


_NO_DROPOUT_RNG = torch.zeros(2, dtype=torch.int64, device="cpu")


def _draw_rng(dropout_p: float) -> torch.Tensor:
    """Dropout's Philox ``[seed, offset]`` as a CPU int64 tensor of 2 elements,
    drawn from PyTorch's default CPU generator, so ``torch.manual_seed`` makes
    dropout reproducible and CPU and CUDA draw the same mask for the same
    tensor. It stays a tensor (never ``.tolist()``): under ``torch.compile``
    the draw is an op of the graph, not a value the tracer would have to know.

    Without dropout the ops ignore its values, and an eager call passes one
    shared zeros pair (a new tensor per call cost a few microseconds); under
    ``torch.compile`` it is a new zeros tensor, an op of the graph, so that
    no real module-level tensor meets the tracer's fake ones."""
    if dropout_p == 0.0:
        if torch.compiler.is_compiling():
            return torch.zeros(2, dtype=torch.int64, device="cpu")
        return _NO_DROPOUT_RNG
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device="cpu")


def safe_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    max_score: Optional[float] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """NaN-safe ``torch.nn.functional.scaled_dot_product_attention``.

    Args mirror PyTorch's: ``query`` ``(..., L, E)``, ``key`` ``(..., S, E)``,
    ``value`` ``(..., S, Ev)`` with broadcastable leading dims; ``attn_mask``
    bool (True = attend) or float (added to the scores), broadcastable to
    ``(..., L, S)``; ``is_causal`` masks key ``j > i`` (top-left alignment, as
    PyTorch); ``scale`` (a float or a 0-d tensor) defaults to ``1/sqrt(E)``; ``enable_gqa`` lets
    ``query`` have a multiple of ``key``'s heads (dim -3). Unlike PyTorch,
    ``attn_mask`` and ``is_causal`` may be combined (both apply).

    Keyword-only guards, off by default: ``max_score`` clamps the scaled
    scores to ``±max_score``; ``softcap`` maps them through
    ``softcap * tanh(s / softcap)``. Both apply before the mask is added.

    Dropout (``dropout_p > 0``) draws a Philox ``[seed, offset]`` pair from
    PyTorch's default CPU generator as a 2-element int64 tensor, so
    ``torch.manual_seed`` makes it reproducible, CPU and CUDA drop the same
    elements for the same pair, and ``torch.compile(fullgraph=True)`` traces
    it without a graph break. ``dropout_p=1`` gives zeros (NaN where an
    input row is NaN), as PyTorch's does. Head dims up to 256 (PyTorch's has
    no such limit); float64 on the CPU only.

    Under autocast it gets the casts PyTorch's ``scaled_dot_product_attention``
    gets (lower precision on the CPU and CUDA): float16 / bfloat16 / float32
    ``query``, ``key``, ``value`` and float ``attn_mask`` become the autocast
    dtype, so the result has the dtype PyTorch's would have.

    ``backend`` (keyword-only) picks the kernel. ``"auto"``: one of
    PyTorch's fused kernels (CUDA flash / memory-efficient) where it has
    exactly these semantics (no mask, no guard, no dropout, top-left causal,
    at least one key, no float16 backward, ...: docs/attention.md lists
    every condition and its reason) and is the faster one on the device
    (CUDA), nanguard's own otherwise. ``"nanguard"``: always nanguard's.
    ``"fused"``: the fused kernel (PyTorch's CPU flash kernel on the CPU), or
    a ValueError naming the argument that rules it out.
    ``"fused-if-allowed"``: the fused kernel wherever the conditions hold, on
    every device. ``None`` (default): the ``NANGUARD_SDPA_BACKEND``
    environment variable at import (``auto`` unless set).
    """
    backend = _delegate.check_backend(backend)
    dev = _checks.device_type(query)
    if _checks.autocast_active("scaled_dot_product_attention", dev):
        dt = torch.get_autocast_dtype(dev)
        query, key, value, attn_mask = (_checks.autocast_to(t, dt) for t in (query, key, value, attn_mask))
    qs, ks, vs = _check_qkv(query, key, value)
    E, L, S, Ev = qs[-1], qs[-2], ks[-2], vs[-1]
    dropout_p, scale = _check_scalars(dropout_p, is_causal, scale, E)
    if dropout_p == 1.0:
        # Every weight dropped: PyTorch returns zeros (and zero gradients).
        # Computed as the undropped result times 0, so a NaN in the inputs
        # still reaches the output, as it does in PyTorch's.
        out = safe_sdpa(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
                        max_score=max_score, softcap=softcap, backend=backend)
        return out * 0.0
    max_score = _check_guard("max_score", max_score)
    softcap = _check_guard("softcap", softcap)
    if query.dtype != torch.float64:
        _check_fp32_scalars(query.dtype, scale, max_score, softcap)

    rng = _draw_rng(dropout_p)
    # (a plain tensor, the common case, is no DTensor: one type test)
    if type(query) is not torch.Tensor and _dist.is_dtensor(query):  # tensor / sequence parallel
        attn_mask, rng = _dtensor_args(query, key, value, attn_mask, dropout_p, rng)
    q4, k4, v4, batch, Hq = _to_4d(query, key, value, enable_gqa, qs, ks, vs)
    scale = float(scale)
    params = (dropout_p, is_causal, scale, max_score, softcap, rng)
    kernel = _delegate.choose(q4, k4, v4, attn_mask, dropout_p, is_causal, scale, max_score, softcap,
                              backend, dev)
    if kernel is not None:
        out = _delegate.fused_attention(kernel, q4, k4, v4, is_causal, scale)
    elif attn_mask is None:
        out, _ = _checks.call_op(_ops.safe_sdpa.default, q4, k4, v4, *params)
    else:
        m = _mask_4d(attn_mask, query, batch, Hq, L, S)
        out, _ = _checks.call_op(_ops.safe_sdpa.masked, q4, k4, v4, m, *params)
    if len(qs) == len(ks) == len(vs) == 4:
        return out  # 4-d inputs, the [B, Hq, L, Ev] result as it is
    nd = max(len(qs), len(ks), len(vs)) - 2  # leading dims of the result
    lead = (*batch, Hq)[-nd:] if nd > 0 else ()
    return out.reshape(*lead, L, Ev)


def _check_qkv(query, key, value):
    """Dtypes, devices and shapes of query / key / value; returns their
    shapes (each read once: every read of ``.shape`` builds a new object)."""
    # written out, not looped over (name, tensor) pairs: this runs on every call
    _checks.check_tensor("query", query)
    _checks.check_tensor("key", key)
    _checks.check_tensor("value", value)
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2:
        name, shape = next(p for p in (("query", qs), ("key", ks), ("value", vs)) if len(p[1]) < 2)
        raise ValueError(f"{name} must have at least 2 dims (..., seq, head_dim), got shape {list(shape)}")
    _checks.check_same_device("key", key, "query", query)
    _checks.check_same_device("value", value, "query", query)
    dt = query.dtype
    if key.dtype != dt or value.dtype != dt:
        name, t = ("key", key) if key.dtype != dt else ("value", value)
        raise TypeError(f"{name} has dtype {t.dtype} but query has {dt}; they must match")
    E, S, Ev = qs[-1], ks[-2], vs[-1]
    if ks[-1] != E:
        raise ValueError(f"key's head dim ({ks[-1]}) must equal query's ({E})")
    if vs[-2] != S:
        raise ValueError(f"value's sequence length ({vs[-2]}) must equal key's ({S})")
    if E > _MAX_HEAD_DIM or Ev > _MAX_HEAD_DIM or E < 1 or Ev < 1:
        raise ValueError(
            f"head dims must be in [1, {_MAX_HEAD_DIM}], got query/key {E} and value {Ev} "
            f"(nanguard's attention kernels stop at {_MAX_HEAD_DIM}, unlike "
            "torch.nn.functional.scaled_dot_product_attention)"
        )
    return qs, ks, vs


def _check_scalars(dropout_p, is_causal, scale, E):
    """dropout_p, is_causal and scale as PyTorch takes them; returns
    (dropout_p, scale) as floats (scale's default 1/sqrt(E))."""
    if type(dropout_p) is not float:  # (the common case skips the abstract Real test)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
            raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
        dropout_p = float(dropout_p)
    if not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        return dropout_p, 1.0 / math.sqrt(E)
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.dtype != torch.bool \
            and not scale.is_complex():
        scale = scale.item()  # a 0-d tensor, as PyTorch's takes (a host sync)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, a 0-d tensor of one, or None, got {scale!r}")
    return dropout_p, scale


def _to_4d(query, key, value, enable_gqa, qs, ks, vs):
    """[B, Hq, L, E], [B, Hkv, S, E], [B, Hkv, S, Ev] views (copies only where
    broadcasting leading dims requires) of tensors of shapes ``qs``, ``ks``,
    ``vs``. Heads are dim -3. A key/value with one head serves every query
    head (Hkv = 1) and, with ``enable_gqa``, Hq may be any multiple of Hkv,
    both without expanding key/value."""
    four_d = len(qs) == len(ks) == len(vs) == 4
    if four_d:  # the common case: the leading dims as they are, no tuples built
        hq, hk, hv = qs[1], ks[1], vs[1]
    else:
        nd = max(len(qs), len(ks), len(vs), 3)
        qb, kb, vb = ((1,) * (nd - len(t)) + tuple(t[:-2]) for t in (qs, ks, vs))
        hq, hk, hv = qb[-1], kb[-1], vb[-1]
    if hk != hv:
        if 1 not in (hk, hv):
            raise ValueError(f"key and value must have the same number of heads (dim -3), got {hk} and {hv}")
        hk = hv = max(hk, hv)
    if hq == hk or hk == 1:
        Hq, Hkv = hq, hk
    elif hq % hk == 0 and enable_gqa:
        Hq, Hkv = hq, hk
    elif hq == 1:
        Hq = Hkv = hk
    elif enable_gqa:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) with enable_gqa=True")
    else:
        raise ValueError(
            f"query has {hq} heads but key/value have {hk}; pass enable_gqa=True for grouped-query attention"
        )
    if four_d:
        if qs[0] == ks[0] == vs[0] and (qs[1], ks[1], vs[1]) == (Hq, Hkv, Hkv):
            return query, key, value, (qs[0],), Hq  # already [B, heads, seq, dim]: no reshapes
        qb, kb, vb = qs[:2], ks[:2], vs[:2]
    try:
        batch = tuple(torch.broadcast_shapes(qb[:-1], kb[:-1], vb[:-1]))
    except RuntimeError:
        raise ValueError(
            f"leading dims of query {list(query.shape[:-2])}, key {list(key.shape[:-2])} and value "
            f"{list(value.shape[:-2])} do not broadcast"
        ) from None
    B = math.prod(batch)

    def four(t, lead, heads):
        n, d = t.shape[-2:]
        return t.reshape(*lead, n, d).expand(*batch, heads, n, d).reshape(B, heads, n, d)

    return four(query, qb, Hq), four(key, kb, Hkv), four(value, vb, Hkv), batch, Hq


def _any_mismatch(shape, full) -> bool:
    """Does a dim of ``shape`` differ from ``full``'s and from 1? (A loop:
    ``all()`` over a generator costs a microsecond on every masked call.)"""
    for s, f in zip(shape, full):
        if s != 1 and s != f:
            return True
    return False


def _mask_4d(attn_mask, query, batch, Hq, L, S):
    """attn_mask as a 4-d tensor whose dims are [B, Hq, L, S]'s or 1 (no copy
    unless several leading batch dims must be merged)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        _checks.check_tensor("attn_mask", attn_mask)
    _checks.check_same_device("attn_mask", attn_mask, "query", query)
    if attn_mask.requires_grad:
        raise ValueError(
            "attn_mask requires grad; gradients with respect to an attention mask are not "
            "supported (pass attn_mask.detach())"
        )
    full = (*batch, Hq, L, S)
    shape = attn_mask.shape
    lead = len(full) - len(shape)  # dims the mask leaves out, in front
    if lead < 0 or _any_mismatch(shape, full[lead:]):
        raise ValueError(f"attn_mask of shape {list(shape)} does not broadcast to {list(full)}")
    m = attn_mask if lead == 0 else attn_mask.reshape((1,) * lead + tuple(shape))
    nb = len(batch)
    if nb == 0:
        return m.unsqueeze(0)
    if nb == 1:
        return m
    if all(s == 1 for s in m.shape[:nb]):
        return m.reshape(1, *m.shape[nb:])
    return m.expand(*batch, *m.shape[nb:]).reshape(math.prod(batch), *m.shape[nb:])


class SafeAttention(nn.Module):
    """Attention as a module, for model code that computes it by hand
    (``softmax(q @ k.T * scale + mask) @ v`` with dropout).

    ``forward(query, key, value, attn_mask=None)`` calls :func:`safe_sdpa`
    with the module's settings (``backend`` included); dropout applies in training mode only. The
    module has no parameters, so swapping it in leaves ``state_dict``
    unchanged.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        max_score: Optional[float] = None,
        softcap: Optional[float] = None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        if not (0.0 <= float(dropout) < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        _delegate.check_backend(backend)
        self.backend = backend
        self.dropout = float(dropout)
        self.is_causal = is_causal
        self.scale = scale
        self.enable_gqa = enable_gqa
        self.max_score = max_score
        self.softcap = softcap

    def forward(self, query, key, value, attn_mask=None):
        return safe_sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            max_score=self.max_score,
            softcap=self.softcap,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        parts = [f"dropout={self.dropout}", f"is_causal={self.is_causal}"]
        for name in ("scale", "max_score", "softcap", "backend"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        if self.enable_gqa:
            parts.append("enable_gqa=True")
        return ", ".join(parts)
