"""LayerNorm and RMSNorm that never produce 0/0: the Python face of
``torch.ops.nanguard.stable_layernorm``.

Statistics are fp32 (fp64 for fp64 input) whatever the input dtype; outputs
are in the input dtype. fp16 / bf16 input may come with fp32 weight and bias
(norms kept in fp32): they are applied in fp32 and their gradients are fp32,
as PyTorch's own layer_norm / rms_norm do; the output is still in the input
dtype. A row whose values are all equal gives exactly the
bias (or 0); NaN or Inf in a row makes that row, and only that row, NaN.
With default arguments the results match ``torch.nn.functional.layer_norm``
and ``rms_norm`` numerically.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from . import _checks
from . import distributed as _dist

__all__ = [
    "layer_norm",
    "rms_norm",
    "StableLayerNorm",
    "StableRMSNorm",
    "EPS_FLOOR",
    "NORM_EPS_ATTRS",
]

_ops = torch.ops.nanguard

#: the attribute names under which norm classes (PyTorch's, Hugging Face
#: Transformers', timm's) keep their epsilon, in the order they are tried
NORM_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps")

#: eps floors used by ``eps_floor="auto"``, per input dtype. 16-bit training
#: with eps far below 1e-5 (1e-12 in BERT-style configs) lets rows that are
#: nearly constant in 16-bit precision be amplified by ~1e6 into rounding noise;
#: 1e-5 is the value PyTorch's own LayerNorm defaults to.
EPS_FLOOR = {
    torch.float16: 1e-5,
    torch.bfloat16: 1e-5,
    torch.float32: 0.0,
    torch.float64: 0.0,
}

_FWD = {
    (False, False): _ops.stable_layernorm.default,
    (True, False): _ops.stable_layernorm.weight,
    (False, True): _ops.stable_layernorm.bias,
    (True, True): _ops.stable_layernorm.weight_bias,
}


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


#: each forward overload's backward (the one with the weight when it has one).
#: Every argument is read by its schema name (ops/ops.h, NG_LAYERNORM_SCHEMAS):
#: nothing below restates an argument list by position.
_BACKWARD = {
    fwd: _ops.stable_layernorm_backward.weight if has_w else _ops.stable_layernorm_backward.default
    for (has_w, _), fwd in _FWD.items()
}
_BACKWARDS = (_ops.stable_layernorm_backward.default, _ops.stable_layernorm_backward.weight)


# ---- fake (meta) kernels: shapes and dtypes for torch.compile / opcheck ----


def _fake_checks(op, a):
    """Every Tensor argument on input's device."""
    named = [(n, a[n]) for n in _checks.tensor_arg_names(op) if n != "input"]
    _checks.fake_same_device(op._schema.name, "input", a["input"], *named)


def _make_fake_fwd(op):
    def fake(*args):
        a = _checks.bind(op, args)
        _fake_checks(op, a)
        input = a["input"]
        stats = input.shape[:-1]
        sd = _stat_dtype(input.dtype)
        return (
            torch.empty_like(input, memory_format=torch.contiguous_format),
            input.new_empty(stats, dtype=sd),
            input.new_empty(stats, dtype=sd),
        )

    return fake


def _make_fake_bwd(op):
    def fake(*args):
        a = _checks.bind(op, args)
        _fake_checks(op, a)
        input = a["input"]
        grad_input = torch.empty_like(input, memory_format=torch.contiguous_format)
        grad_bias = input.new_empty((input.shape[-1] if a["with_bias"] else 0,))
        if "weight" not in a:
            return grad_input, grad_bias
        weight = a["weight"]  # the parameters' gradients in their dtype (fp32 with 16-bit input)
        return grad_input, torch.empty_like(weight, memory_format=torch.contiguous_format), \
            weight.new_empty(grad_bias.shape)

    return fake


for _op in _FWD.values():
    torch.library.register_fake(_op)(_make_fake_fwd(_op))
for _op in _BACKWARDS:
    torch.library.register_fake(_op)(_make_fake_bwd(_op))


# ---- autograd ---------------------------------------------------------------


def _make_setup(op):
    def setup_context(ctx, inputs, output):
        a = _checks.bind(op, inputs)
        _, mean, rstd = output
        # The statistics are outputs for the backward only: marked so, they do
        # not claim a gradient they would never get.
        ctx.mark_non_differentiable(mean, rstd)
        ctx.save_for_backward(a["input"], a.get("weight"), mean, rstd)
        ctx.rms = a["rms"]
        ctx.has_b = "bias" in a
        # An fp32 bias of 16-bit input without a weight: the backward op gives
        # grad_bias in the input dtype, so its fp32 sum is taken here.
        ctx.bias_f32 = ctx.has_b and "weight" not in a and a["bias"].dtype != a["input"].dtype

    return setup_context


