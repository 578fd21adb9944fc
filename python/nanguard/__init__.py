"""nanguard: NaN-safe attention, normalization and gradient guards for PyTorch.

The kernels are C and CUDA C registered as ``torch.ops.nanguard.*`` through
PyTorch's stable C ABI. Importing this package loads them and registers their
autograd formulas and fake (meta) kernels.
"""

from __future__ import annotations

from . import _lib

_lib.load()

from . import layernorm  # noqa: E402  (registers autograd / fake kernels)
from . import attention  # noqa: E402
from . import amp, grad_guard  # noqa: E402
from .grad_guard import clip_grad_norm_  # noqa: E402
from . import functional, nn  # noqa: E402
from ._info import info  # noqa: E402
from .tensor_stats import tensor_stats, tensor_stats_  # noqa: E402
from .watch import NonFiniteError, watch  # noqa: E402
from .doctor import check_batch, doctor  # noqa: E402
from .patching import patch, unpatch  # noqa: E402  (transformers is imported on first use)

__version__ = "0.1.0"

__all__ = ["functional", "nn", "info", "__version__", "amp", "clip_grad_norm_"]
__all__ += ["tensor_stats", "tensor_stats_", "watch", "NonFiniteError", "check_batch", "doctor"]
__all__ += ["patch", "unpatch"]
