"""Drop-in modules: same constructor arguments and state_dict keys as the
PyTorch / Hugging Face modules they replace."""

from .attention import SafeAttention
from .layernorm import StableLayerNorm, StableRMSNorm

__all__ = ["SafeAttention", "StableLayerNorm", "StableRMSNorm"]
