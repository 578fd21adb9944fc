"""``nanguard.info()``: what is loaded and where each op runs."""

from __future__ import annotations

import torch

from . import _lib

_KEYS = ("CPU", "CUDA")


def _ops() -> list[str]:
    """Every ``nanguard::`` operator overload the dispatcher knows."""
    names = sorted(
        n for n in torch._C._dispatch_get_all_op_names() if n.startswith("nanguard::")
    )
    return names


def info(as_dict: bool = False):
    """Print (or return, with ``as_dict=True``) versions, loaded libraries and,
    for each op, the devices it has kernels for."""
    ops = {}
    for name in _ops():
        ops[name] = [
            k.lower() for k in _KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
        ]
    from . import __version__

    d = {
        "nanguard": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "min_torch": "%d.%d" % _lib.MIN_TORCH,
        "libraries": _lib.loaded(),
        "library_errors": _lib.errors(),
        "ops": ops,
    }
    if as_dict:
        return d
    print(f"nanguard {d['nanguard']}  (torch {d['torch']}, needs >= {d['min_torch']})")
    print(f"CUDA: torch built with {d['torch_cuda'] or 'none'}, available: {d['cuda_available']}")
    for lib, path in d["libraries"].items():
        print(f"loaded {lib}: {path}")
    for lib, err in d["library_errors"].items():
        print(f"not loaded {lib}: {err}")
    width = max((len(n) for n in ops), default=0)
    for name, devs in ops.items():
        print(f"  {name:<{width}}  {', '.join(devs) or '-'}")
    return None
