"""The public namespace has no traps: no public name of a nanguard package is
both a module and something else (``import nanguard.watch as w`` once gave
the function, and ``nanguard.watch.Report`` raised AttributeError), and each
class users catch or inspect is importable from the top level and from its
one documented module."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys

import pytest

import nanguard

#: class -> its documented module; each must also be ``nanguard.<name>``
DOCUMENTED = {
    "NonFiniteError": "nanguard.diagnostics",
    "Report": "nanguard.diagnostics",
    "TensorStats": "nanguard.diagnostics",
    "Watch": "nanguard.diagnostics",
    "BadBatchError": "nanguard.diagnostics",
    "BatchFinding": "nanguard.diagnostics",
    "Finding": "nanguard.diagnostics",
    "SkippedStep": "nanguard.amp",
    "PatchSummary": "nanguard.patching",
    "UnsupportedModuleError": "nanguard.patching",
}

#: functions documented at the top level, and where their code is documented
FUNCTIONS = {
    "watch": "nanguard.diagnostics",
    "check_batch": "nanguard.diagnostics",
    "doctor": "nanguard.diagnostics",
    "patch": "nanguard.patching",
    "unpatch": "nanguard.patching",
    "tensor_stats": "nanguard._tensor_stats",
    "tensor_stats_": "nanguard._tensor_stats",
    "new_stats_buffers": "nanguard._tensor_stats",
}

#: modules that import an optional third-party package
OPTIONAL = {"nanguard.integrations.transformers": "transformers",
            "nanguard.integrations.lightning": "lightning"}


def _packages():
    """nanguard and every package under it, with the names of their submodules."""
    out = {"nanguard": [m.name for m in pkgutil.iter_modules(nanguard.__path__)]}
    for info in pkgutil.walk_packages(nanguard.__path__, "nanguard."):
        if info.ispkg:
            pkg = importlib.import_module(info.name)
            out[info.name] = [m.name for m in pkgutil.iter_modules(pkg.__path__)]
    return out


PACKAGES = _packages()


def test_the_walk_finds_the_packages():
    assert {"nanguard", "nanguard.diagnostics", "nanguard.integrations"} <= set(PACKAGES)
    assert "_watch" in PACKAGES["nanguard.diagnostics"]
    assert "_tensor_stats" in PACKAGES["nanguard"]


@pytest.mark.parametrize("pkg_name", sorted(PACKAGES))
def test_no_submodule_is_shadowed(pkg_name):
    """Whenever ``pkg.n`` exists for a submodule ``n`` of pkg, it is that module."""
    pkg = importlib.import_module(pkg_name)
    for name in PACKAGES[pkg_name]:
        full = f"{pkg_name}.{name}"
        if not hasattr(pkg, name):
            continue  # not imported yet: importing it binds the module itself
        attr = getattr(pkg, name)
        if full in OPTIONAL:
            pytest.importorskip(OPTIONAL[full])
        mod = importlib.import_module(full)
        assert attr is mod is sys.modules[full], (
            f"{full} is a module but {pkg_name}.{name} is {attr!r}")


@pytest.mark.parametrize("name", sorted(set(nanguard.__all__)))
def test_public_names(name):
    """Every name in nanguard.__all__ exists; a module among them is
    sys.modules['nanguard.' + name]; a submodule name is never bound to
    something else."""
    assert hasattr(nanguard, name), f"nanguard.__all__ lists {name!r} but nanguard has no {name}"
    value = getattr(nanguard, name)
    full = "nanguard." + name
    if inspect.ismodule(value):
        assert value is sys.modules[full]
    else:
        assert name not in PACKAGES["nanguard"], f"nanguard.{name} is {value!r}, not the module {full}"
        assert full not in sys.modules


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_classes_at_top_level_and_documented_module(name):
    module = importlib.import_module(DOCUMENTED[name])
    assert name in module.__all__
    cls = getattr(module, name)
    assert inspect.isclass(cls)
    assert name in nanguard.__all__
    assert getattr(nanguard, name) is cls


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_at_top_level(name):
    module = importlib.import_module(FUNCTIONS[name])
    assert name in nanguard.__all__
    fn = getattr(nanguard, name)
    assert callable(fn) and not inspect.ismodule(fn)
    assert getattr(module, name) is fn


def test_watch_is_a_function_with_its_help():
    """help(nanguard.watch) shows the watcher's documentation (its arguments),
    and there is no module nanguard.watch to confuse with it."""
    assert "policy" in nanguard.watch.__doc__ and "every" in nanguard.watch.__doc__
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nanguard.watch")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nanguard.tensor_stats")
    from nanguard.diagnostics import Report  # the documented path

    assert Report is nanguard.Report


def test_one_skipped_step():
    """One SkippedStep class, in nanguard.amp, also used by the integrations."""
    from nanguard import amp

    integrations = importlib.import_module("nanguard.integrations")
    assert integrations.SkippedStep is amp.SkippedStep is nanguard.SkippedStep


def test_the_version_is_the_packages():
    import re
    from pathlib import Path

    import nanguard

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not run from a source tree")
    declared = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M).group(1)
    assert nanguard.__version__ == declared
