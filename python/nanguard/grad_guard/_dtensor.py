"""The gradient guard on DTensor gradients (FSDP2, HSDP, tensor parallel).

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
all-reduce (:func:`nanguard.distributed.all_reduce_stats`). Nothing is read
back to the host.

Plain tensors mixed with DTensors are taken as replicated over the first
DTensor's mesh (parameters left unsharded), unless ``process_group=`` is
given, in which case they are taken as shards over that group (the meaning
``process_group=`` has without DTensors).

Imported by the guard only when a DTensor gradient is met.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import _checks
from .. import distributed as _dist
from ._plan import _Plan, _combine_rows, _empty_stats, _first_bad_of_call, _first_of, _norm_from_stats


class _Unit(NamedTuple):
    """Gradients whose statistics are reduced over the same process groups:
    those on one device mesh (``kind="mesh"``: each of its dimension groups),
    plain tensors sharded over ``process_group=`` (``"pg"``), or plain tensors
    of a rank that holds no DTensor (``"local"``: no collective)."""

    kind: str
    mesh: Optional[object] = None


class _BucketKey(NamedTuple):
    """One ``_Plan`` of local tensors: its unit, and whether this rank is a
    replica other than coordinate 0 along a ``Replicate`` mesh dimension of
    them (``dup``: its sum of squares is counted on the coordinate-0 rank,
    only its NaN / Inf counts here)."""

    unit: _Unit
    dup: bool


class _Bucket(NamedTuple):
    key: _BucketKey
    plan: _Plan
    indices: List[int]  # each tensor's index in the caller's list


def _group_ranks(group) -> Tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _placement_dup(i: int, g, coord) -> bool:
    """Whether this rank, at ``coord`` of ``g``'s mesh, is a replica other
    than coordinate 0 (refusing a Partial placement)."""
    dup = False
    for d, p in enumerate(g.placements):
        if p.is_partial():
            raise ValueError(
                f"grads[{i}] is a DTensor with a Partial placement on mesh dim {d}; "
                "reduce it first (grad.redistribute(placements=[... Replicate() ...]))"
            )
        if p.is_replicate() and coord[d] != 0:
            dup = True
    return dup


class DTensorPlan:
    """The guard's plan when some gradients are DTensors: the local shards
    grouped into buckets (one :class:`nanguard.grad_guard._plan._Plan` each), and
    the all-reduces that turn the buckets' statistics into the global ones.

    Same interface as ``_Plan``: ``reduce()`` gives the float64 ``[4]``
    statistics (``first_bad`` is this rank's index into ``grads``), and
    ``apply(stats, max_norm)`` writes the gradients and returns the norm.
    """

    def __init__(self, grads, inv_scale, norm_type, found_inf, process_group):
        self.norm_type = norm_type
        self.inf_norm = norm_type == math.inf
        self.found_inf = {} if found_inf is None else found_inf
        self.process_group = process_group
        items, meshes, plain = self._sort(grads)
        self.return_mesh = self._return_mesh(grads, items, meshes, plain)
        self.main = (
            next(iter(items.values()))[0][1].device if items else
            (grads[0].device if len(grads) else torch.device("cpu"))
        )
        self.buckets = [
            _Bucket(key, _Plan([t for _, t in its], inv_scale, norm_type, self.found_inf), [i for i, _ in its])
            for key, its in items.items()
        ]
        self.unit_order: List[_Unit] = list(dict.fromkeys(b.key.unit for b in self.buckets))
        self.steps = self._steps(self.unit_order)

    def _sort(self, grads):
        """The local tensors by bucket key, in first-seen order; the meshes
        met; whether there were plain tensors."""
        mod = _dist._dtensor_module()
        meshes: List[object] = []
        items: Dict[_BucketKey, List[Tuple[int, torch.Tensor]]] = {}
        plain: List[Tuple[int, torch.Tensor]] = []
        for i, g in enumerate(grads):
            if not isinstance(g, mod.DTensor):
                plain.append((i, g))
                continue
            mesh = g.device_mesh
            coord = mesh.get_coordinate()
            if coord is None:  # this rank is not in the mesh: holds nothing
                continue
            dup = _placement_dup(i, g, coord)
            _checks.check_tensor(f"grads[{i}]", g)
            if mesh not in meshes:
                meshes.append(mesh)
            lt = _dist.local(g)
            if lt.numel():  # an empty shard (uneven FSDP2 sharding) adds nothing
                items.setdefault(_BucketKey(_Unit("mesh", mesh), dup), []).append((i, lt))
        if plain:
            if self.process_group is not None:
                items[_BucketKey(_Unit("pg"), False)] = plain
            elif meshes:  # replicated over the first DTensor's mesh
                coord = meshes[0].get_coordinate()
                key = _BucketKey(_Unit("mesh", meshes[0]), any(c != 0 for c in coord))
                items.setdefault(key, []).extend(plain)
            else:  # no DTensor this rank holds: plain tensors are local
                items[_BucketKey(_Unit("local"), False)] = plain
        return items, meshes, bool(plain)

    @staticmethod
    def _return_mesh(grads, items, meshes, plain):
        """The mesh of the returned norm: set when every gradient is a DTensor on one mesh."""
        mod = _dist._dtensor_module()
        if not plain and len(meshes) == 1 and items and all(isinstance(g, mod.DTensor) for g in grads):
            return meshes[0]
        return None

    def _steps(self, units: List[_Unit]) -> List[Tuple[object, List[_Unit]]]:
        """The collectives, in an order every rank follows: meshes in
        first-seen order, their dims in order, then process_group; each
        distinct group once, with the units it reduces."""
        steps: List[Tuple[object, List[_Unit]]] = []
        at: Dict[Tuple[int, ...], int] = {}
        for unit in units:
            if unit.kind == "mesh":
                groups = [unit.mesh.get_group(d) for d in range(unit.mesh.ndim)]
            elif unit.kind == "pg":
                groups = [self.process_group]
            else:
                groups = []
            for grp in groups:
                k = _group_ranks(grp)
                if k not in at:
                    at[k] = len(steps)
                    steps.append((grp, []))
                steps[at[k]][1].append(unit)
        return steps

    @property
    def collectives(self) -> int:
        """All-reduces one guard call issues on this rank."""
        return len(self.steps)

    def reduce(self, process_group=None) -> torch.Tensor:
        dev = self.main
        per_unit: Dict[_Unit, List[torch.Tensor]] = {}
        firsts = []
        for key, plan, idx in self.buckets:
            st = plan.reduce(None).to(dev)
            firsts.append(_first_bad_of_call(st[3], idx, dev))
            row = st[:3]
            if key.dup and not self.inf_norm:  # a replica other than coordinate 0: counts only
                row = torch.cat([torch.zeros_like(row[:1]), row[1:]])
            per_unit.setdefault(key.unit, []).append(row)
        rows = {unit: _combine_rows(torch.stack(rs), self.inf_norm) for unit, rs in per_unit.items()}
        for grp, units in self.steps:
            vec = torch.stack([rows[u] for u in units])
            red = _dist.all_reduce_stats(vec, len(units), self.inf_norm, grp)
            for j, u in enumerate(units):
                rows[u] = red[j]
        if rows:
            return torch.cat([_combine_rows(torch.stack(list(rows.values())), self.inf_norm), _first_of(firsts)])
        return _empty_stats(dev)

    def apply(self, stats: torch.Tensor, max_norm: float) -> torch.Tensor:
        total = None
        for bucket in self.buckets:
            tn = bucket.plan.apply(stats, max_norm)
            if total is None:
                total = tn
        if total is None:  # nothing on this rank: the norm from the stats
            total = _norm_from_stats(stats, self.inf_norm)
        return total.to(self.main)

    def wrap(self, total: torch.Tensor) -> torch.Tensor:
        """The norm as PyTorch returns it for the same gradients: a
        replicated DTensor when every gradient is a DTensor on one mesh
        (what ``torch.nn.utils.clip_grad_norm_`` gives under FSDP2), a plain
        tensor otherwise."""
        if self.return_mesh is None:
            return total
        mod = _dist._dtensor_module()
        mesh = self.return_mesh
        return mod.DTensor.from_local(total, mesh, [mod.Replicate()] * mesh.ndim, run_check=False)
