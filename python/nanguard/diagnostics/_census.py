"""What :func:`nanguard.watch` records: the record of one tensor, the call
of a watched module it belongs to, and which tensors are recorded."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import IntEnum
from typing import List, NamedTuple, Tuple, Union

import torch

from ._walk import tensor_leaves
from torch import nn

from .. import distributed as _dist

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Kind(IntEnum):
    """What a record holds."""

    OUT = 0  #: an output of a module call (forward)
    IN = 1  #: an input of a module call that no watched module produced (forward)
    GRAD = 2  #: the gradient arriving at an output of a module call (backward)
    PGRAD = 3  #: a parameter's accumulated gradient
    #: a bound on an attention module's raw scores (the history's early
    #: warning): derived from recorded outputs, never an offender itself
    SCORE = 4


class Call:
    """One invocation of a watched module."""

    __slots__ = ("name", "cls", "step", "inputs", "grads")

    def __init__(self, name: str, cls: str, step: int):
        self.name = name
        self.cls = cls
        self.step = step
        self.inputs: List[Tuple[str, int]] = []  # (label, record)
        self.grads: List[int] = []  # records of gradients at its outputs


class Owner(NamedTuple):
    """The module a parameter belongs to (the "call" of a parameter gradient)."""

    name: str
    cls: str


@dataclass(slots=True)
class Rec:
    """One recorded tensor: its census is row ``slot`` of the buffers of ``dev``."""

    dev: torch.device
    slot: int
    kind: Kind
    call: Union[Call, Owner]
    label: str
    shape: torch.Size
    dtype: torch.dtype
    #: for a gradient (Kind.GRAD), the record of the forward output it belongs to
    fwd_record: int = -1


def flatten(obj, label: str, out: List[Tuple[str, torch.Tensor]]) -> None:
    """(label, tensor) for every tensor inside obj (tuples, lists, mappings
    such as ModelOutput), by the one walker of nested containers. A plain
    tensor, and a tuple of plain tensors (a module's positional inputs), are
    labelled as the walker labels them without its walk: they are most of
    what a watcher's hooks see, once per module call."""
    if type(obj) is torch.Tensor:
        out.append((label, obj))
    elif type(obj) is tuple and all(type(t) is torch.Tensor for t in obj):
        out.extend((f"{label}[{i}]", t) for i, t in enumerate(obj))
    else:
        out.extend((leaf.path, leaf.tensor) for leaf in tensor_leaves(obj, label))


def version_of(t: torch.Tensor):
    """The in-place version counter; None for inference tensors, which have
    none (their records are then never reused)."""
    return None if t.is_inference() else t._version


def recordable(t: torch.Tensor) -> bool:
    return (
        t.dtype in _FLOAT
        and (t.is_cpu or t.is_cuda)
        and t.layout == torch.strided
        and (type(t) is torch.Tensor or type(t) is nn.Parameter or _dist.is_dtensor(t))
    )


def is_ancestor(a: str, b: str) -> bool:
    """Is module name a a strict ancestor of module name b?"""
    return a != b and (a == "" or b.startswith(a + "."))


def selected(name: str, mod: nn.Module, modules) -> bool:
    if modules is None:
        return True
    if isinstance(modules, (str, type)):
        modules = [modules]
    for m in modules:
        if isinstance(m, type) and isinstance(mod, m):
            return True
        if isinstance(m, str) and (fnmatch.fnmatchcase(name, m) or name == m):
            return True
    return False


def positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
