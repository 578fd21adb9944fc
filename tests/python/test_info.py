"""nanguard.info() / ``python -m nanguard info``: the CPU, its ISA flags and
which CPU code path each op's kernel takes (ng_cpu_info of the C library).
Every test reads the C library: none runs on the composite path."""

import ctypes
import os
import platform
import re
import subprocess
import sys

import pytest

import nanguard
from nanguard import _info, _lib
from conftest import requires_kernels

pytestmark = requires_kernels

ORDER = ("baseline", "avx2", "avx512")


def _core():
    lib = ctypes.CDLL(_lib.loaded()["libnanguard.so"])
    lib.ng_cpu_isa_name.restype = ctypes.c_char_p
    lib.ng_cpu_isa_name.argtypes = [ctypes.c_int]
    return lib


def _supported() -> str:
    lib = _core()
    return lib.ng_cpu_isa_name(lib.ng_cpu_isa_supported()).decode()


@pytest.fixture
def cpu_info_lib():
    if not hasattr(_core(), "ng_cpu_info"):
        pytest.skip("the loaded libnanguard.so predates ng_cpu_info (point NANGUARD_LIB_DIR at a build)")


def test_info_names_the_active_isa_as_the_c_library_picks_it(cpu_info_lib):
    lib = _core()
    active = lib.ng_cpu_isa_name(lib.ng_cpu_isa_active()).decode()
    cpu = nanguard.info(as_dict=True)["cpu"]
    assert cpu["active"] == active
    assert cpu["supported"] == _supported()
    assert cpu["capped"] == (ORDER.index(active) < ORDER.index(cpu["supported"]))
    assert cpu["requested"] == os.environ.get("NANGUARD_CPU_ISA", "")


def test_every_cpu_op_has_a_cpu_path(cpu_info_lib):
    """An op family missing from _info's table, or a family missing from
    ng_cpu_info, fails here."""
    d = nanguard.info(as_dict=True)
    cpu_ops = [n for n, devs in d["ops"].items() if "cpu" in devs]
    assert cpu_ops
    for name in cpu_ops:
        assert set(d["op_cpu_paths"].get(name, {})) == {"f32", "f64", "bf16", "f16"}, name


def test_paths_follow_the_kernels_dispatch(cpu_info_lib):
    """The dispatch rules of cpu_info.c against the active ISA: attention fp32
    and tensor_stats on the active path, fp64 attention at most AVX2, the
    half types through fp32, layernorm and grad_guard on AVX2 at most."""
    cpu = nanguard.info(as_dict=True)["cpu"]
    a, p = cpu["active"], cpu["paths"]
    at_most_avx2 = ORDER[min(ORDER.index(a), 1)]
    assert p["attention"]["f32"] == a
    assert p["attention"]["f64"] == at_most_avx2
    for dt in ("bf16", "f16"):
        assert p["attention"][dt].startswith(a) and "fp32" in p["attention"][dt]
    assert all(v == a for v in p["tensor_stats"].values())
    assert all(v == at_most_avx2 for v in p["grad_guard"].values())
    assert p["layernorm"]["f32"] == at_most_avx2


def test_cpu_model_and_flags():
    m = _info.cpu_model()
    assert m["model"]
    assert set(m["flags"]) <= set(_info.ISA_FLAGS)
    if platform.system() == "Linux" and os.path.exists("/proc/cpuinfo"):
        sup = _supported()
        if sup == "avx512":
            assert {"avx512f", "avx512bw", "avx512vl", "fma"} <= set(m["flags"])
        if sup in ("avx2", "avx512"):
            assert {"avx2", "fma"} <= set(m["flags"])


def _cli_info(isa: str | None) -> str:
    env = dict(os.environ)
    env.pop("NANGUARD_CPU_ISA", None)
    if isa is not None:
        env["NANGUARD_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-m", "nanguard", "info"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("cap", [None, "avx2", "baseline"])
def test_cli_info_names_the_isa_and_the_cap_changes_it(cpu_info_lib, cap):
    """In a fresh process (the path is chosen once): NANGUARD_CPU_ISA=avx2 or
    baseline shows the capped path, named as capped, on the CPU line and on
    safe_sdpa's line."""
    sup = _supported()
    want = sup if cap is None else ORDER[min(ORDER.index(cap), ORDER.index(sup))]
    out = _cli_info(cap)
    line = re.search(r"^CPU kernels: (\S+) \((.*)\)$", out, re.M)
    assert line, out
    assert line.group(1) == want
    if want != sup:
        assert line.group(2) == f"capped by NANGUARD_CPU_ISA={cap}; this CPU supports {sup}"
    else:
        assert line.group(2) == "the widest this CPU supports"
    # "[cpu: f32 avx512; ..." or, with fp64 on the same path, "[cpu: f32, f64 avx2; ..."
    sdpa = re.search(r"^  nanguard::safe_sdpa +kernel on cpu;[^[]* +\[cpu: f32(?:, f64)? (\w+);", out, re.M)
    assert sdpa and sdpa.group(1) == want, out
    assert re.search(r"^CPU: .+; flags: ", out, re.M)


@pytest.mark.parametrize("want", ["0", "1"])
def test_cli_info_names_the_bf16_dot_scores_when_asked(cpu_info_lib, want):
    """NANGUARD_CPU_BF16_DOT=1 / 0 turns the vdpbf16ps bf16 scores on or off
    where the CPU has AVX-512 BF16 (and is on the AVX-512 path); elsewhere
    it never appears. safe_sdpa's bf16 line says which."""
    env = dict(os.environ)
    env.pop("NANGUARD_CPU_ISA", None)
    env["NANGUARD_CPU_BF16_DOT"] = want
    env["NANGUARD_CPU_AMX"] = "0"  # AMX, where the CPU has it, comes first
    sdpa = _sdpa_line(env)
    has = _supported() == "avx512" and "avx512_bf16" in _info.cpu_model()["flags"]
    named = "scores and dP by vdpbf16ps (avx512_bf16)" in sdpa
    assert named == (has and want == "1"), sdpa


@pytest.mark.parametrize("want", ["0", "1"])
def test_cli_info_names_the_amx_tiles_when_used(cpu_info_lib, want):
    """bf16 attention runs on AMX tiles where the CPU has AMX-TILE and
    AMX-BF16 (Linux grants the tile state) on the AVX-512 path, unless
    NANGUARD_CPU_AMX=0; safe_sdpa's bf16 line says so."""
    env = dict(os.environ)
    env.pop("NANGUARD_CPU_ISA", None)
    env["NANGUARD_CPU_AMX"] = want
    sdpa = _sdpa_line(env)
    flags = _info.cpu_model()["flags"]
    has = (_supported() == "avx512" and "amx_bf16" in flags and "amx_tile" in flags
           and sys.platform == "linux")
    named = "products on AMX tiles (amx_bf16" in sdpa
    assert named == (has and want == "1"), sdpa


def _sdpa_line(env):
    out = subprocess.run([sys.executable, "-m", "nanguard", "info"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    sdpa = re.search(r"^  nanguard::safe_sdpa +kernel on cpu;[^[]* +\[(.*)\]$", out.stdout, re.M)
    assert sdpa, out.stdout
    return sdpa.group(1)
