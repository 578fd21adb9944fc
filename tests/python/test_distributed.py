"""nanguard under torch.distributed: real gloo process groups on the CPU, 2 and
4 processes, nothing mocked.

Each launch runs one scenario function in every rank (this file re-run as
``python test_distributed.py --worker SCENARIO RANK WORLD PORT OUT``); each
rank returns the scenario's result (a dataclass per scenario, right above the
scenario), and the pytest tests right below each scenario check it against
references: PyTorch's own ``clip_grad_norm_`` on the same DTensor
gradients, an fp64 norm of the full (gathered) gradients, and the
unsharded computation for tensor-parallel attention and norms.

Tolerances (|got - ref| <= atol + rtol * |ref|):
- norms vs PyTorch's fp32 norm: rel 1e-6. nanguard accumulates squares in
  fp64 and rounds once to fp32; PyTorch sums fp32 per-tensor norms: both are
  within a few fp32 ulps (6e-8) of the fp64 norm, 1e-6 leaves room for the
  fp32 per-tensor norms of PyTorch over a few thousand elements.
- norms vs the fp64 norm of the full gradients: rel 2e-7 (one fp32 rounding
  of an fp64 sum: half an ulp is 6e-8).
- clipped gradients vs PyTorch's: rel 2e-6 (one fp32 multiply by a
  coefficient that agrees to the norm's tolerance; PyTorch rounds twice).
- clipped gradients vs g * fp64 coefficient: rel 3e-7 (the coefficient
  rounded to fp32, then one fp32 multiply: two half-ulp roundings).
- tensor-parallel attention / norms vs the unsharded op: the same kernel on
  row subsets, so forward results are bitwise equal where the rows are the
  same; gradients of replicated weights add partial sums from each rank in
  another order: TOLERANCES["layernorm_grad"] / ["attention_grad"].

Collective counts are measured by counting the calls that reach
``torch.distributed``'s collective functions during one guard call (the
functions are wrapped, still called).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch

import nanguard
from nanguard import grad_guard as gg

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

NORM_RTOL_TORCH = 1e-6
NORM_RTOL_FP64 = 2e-7
GRAD_RTOL_TORCH = 2e-6
GRAD_RTOL_FP64 = 3e-7

dist_ok = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)


# ---- launching ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, world: int, out_dir, timeout: float = 240.0):
    """Run SCENARIO in `world` processes; return each rank's result."""
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + sys.path)
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", scenario, str(r), str(world),
             str(port), str(out_dir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o[-6000:]}"
                    for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), log
    return [torch.load(os.path.join(out_dir, f"{scenario}.rank{r}.pt"), weights_only=False)
            for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(scenario, world):
        if (scenario, world) not in cache:
            cache[(scenario, world)] = launch(scenario, world, tmp_path_factory.mktemp(f"{scenario}{world}"))
        return cache[(scenario, world)]

    return get


def _rel(a, b):
    return abs(a - b) / abs(b)


def two(runs):
    return runs("two", 2)


def four(runs):
    return runs("four", 4)


def _part(runs, world, key):
    return [r[key] for r in (two(runs) if world == 2 else four(runs))]


def _only_all_reduces(calls, groups):
    """calls is exactly one all_reduce per group in `groups` (sets of ranks)."""
    assert [c[0] for c in calls] == ["all_reduce"] * len(groups), calls
    assert sorted(tuple(c[1]) for c in calls) == sorted(tuple(g) for g in groups), calls


# ---- worker-side helpers --------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single",
                "reduce", "gather", "scatter", "barrier", "all_gather_object",
                "broadcast_object_list")


class CountCollectives:
    """Count the calls into torch.distributed's collectives inside the block
    (each function is wrapped, and still called). Groups are recorded by
    their ranks."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls = []
        self._saved = {}
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                grp = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(grp)) if grp is not None else "default"
                self.calls.append((_name, ranks))
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _value(t) -> float:
    """A norm's value: PyTorch's inf-norm of DTensors is Partial(max), whose
    local value is this rank's own max until it is redistributed."""
    from torch.distributed.tensor import DTensor

    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def _snapshot(params):
    return [_local(p.grad).detach().clone() for p in params if p.grad is not None]


def _restore(params, saved):
    with torch.no_grad():
        for g, s in zip(_grads(params), saved):
            _local(g).copy_(s)


def _full_norm64(params):
    from torch.distributed.tensor import DTensor

    sq = 0.0
    for g in _grads(params):
        f = g.full_tensor() if isinstance(g, DTensor) else g
        sq += float(f.double().pow(2).sum())
    return math.sqrt(sq)


def _full_max(params):
    from torch.distributed.tensor import DTensor

    m = 0.0
    for g in _grads(params):
        f = g.full_tensor() if isinstance(g, DTensor) else g
        m = max(m, float(f.abs().max()))
    return m


