"""nanguard: NaN-safe attention, normalization and gradient guards for PyTorch.

The kernels are C and CUDA C registered as ``torch.ops.nanguard.*`` through
PyTorch's stable C ABI. Importing this package loads them and registers their
autograd formulas and fake (meta) kernels, and the composite path (the same
ops in PyTorch operations) for every device without a kernel of nanguard's.

Every public name is either a function or class, or the module of the same
name, never both: the diagnostic tools' code is in ``nanguard.diagnostics``
(re-exported here: ``nanguard.watch(model)``, ``nanguard.Report``, ...) and
the op ``tensor_stats_``'s in the private ``nanguard._tensor_stats``.
"""

from __future__ import annotations

from . import _lib
from ._lib import LibraryUnavailableWarning

_lib.load()

from . import composite  # noqa: E402

composite.register(define=_lib.composite_only() is not None)

from . import layernorm  # noqa: E402  (registers autograd / fake kernels)
from . import attention  # noqa: E402
from . import amp, grad_guard  # noqa: E402
from .grad_guard import clip_grad_norm_  # noqa: E402
from . import functional, nn  # noqa: E402
from ._losses import z_loss  # noqa: E402
from ._stability import rescale_residual_init, warmup  # noqa: E402
from ._study import StudyConfig, study  # noqa: E402
from ._info import info  # noqa: E402
from ._tensor_stats import new_stats_buffers, tensor_stats, tensor_stats_  # noqa: E402
from .amp import SkippedStep  # noqa: E402
from . import diagnostics  # noqa: E402
from .diagnostics import *  # noqa: E402,F401,F403  (watch, Watch, Report, NonFiniteError, ...)
from . import patching  # noqa: E402
from . import rewind  # noqa: E402
from .rewind import Rewind, RewindError  # noqa: E402
from .patching import PatchSummary, UnsupportedModuleError, patch, unpatch  # noqa: E402  (transformers is imported on first use)

from ._version import __version__  # noqa: E402

__all__ = ["functional", "nn", "info", "composite", "__version__", "amp", "clip_grad_norm_", "z_loss", "warmup",
           "rescale_residual_init", "study", "StudyConfig"]
__all__ += ["tensor_stats", "tensor_stats_", "new_stats_buffers", "SkippedStep", "diagnostics"]
__all__ += diagnostics.__all__  # the diagnostic tools and the classes they raise or return
__all__ += ["patching", "patch", "unpatch", "PatchSummary", "UnsupportedModuleError"]
__all__ += ["rewind", "Rewind", "RewindError", "LibraryUnavailableWarning"]
