"""Finding and loading nanguard's C libraries.

``libnanguard.so`` (every schema, CPU kernels) is loaded on import;
``libnanguard_cuda.so`` (CUDA kernels) only when the running PyTorch was built
with CUDA. Both are looked for in ``$NANGUARD_LIB_DIR`` first (a development
build tree), then in the installed package's ``lib/`` folder.
"""

from __future__ import annotations

import ctypes
import os
import pathlib

import torch

#: The oldest PyTorch whose stable C ABI nanguard's libraries follow.
MIN_TORCH = (2, 11)

_loaded: dict[str, str] = {}
_errors: dict[str, str] = {}


def _parse_version(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError when ``version`` (default: the running torch) is too old."""
    version = torch.__version__ if version is None else version
    if _parse_version(version) < MIN_TORCH:
        raise ImportError(
            f"nanguard needs PyTorch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (its kernels use the "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]} stable C ABI); found PyTorch {version}. "
            f"Upgrade with: pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'"
        )


def _candidates(name: str) -> list[pathlib.Path]:
    dirs = []
    env = os.environ.get("NANGUARD_LIB_DIR")
    if env:
        dirs.append(pathlib.Path(env))
    dirs.append(pathlib.Path(__file__).resolve().parent / "lib")
    # An editable install keeps the compiled files in site-packages/nanguard/lib
    # while the Python files stay in the source tree.
    import site
    import sysconfig

    roots = [sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        roots.append(site.getusersitepackages())
    for root in roots:
        d = pathlib.Path(root) / "nanguard" / "lib"
        if d not in dirs:
            dirs.append(d)
    return [d / name for d in dirs]


def _load(name: str) -> str:
    for path in _candidates(name):
        if path.is_file():
            torch.ops.load_library(str(path))
            err = ctypes.CDLL(str(path)).ng_load_error
            err.restype = ctypes.c_char_p
            msg = err()
            if msg:
                raise ImportError(f"{path.name}: {msg.decode()}")
            _loaded[name] = str(path)
            return str(path)
    raise ImportError(
        f"nanguard: {name} not found (looked in: "
        + ", ".join(str(p.parent) for p in _candidates(name))
        + "). Build it with `pip install --no-build-isolation .` or point NANGUARD_LIB_DIR at a "
        "CMake build folder."
    )


def load() -> None:
    """Load the core library and, when PyTorch has CUDA, the CUDA one."""
    check_torch_version()
    if "libnanguard.so" not in _loaded:
        _load("libnanguard.so")
    if torch.version.cuda is not None and "libnanguard_cuda.so" not in _loaded:
        try:
            _load("libnanguard_cuda.so")
        except (ImportError, OSError) as e:  # CPU ops keep working without it
            _errors["libnanguard_cuda.so"] = str(e)


def loaded() -> dict[str, str]:
    return dict(_loaded)


def errors() -> dict[str, str]:
    return dict(_errors)