def _make_backward(op):
    bwd = _BACKWARD[op]

    def backward(ctx, grad_out, _grad_mean, _grad_rstd):
        input, weight, mean, rstd = ctx.saved_tensors
        values = {"grad_out": grad_out.contiguous(), "input": input, "weight": weight, "mean": mean,
                  "rstd": rstd, "rms": ctx.rms, "with_bias": ctx.has_b and not ctx.bias_f32}
        out = _checks.call_op(bwd, *_checks.call_args(bwd, values))
        gx, gw, gb = out if len(out) == 3 else (out[0], None, out[1])
        if ctx.bias_f32:
            gb = grad_out.sum(tuple(range(grad_out.dim() - 1)), dtype=torch.float32)
        return _checks.per_arg(op, {"input": gx, "weight": gw, "bias": gb})

    return backward


for _op in _FWD.values():
    _checks.register_autograd(_op, _make_backward(_op), setup_context=_make_setup(_op))


# ---- double backward ----------------------------------------------------------
#
# The first backward stays in C. Its own derivative (for gradient penalties,
# Hessian-vector products) comes from the same closed-form backward written
# in PyTorch ops and differentiated by autograd. The backward op receives
# mean and rstd, not eps; they are functions of the input, and the formula
# must see them as such. Per row, with v(x) the variance (LayerNorm) or mean
# square (RMSNorm) of x, rstd = (v(x) + eps)^(-1/2); eps is recovered as the
# constant c = 1/rstd^2 - v(x), so that r(x) = (v(x) + c)^(-1/2) equals rstd
# in value and has every derivative of the true one. A row whose rstd is 0
# (var + eps == 0, see kernels/layernorm_math.h) has a zero gradient, and so a
# zero derivative of it; a NaN rstd stays NaN. Arithmetic is in the
# statistics dtype (fp32, fp64 for fp64).


def backward_reference(grad_out, input, weight, mean, rstd, rms: bool, with_bias: bool):
    """``stable_layernorm_backward`` in PyTorch ops, differentiable in
    ``grad_out``, ``input`` and ``weight`` (mean and rstd taken as the
    statistics of ``input``). Returns (grad_input, grad_weight or None,
    grad_bias): grad_input in the input dtype, the others in weight's (the
    input's without weight)."""
    sd = _stat_dtype(input.dtype)
    x, go = input.to(sd), grad_out.to(sd)
    r0 = rstd.to(sd).unsqueeze(-1)
    live = r0 != 0  # NaN counts as live: it must reach the result
    d = x if rms else x - x.mean(-1, keepdim=True)
    v = (d * d).mean(-1, keepdim=True)
    c = torch.where(live, torch.where(live, r0, 1.0).square().reciprocal() - v.detach(), 0.0)
    # where() backpropagates into both branches: keep the unused one finite
    r = torch.where(live, torch.where(live, v + c, 1.0).rsqrt(), 0.0)
    xhat = d * r
    g = go * weight.to(sd) if weight is not None else go
    gxhat = (g * xhat).mean(-1, keepdim=True)
    gx = r * (g - xhat * gxhat) if rms else r * (g - g.mean(-1, keepdim=True) - xhat * gxhat)
    rows = tuple(range(input.dim() - 1))
    pdt = weight.dtype if weight is not None else input.dtype
    gw = (go * xhat).sum(rows).to(pdt) if weight is not None else None
    gb = go.sum(rows) if with_bias else go.new_zeros((0,))
    return gx.to(input.dtype), gw, gb.to(pdt)


def _make_bwd_setup(op):
    def setup_context(ctx, inputs, output):
        a = _checks.bind(op, inputs)
        if a["mean"].requires_grad or a["rstd"].requires_grad:
            raise RuntimeError(
                "nanguard.stable_layernorm_backward: mean and rstd require grad; they must be "
                "the forward's statistics, which are not differentiable (its derivative treats "
                "them as functions of input)"
            )
        ctx.save_for_backward(a["grad_out"], a["input"], a.get("weight"), a["mean"], a["rstd"])
        ctx.rms, ctx.with_bias = a["rms"], a["with_bias"]

    return setup_context


def _make_bwd_backward(op):
    names = _checks.arg_names(op)
    # the differentiable arguments (mean and rstd are the input's statistics)
    diff = tuple(n for n in ("grad_out", "input", "weight") if n in names)

    def backward(ctx, *grads):
        grad_out, input, weight, mean, rstd = ctx.saved_tensors
        ins = dict(zip(("grad_out", "input", "weight"), (grad_out, input, weight)))
        needed = [n for n in diff if ctx.needs_input_grad[names.index(n)]]
        result = {}
        if needed:
            # the saved tensors themselves when they carry a graph, so that a
            # create_graph=True call can differentiate this once more
            leaves = {n: t if t.requires_grad else t.detach().requires_grad_()
                      for n, t in ins.items() if n in diff}
            with torch.enable_grad():
                outs = backward_reference(
                    leaves["grad_out"], leaves["input"], leaves.get("weight"), mean, rstd, ctx.rms,
                    ctx.with_bias,
                )
            pairs = [(o, g) for o, g in zip([o for o in outs if o is not None], grads)
                     if g is not None and o.requires_grad]
            if pairs:
                got = torch.autograd.grad(
                    [o for o, _ in pairs], [leaves[n] for n in needed], [g for _, g in pairs],
                    allow_unused=True, create_graph=torch.is_grad_enabled(),
                )
                result = dict(zip(needed, got))
        return _checks.per_arg(op, result)

    return backward


for _op in _BACKWARDS:
    torch.library.register_autograd(_op, _make_bwd_backward(_op), setup_context=_make_bwd_setup(_op))


# ---- DTensor ----------------------------------------------------------------------


def _make_sharding(op):
    """stable_layernorm's DTensor strategies for one overload and mesh
    dimension: replicated, or sharded on any dim but the normalized (last)
    one, with weight and bias replicated and their gradients Partial."""
    backward = op in _BACKWARDS

    def strategies(*args, **kwargs):
        from torch.distributed.tensor import Partial, Replicate, Shard

        a = _checks.bind(op, args, kwargs)
        x = a["input"]
        R = Replicate()
        res = []
        for p in [R] + [Shard(d) for d in range(x.ndim - 1)]:
            pp = R if p == R else Partial()  # weight / bias gradients
            ins = {"grad_out": p, "input": p, "weight": R, "bias": R, "mean": p, "rstd": p}
            # forward: y, mean, rstd; backward: grad_input, [grad_weight], grad_bias
            outs = [p] + [pp] * (1 + ("weight" in a)) if backward else [p, p, p]
            res.append((outs, _checks.tensor_placements(op, ins)))
        return res

    return strategies


for _op in (*_FWD.values(), *_BACKWARDS):
    _dist.sharding_strategy(_op, _make_sharding(_op))


# ---- functional API ---------------------------------------------------------


def _shape_tuple(normalized_shape) -> tuple[int, ...]:
    if type(normalized_shape) is tuple:  # as nn.LayerNorm / nn.RMSNorm keep it
        for s in normalized_shape:  # (a loop: all() over a generator costs ~1 us a call)
            if type(s) is not int:
                break
        else:
            return normalized_shape
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    if isinstance(normalized_shape, (str, bytes)):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    try:
        return tuple(int(s) for s in normalized_shape)
    except TypeError:
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        ) from None


def _effective_eps(eps: float, eps_floor, dtype: torch.dtype) -> float:
    if eps_floor is None or eps_floor is False:
        return eps
    if isinstance(eps_floor, str):
        if eps_floor != "auto":
            raise ValueError(f"eps_floor must be None, 'auto' or a float, got {eps_floor!r}")
        floor = EPS_FLOOR[dtype]
    else:
        floor = _checks.check_eps("eps_floor", eps_floor)
    return max(eps, floor)


def _check_param(name: str, p, shape: tuple, input: torch.Tensor):
    """weight / bias: None, or a tensor of ``shape`` on input's device;
    returned flat (the op takes the normalized dims as one)."""
    if p is None:
        return None
    _checks.check_tensor(name, p)
    _checks.check_same_device(name, p, "input", input)
    if p.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (normalized_shape), got {list(p.shape)}")
    return p if len(shape) == 1 else p.reshape(-1)