def _compare_with_torch(params, max_norm, norm_type=2.0):
    """Guard the same gradients with PyTorch and with nanguard; returns a
    dict of norms, types, max relative gradient difference, collectives."""
    saved = _snapshot(params)
    ref64 = _full_norm64(params) if norm_type == 2.0 else _full_max(params)
    # PyTorch's inf-norm raises on a rank whose shard is empty (and the other
    # ranks would then wait in its all-reduce): compared with the exact max only
    empty = torch.tensor([float(any(_local(g).numel() == 0 for g in _grads(params)))])
    torch.distributed.all_reduce(empty, op=torch.distributed.ReduceOp.MAX)
    torch_error = None
    if norm_type == math.inf and empty.item():
        tn_t, torch_error = torch.tensor(math.nan), "empty shard"
    else:
        tn_t = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    clipped_t = _snapshot(params)
    _restore(params, saved)
    with CountCollectives() as cc:
        tn_n = nanguard.clip_grad_norm_(params, max_norm, norm_type)
    clipped_n = _snapshot(params)
    rel = 0.0
    for a, b in zip(clipped_n, clipped_t):
        d = ((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max().item() if a.numel() else 0.0
        rel = max(rel, d)
    return {
        "torch_norm": _value(tn_t), "nanguard_norm": float(_local(tn_n)), "ref64": ref64,
        "torch_type": (type(tn_t).__name__, str(getattr(tn_t, "placements", None)), tn_t.dtype),
        "nanguard_type": (type(tn_n).__name__, str(getattr(tn_n, "placements", None)), tn_n.dtype),
        "grad_rel": rel, "collectives": cc.calls, "saved": saved, "torch_error": torch_error,
        "clip_ref": max_norm / (ref64 + 1e-6),
        "grad_rel_ref": max(((a.double() - b.double() * min(1.0, max_norm / (ref64 + 1e-6))).abs()
                             / (b.double().abs() * min(1.0, max_norm / (ref64 + 1e-6))).clamp_min(1e-30)).max().item()
                            if a.numel() else 0.0 for a, b in zip(clipped_n, saved)),
    }


class Block(torch.nn.Module):
    def __init__(self, d=15, h=33):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 15), Block(), Block(), torch.nn.Linear(15, 5))


