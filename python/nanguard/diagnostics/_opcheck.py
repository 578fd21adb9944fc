"""The op-level checker behind :func:`nanguard.replay`: the first aten op,
forward or backward, that made a non-finite value from finite inputs.

Three views of one step, joined:

- a ``TorchDispatchMode`` sees every aten op below autograd, forward and
  backward, with its real inputs and outputs: it checks the floating outputs
  of each op whose floating inputs (tensors, and float scalars such as a
  ``masked_fill`` value) are all finite, and keeps the first op whose output
  is not;
- forward pre/post hooks on every named module keep the stack of modules
  running, so a forward op is attributed to the innermost one (none: the op
  ran outside the model, in the loss function). A non-finite value made
  inside a module call whose outputs are all finite was absorbed there
  (GPT-2's ``gelu_new`` cubes its input, and ``tanh`` of the resulting
  ``inf`` is 1): it is dropped, and the search goes on;
- a ``TorchFunctionMode`` maps each autograd node made in the forward to the
  module that made it, and a pre-hook on every node of the loss's graph names
  the node (``AddmmBackward0``) and its module while its backward ops run.
  Nodes made inside a PyTorch function (an autocast cast) take the module of
  the node that consumed their output.

It reads every op's outputs back to the host: slow, and meant for one step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops whose output is uninitialised memory or a pure allocation: their NaN
# is garbage about to be overwritten, not a result.
_SKIP = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "resize_", "set_")


def _op_stats(t: torch.Tensor) -> dict:
    """An op's input or output as the report shows it: shape, dtype, max |x|
    over finite values, and non-finite counts (not ``nanguard.tensor_stats``,
    the op that counts on the device)."""
    info: Dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if t.is_floating_point() and t.numel():
        x = t.detach().float()
        fin = torch.isfinite(x)
        info["max_abs"] = float(x[fin].abs().max()) if bool(fin.any()) else None
        info["nan"] = int(torch.isnan(x).sum())
        info["inf"] = int(torch.isinf(x).sum())
    return info


@dataclasses.dataclass
class FirstNonFinite:
    """Where a step first made a non-finite value from finite inputs."""

    op: str  # "aten::matmul"
    pass_: str  # "forward" or "backward"
    module: Optional[str]  # innermost module path; None: outside the model
    node: Optional[str]  # the autograd node for a backward op ("AddmmBackward0")
    inputs: List[dict]  # _op_stats of each tensor input
    output: dict  # _op_stats of the first non-finite output

    def where(self) -> str:
        place = f"in `{self.module}`" if self.module else "outside the model"
        node = f", node `{self.node}`" if self.node else ""
        return f"`{self.op}` ({self.pass_}{node}) {place}"


def _finite(x) -> bool:
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point() and not x.is_complex():
            return True
        return x.numel() == 0 or bool(torch.isfinite(x).all())
    if isinstance(x, float):
        return math.isfinite(x)
    return True


def _op_name(func) -> str:
    name = func._schema.name  # "aten::addmm"
    return name


class OpChecker:
    """Attach to a model, run one step inside ``with checker:``, read
    ``checker.first``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.first: Optional[FirstNonFinite] = None
        self.absorbed: List[FirstNonFinite] = []  #: non-finite values a module's finite outputs absorbed
        self._stack: List[str] = []
        self._calls: List[int] = []  # ids of the module calls running, innermost last
        self._next_call = 0
        self._first_calls: tuple = ()  # the calls running when ``first`` was made
        self._node_module: Dict[Any, Optional[str]] = {}
        self._node: Optional[str] = None
        self._node_mod: Optional[str] = None
        self._backward = False
        self._handles: list = []
        self._dispatch = _Dispatch(self)
        self._function = _Function(self)

    # -- forward: which module is running ------------------------------------------------------
    def _hooks(self) -> None:
        def enter(label):
            self._stack.append(label)
            self._calls.append(self._next_call)
            self._next_call += 1

        def leave(_m, _args, output):  # a forward hook's return value would replace the output: return None
            self._stack.pop()
            call = self._calls.pop()
            if (self.first is not None and not self._backward and call in self._first_calls
                    and all(_finite(o) for o in tree_flatten(output)[0])):
                self.absorbed.append(self.first)  # made inside this call, gone from its outputs
                self.first, self._first_calls = None, ()

        for name, m in self.model.named_modules():
            label = name or type(m).__name__
            self._handles.append(m.register_forward_pre_hook(lambda _m, _a, label=label: enter(label)))
            self._handles.append(m.register_forward_hook(leave, always_call=True))

    def module(self) -> Optional[str]:
        return self._stack[-1] if self._stack else None

    # -- backward: which node is running ----------------------------------------------------------
    def watch_backward(self, root: torch.Tensor) -> None:
        """Name every node of ``root``'s graph while its backward runs; call
        between the forward and ``backward()``."""
        fn = root.grad_fn
        if fn is None:
            return
        seen = {fn}
        todo = [(fn, self._node_module.get(fn))]
        while todo:
            node, inherited = todo.pop()
            mod = self._node_module.get(node, inherited)
            self._handles.append(node.register_prehook(lambda _g, node=node, mod=mod: self._enter(node, mod)))
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, mod))
        self._backward = True

    def _enter(self, node, mod) -> None:
        self._node, self._node_mod = node.name(), mod

    # -- the check -------------------------------------------------------------------------------
    def check(self, func, args, kwargs, out) -> None:
        if self.first is not None:
            return
        name = _op_name(func)
        if name.split("::")[-1] in _SKIP:
            return
        inputs, _ = tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))
        if not all(_finite(x) for x in inputs):
            return
        outs, _ = tree_flatten(out)
        bad = next((o for o in outs if isinstance(o, torch.Tensor) and not _finite(o)), None)
        if bad is None:
            return
        backward = self._backward and self._node is not None
        self.first = FirstNonFinite(
            op=name, pass_="backward" if backward else "forward",
            module=self._node_mod if backward else self.module(),
            node=self._node if backward else None,
            inputs=[_op_stats(x) for x in inputs if isinstance(x, torch.Tensor)],
            output=_op_stats(bad))
        self._first_calls = () if backward else tuple(self._calls)

    def __enter__(self) -> "OpChecker":
        self._hooks()
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def forward_done(self) -> None:
        """The forward is over: stop mapping nodes to modules."""
        self._function.active = False


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: OpChecker):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner.check(func, args, kwargs, out)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: OpChecker):
        super().__init__()
        self.owner = owner
        self.active = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            mod = self.owner.module()
            for o in tree_flatten(out)[0]:
                fn = getattr(o, "grad_fn", None) if isinstance(o, torch.Tensor) else None
                if fn is not None and fn not in self.owner._node_module:
                    self.owner._node_module[fn] = mod
        return out
