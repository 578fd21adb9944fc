"""Two training-setup levers that the literature ties to stability, as
helpers: a learning-rate warmup, and the residual-branch init rescale.

- :func:`warmup`: a linear warmup to the optimizer's learning rate (longer
  warmup lowers LR sensitivity: Wortsman et al. 2023, "Small-scale proxies
  for large-scale Transformer training instabilities").
- :func:`rescale_residual_init`: the output projection of every residual
  branch (attention's ``o_proj`` / ``c_proj`` / ``out_proj``, the MLP's
  ``down_proj`` / ``c_proj`` / ``fc2`` / ...) multiplied by
  ``1 / sqrt(2 * n_layers)``, GPT-2's scheme (Radford et al. 2019): the
  residual stream's variance then grows with depth as one branch's, not as
  ``2 * n_layers`` branches'. Use it right after initialisation: on a
  pretrained model it is a change of the model, not of its init; and
  transformers' GPT-2 init already scales its ``c_proj`` weights this way
  (do not apply it twice).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

__all__ = ["warmup", "rescale_residual_init", "RESIDUAL_PROJECTIONS"]

#: child names of the residual branches' output projections in Hugging Face
#: families (Llama-likes, GPT-2, GPT-J / NeoX, OPT / BART, T5, BERT-likes)
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "c_proj", "fc_out", "dense_4h_to_h", "fc2", "wo")


def warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that ramps every param group's learning rate linearly
    from ``lr / steps`` at step 0 to ``lr`` at step ``steps - 1``, then
    holds it; call ``scheduler.step()`` after each optimizer step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps))


def _n_layers(model: nn.Module) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def rescale_residual_init(model: nn.Module, n_layers: Optional[int] = None) -> int:
    """Multiply the weight of every residual output projection of ``model``
    (a child named one of :data:`RESIDUAL_PROJECTIONS`; their biases are
    left as they are) by ``1 / sqrt(2 * n_layers)``. ``n_layers``: the
    number of blocks (default: the model's ``config``). Returns how many
    weights were scaled; raises ``ValueError`` when there is none or the
    depth is unknown."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if n_layers is None:
        n_layers = _n_layers(model)
        if n_layers is None:
            raise ValueError("n_layers: the model has no config with its depth; pass n_layers=")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be an int >= 1, got {n_layers!r}")
    factor = 1.0 / math.sqrt(2 * n_layers)
    n = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS and isinstance(getattr(m, "weight", None),
                                                                             torch.Tensor):
                m.weight.mul_(factor)
                n += 1
    if n == 0:
        raise ValueError(f"no residual output projection ({', '.join(RESIDUAL_PROJECTIONS)}) in "
                         f"{type(model).__name__}")
    return n
