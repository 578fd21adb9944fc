"""nanguard across processes: the generic pieces its features share.

- DTensor detection that never imports ``torch.distributed.tensor`` (a
  DTensor cannot exist before it is imported), and a DTensor's local shard;
- :func:`all_reduce_stats`, the one collective of the gradient guard (whose
  DTensor plan lives with it, in ``nanguard.grad_guard._dtensor``);
- the registry of DTensor sharding strategies: each op declares its own
  strategy beside the op (``nanguard.attention``, ``nanguard.layernorm``)
  with :func:`sharding_strategy`; :func:`register_sharding_strategies`
  hands them to DTensor when a DTensor first meets a nanguard op.

Importing this module is cheap.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Tuple

import torch

__all__ = ["is_dtensor", "register_sharding_strategies", "sharding_strategy", "all_reduce_stats"]


# ---- DTensor detection, without importing torch.distributed.tensor -------------------


def _dtensor_module():
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t) -> bool:
    """Is ``t`` a :class:`torch.distributed.tensor.DTensor`? (Never imports it.)"""
    mod = _dtensor_module()
    return mod is not None and isinstance(t, mod.DTensor)


def any_dtensor(ts) -> bool:
    mod = _dtensor_module()
    return mod is not None and any(isinstance(t, mod.DTensor) for t in ts)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the same storage: writes go through), or
    ``t`` itself."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


# ---- the collectives of the guard --------------------------------------------------


def all_reduce_stats(vec: torch.Tensor, n_units: int, inf_norm: bool, group) -> torch.Tensor:
    """All-reduce ``n_units`` stacked ``[acc, nan, inf]`` rows (float64, shape
    ``[n_units, 3]``) over ``group`` with **one** collective; ``acc`` is summed
    (2-norm) or maxed (inf-norm), the counts are summed."""
    import torch.distributed as dist

    if not inf_norm:
        flat = vec.reshape(-1).clone()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return flat.reshape(n_units, 3)
    # max and sum in one SUM: each rank writes its acc into its own slot
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    wide = torch.zeros((n_units, size + 2), dtype=vec.dtype, device=vec.device)
    wide[:, me] = vec[:, 0]
    wide[:, size:] = vec[:, 1:3]
    dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group)
    # a NaN acc on one rank makes the max NaN, as the local combine does
    acc = wide[:, :size].amax(dim=1, keepdim=True)
    return torch.cat([acc, wide[:, size:]], dim=1)


# ---- sharding strategies ----------------------------------------------------------

_strategies: List[Tuple[object, Callable]] = []  # (op overload, strategy), in declaration order
_registered = 0  # how many of them DTensor has


def sharding_strategy(op, strategy: Callable) -> None:
    """Declare ``strategy`` as the DTensor sharding strategy of ``op`` (an
    ``OpOverload``). It is handed to
    ``torch.distributed.tensor.experimental.register_sharding`` by
    :func:`register_sharding_strategies`, so that declaring one imports
    nothing. The strategy is called with the op's arguments (tensors as
    their specs) and returns ``[(output placements, input placements), ...]``
    for one mesh dimension; ``nanguard._checks.tensor_placements`` builds the
    input list from the op's schema."""
    _strategies.append((op, strategy))


def register_sharding_strategies() -> None:
    """Register the DTensor sharding strategies of nanguard's attention and
    normalization ops (idempotent). Called automatically when
    ``nanguard.functional.safe_sdpa`` / ``layer_norm`` / ``rms_norm`` meet a
    DTensor; call it yourself before passing DTensors to ``torch.ops.nanguard``
    directly.

    - ``safe_sdpa`` (and its backward): sharded on batch (dim 0) or heads
      (dim 1, when query and key/value heads divide by the mesh size; a
      single key/value head stays replicated and its gradient is Partial), or
      replicated. A sequence-sharded input is redistributed by DTensor to one
      of these.
    - ``stable_layernorm`` (and its backward): sharded on any dim but the
      normalized (last) one, with weight and bias replicated; their gradients
      are Partial. A sharded normalized dim is redistributed.
    """
    global _registered
    if _registered == len(_strategies):
        return
    from torch.distributed.tensor.experimental import register_sharding

    for op, strategy in _strategies[_registered:]:
        register_sharding(op)(strategy)
    _registered = len(_strategies)


# ---- rank agreement ----------------------------------------------------------------


def agreement_group(process_group=None):
    """The process group whose ranks agree on a per-rank flag
    (``process_group``, default: the default group), or None when
    torch.distributed is not initialised or the group has a single rank."""
    if not torch.distributed.is_available():
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def ranks_flagged(group, flag: bool) -> List[int]:
    """One all-reduce over ``group``: the global ranks that passed ``flag=True``.
    Every rank of the group must call it (on the current CUDA device under
    NCCL, on the CPU otherwise)."""
    import torch.distributed as dist

    dev = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        dev = torch.device("cuda", torch.cuda.current_device())
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=dev)
    flags[dist.get_rank(group)] = int(flag)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    ranks = dist.get_process_group_ranks(group)
    return [ranks[i] for i in flags.cpu().nonzero().flatten().tolist()]


def max_over_ranks(group, values: List[int]) -> List[int]:
    """One all-reduce over ``group``: the element-wise maximum of ``values``
    (small non-negative ints) over its ranks. Every rank of the group must
    call it with as many values."""
    import torch.distributed as dist

    dev = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()
