"""Loading, version checks and nanguard.info()."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import nanguard
from nanguard import _lib
from conftest import requires_kernels


def test_refuses_old_torch_with_clear_message():
    with pytest.raises(ImportError) as e:
        _lib.check_torch_version("2.10.1+cu128")
    msg = str(e.value)
    assert "2.10.1+cu128" in msg and ">= 2.11" in msg


@pytest.mark.parametrize("v", ["2.11.0", "2.13.0+cpu", "3.0.0a0"])
def test_accepts_supported_torch(v):
    _lib.check_torch_version(v)


@requires_kernels
def test_c_library_reports_no_load_error_and_targets_2_11():
    import ctypes

    lib = ctypes.CDLL(_lib.loaded()["libnanguard.so"])
    lib.ng_load_error.restype = ctypes.c_char_p
    assert lib.ng_load_error() is None
    lib.ng_target_abi_version.restype = ctypes.c_uint64
    v = lib.ng_target_abi_version()
    assert (v >> 56, (v >> 48) & 0xFF) == (2, 11)


@requires_kernels
def test_info_lists_ops_and_devices():
    d = nanguard.info(as_dict=True)
    assert d["torch"] == torch.__version__
    assert "libnanguard.so" in d["libraries"]
    assert d["ops"]["nanguard::stable_layernorm.weight_bias"][0] == "cpu"
    if torch.cuda.is_available():
        assert "cuda" in d["ops"]["nanguard::stable_layernorm.weight_bias"]


def test_cli_info_runs():
    out = subprocess.run(
        [sys.executable, "-m", "nanguard", "info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "nanguard::stable_layernorm" in out.stdout


def _run(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def _import_after(prelude: str, env_extra: dict) -> subprocess.CompletedProcess:
    """A child that imports torch, runs prelude, then imports nanguard and
    prints IMPORT_ERROR and the error, or IMPORTED."""
    return _run(
        "import torch\n" + prelude + "try:\n    import nanguard\nexcept ImportError as e:\n"
        "    print('IMPORT_ERROR', e)\nelse:\n    print('IMPORTED')\n",
        env_extra,
    )


@requires_kernels
def test_failed_registration_makes_import_fail():
    """A schema the core library cannot define (here: the name is already
    taken in this process) must fail the import, not only print to stderr."""
    out = _import_after(
        "lib = torch.library.Library('nanguard', 'FRAGMENT')\n"
        "lib.define('stable_layernorm(Tensor x) -> Tensor')\n",
        {},
    )
    assert "IMPORT_ERROR" in out.stdout, out.stdout + out.stderr
    assert "could not define the schema stable_layernorm(Tensor input" in out.stdout


@requires_kernels
def test_build_id_names_the_target_abi_and_schemas():
    bid = _lib.build_id(_lib.loaded()["libnanguard.so"])
    assert re.fullmatch(r"stable-abi-2\.11/schemas-[0-9a-f]{16}", bid), bid


@requires_kernels
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in library")
def test_cuda_library_of_another_build_is_refused(tmp_path):
    """A libnanguard_cuda.so beside the core library but from another build
    (another schema fingerprint) must make the import fail, naming both
    files and both builds. The stand-in exports what a CUDA library of another
    build would and registers nothing; torch.version.cuda is set so that the
    loader tries it on this CPU-only machine."""
    core = pathlib.Path(_lib.loaded()["libnanguard.so"])
    (tmp_path / "libnanguard.so").symlink_to(core)
    src = tmp_path / "other.c"
    src.write_text(
        'const char *ng_build_id(void) { return "stable-abi-2.11/schemas-0123456789abcdef"; }\n'
        "const char *ng_load_error(void) { return 0; }\n"
    )
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libnanguard_cuda.so"), str(src)],
                   check=True)
    out = _import_after("torch.version.cuda = '12.4'\n", {"NANGUARD_LIB_DIR": str(tmp_path)})
    msg = out.stdout
    assert "IMPORT_ERROR" in msg, msg + out.stderr
    core_id = _lib.build_id(str(core))
    assert str(tmp_path / "libnanguard_cuda.so") in msg and "schemas-0123456789abcdef" in msg
    assert "libnanguard.so" in msg and core_id in msg and "different builds" in msg


@requires_kernels
def test_cuda_library_is_only_taken_from_beside_the_core_library(tmp_path):
    """The CUDA library is looked for in the core library's folder only, so
    a development build of the core library never pairs with an installed
    CUDA library."""
    core = pathlib.Path(_lib.loaded()["libnanguard.so"])
    (tmp_path / "libnanguard.so").symlink_to(core)
    code = (
        "import torch\n"
        "torch.version.cuda = '12.4'\n"
        "import nanguard\n"
        "from nanguard import _lib\n"
        "print('ERR', _lib.errors().get('libnanguard_cuda.so'))\n"
    )
    out = _run(code, {"NANGUARD_LIB_DIR": str(tmp_path)})
    assert f"looked in: {tmp_path})" in out.stdout, out.stdout + out.stderr
