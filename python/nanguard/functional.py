"""Functional forms of nanguard's ops, with PyTorch's signatures
(``nanguard.functional.layer_norm`` mirrors ``torch.nn.functional.layer_norm``)."""

from .attention import safe_sdpa
from .layernorm import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm", "safe_sdpa"]
