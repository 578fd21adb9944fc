"""Functional forms of nanguard's ops, with PyTorch's signatures
(``nanguard.functional.layer_norm`` mirrors ``torch.nn.functional.layer_norm``)."""

from ._losses import z_loss
from .attention import safe_sdpa
from .layernorm import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm", "safe_sdpa", "z_loss"]
