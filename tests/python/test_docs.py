"""The documentation's Python still works: every ``python`` block of
README.md runs on the CPU (its free names, such as ``model`` or ``q``, bound
to small real objects; ``"cuda"`` read as the CPU where no GPU is present),
and every ``nanguard.<name>`` path written in README.md and docs/ resolves."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
import torch

import nanguard

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: the user pages (docs/*.md) stay readable: what a user needs, not design
#: notes (those are docs/design/*.md)
USER_PAGE_MAX_LINES = 300


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _namespace():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    return {
        "model": model, "LlamaForCausalLM": transformers.LlamaForCausalLM,
        "q": q, "k": k, "v": v, "mask": torch.rand(2, 1, 8, 8) > 0.3,
        "batch": {"input_ids": ids, "labels": ids},
        "loss": model(input_ids=ids, labels=ids).loss,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
    }


@pytest.mark.parametrize("index", range(len(_blocks(ROOT / "README.md"))))
def test_readme_python_blocks_run(index):
    code = _blocks(ROOT / "README.md")[index]
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    ns = _namespace()
    try:
        exec(compile(code, f"README.md python block {index}", "exec"), ns)
    finally:
        nanguard.unpatch(ns["LlamaForCausalLM"]) if "patch(LlamaForCausalLM)" in code else None


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _documented_paths():
    found = set()
    for doc in DOCS:
        for m in re.finditer(r"(?<![\w/.-])nanguard(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?![\w-])", doc.read_text()):
            found.add((doc.name, m.group(0)))
    return sorted(found)


@pytest.mark.parametrize("doc, path", _documented_paths())
def test_documented_names_resolve(doc, path):
    _resolve(path)


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_user_pages_are_short(page):
    n = len(page.read_text().splitlines())
    assert n <= USER_PAGE_MAX_LINES, f"docs/{page.name} has {n} lines; move design notes to docs/design/"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _links():
    found = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if not re.match(r"[a-z]+:", target):
                found.append((doc.relative_to(ROOT).as_posix(), target))
    return found


@pytest.mark.parametrize("doc, target", _links())
def test_relative_links_resolve(doc, target):
    path, _, anchor = target.partition("#")
    dest = (ROOT / doc).parent / path if path else ROOT / doc
    assert dest.exists(), f"{doc} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
        assert anchor in slugs, f"{doc} links to {target}: no heading with that anchor"
