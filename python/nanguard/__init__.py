"""nanguard: NaN-safe attention, normalization and gradient guards for PyTorch.

The kernels are C and CUDA C registered as ``torch.ops.nanguard.*`` through
PyTorch's stable C ABI. Importing this package loads them and registers their
autograd formulas and fake (meta) kernels.
"""

from __future__ import annotations

from . import _lib

_lib.load()

from . import layernorm  # noqa: E402  (registers autograd / fake kernels)
from . import functional, nn  # noqa: E402
from ._info import info  # noqa: E402

__version__ = "0.1.0"

__all__ = ["functional", "nn", "info", "__version__"]
