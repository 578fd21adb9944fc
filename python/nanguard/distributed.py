"""nanguard across processes: DTensor gradients in the gradient guard,
DTensor activations in ``safe_sdpa`` / ``stable_layernorm``, and the
collectives that make every rank take the same decision.

Importing this module is cheap: ``torch.distributed.tensor`` is imported only
when a DTensor is actually met (a DTensor cannot exist before it is imported).

Gradient guard on DTensor gradients (FSDP2, HSDP, tensor parallel)
------------------------------------------------------------------
Each gradient contributes its *local* shard. Its placements say how the
shards add up to the full tensor:

- ``Shard(d)`` on a mesh dimension: the shards along that dimension are
  disjoint, their sums of squares add up;
- ``Replicate()`` on a mesh dimension: every rank along it holds the same
  values. Only the rank at coordinate 0 of that dimension contributes the
  sum of squares (exact: no division), while every rank contributes its
  NaN / Inf counts, so a value made non-finite on one replica only still
  makes every rank skip;
- ``Partial()`` is refused (reduce the gradient first).

The statistics of all gradients on one mesh are reduced over each of the
mesh's dimension groups in turn (a sum over every dimension is a sum over the
whole mesh), concatenated with those of other meshes that share a group, so
each distinct process group sees **one** all-reduce per guard call. The
infinity norm needs a max and the counts a sum: both ride in one SUM
all-reduce, each rank writing its max into its own slot of a vector as long
as the group (the max is taken afterwards, exactly). Nothing is read back to
the host.

Plain tensors mixed with DTensors are taken as replicated over the first
DTensor's mesh (parameters left unsharded), unless ``process_group=`` is
given, in which case they are taken as shards over that group (the meaning
``process_group=`` has without DTensors).
"""

from __future__ import annotations

import math
import sys
from typing import Dict, List, Tuple

import torch

from . import _checks

__all__ = ["is_dtensor", "register_sharding_strategies", "all_reduce_stats"]


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


def _group_key(group) -> Tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