def _fsdp(model, mesh, bf16=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for m in model:
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _backward(model, rank, seed=1, scale=1.0):
    torch.manual_seed(seed + rank)
    x = torch.randn(6, 7)
    loss = model(x).float().pow(2).mean() * scale
    loss.backward()
    return loss


# ---- FSDP2: gradient guard, GradScaler, mixed meshes (2 and 4 ranks) -----------------------------


@dataclasses.dataclass
class Fsdp2Result:
    """scenario_fsdp2's record on one rank."""

    placements: list  # the gradients' placements (str)
    grad_dtypes: list  # the gradients' dtypes (str)
    l2: dict  # _compare_with_torch, max_norm 0.05 (clips)
    l2_noclip: dict  # _compare_with_torch, max_norm 1e6
    linf: dict  # _compare_with_torch, norm inf
    nan: dict  # a NaN on the last rank: norm, found_inf, nan_count, untouched
    scaler: dict  # nanguard.amp.GradScaler against PyTorch on g / scale
    mixed: dict  # DTensors on two meshes and plain tensors against fp64
    partial_error: str | None  # the message refusing a Partial gradient


def scenario_fsdp2(rank, world):
    """FSDP2 (bf16 params, fp32 reduce): norm and clip vs PyTorch, inf norm,
    NaN on one rank, GradScaler, a mix of DTensors on two meshes and plain
    tensors, collective counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    res = {}
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(_mlp(), mesh)
    params = list(model.parameters())
    _backward(model, rank)
    res["placements"] = sorted({str(p.grad.placements) for p in params})
    res["grad_dtypes"] = sorted({str(p.grad.dtype) for p in params})
    res["l2"] = _compare_with_torch(params, 0.05)  # clips
    _restore(params, res["l2"]["saved"])
    res["l2_noclip"] = _compare_with_torch(params, 1e6)
    _restore(params, res["l2"]["saved"])
    res["linf"] = _compare_with_torch(params, 0.01, math.inf)
    _restore(params, res["l2"]["saved"])

    # a NaN on the last rank only: every rank skips, nothing is written
    with torch.no_grad():
        if rank == world - 1:
            _local(params[3].grad).view(-1)[0] = math.nan
    before = _snapshot(params)
    tn, stats, found = gg.guard_(_grads(params), 1.0, 0.01)
    after = _snapshot(params)
    res["nan"] = {
        "norm": float(_local(tn)), "found_inf": float(found[torch.device("cpu")]),
        "nan_count": stats.nan_count,
        # bit for bit (the NaN itself included)
        "untouched": all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(after, before)),
    }
    _restore(params, res["l2"]["saved"])

    # nanguard.amp.GradScaler on FSDP2: unscale + clip vs PyTorch on g / scale
    model.zero_grad()
    scaler = nanguard.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(7 + rank)
    x = torch.randn(6, 7)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaled = _snapshot(params)
    with torch.no_grad():
        for g in _grads(params):
            _local(g).div_(1024.0)
    tn_t = torch.nn.utils.clip_grad_norm_(params, 0.05)
    ref = _snapshot(params)
    _restore(params, scaled)
    tn_n = scaler.unscale_and_clip_(opt, max_norm=0.05)
    got = _snapshot(params)
    res["scaler"] = {
        "torch_norm": _value(tn_t), "nanguard_norm": float(_local(tn_n)),
        "type": type(tn_n).__name__,
        "grad_rel": max(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max().item()
                        for a, b in zip(got, ref) if a.numel()),
    }
    p_before = [_local(p).detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    res["scaler"]["stepped"] = not all(torch.equal(a, _local(p)) for a, p in zip(p_before, params))
    # the next step has a NaN on rank 0 only: every rank skips and backs off
    opt.zero_grad()
    scaler.scale(model(x).float().pow(2).mean()).backward()
    with torch.no_grad():
        if rank == 0:
            _local(params[0].grad).view(-1)[1] = math.inf
    p_before = [_local(p).detach().clone() for p in params]
    scaler.unscale_and_clip_(opt, max_norm=0.05)
    scaler.step(opt)
    scaler.update()
    res["scaler"]["skipped_unchanged"] = all(torch.equal(a, _local(p)) for a, p in zip(p_before, params))
    res["scaler"]["scale_after"] = float(scaler.get_scale())
    res["scaler"]["skipped"] = [(s.nan_count, s.inf_count) for s in scaler.skipped_steps]

    # a mix: DTensors on a 1-D and on a 2-D mesh (when 4 ranks), every
    # placement, plain tensors (replicated), against the fp64 norm of the
    # full tensors, which every rank builds from the same seed
    torch.manual_seed(123)
    fulls = [torch.randn(9, 5), torch.randn(13), torch.randn(4, 3), torch.randn(6, 6), torch.randn(11, 2),
             torch.randn(3)]
    dts = [
        distribute_tensor(fulls[0], mesh, [Shard(0)]),
        distribute_tensor(fulls[1], mesh, [Shard(0)]),
        distribute_tensor(fulls[2], mesh, [Replicate()]),
        distribute_tensor(fulls[3], mesh, [Shard(1)]),
    ]
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dts.append(distribute_tensor(fulls[4], mesh2, [Shard(0), Shard(1)]))
        dts.append(distribute_tensor(fulls[5], mesh2, [Replicate(), Shard(0)]))
    else:
        dts.append(distribute_tensor(fulls[4], mesh, [Replicate()]))
        dts.append(fulls[5].clone())  # a plain tensor
    plain = [torch.randn(8) for _ in range(2)]  # same on every rank (same seed)
    grads = dts + plain
    ref_full = fulls + plain
    ref64 = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ref_full))
    refinf = max(float(t.abs().max()) for t in ref_full)
    mixed = {"ref64": ref64, "refinf": refinf}
    for norm_type, key in ((2.0, "l2"), (math.inf, "linf")):
        gs = [g.clone() for g in grads]
        max_norm = (ref64 if norm_type == 2.0 else refinf) / 3
        with CountCollectives() as cc:
            tn, stats, _ = gg.guard_(gs, 1.0, max_norm, norm_type)
        clip = max_norm / (float(_local(tn)) + 1e-6)
        worst = 0.0
        for g, f in zip(gs, ref_full):
            full = g.full_tensor() if isinstance(g, DTensor) else g
            ref = f.double() * clip
            worst = max(worst, ((full.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item())
        mixed[key] = {"norm": float(_local(tn)), "type": type(tn).__name__, "collectives": cc.calls,
                      "grad_rel": worst}
    # a NaN in a replicated DTensor on one rank only, and an Inf in a plain tensor on another
    gs = [g.clone() for g in grads]
    with torch.no_grad():
        if rank == world - 1:
            _local(gs[2]).view(-1)[0] = math.nan
        if rank == 0:
            gs[-1][0] = math.inf
    before = [_local(g).clone() for g in gs]
    tn, stats, found = gg.guard_(gs, 1.0, 0.1)
    mixed["nan"] = {"norm": float(_local(tn)), "found_inf": float(found[torch.device("cpu")]),
                    "untouched": all(torch.equal(_local(g), b) for g, b in zip(gs, before) if not torch.isnan(b).any())
                    and all(torch.equal(_local(g).isnan(), b.isnan()) for g, b in zip(gs, before))}
    res["mixed"] = mixed

    # refusals
    try:
        from torch.distributed.tensor import Partial

        pg = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        gg.guard_([pg], 1.0, 1.0)
        res["partial_error"] = None
    except ValueError as e:
        res["partial_error"] = str(e)
    return Fsdp2Result(**res)


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_bf16_norm_and_clip_match_pytorch(runs, world):
    res = _part(runs, world, "fsdp2")
    for d in res:
        assert d.placements == ["(Shard(dim=0),)"] and d.grad_dtypes == ["torch.float32"]
        for key in ("l2", "l2_noclip"):
            c = getattr(d, key)
            assert _rel(c["nanguard_norm"], c["torch_norm"]) <= NORM_RTOL_TORCH, c
            assert _rel(c["nanguard_norm"], c["ref64"]) <= NORM_RTOL_FP64, c
            assert c["grad_rel"] <= GRAD_RTOL_TORCH and c["grad_rel_ref"] <= GRAD_RTOL_FP64, c
            # the type PyTorch returns: a replicated fp32 DTensor
            assert c["nanguard_type"] == c["torch_type"] == ("DTensor", "(Replicate(),)", torch.float32)
            _only_all_reduces(c["collectives"], [range(world)])
        assert d.l2["clip_ref"] < 1.0 < d.l2_noclip["clip_ref"]  # one clips, one does not
    assert len({d.l2["nanguard_norm"] for d in res}) == 1


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_inf_norm_is_the_exact_max(runs, world):
    for d in _part(runs, world, "fsdp2"):
        c = d.linf
        assert c["nanguard_norm"] == c["ref64"]  # a max is exact
        assert c["grad_rel_ref"] <= GRAD_RTOL_FP64
        if c["torch_error"] is None:  # PyTorch refuses an empty shard (4 ranks)
            assert c["torch_norm"] == c["nanguard_norm"] and c["grad_rel"] <= GRAD_RTOL_TORCH
            assert c["torch_type"][0] == "DTensor"
        assert c["nanguard_type"][0] == "DTensor"
        _only_all_reduces(c["collectives"], [range(world)])


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_nan_on_one_rank_skips_every_rank(runs, world):
    for d in _part(runs, world, "fsdp2"):
        n = d.nan
        assert math.isnan(n["norm"]) and n["found_inf"] == 1.0 and n["untouched"], n
        assert n["nan_count"] == 1  # counted once, over every rank


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_grad_scaler(runs, world):
    for d in _part(runs, world, "fsdp2"):
        s = d.scaler
        assert _rel(s["nanguard_norm"], s["torch_norm"]) <= NORM_RTOL_TORCH, s
        assert s["grad_rel"] <= GRAD_RTOL_TORCH and s["type"] == "DTensor"
        assert s["stepped"]
        # an Inf on rank 0 only: every rank skipped the step and backed off
        assert s["skipped_unchanged"] and s["scale_after"] == 512.0 and s["skipped"] == [(0, 1)]


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_mixed_meshes_placements_and_plain_tensors(runs, world):
    for d in _part(runs, world, "fsdp2"):
        m = d.mixed
        assert _rel(m["l2"]["norm"], m["ref64"]) <= NORM_RTOL_FP64, m
        assert m["linf"]["norm"] == m["refinf"]
        for key in ("l2", "linf"):
            assert m[key]["grad_rel"] <= GRAD_RTOL_FP64, m
            assert m[key]["type"] == "Tensor"  # PyTorch refuses this mix; a plain tensor
            calls = m[key]["collectives"]
            if world == 2:
                _only_all_reduces(calls, [(0, 1)])
            else:  # the 1-D mesh (all ranks), then each dim of the 2 x 2 mesh
                assert [c[0] for c in calls] == ["all_reduce"] * 3, calls
                assert [len(c[1]) for c in calls] == [4, 2, 2], calls
        n = m["nan"]
        assert math.isnan(n["norm"]) and n["found_inf"] == 1.0 and n["untouched"], n
        assert "grads[0]" in d.partial_error and "Partial" in d.partial_error


# ---- HSDP on a 2 x 2 mesh (4 ranks) --------------------------------------------------------------


@dataclasses.dataclass
class HsdpResult:
    """scenario_hsdp's record on one rank."""

    placements: list  # the gradients' placements (str)
    l2: dict  # _compare_with_torch, norm 2
    linf: dict  # _compare_with_torch, norm inf
    nan: dict  # a NaN on rank 3: norm, found_inf, untouched


def scenario_hsdp(rank, world):
    """HSDP on a 2 x 2 mesh (replicate x shard): norm vs PyTorch, NaN on one
    replica, collective counts."""
    from torch.distributed.device_mesh import init_device_mesh

    res = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp(_mlp(), mesh)
    params = list(model.parameters())
    _backward(model, rank)
    res["placements"] = sorted({str(p.grad.placements) for p in params})
    res["l2"] = _compare_with_torch(params, 0.05)
    _restore(params, res["l2"]["saved"])
    res["linf"] = _compare_with_torch(params, 0.01, math.inf)
    _restore(params, res["l2"]["saved"])
    with torch.no_grad():
        if rank == 3:  # one replica of one shard
            _local(params[2].grad).view(-1)[0] = math.nan
    before = _snapshot(params)
    tn, stats, found = gg.guard_(_grads(params), 1.0, 0.01)
    after = _snapshot(params)
    res["nan"] = {"norm": float(_local(tn)), "found_inf": float(found[torch.device("cpu")]),
                  "untouched": all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                                   for a, b in zip(after, before))}
    return HsdpResult(**res)


