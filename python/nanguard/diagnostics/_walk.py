"""The one walker of nested tensor containers (a batch, a module's inputs or
outputs, a flight record's arguments): mappings (``dict``, ``BatchEncoding``,
``ModelOutput``), lists and tuples, entered at most :data:`MAX_DEPTH`
containers deep. :func:`tensor_leaves` collects the tensors;
:func:`rebuild` copies the structure with every leaf transformed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, NamedTuple

import torch

__all__ = ["MAX_DEPTH", "TensorLeaf", "rebuild", "tensor_leaves"]

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


def rebuild(obj, root: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``obj`` with the same nesting, every mapping a ``dict`` with ``str``
    keys, every list a list, every tuple a tuple, and every other value
    ``leaf(value, path)`` (``leaf`` may raise to refuse one). A container
    deeper than :data:`MAX_DEPTH` is refused with ``ValueError`` naming its path."""
    return _rebuild(obj, root, leaf, 0)


def _is_container(obj) -> bool:
    return isinstance(obj, (Mapping, tuple, list)) and not isinstance(obj, torch.Tensor)


def _rebuild(obj, path: str, leaf, depth: int):
    if not _is_container(obj):
        return leaf(obj, path)
    if depth >= MAX_DEPTH:
        raise ValueError(f"{path} is nested more than {MAX_DEPTH} containers deep")
    if isinstance(obj, Mapping):
        return {str(k): _rebuild(v, f"{path}[{k!r}]", leaf, depth + 1) for k, v in obj.items()}
    items = [_rebuild(v, f"{path}[{i}]", leaf, depth + 1) for i, v in enumerate(obj)]
    return items if isinstance(obj, list) else tuple(items)


def _visit(obj, path: str, key: str, depth: int, out: List[TensorLeaf]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(TensorLeaf(path, key, obj))
    elif depth >= MAX_DEPTH or not _is_container(obj):
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _visit(v, f"{path}[{k!r}]", str(k), depth + 1, out)
    else:
        for i, v in enumerate(obj):
            _visit(v, f"{path}[{i}]", key, depth + 1, out)