class DTensorPlan:
    """The guard's plan when some gradients are DTensors: the local shards
    grouped into buckets (one :class:`nanguard.grad_guard._Plan` each), and
    the all-reduces that turn the buckets' statistics into the global ones.

    Same interface as ``_Plan``: ``reduce()`` gives the float64 ``[4]``
    statistics (``first_bad`` is this rank's index into ``grads``), and
    ``apply(stats, max_norm)`` writes the gradients and returns the norm.
    """

    def __init__(self, grads, inv_scale, norm_type, found_inf, process_group, plan_cls):
        mod = _dtensor_module()
        self.norm_type = norm_type
        self.inf_norm = norm_type == math.inf
        self.found_inf = {} if found_inf is None else found_inf
        self.process_group = process_group
        # unit: a set of gradients reduced over the same groups; key -> state
        # ("mesh", mesh) for DTensors (and plain tensors replicated on it),
        # ("pg",) for plain tensors sharded over process_group.
        self.units: Dict[tuple, dict] = {}
        meshes = []
        first_mesh = None
        buckets: Dict[tuple, List[Tuple[int, torch.Tensor]]] = {}
        for i, g in enumerate(grads):
            if isinstance(g, mod.DTensor):
                mesh = g.device_mesh
                coord = mesh.get_coordinate()
                if coord is None:  # this rank is not in the mesh: holds nothing
                    continue
                dup = False
                for d, p in enumerate(g.placements):
                    if p.is_partial():
                        raise ValueError(
                            f"grads[{i}] is a DTensor with a Partial placement on mesh dim {d}; "
                            "reduce it first (grad.redistribute(placements=[... Replicate() ...]))"
                        )
                    if p.is_replicate() and coord[d] != 0:
                        dup = True
                _checks.check_tensor(f"grads[{i}]", g)
                if first_mesh is None:
                    first_mesh = mesh
                if mesh not in meshes:
                    meshes.append(mesh)
                lt = local(g)
                if lt.numel():  # an empty shard (uneven FSDP2 sharding) adds nothing
                    buckets.setdefault((("mesh", mesh), dup), []).append((i, lt))
            else:
                buckets.setdefault(("plain",), []).append((i, g))
        plain = buckets.pop(("plain",), None)
        if plain:
            if process_group is not None:
                buckets[(("pg",), False)] = plain
            elif first_mesh is not None:
                coord = first_mesh.get_coordinate()
                buckets.setdefault((("mesh", first_mesh), any(c != 0 for c in coord)), []).extend(plain)
            else:  # no DTensor this rank holds: plain tensors are local
                buckets[(("local",), False)] = plain
        self.return_mesh = None
        if not plain and len(meshes) == 1 and len(buckets) and all(
            isinstance(g, mod.DTensor) for g in grads
        ):
            self.return_mesh = meshes[0]
        self.main = (
            next(iter(buckets.values()))[0][1].device if buckets else
            (grads[0].device if len(grads) else torch.device("cpu"))
        )
        self.buckets = []  # (unit key, zero acc?, _Plan, caller indices)
        for (unit, dup), items in buckets.items():
            plan = plan_cls([t for _, t in items], inv_scale, norm_type, self.found_inf)
            self.buckets.append((unit, dup, plan, [i for i, _ in items]))
        # the groups, in an order every rank follows: meshes in first-seen
        # order, their dims in order, then process_group
        self.steps: List[Tuple[object, List[tuple]]] = []
        keys: Dict[Tuple[int, ...], int] = {}
        units = []
        for unit, _, _, _ in self.buckets:
            if unit not in units:
                units.append(unit)
        for unit in units:
            if unit[0] == "mesh":
                groups = [unit[1].get_group(d) for d in range(unit[1].ndim)]
            elif unit[0] == "pg":
                groups = [process_group]
            else:
                groups = []
            for grp in groups:
                k = _group_key(grp)
                if k not in keys:
                    keys[k] = len(self.steps)
                    self.steps.append((grp, []))
                self.steps[keys[k]][1].append(unit)
        self.unit_order = units

    @property
    def collectives(self) -> int:
        """All-reduces one guard call issues on this rank."""
        return len(self.steps)

    def reduce(self, process_group=None) -> torch.Tensor:
        dev = self.main
        per_unit: Dict[tuple, List[torch.Tensor]] = {}
        firsts = []
        for unit, dup, plan, idx in self.buckets:
            st = plan.reduce(None).to(dev)
            fb = st[3]
            # host-to-device, never the other way: no sync
            lut = torch.tensor(idx, dtype=torch.float64).to(dev, non_blocking=dev.type != "cpu")
            mapped = lut.index_select(0, fb.clamp(min=0).long().reshape(1)).reshape(())
            firsts.append(torch.where(fb >= 0, mapped, torch.full_like(mapped, math.inf)))
            row = st[:3]
            if dup and not self.inf_norm:  # a replica other than coordinate 0: counts only
                row = torch.cat([torch.zeros_like(row[:1]), row[1:]])
            per_unit.setdefault(unit, []).append(row)
        rows = {}
        for unit, rs in per_unit.items():
            s = torch.stack(rs)
            acc = s[:, 0].amax() if self.inf_norm else s[:, 0].sum()
            rows[unit] = torch.cat([acc.reshape(1), s[:, 1:].sum(0)])
        for grp, units in self.steps:
            vec = torch.stack([rows[u] for u in units])
            red = all_reduce_stats(vec, len(units), self.inf_norm, grp)
            for j, u in enumerate(units):
                rows[u] = red[j]
        if rows:
            s = torch.stack(list(rows.values()))
            acc = s[:, 0].amax() if self.inf_norm else s[:, 0].sum()
            counts = s[:, 1:].sum(0)
            first = torch.stack(firsts).amin()
            first = torch.where(torch.isinf(first), torch.full_like(first, -1.0), first)
            return torch.cat([acc.reshape(1), counts, first.reshape(1)])
        return torch.tensor([0.0, 0.0, 0.0, -1.0], dtype=torch.float64, device=dev)

    def apply(self, stats: torch.Tensor, max_norm: float) -> torch.Tensor:
        total = None
        for _, _, plan, _ in self.buckets:
            tn = plan.apply(stats, max_norm)
            if total is None:
                total = tn
        if total is None:  # nothing on this rank: the norm from the stats
            tn = stats[0] if self.inf_norm else stats[0].sqrt()
            tn = torch.where(stats[2] > 0, torch.full_like(tn, math.inf), tn)
            total = torch.where(stats[1] > 0, torch.full_like(tn, math.nan), tn).float()
        return total.to(self.main)

    def wrap(self, total: torch.Tensor) -> torch.Tensor:
        """The norm as PyTorch returns it for the same gradients: a
        replicated DTensor when every gradient is a DTensor on one mesh
        (what ``torch.nn.utils.clip_grad_norm_`` gives under FSDP2), a plain
        tensor otherwise."""
        if self.return_mesh is None:
            return total
        mod = _dtensor_module()
        mesh = self.return_mesh
        return mod.DTensor.from_local(total, mesh, [mod.Replicate()] * mesh.ndim, run_check=False)


# ---- sharding strategies for safe_sdpa and stable_layernorm --------------------------

_registered = False


