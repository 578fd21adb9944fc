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

A core library that is not there, or that the platform cannot load, does
not: nanguard then runs every op on its composite path
(``nanguard.composite``) and warns once, naming the reason.
``NANGUARD_COMPOSITE=1`` asks for that path on purpose (no library is
loaded, no warning): the test suite runs the op suites through it on the CPU.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import warnings

import torch

#: The oldest PyTorch whose stable C ABI nanguard's libraries follow.
MIN_TORCH = (2, 11)

#: NG_ATTN_MAX_HEAD_DIM (kernels/attention.h), for when no library is loaded:
#: the composite path keeps the kernels' limit, so a model behaves the same
#: on every device
ATTENTION_MAX_HEAD_DIM = 256

_ENV_COMPOSITE = "NANGUARD_COMPOSITE"

_loaded: dict[str, str] = {}
_errors: dict[str, str] = {}
#: why the core library is not loaded (None: it is)
_composite_reason: str | None = None


class LibraryUnavailableWarning(UserWarning):
    """The core library could not be loaded; every op runs its composite path."""


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


class LibraryNotFoundError(ImportError):
    """No file of that name in any folder looked in."""


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
    if "libnanguard.so" not in _loaded:
        return ATTENTION_MAX_HEAD_DIM
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
    raise LibraryNotFoundError(
        f"nanguard: {name} not found (looked in: "
        + ", ".join(str(p.parent) for p in paths)
        + "). Build it with `pip install --no-build-isolation .` or point NANGUARD_LIB_DIR at a "
        "CMake build folder."
    )


def load() -> None:
    """Load the core library and, when PyTorch has CUDA, the CUDA one from the
    same folder. Without a loadable core library, record why (the caller
    then defines the schemas on the composite path)."""
    global _composite_reason
    check_torch_version()
    if _composite_reason is not None:
        return
    if os.environ.get(_ENV_COMPOSITE, "0") not in ("", "0"):
        _composite_reason = f"{_ENV_COMPOSITE}={os.environ[_ENV_COMPOSITE]}"
        return
    if "libnanguard.so" not in _loaded:
        try:
            _load("libnanguard.so", _candidates("libnanguard.so"))
        except (LibraryNotFoundError, OSError) as e:
            # absent, or not loadable here (another platform's build, a missing
            # dependency). A library that loaded but failed to register is not
            # caught: its schemas may be half defined.
            _composite_reason = str(e)
            _errors["libnanguard.so"] = str(e)
            warnings.warn(
                f"nanguard: the C library could not be loaded ({e}); every op runs its "
                "composite path (PyTorch operations, the same numerics, slower)",
                LibraryUnavailableWarning,
                stacklevel=3,
            )
            return
    if torch.version.cuda is not None and "libnanguard_cuda.so" not in _loaded:
        beside = pathlib.Path(_loaded["libnanguard.so"]).parent / "libnanguard_cuda.so"
        try:
            _load("libnanguard_cuda.so", [beside])
        except BuildMismatchError:
            raise
        except (ImportError, OSError) as e:  # CPU ops keep working without it
            _errors["libnanguard_cuda.so"] = str(e)


def composite_only() -> str | None:
    """Why no core library is loaded (every op on the composite path), or None."""
    return _composite_reason


def loaded() -> dict[str, str]:
    return dict(_loaded)


def errors() -> dict[str, str]:
    return dict(_errors)