@dist_ok
def test_hsdp_2x2_matches_pytorch_and_counts_each_element_once(runs):
    for d in _part(runs, 4, "hsdp"):
        assert d.placements == ["(Replicate(), Shard(dim=0))"]
        c = d.l2
        assert _rel(c["nanguard_norm"], c["torch_norm"]) <= NORM_RTOL_TORCH, c
        assert _rel(c["nanguard_norm"], c["ref64"]) <= NORM_RTOL_FP64, c
        assert c["grad_rel"] <= GRAD_RTOL_TORCH and c["grad_rel_ref"] <= GRAD_RTOL_FP64
        assert c["nanguard_type"] == c["torch_type"]
        li = d.linf
        assert li["nanguard_norm"] == li["ref64"] and li["grad_rel_ref"] <= GRAD_RTOL_FP64
        for calls in (c["collectives"], li["collectives"]):  # one per mesh dim group
            assert [x[0] for x in calls] == ["all_reduce"] * 2 and [len(x[1]) for x in calls] == [2, 2]
            assert calls[0][1] != calls[1][1]
        # a NaN on one replica of one shard (rank 3 only): every rank skips
        n = d.nan
        assert math.isnan(n["norm"]) and n["found_inf"] == 1.0 and n["untouched"], n


# ---- DDP: the guard and watch (2 ranks) ----------------------------------------------------------


@dataclasses.dataclass
class DdpWatchResult:
    """scenario_ddp_watch's record on one rank."""

    l2: dict  # _compare_with_torch, norm 2
    watch: list  # (step, None or the report's fields) per step
    after_barrier: bool  # every rank reached the barrier after the steps