def _norm(input, normalized_shape, weight, bias, eps, rms: bool, eps_floor):
    _checks.check_tensor("input", input)
    # (a plain tensor, the common case, is no DTensor: one type test)
    if type(input) is not torch.Tensor and _dist.is_dtensor(input):  # tensor / sequence parallel
        _dist.register_sharding_strategies()
    shape = _shape_tuple(normalized_shape)
    k = len(shape)
    if k == 0:
        raise ValueError("normalized_shape must have at least one dimension")
    in_shape = input.shape
    if len(in_shape) < k or in_shape[len(in_shape) - k :] != shape:
        raise ValueError(
            f"normalized_shape {list(shape)} does not match the trailing dimensions of input "
            f"with shape {list(in_shape)}"
        )
    # Under autocast, the casts PyTorch's own layer_norm / rms_norm get: on
    # CUDA they run in float32 with float32 parameters and return float32; on
    # the CPU autocast leaves them alone. Mirrored so that a drop-in module
    # returns the dtype the module it replaces returns.
    compute = input.dtype
    if _checks.autocast_active("rms_norm" if rms else "layer_norm", _checks.device_type(input)):
        input = _checks.autocast_to(input, torch.float32)
        compute = input.dtype
    if eps is None:
        eps = torch.finfo(input.dtype).eps  # rms_norm's default, as in PyTorch
    eps = _effective_eps(_checks.check_eps("eps", eps), eps_floor, input.dtype)
    w = _check_param("weight", weight, shape, input)
    b = _check_param("bias", bias, shape, input)
    # Parameters follow the input's dtype (differentiably), as autocast would,
    # except fp32 parameters of fp16 / bf16 input: those are applied in fp32
    # (PyTorch's mixed-dtype layer_norm / rms_norm; the output keeps the input
    # dtype), and a 16-bit one beside an fp32 one is widened to fp32 (exact).
    # The no-op conversions are skipped (each is a dispatcher call).
    pdt = compute
    if compute in (torch.float16, torch.bfloat16) and (
        (w is not None and w.dtype == torch.float32) or (b is not None and b.dtype == torch.float32)
    ):
        pdt = torch.float32
    if w is not None and w.dtype != pdt:
        w = w.to(pdt)
    if b is not None and b.dtype != pdt:
        b = b.to(pdt)
    if k == 1:
        # Already [..., n]: the op normalizes the last dimension and returns
        # the input's shape.
        x = input
    else:
        x = input.reshape(*in_shape[: len(in_shape) - k], math.prod(shape))
    if w is not None and b is not None:
        y = _checks.call_op(_ops.stable_layernorm.weight_bias, x, w, b, eps, rms)[0]
    elif w is not None:
        y = _checks.call_op(_ops.stable_layernorm.weight, x, w, eps, rms)[0]
    elif b is not None:
        y = _checks.call_op(_ops.stable_layernorm.bias, x, b, eps, rms)[0]
    else:
        y = _checks.call_op(_ops.stable_layernorm.default, x, eps, rms)[0]
    return y if k == 1 else y.view(in_shape)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    eps_floor: Union[None, str, float] = None,
) -> torch.Tensor:
    """NaN-safe ``torch.nn.functional.layer_norm``.

    Same arguments and result as PyTorch's, with fp32 statistics for 16-bit
    inputs. ``eps_floor`` (keyword only, off by default) raises ``eps`` to at
    least a floor: ``"auto"`` takes it from :data:`EPS_FLOOR` for the input
    dtype, a float sets it directly.
    """
    return _norm(input, normalized_shape, weight, bias, eps, False, eps_floor)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    eps_floor: Union[None, str, float] = None,
) -> torch.Tensor:
    """NaN-safe ``torch.nn.functional.rms_norm``: ``x / sqrt(mean(x^2) + eps) * weight``.

    ``eps=None`` uses ``torch.finfo(input.dtype).eps`` as PyTorch does. An
    all-zero row gives zeros even with ``eps=0``.
    """
    return _norm(input, normalized_shape, weight, None, eps, True, eps_floor)


# ---- TorchScript ----------------------------------------------------------
#
# torch.jit.script(StableLayerNorm(...)) compiles the modules' forward, which
# then calls the two functions below instead of layer_norm / rms_norm (whose
# argument handling TorchScript cannot compile). They make the same op calls
# with the same eps and parameter dtypes; what they leave out is autocast
# (TorchScript has its own) and DTensor inputs.


def _script_eps(eps: Optional[float], floor: float, dtype: torch.dtype) -> float:
    """eps (None: the dtype's machine epsilon, rms_norm's default), raised to
    at least floor."""
    if eps is None:
        if dtype == torch.float16:
            e = 0.0009765625
        elif dtype == torch.bfloat16:
            e = 0.0078125
        elif dtype == torch.float64:
            e = 2.220446049250313e-16
        else:
            e = 1.1920928955078125e-07
    else:
        e = eps
    return max(e, floor)


