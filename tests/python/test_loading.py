"""Loading, version checks and nanguard.info()."""

import subprocess
import sys

import pytest
import torch

import nanguard
from nanguard import _lib


def test_refuses_old_torch_with_clear_message():
    with pytest.raises(ImportError) as e:
        _lib.check_torch_version("2.10.1+cu128")
    msg = str(e.value)
    assert "2.10.1+cu128" in msg and ">= 2.11" in msg


@pytest.mark.parametrize("v", ["2.11.0", "2.13.0+cpu", "3.0.0a0"])
def test_accepts_supported_torch(v):
    _lib.check_torch_version(v)


def test_c_library_reports_no_load_error_and_targets_2_11():
    import ctypes

    lib = ctypes.CDLL(_lib.loaded()["libnanguard.so"])
    lib.ng_load_error.restype = ctypes.c_char_p
    assert lib.ng_load_error() is None
    lib.ng_target_abi_version.restype = ctypes.c_uint64
    v = lib.ng_target_abi_version()
    assert (v >> 56, (v >> 48) & 0xFF) == (2, 11)


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