def scenario_ddp_watch(rank, world):
    """DDP: the guard without process_group, and watch agreeing across ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = {}
    model = DDP(_mlp())
    params = list(model.parameters())
    torch.manual_seed(3 + rank)
    model(torch.randn(6, 7)).pow(2).mean().backward()
    res["l2"] = _compare_with_torch(params, 0.05)
    model.zero_grad()

    w = nanguard.watch(model)
    steps = []
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(6, 7)
        if step == 1 and rank == 1:
            x[2, 3] = math.nan  # a bad sample on rank 1 only
        model(x).pow(2).mean().backward()
        try:
            w.step()
            steps.append((step, None))
        except nanguard.NonFiniteError as e:
            r = e.report
            steps.append((step, {"module": r.module, "pass": r.pass_, "rank": r.rank,
                                 "bad_ranks": r.bad_ranks, "local": r.local, "text": str(r)}))
        model.zero_grad()
    w.remove()
    res["watch"] = steps
    torch.distributed.barrier()  # nobody is left behind in a collective
    res["after_barrier"] = True
    return DdpWatchResult(**res)


@dist_ok
def test_ddp_guard_needs_no_collective(runs):
    for d in _part(runs, 2, "ddp_watch"):
        c = d.l2
        assert _rel(c["nanguard_norm"], c["torch_norm"]) <= NORM_RTOL_TORCH
        assert c["grad_rel"] <= GRAD_RTOL_TORCH and c["nanguard_type"] == c["torch_type"]
        assert c["collectives"] == []  # DDP gradients are already identical on every rank


@dist_ok
def test_watch_under_ddp_every_rank_raises_in_the_same_step(runs):
    res = _part(runs, 2, "ddp_watch")
    for r, d in enumerate(res):
        steps = dict(d.watch)
        assert steps[0] is None and steps[2] is None and d.after_barrier
        rep = steps[1]
        assert rep is not None and rep["rank"] == r and rep["bad_ranks"] == [1], rep
    r1 = dict(res[1].watch)[1]
    assert r1["local"] and r1["pass"] == "forward" and "on rank 1" in r1["text"]
    r0 = dict(res[0].watch)[1]
    assert not r0["local"] and "rank(s) [1]" in r0["text"]


# ---- watch under FSDP2 (2 ranks) -----------------------------------------------------------------


@dataclasses.dataclass
class Fsdp2WatchResult:
    """scenario_fsdp2_watch's record on one rank."""

    watch: list  # (step, None or the report's fields) per step


def scenario_fsdp2_watch(rank, world):
    """watch on an FSDP2 model: a NaN made in one rank's parameter gradient
    shard (read at check time) and one in a module's forward on one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    res = {}
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(_mlp(), mesh)
    w = nanguard.watch(model)
    steps = []
    for step in range(4):
        hook = None
        if step == 2 and rank == world - 1:  # an Inf made in block 2's forward on one rank
            hook = model[2].down.register_forward_hook(
                lambda m, a, o: o.index_fill(0, torch.tensor([0]), math.inf))
        _backward(model, rank, seed=20 + step)
        if hook is not None:
            hook.remove()
        if step == 1 and rank == 0:  # a NaN in one rank's shard of a gradient
            with torch.no_grad():
                _local(model[1].up.weight.grad).view(-1)[0] = math.nan
        try:
            w.step()
            steps.append((step, None))
        except nanguard.NonFiniteError as e:
            r = e.report
            steps.append((step, {"module": r.module, "pass": r.pass_, "rank": r.rank,
                                 "bad_ranks": r.bad_ranks, "local": r.local, "text": str(r)}))
        model.zero_grad()
    w.remove()
    torch.distributed.barrier()
    res["watch"] = steps
    return Fsdp2WatchResult(**res)


@dist_ok
def test_watch_under_fsdp2(runs):
    res = _part(runs, 2, "fsdp2_watch")
    for r, d in enumerate(res):
        steps = dict(d.watch)
        assert steps[0] is None and steps[3] is None, steps
        assert steps[1]["bad_ranks"] == [0] and steps[1]["rank"] == r
        assert 1 in steps[2]["bad_ranks"] and steps[2]["rank"] == r
    # a NaN in rank 0's shard of a gradient: named there as a parameter grad
    s1 = dict(res[0].watch)[1]
    assert s1["local"] and s1["module"] == "1.up" and s1["pass"] == "parameter grad", s1
    assert "weight.grad" in s1["text"]
    assert not dict(res[1].watch)[1]["local"]
    # an Inf made in block 2's forward on rank 1
    s2 = dict(res[1].watch)[2]
    assert s2["local"] and s2["pass"] == "forward" and s2["module"].startswith("2"), s2


# ---- tensor parallel attention and norms (2 and 4 ranks) -----------------------------------------


@dataclasses.dataclass
class TpResult:
    """scenario_tp's record on one rank: {(case, placement name): comparison}
    per part (_tp_attention, _tp_norms), the plan's comparison (_tp_plan)."""

    attention: dict
    norms: dict
    plan: dict
    attention2d: dict | None = None  # 4 ranks: on a 2 x 2 mesh
    norms2d: dict | None = None


def scenario_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    att = {"batch": [Shard(0)], "heads": [Shard(1)], "seq": [Shard(2)], "replicate": [Replicate()]}
    nrm = {"batch": [Shard(0)], "seq": [Shard(1)], "hidden": [Shard(2)], "replicate": [Replicate()]}
    res = {"attention": _tp_attention(rank, world, mesh, att), "norms": _tp_norms(rank, world, mesh, nrm)}
    try:
        res["plan"] = _tp_plan(rank, world, mesh)
    except Exception:
        res["plan"] = {"error": traceback.format_exc()}
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        res["attention2d"] = _tp_attention(rank, world, mesh2, {"batch_heads": [Shard(0), Shard(1)]})
        res["norms2d"] = _tp_norms(rank, world, mesh2, {"batch_seq": [Shard(0), Shard(1)],
                                                       "seq_hidden": [Shard(1), Shard(2)]})
    return TpResult(**res)


def _check_tp(cases, op, expect):
    from conftest import TOLERANCES

    atol, _ = TOLERANCES[op][torch.float32]
    gatol, _ = TOLERANCES[op + "_grad"][torch.float32] if op + "_grad" in TOLERANCES else (atol, 0)
    for key, c in cases.items():
        if not isinstance(key, tuple):
            continue
        assert "error" not in c, c.get("error")
        assert c["out"] <= atol * (1 + c["scale"]), (key, c)
        for g in ("dq", "dk", "dv", "dx", "dw", "db"):
            if g in c:
                assert c[g] <= gatol * (1 + c["scale"]), (key, g, c)
        want = expect.get(key, expect.get(key[1]))
        if want is not None:
            assert c["out_placements"] == want, (key, c["out_placements"])


