"""Finding the model inside the wrappers training code puts around it, and
transformers' ``PreTrainedModel`` when transformers is in use."""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

from torch import nn


def unwrap(model: nn.Module) -> Tuple[nn.Module, List[str]]:
    """The model inside the wrappers training code puts around it, and the
    wrappers' class names (outermost first): ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod``), ``DistributedDataParallel`` /
    ``DataParallel`` / FSDP's ``FullyShardedDataParallel`` (``module``),
    peft's ``PeftModel`` (``get_base_model()``) and its tuner (``model``).
    accelerate's ``prepare`` returns one of these or the model itself; an
    FSDP2 (``fully_shard``) module is the model itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    chain: List[str] = []
    for _ in range(32):
        inner = _inner(model)
        if inner is None or inner is model:
            break
        chain.append(type(model).__name__)
        model = inner
    return model, chain


def _inner(model: nn.Module) -> Optional[nn.Module]:
    """The module one wrapper holds, or None when ``model`` is no wrapper."""
    cls = type(model)
    name, mod = cls.__name__, cls.__module__
    if name == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return model._orig_mod
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or (
            name == "FullyShardedDataParallel" and mod.startswith("torch.distributed")):
        return model.module
    if mod.startswith("peft"):
        if callable(getattr(model, "get_base_model", None)) and name.startswith("Peft"):
            return model.get_base_model()
        if isinstance(getattr(model, "model", None), nn.Module):
            return model.model
    return None


def _hf_pretrained_base() -> Optional[type]:
    """transformers' ``PreTrainedModel``, or None when transformers has not
    been imported (a model of transformers cannot exist without it)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel
