"""The walker of nested tensor containers: paths, innermost keys, the
containers it enters and its depth limit."""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch

from nanguard.diagnostics._walk import MAX_DEPTH, TensorLeaf, rebuild, tensor_leaves


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


def test_rebuild_keeps_the_nesting_and_transforms_every_leaf():
    Pair = namedtuple("Pair", "a b")
    t = torch.arange(3.0)
    obj = OrderedDict([("x", [1, (t, "s")]), (7, Pair(None, 2.5)), ("u", UserDict({"k": [True]}))])
    seen = []

    def leaf(v, path):
        seen.append(path)
        return ("leaf", v)

    got = rebuild(obj, "kwargs", leaf)
    assert type(got) is dict and list(got) == ["x", "7", "u"]  # mappings as dicts with str keys
    assert got["x"] == [("leaf", 1), (("leaf", t), ("leaf", "s"))]
    assert type(got["x"][1]) is tuple and type(got["7"]) is tuple  # a namedtuple as a plain tuple
    assert got["7"] == (("leaf", None), ("leaf", 2.5))
    assert got["u"] == {"k": [("leaf", True)]}
    assert seen == ["kwargs['x'][0]", "kwargs['x'][1][0]", "kwargs['x'][1][1]", "kwargs[7][0]", "kwargs[7][1]",
                    "kwargs['u']['k'][0]"]


def test_rebuild_refuses_what_is_too_deep_and_what_the_leaf_refuses():
    deep = t = torch.zeros(1)
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert rebuild(deep, "a", lambda v, p: v)  # MAX_DEPTH containers: fine
    with pytest.raises(ValueError, match=r"a\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\] is nested more than 8"):
        rebuild([deep], "a", lambda v, p: v)
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match="nested more than"):
        rebuild(loop, "loop", lambda v, p: v)

    def refuse(v, path):
        raise TypeError(f"{path} is a {type(v).__name__}")

    with pytest.raises(TypeError, match=r"b\['z'\]\[1\] is a int"):
        rebuild({"z": [t, 3]}, "b", lambda v, p: v if isinstance(v, torch.Tensor) else refuse(v, p))