def _tp_attention(rank, world, mesh, placements_list):
    """safe_sdpa on DTensor q / k / v against the unsharded op: outputs and
    gradients."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    out = {}
    torch.manual_seed(5)
    B, Hq, Hkv, L, E = 4, 4, 2, 6, 8
    q = torch.randn(B, Hq, L, E)
    k = torch.randn(B, Hkv, L, E)
    v = torch.randn(B, Hkv, L, E)
    k1 = torch.randn(B, 1, L, E)
    v1 = torch.randn(B, 1, L, E)
    mask = torch.rand(B, 1, L, L) > 0.3
    go = torch.randn(B, Hq, L, E)
    cases = {
        "gqa_causal": (q, k, v, None, dict(is_causal=True, enable_gqa=True)),
        "mqa_mask": (q, k1, v1, mask, dict()),
    }
    for cname, (qq, kk, vv, mm, kw) in cases.items():
        qr, kr, vr = (t.clone().requires_grad_() for t in (qq, kk, vv))
        ref = nanguard.functional.safe_sdpa(qr, kr, vr, attn_mask=mm, **kw)
        ref.backward(go)
        for pname, pl in placements_list.items():
            try:
                qd = distribute_tensor(qq, mesh, pl).requires_grad_()
                kd = distribute_tensor(kk, mesh, pl if kk.shape[1] > 1 else [Replicate()] * mesh.ndim).requires_grad_()
                vd = distribute_tensor(vv, mesh, pl if vv.shape[1] > 1 else [Replicate()] * mesh.ndim).requires_grad_()
                md = None if mm is None else distribute_tensor(mm, mesh, [Replicate()] * mesh.ndim)
                o = nanguard.functional.safe_sdpa(qd, kd, vd, attn_mask=md, **kw)
                o.backward(distribute_tensor(go, mesh, o.placements))
                out[(cname, pname)] = {
                    "out_placements": str(o.placements),
                    "out": (o.full_tensor() - ref).abs().max().item(),
                    "dq": (qd.grad.full_tensor() - qr.grad).abs().max().item(),
                    "dk": (kd.grad.full_tensor() - kr.grad).abs().max().item(),
                    "dv": (vd.grad.full_tensor() - vr.grad).abs().max().item(),
                    "scale": max(ref.abs().max().item(), qr.grad.abs().max().item(),
                                 kr.grad.abs().max().item(), vr.grad.abs().max().item()),
                }
            except Exception:
                out[(cname, pname)] = {"error": traceback.format_exc()}
    # dropout is refused with DTensor inputs
    try:
        qd = distribute_tensor(q, mesh, [Replicate()] * mesh.ndim)
        nanguard.functional.safe_sdpa(qd, qd, qd, dropout_p=0.1)
        out["dropout_error"] = None
    except ValueError as e:
        out["dropout_error"] = str(e)
    return out


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_tp_attention_matches_unsharded(runs, world):
    for d in _part(runs, world, "tp"):
        # batch and heads stay sharded (no gather); a sequence shard is redistributed
        expect = {"batch": "(Shard(dim=0),)", "heads": "(Shard(dim=1),)", "replicate": "(Replicate(),)"}
        if world == 4:  # 2 key/value heads do not split over 4 ranks: not sharded on heads
            expect[("gqa_causal", "heads")] = "(Replicate(),)"
        _check_tp(d.attention, "attention", expect)
        assert "dropout_p" in d.attention["dropout_error"]
        if world == 4:
            _check_tp(d.attention2d, "attention", {})
            assert d.attention2d[("mqa_mask", "batch_heads")]["out_placements"] == \
                "(Shard(dim=0), Shard(dim=1))"


def _tp_norms(rank, world, mesh, placements_list):
    """stable_layernorm / rms_norm on DTensor activations (weight and bias
    replicated DTensor parameters) against the unsharded op."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    out = {}
    torch.manual_seed(6)
    x = torch.randn(4, 6, 16)
    w = torch.randn(16)
    b = torch.randn(16)
    go = torch.randn(4, 6, 16)
    for kind in ("layer", "rms"):
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        if kind == "layer":
            ref = nanguard.functional.layer_norm(xr, (16,), wr, br, 1e-5)
        else:
            ref = nanguard.functional.rms_norm(xr, (16,), wr, 1e-5)
        ref.backward(go)
        for pname, pl in placements_list.items():
            try:
                rep = [Replicate()] * mesh.ndim
                xd = distribute_tensor(x, mesh, pl).requires_grad_()
                wd = distribute_tensor(w, mesh, rep).requires_grad_()
                bd = distribute_tensor(b, mesh, rep).requires_grad_()
                if kind == "layer":
                    y = nanguard.functional.layer_norm(xd, (16,), wd, bd, 1e-5)
                else:
                    y = nanguard.functional.rms_norm(xd, (16,), wd, 1e-5)
                y.backward(distribute_tensor(go, mesh, y.placements))
                r = {
                    "out_placements": str(y.placements),
                    "out": (y.full_tensor() - ref).abs().max().item(),
                    "dx": (xd.grad.full_tensor() - xr.grad).abs().max().item(),
                    "dw": (wd.grad.full_tensor() - wr.grad).abs().max().item(),
                    "scale": max(xr.grad.abs().max().item(), wr.grad.abs().max().item()),
                }
                if kind == "layer":
                    r["db"] = (bd.grad.full_tensor() - br.grad).abs().max().item()
                out[(kind, pname)] = r
            except Exception:
                out[(kind, pname)] = {"error": traceback.format_exc()}
    return out


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_tp_norms_match_unsharded(runs, world):
    for d in _part(runs, world, "tp"):
        _check_tp(d.norms, "layernorm", {"batch": "(Shard(dim=0),)", "seq": "(Shard(dim=1),)",
                                             "replicate": "(Replicate(),)"})
        # the normalized dim sharded: redistributed, never computed on a part of a row
        assert all("Shard(dim=2)" not in c["out_placements"] for k, c in d.norms.items())
        if world == 4:
            _check_tp(d.norms2d, "layernorm", {"batch_seq": "(Shard(dim=0), Shard(dim=1))"})