def register_sharding_strategies() -> None:
    """Register DTensor sharding strategies for nanguard's attention and
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
    if _registered:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.nanguard
    R = Replicate()

    def sdpa_strategies(q, k, v, mask, n_scalars, backward):
        """Placement lists for (outputs, inputs) of one mesh dim."""
        B, Hq = q.shape[0], q.shape[1]
        Hkv = k.shape[1]
        n = q.mesh.size()

        def build(qp, kvp, maskp, outp, lsep, dkvp):
            if backward:  # (grad_out, q, k, v, [mask], out, lse, scalars, rng) -> dq, dk, dv
                ins = [qp, qp, kvp, kvp] + ([maskp] if mask is not None else []) + [outp, lsep]
                return [qp, dkvp, dkvp], ins + [None] * n_scalars + [R]
            ins = [qp, kvp, kvp] + ([maskp] if mask is not None else [])
            return [outp, lsep], ins + [None] * n_scalars + [R]

        out = [build(R, R, R, R, R, R)]
        mb = mask is not None and mask.shape[0] == B and B > 1
        out.append(build(Shard(0), Shard(0), Shard(0) if mb else R, Shard(0), Shard(0), Shard(0)))
        if Hq % n == 0 and (Hkv == 1 or Hkv % n == 0):
            kvp = R if Hkv == 1 else Shard(1)
            dkvp = Partial() if Hkv == 1 else Shard(1)
            mh = mask is not None and mask.shape[1] == Hq and Hq > 1
            out.append(build(Shard(1), kvp, Shard(1) if mh else R, Shard(1), Shard(1), dkvp))
        return out

    @register_sharding(ops.safe_sdpa.default)
    def _sdpa(q, k, v, dropout_p, is_causal, scale, max_score, softcap, rng):
        return sdpa_strategies(q, k, v, None, 5, False)

    @register_sharding(ops.safe_sdpa.masked)
    def _sdpa_m(q, k, v, mask, dropout_p, is_causal, scale, max_score, softcap, rng):
        return sdpa_strategies(q, k, v, mask, 5, False)

    @register_sharding(ops.safe_sdpa_backward.default)
    def _sdpa_b(go, q, k, v, out, lse, dropout_p, is_causal, scale, max_score, softcap, rng):
        return sdpa_strategies(q, k, v, None, 5, True)

    @register_sharding(ops.safe_sdpa_backward.masked)
    def _sdpa_bm(go, q, k, v, mask, out, lse, dropout_p, is_causal, scale, max_score, softcap, rng):
        return sdpa_strategies(q, k, v, mask, 5, True)

    def ln_strategies(x, n_params, backward, with_weight):
        res = []
        for p in [R] + [Shard(d) for d in range(x.ndim - 1)]:
            pp = R if p == R else Partial()  # weight / bias gradients
            if backward:  # (grad_out, input, [weight], mean, rstd, rms, with_bias)
                outs = [p] + ([pp] if with_weight else []) + [pp]
                ins = [p, p] + ([R] if with_weight else []) + [p, p, None, None]
            else:  # (input, [weight], [bias], eps, rms) -> y, mean, rstd
                outs = [p, p, p]
                ins = [p] + [R] * n_params + [None, None]
            res.append((outs, ins))
        return res

    @register_sharding(ops.stable_layernorm.default)
    def _ln(x, eps, rms):
        return ln_strategies(x, 0, False, False)

    @register_sharding(ops.stable_layernorm.weight)
    def _ln_w(x, w, eps, rms):
        return ln_strategies(x, 1, False, False)

    @register_sharding(ops.stable_layernorm.bias)
    def _ln_b(x, b, eps, rms):
        return ln_strategies(x, 1, False, False)

    @register_sharding(ops.stable_layernorm.weight_bias)
    def _ln_wb(x, w, b, eps, rms):
        return ln_strategies(x, 2, False, False)

    @register_sharding(ops.stable_layernorm_backward.default)
    def _ln_bwd(go, x, mean, rstd, rms, with_bias):
        return ln_strategies(x, 0, True, False)

    @register_sharding(ops.stable_layernorm_backward.weight)
    def _ln_bwd_w(go, x, w, mean, rstd, rms, with_bias):
        return ln_strategies(x, 1, True, True)

    _registered = True


def sdpa_args(query, key, value, attn_mask, dropout_p, rng):
    """For DTensor attention inputs: register the strategies and make the
    mask and the dropout seed replicated DTensors on query's mesh (they are
    the same on every rank). Dropout is refused: the same seed on every
    shard would drop the same pattern in every shard, which is not the
    unsharded computation."""
    mod = _dtensor_module()
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, mod.DTensor):
            raise TypeError(f"query is a DTensor but {name} is not: pass DTensors on one mesh")
        if t.device_mesh != query.device_mesh:
            raise ValueError(f"{name} is on another device mesh than query")
    if dropout_p > 0.0:
        raise ValueError(
            "dropout_p > 0 is not supported with DTensor inputs (every shard would draw the same "
            "dropout mask); pass dropout_p=0.0, or call safe_sdpa on local tensors"
        )
    register_sharding_strategies()
    mesh = query.device_mesh
    rep = [mod.Replicate()] * mesh.ndim
    rng = mod.DTensor.from_local(rng, mesh, rep, run_check=False)
    if attn_mask is not None and not isinstance(attn_mask, mod.DTensor):
        attn_mask = mod.DTensor.from_local(attn_mask, mesh, rep, run_check=False)
    return attn_mask, rng


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
