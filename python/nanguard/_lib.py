"""Finding and loading nanguard's C libraries.

``libnanguard.so`` (every schema, CPU kernels) is loaded on import;
``libnanguard_cuda.so`` (CUDA kernels) only when the running PyTorch was built
with CUDA. The core library is looked for in ``$NANGUARD_LIB_DIR`` first (a
development build tree), then in the installed package's ``lib/`` folder; the
CUDA library only beside the core library that was loaded.

The two must come from one build: the CUDA kernels read the stack layouts of
the core library's schemas. Both export ``ng_build_id()`` (the target stable
ABI and a fingerprint of every schema); a CUDA library whose id differs from
the core library's is refused with an ImportError that names both files and
both ids (the CUDA library also refuses, in C, to register its kernels).
A core library that could not register every schema and kernel makes the
import fail too.
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


class BuildMismatchError(ImportError):
    """libnanguard.so and libnanguard_cuda.so come from different builds."""


def build_id(path: str) -> str | None:
    """The ``ng_build_id()`` of a nanguard library (None for a library built
    before build ids existed)."""
    lib = ctypes.CDLL(path)
    try:
        fn = lib.ng_build_id
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    v = fn()
    return v.decode() if v else None


def attention_max_head_dim() -> int:
    """The largest head dim the loaded library's attention kernels take."""
    fn = ctypes.CDLL(_loaded["libnanguard.so"]).ng_attention_max_head_dim
    fn.restype = ctypes.c_int
    return int(fn())


def _load(name: str, paths: list[pathlib.Path]) -> str:
    for path in paths:
        if path.is_file():
            torch.ops.load_library(str(path))
            if name == "libnanguard_cuda.so":
                core = _loaded["libnanguard.so"]
                mine, theirs = build_id(str(path)), build_id(core)
                if mine != theirs:
                    raise BuildMismatchError(
                        f"nanguard: {path} is build {mine or '(no build id: an older build)'} but "
                        f"the loaded {core} is build {theirs}; the two libraries come from "
                        "different builds. Rebuild or reinstall both together."
                    )
            err = ctypes.CDLL(str(path)).ng_load_error
            err.restype = ctypes.c_char_p
            msg = err()
            if msg:
                raise ImportError(f"{path.name}: {msg.decode()}")
            _loaded[name] = str(path)
            return str(path)
    raise ImportError(
        f"nanguard: {name} not found (looked in: "
        + ", ".join(str(p.parent) for p in paths)
        + "). Build it with `pip install --no-build-isolation .` or point NANGUARD_LIB_DIR at a "
        "CMake build folder."
    )


def load() -> None:
    """Load the core library and, when PyTorch has CUDA, the CUDA one from the
    same folder."""
    check_torch_version()
    if "libnanguard.so" not in _loaded:
        _load("libnanguard.so", _candidates("libnanguard.so"))
    if torch.version.cuda is not None and "libnanguard_cuda.so" not in _loaded:
        beside = pathlib.Path(_loaded["libnanguard.so"]).parent / "libnanguard_cuda.so"
        try:
            _load("libnanguard_cuda.so", [beside])
        except BuildMismatchError:
            raise
        except (ImportError, OSError) as e:  # CPU ops keep working without it
            _errors["libnanguard_cuda.so"] = str(e)


def loaded() -> dict[str, str]:
    return dict(_loaded)


def errors() -> dict[str, str]:
    return dict(_errors)