class TPBlock(torch.nn.Module):
    """Pre-norm causal self-attention with a residual, written as model code
    is: nanguard's RMSNorm and SafeAttention modules."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm = nanguard.nn.StableRMSNorm(d, eps=1e-5)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, d, bias=False)
        self.v = torch.nn.Linear(d, d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.attn = nanguard.nn.SafeAttention(is_causal=True)

    def forward(self, x):
        h = self.norm(x)
        B, L = h.shape[0], h.shape[1]
        q, k, v = (m(h).view(B, L, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = self.attn(q, k, v).transpose(1, 2).reshape(B, L, -1)
        return x + self.o(a)


def _tp_plan(rank, world, mesh):
    """A Megatron-style sequence + tensor parallel plan (parallelize_module):
    the norm gets a sequence-sharded DTensor, the attention DTensors sharded
    on heads; output and every parameter gradient against the unsharded
    block."""
    import copy

    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(8)
    ref = TPBlock()
    with torch.no_grad():
        ref.norm.weight.normal_()
    model = copy.deepcopy(ref)
    x = torch.randn(2, 8, 16)
    go = torch.randn(2, 8, 16)
    y_ref = ref(x)
    y_ref.backward(go)
    col = dict(input_layouts=Shard(1), use_local_output=False)
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(use_local_output=False),
        "q": ColwiseParallel(**col), "k": ColwiseParallel(**col), "v": ColwiseParallel(**col),
        "o": RowwiseParallel(output_layouts=Shard(1)),
    })
    seen = {}
    model.attn.register_forward_pre_hook(
        lambda m, a: seen.update(attn_in=[str(t.placements) for t in a]))
    model.norm.register_forward_hook(lambda m, a, o: seen.update(norm_out=str(o.placements)))
    x_local = x.chunk(world, dim=1)[rank]
    y_local = model(x_local)
    y_local.backward(go.chunk(world, dim=1)[rank])
    y = DTensor.from_local(y_local, mesh, [Shard(1)]).full_tensor()
    out = {"seen": seen, "out": (y - y_ref).abs().max().item(), "scale": y_ref.abs().max().item()}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        r = dict(ref.named_parameters())[name].grad
        out["d_" + name] = (g - r).abs().max().item()
        out["scale"] = max(out["scale"], r.abs().max().item())
    return out


@dist_ok
@pytest.mark.parametrize("world", [2, 4])
def test_tp_plan_block_matches_unsharded(runs, world):
    """parallelize_module with SequenceParallel norms and Colwise / Rowwise
    projections: nanguard's modules receive DTensors and stay sharded."""
    from conftest import TOLERANCES

    for d in _part(runs, world, "tp"):
        c = d.plan
        assert "error" not in c, c.get("error")
        assert c["seen"] == {"norm_out": "(Shard(dim=1),)", "attn_in": ["(Shard(dim=1),)"] * 3}, c["seen"]
        atol = TOLERANCES["attention"][torch.float32][0]
        gatol = TOLERANCES["attention_grad"][torch.float32][0]
        assert c["out"] <= atol * (1 + c["scale"]), c
        grads = {k: v for k, v in c.items() if k.startswith("d_")}
        assert len(grads) == 5 and max(grads.values()) <= gatol * (1 + c["scale"]), c


# ---- a small Llama, patched, FSDP2 bf16, guard and watch in the loop (2 ranks) -------------------


@dataclasses.dataclass
class LlamaResult:
    """scenario_llama's record on one rank."""

    steps: list  # per step: loss, norms, collectives, the report, untouched
    patched: str  # nanguard.patch's summary
    param_checksum: float  # sum of the full parameters after the loop


