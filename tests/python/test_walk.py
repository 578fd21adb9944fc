"""The walker of nested tensor containers: paths, innermost keys, the
containers it enters and its depth limit."""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch

from nanguard.diagnostics._walk import MAX_DEPTH, TensorLeaf, tensor_leaves


def test_paths_keys_and_order():
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    batch = {"input_ids": a, "extra": [b, {"labels": (c,)}], 3: d, "skip": ["x", 1, 2.0, None]}
    got = tensor_leaves(batch, "batch")
    assert [(x.path, x.key) for x in got] == [
        ("batch['input_ids']", "input_ids"),
        ("batch['extra'][0]", "extra"),
        ("batch['extra'][1]['labels'][0]", "labels"),
        ("batch[3]", "3"),
    ]
    assert [x.tensor for x in got] == [a, b, c, d]  # the tensors themselves, not copies
    assert all(type(x) is TensorLeaf for x in got)


def test_a_bare_tensor_and_nothing():
    t = torch.ones(2)
    assert tensor_leaves(t, "output") == [TensorLeaf("output", "", t)]
    for obj in (None, "text", b"bytes", 3, 2.5, True, object(), {}, [], ()):
        assert tensor_leaves(obj, "x") == [], obj


def test_mappings_that_are_not_dicts():
    t = torch.ones(1)
    Pair = namedtuple("Pair", "first second")
    for obj in (UserDict({"mask": t}), OrderedDict(mask=t)):
        assert tensor_leaves(obj, "b") == [TensorLeaf("b['mask']", "mask", t)]
    assert [x.path for x in tensor_leaves(Pair(t, t), "p")] == ["p[0]", "p[1]"]
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": t})
    assert tensor_leaves(enc, "batch") == [TensorLeaf("batch['input_ids']", "input_ids", t)]
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=t, hidden_states=(t, t))
    assert [x.path for x in tensor_leaves(out, "output")] == [
        "output['last_hidden_state']", "output['hidden_states'][0]", "output['hidden_states'][1]"]


def nest(t, levels):
    for i in range(levels):
        t = [t] if i % 2 else {"k": t}
    return t


def test_depth_limit():
    t = torch.ones(1)
    # a tensor inside MAX_DEPTH containers is found, one level deeper is not
    assert [x.tensor for x in tensor_leaves(nest(t, MAX_DEPTH), "r")] == [t]
    assert tensor_leaves(nest(t, MAX_DEPTH + 1), "r") == []
    deep = tensor_leaves([nest(t, MAX_DEPTH - 1), nest(t, MAX_DEPTH)], "r")
    assert len(deep) == 1 and deep[0].path.count("[") == MAX_DEPTH


def test_a_container_that_holds_itself_ends():
    t = torch.ones(1)
    loop = [t]
    loop.append(loop)
    got = tensor_leaves(loop, "r")
    assert len(got) == MAX_DEPTH and all(x.tensor is t for x in got)
