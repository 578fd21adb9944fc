"""No import cycles between nanguard's modules, delayed ones included.

The graph is read from the source with ``ast``: every ``import`` and
``from ... import`` statement counts, at module level, inside a function or
under ``TYPE_CHECKING``, because an import moved into a function hides a
cycle from the interpreter without removing it. Rules:

* an import is an edge to the module it loads: ``from .pkg import name`` to
  ``pkg.name`` when that is a module of the package, else to ``pkg`` (its
  ``__init__``);
* the packages above a loaded module are not edges: Python initialises them
  first, and a package's ``__init__`` importing its own submodules is the
  normal layout. A submodule that imports a *name* from its package (or
  ``import nanguard`` to reach a sibling) is an edge to that ``__init__``,
  and with the ``__init__`` importing the submodule, a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

import nanguard

PKG = Path(nanguard.__file__).resolve().parent


def _modules(root: Path) -> Dict[str, Path]:
    """module name -> file, for every .py under root (a package as its __init__)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _graph(root: Path) -> Dict[str, Set[str]]:
    mods = _modules(root)
    top = root.name
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]  # the package relative imports start from
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            for t in targets:
                if t == top or t.startswith(top + "."):
                    while t not in mods:  # `import nanguard.x.y` of a name: its module
                        t = t.rpartition(".")[0]
                    if t != name:
                        graph[name].add(t)
    return graph


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as [a, b, ..., a], or None."""
    state: Dict[str, int] = {}  # 1: on the stack, 2: done
    stack: List[str] = []

    def visit(n: str) -> Optional[List[str]]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_between_nanguard_modules():
    graph = _graph(PKG)
    assert "nanguard.diagnostics._replay" in graph and len(graph) > 40  # it read the package
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _write(root: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "nanguard"


@pytest.mark.parametrize("where", ["top", "function", "type_checking"])
def test_the_cycle_finder_sees_a_delayed_import(tmp_path, where):
    body = {"top": "from ._b import g\n",
            "function": "def f():\n    from ._b import g\n    return g\n",
            "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import g\n"}[where]
    pkg = _write(tmp_path, {"nanguard/__init__.py": "from . import _a\n",
                            "nanguard/sub/__init__.py": "", "nanguard/_a.py": body,
                            "nanguard/_b.py": "from ._a import f\n\ndef g():\n    pass\n"})
    assert _find_cycle(_graph(pkg)) == ["nanguard._a", "nanguard._b", "nanguard._a"]


def test_the_cycle_finder_rules_on_packages(tmp_path):
    # a package importing its submodules, and siblings importing each other through
    # `from . import sibling`: no cycle
    pkg = _write(tmp_path, {"nanguard/__init__.py": "from . import sub\nfrom .sub import _x\n",
                            "nanguard/sub/__init__.py": "from ._x import X\nfrom ._y import Y\n",
                            "nanguard/sub/_x.py": "from . import _y\nX = 1\n",
                            "nanguard/sub/_y.py": "import torch\nY = 2\n"})
    assert _find_cycle(_graph(pkg)) is None
    # a submodule taking a name from its own package's __init__: a cycle
    (tmp_path / "nanguard/sub/_y.py").write_text("def f():\n    from . import X\n    return X\n")
    cycle = _find_cycle(_graph(pkg))
    assert cycle[0] == cycle[-1] == "nanguard.sub" and "nanguard.sub._y" in cycle
    # `import nanguard` from below, to reach a sibling: a cycle through the root
    (tmp_path / "nanguard/sub/_y.py").write_text("def f():\n    import nanguard\n    return nanguard.sub\n")
    cycle = _find_cycle(_graph(pkg))
    assert cycle[0] == cycle[-1] == "nanguard" and "nanguard.sub._y" in cycle