def scenario_llama(rank, world):
    """A small Llama from transformers, patched with nanguard.patch, FSDP2 with
    bf16 params / fp32 reduce per decoder layer; nanguard.watch and the guard
    in the loop; a NaN made on one rank at step 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    res = {"steps": []}
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.0)
    model = LlamaForCausalLM(cfg)
    summary = nanguard.patch(model)
    res["patched"] = str(summary)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = nanguard.watch(model)
    bad_rank = world - 1
    for step in range(5):
        torch.manual_seed(100 * step + rank)
        ids = torch.randint(0, 64, (2, 12))
        hook = None
        if step == 2 and rank == bad_rank:
            hook = model.model.layers[1].mlp.register_forward_hook(
                lambda m, a, o: o.index_fill(1, torch.tensor([5]), math.nan))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if hook is not None:
            hook.remove()
        # PyTorch's norm of the same gradients, then the guard
        with torch.no_grad():
            torch_norm = torch.nn.utils.get_total_norm(_grads(params), 2.0)
        before = _snapshot(params)
        with CountCollectives() as cc:
            tn = nanguard.clip_grad_norm_(params, 1.0)
        after = _snapshot(params)
        rec = {"step": step, "loss": loss.item(), "torch_norm": _value(torch_norm),
               "nanguard_norm": float(_local(tn)), "norm_type": type(tn).__name__,
               "collectives": cc.calls, "report": None}
        try:
            w.step()
            opt.step()
        except nanguard.NonFiniteError as e:
            r = e.report
            rec["report"] = {"module": r.module, "pass": r.pass_, "rank": r.rank,
                             "bad_ranks": r.bad_ranks, "local": r.local}
            rec["untouched"] = all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(after, before))
        opt.zero_grad()
        res["steps"].append(rec)
    w.remove()
    # every rank holds the same full parameters afterwards
    res["param_checksum"] = float(sum(p.full_tensor().double().sum() for p in params))
    return LlamaResult(**res)


@dist_ok
def test_llama_fsdp2_training_loop_with_guard_and_watch(runs):
    pytest.importorskip("transformers")
    res = runs("llama", 2)
    for r, d in enumerate(res):
        assert "safe_sdpa" in d.patched and "RMSNorm" in d.patched
        for s in d.steps:
            _only_all_reduces(s["collectives"], [(0, 1)])
            assert s["norm_type"] == "DTensor"
            if s["step"] == 2:  # NaN made on rank 1: every rank raises and skips
                assert math.isnan(s["nanguard_norm"]) and s["untouched"]
                assert s["report"] is not None and s["report"]["rank"] == r
                assert 1 in s["report"]["bad_ranks"]
            else:
                assert s["report"] is None and math.isfinite(s["loss"])
                assert _rel(s["nanguard_norm"], s["torch_norm"]) <= NORM_RTOL_TORCH, s
    bad = res[1].steps[2]["report"]
    assert bad["local"] and bad["pass"] == "forward" and bad["module"].startswith("model.layers.1")
    assert res[0].param_checksum == res[1].param_checksum


# ---- the launches and the worker -----------------------------------------------------------------


def scenario_two(rank, world):
    """Everything that runs on 2 ranks, in one launch (process start-up is
    most of the cost)."""
    return {"fsdp2": scenario_fsdp2(rank, world), "tp": scenario_tp(rank, world),
            "ddp_watch": scenario_ddp_watch(rank, world),
            "fsdp2_watch": scenario_fsdp2_watch(rank, world)}


def scenario_four(rank, world):
    """Everything that runs on 4 ranks (2 x 2 meshes), in one launch."""
    return {"fsdp2": scenario_fsdp2(rank, world), "hsdp": scenario_hsdp(rank, world),
            "tp": scenario_tp(rank, world)}


# ---- Rewind under DDP (2 ranks) -------------------------------------------------------------------


@dataclasses.dataclass
class DdpRewindResult:
    """scenario_ddp_rewind's record on one rank."""

    events: list  # (trigger kind, trigger step, restored step, blame) per rewind
    skipped: list  # the batch indices this rank skipped
    global_step: int
    history: list  # the batch index of each step that stood
    params: list  # the final parameters
    finite: bool


def scenario_ddp_rewind(rank, world):
    """A DDP MLP under nanguard.Rewind(every=5); rank 1's batch 6 holds a
    NaN. Rank 1's loss is NaN; the all-reduced gradients make rank 0's
    non-finite too: both ranks rewind to step 5 together, both test their
    batch 6 from there (rank 0's gradients fail again with rank 1's), blame
    the data, and train on in step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    data = []
    for i in range(30):
        x = torch.randn(4, 8, generator=g)
        y = x.sum(1, keepdim=True)
        if rank == 1 and i == 6:
            x[0, 0] = math.nan
        data.append((x, y))
    rw = nanguard.Rewind(model, opt, every=5, keep=3)
    for _, (x, y) in rw.loop(data, 12):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = nanguard.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rw.step(loss, gn)
    return DdpRewindResult(
        events=[(e.trigger.kind, e.trigger.step, e.restored_step, e.blame) for e in rw.events],
        skipped=[d["batch"] for d in rw.skipped_batches], global_step=rw.global_step,
        history=[r.batch for r in rw.history], params=[p.detach().clone() for p in net.parameters()],
        finite=all(bool(torch.isfinite(p).all()) for p in net.parameters()))


@dist_ok
def test_rewind_under_ddp_every_rank_rewinds_together(runs):
    r0, r1 = runs("ddp_rewind", 2)
    assert r1.events == [("non-finite loss", 6, 5, "data")]
    assert r0.events == [("non-finite gradients", 6, 5, "data")]  # rank 1's NaN reached its gradients
    assert r1.skipped == [6] and r0.skipped == [6]
    assert r0.global_step == r1.global_step == 12 and r0.history == r1.history == [i for i in range(13) if i != 6]
    assert r0.finite and r1.finite
    assert all(torch.equal(a, b) for a, b in zip(r0.params, r1.params))  # DDP's replicas still agree


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def _worker(scenario, rank, world, port, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        res = SCENARIOS[scenario](rank, world)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # the other ranks fail fast instead of waiting in a collective
    torch.save(res, os.path.join(out, f"{scenario}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


# ---- one process ---------------------------------------------------------------------------------


def test_without_dtensors_nothing_changes():
    from nanguard import distributed as nd

    assert not nd.is_dtensor(torch.ones(2)) and not nd.any_dtensor([torch.ones(2)])
    assert nd.local(torch.ones(2)).shape == (2,)
    with pytest.raises(TypeError, match="agree"):
        nanguard.watch(torch.nn.Linear(2, 2), agree=1)
    from nanguard.diagnostics import Report

    rep = Report("", "", "", 3, rank=0, bad_ranks=[1])
    assert not rep.local and "rank(s) [1]" in str(rep) and "step 3" in str(rep)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    # run the scenario from the module as pytest imports it, so that the
    # result dataclasses are pickled as test_distributed.*, not __main__.*
    import test_distributed

    test_distributed._worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
