"""The one walker of nested tensor containers (a batch, a module's inputs or
outputs): mappings (``dict``, ``BatchEncoding``, ``ModelOutput``), lists and
tuples, entered at most :data:`MAX_DEPTH` containers deep."""

from __future__ import annotations

from collections.abc import Mapping
from typing import List, NamedTuple

import torch

__all__ = ["MAX_DEPTH", "TensorLeaf", "tensor_leaves"]

#: A tensor is found when at most this many containers enclose it; deeper
#: containers are not entered (this also bounds a container that holds itself).
MAX_DEPTH = 8


class TensorLeaf(NamedTuple):
    path: str  #: e.g. ``batch['labels'][0]``: the root's name, then one index per container
    key: str  #: the innermost mapping key on the path, as a string; "" when there is none
    tensor: torch.Tensor


def tensor_leaves(obj, root: str) -> List[TensorLeaf]:
    """Every tensor inside ``obj`` (itself included), in container order.

    ``root`` names ``obj`` in the paths. Mappings are entered through
    ``items()``, lists and tuples by position; anything else that is not a
    tensor (strings, numbers, None, other objects) is skipped.
    """
    out: List[TensorLeaf] = []
    _visit(obj, root, "", 0, out)
    return out


def _visit(obj, path: str, key: str, depth: int, out: List[TensorLeaf]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(TensorLeaf(path, key, obj))
    elif depth >= MAX_DEPTH or isinstance(obj, (str, bytes)):
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _visit(v, f"{path}[{k!r}]", str(k), depth + 1, out)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _visit(v, f"{path}[{i}]", key, depth + 1, out)
