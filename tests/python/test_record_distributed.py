"""The flight record under torch.distributed: each rank writes its own file
(``nanguard-step<N>-rank<R>.pt``), and parameters that are DTensors are
saved as their local shards with their placements in ``sharding``. A
single-process gloo world of size 1 with a one-dimensional DeviceMesh runs
the real DTensor code paths (tensor parallel plans shard the weights)."""

from __future__ import annotations

import datetime
import math
import os
import socket

import pytest
import torch
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.fixture
def world_of_one():
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (1,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, plain


def test_dtensor_parameters_are_saved_as_local_shards_with_placements(world_of_one, tmp_path):
    import nanguard
    from nanguard.diagnostics._flight_record import load_record
    from torch.distributed.tensor import DTensor

    model, plain = _tp_model()
    assert isinstance(model[0].weight, DTensor) and isinstance(model[2].weight, DTensor)
    w = nanguard.watch(model, record_dir=tmp_path / "rec", policy="record")
    x = torch.randn(3, 8)
    x[1, 4] = math.nan  # a NaN in the batch: the step is non-finite
    model(x).sum().backward()
    rep = w.step()
    w.remove()
    assert rep is not None and rep.rank == 0
    path = str(tmp_path / "rec" / "nanguard-step0-rank0.pt")
    assert rep.replay_path == path and os.listdir(tmp_path / "rec") == ["nanguard-step0-rank0.pt"]
    rec = load_record(path)  # weights_only: shards are plain tensors, placements are strings
    assert rec.rank == 0
    placements = {k: v["placements"] for k, v in rec.sharding.items()}
    assert placements == {"0.weight": ["Shard(dim=0)"], "0.bias": ["Shard(dim=0)"],
                          "2.weight": ["Shard(dim=1)"], "2.bias": ["Replicate()"]}
    assert rec.sharding["2.weight"]["global_shape"] == [4, 16]
    assert {tuple(v["mesh_shape"]) for v in rec.sharding.values()} == {(1,)}
    for k, v in rec.state.items():
        assert type(v) is torch.Tensor, k
        local = model.state_dict()[k].to_local()
        assert torch.equal(v, local), k
        assert torch.equal(v, plain[k]), k  # a world of one: each local shard is the whole tensor
    assert torch.allclose(rec.args[0], x, equal_nan=True)
    with pytest.raises(NotImplementedError, match="DTensor shards"):
        nanguard.replay(path, model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