def _script_floor(self, dtype: torch.dtype) -> float:
    """A module's eps_floor as a number, for its scripted forward (eager
    forward resolves it in _effective_eps). TorchScript types the attribute
    from its value (None, "auto" or a number) and compiles only the branch
    that type takes."""
    floor = self.eps_floor
    if isinstance(floor, str):  # "auto" (any other string fails in eager forward)
        if dtype == torch.float16 or dtype == torch.bfloat16:
            return 1e-5
        return 0.0
    if isinstance(floor, float):
        return floor
    if isinstance(floor, int):
        return float(floor)
    return 0.0  # None, False


def _script_norm(input: torch.Tensor, normalized_shape: List[int], weight: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], eps: float, rms: bool) -> torch.Tensor:
    """_norm's op calls in a form torch.jit.script compiles."""
    k = len(normalized_shape)
    if k == 0 or input.dim() < k or input.shape[input.dim() - k:] != normalized_shape:
        raise ValueError("normalized_shape does not match the trailing dimensions of input")
    n = 1
    for s in normalized_shape:
        n *= s
    lead = input.shape[: input.dim() - k]
    x = input if k == 1 else input.reshape(lead + [n])
    pdt = input.dtype
    if pdt == torch.float16 or pdt == torch.bfloat16:
        if (weight is not None and weight.dtype == torch.float32) or (
            bias is not None and bias.dtype == torch.float32
        ):
            pdt = torch.float32
    w: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None
    if weight is not None:
        w = weight.reshape([n]).to(pdt)
    if bias is not None:
        b = bias.reshape([n]).to(pdt)
    if w is not None and b is not None:
        y = torch.ops.nanguard.stable_layernorm(x, w, b, eps, rms)[0]
    elif w is not None:
        y = torch.ops.nanguard.stable_layernorm(x, w, eps, rms)[0]
    elif b is not None:
        # the overload with a bias alone has the signature of the one with a
        # weight alone, which TorchScript would pick: a weight of ones is exact
        y = torch.ops.nanguard.stable_layernorm(x, torch.ones_like(b), b, eps, rms)[0]
    else:
        y = torch.ops.nanguard.stable_layernorm(x, eps, rms)[0]
    return y if k == 1 else y.view(input.shape)


# ---- modules --------------------------------------------------------------


class StableLayerNorm(nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` backed by ``nanguard.stable_layernorm``.

    Constructor arguments, parameters and ``state_dict`` keys are those of
    ``torch.nn.LayerNorm`` (it is a subclass), so checkpoints load both ways.
    """

    def __init__(self, *args, eps_floor: Union[None, str, float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps_floor = eps_floor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            eps = _script_eps(self.eps, self._script_floor(input.dtype), input.dtype)
            return _script_norm(input, self.normalized_shape, self.weight, self.bias, eps, False)
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, eps_floor=self.eps_floor
        )

    _script_floor = _script_floor

    @classmethod
    def from_module(cls, module: nn.LayerNorm, *, eps_floor=None) -> "StableLayerNorm":
        """A StableLayerNorm sharing ``module``'s parameters (no copy)."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"module must be a torch.nn.LayerNorm, got {type(module).__name__}")
        new = cls(
            module.normalized_shape,
            eps=module.eps,
            elementwise_affine=module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
            eps_floor=eps_floor,
        )
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        floor = f", eps_floor={self.eps_floor!r}" if self.eps_floor is not None else ""
        return super().extra_repr() + floor


class StableRMSNorm(nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` backed by ``nanguard.stable_layernorm``.

    Same constructor arguments, parameters and ``state_dict`` keys as
    ``torch.nn.RMSNorm``; ``eps=None`` means ``torch.finfo(input.dtype).eps``.
    """

    def __init__(self, *args, eps_floor: Union[None, str, float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps_floor = eps_floor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            eps = _script_eps(self.eps, self._script_floor(input.dtype), input.dtype)
            return _script_norm(input, self.normalized_shape, self.weight, None, eps, True)
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, eps_floor=self.eps_floor)

    _script_floor = _script_floor

    @classmethod
    def from_module(cls, module: nn.RMSNorm, *, eps_floor=None) -> "StableRMSNorm":
        """A StableRMSNorm sharing ``module``'s parameters (no copy)."""
        if not isinstance(module, nn.RMSNorm):
            raise TypeError(f"module must be a torch.nn.RMSNorm, got {type(module).__name__}")
        new = cls(
            module.normalized_shape,
            eps=module.eps,
            elementwise_affine=module.elementwise_affine,
            device="meta",
            eps_floor=eps_floor,
        )
        new.weight = module.weight
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        floor = f", eps_floor={self.eps_floor!r}" if self.eps_floor is not None else ""
        return super().extra_repr() + floor
