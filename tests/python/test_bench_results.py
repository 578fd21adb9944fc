"""bench/results/ is a dataset: every table's rows parse and name their
machine, every summary is what bench/summarize.py makes of its table today,
a benchmark's results are appended (never overwritten), and every results
file the README and the docs cite exists. No benchmark is run."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
TABLES = sorted(RESULTS.glob("*.jsonl"))


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("_common"), importlib.import_module("summarize")
    finally:
        sys.path.remove(str(BENCH))


def test_there_are_tables():
    assert TABLES, "bench/results holds no .jsonl table"


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_rows_name_their_machine(table, bench_modules):
    common, summarize = bench_modules
    rows = summarize.load(table)
    assert rows, f"{table.name} is empty"
    runs = {}
    for n, r in enumerate(rows, 1):
        missing = [k for k in (*common.MACHINE_COLUMNS, "run", "date", "series", "params") if k not in r]
        assert not missing, f"{table.name} row {n} lacks {missing}"
        assert isinstance(r["cpu_model"], str) and r["cpu_model"], f"{table.name} row {n}: no CPU model"
        assert r["series"], f"{table.name} row {n}: no series"
        runs.setdefault(r["run"], []).append(r)
    for rid, rs in runs.items():
        # a run's rows are of one series and one machine, its first row carries the columns shown
        assert len({r["series"] for r in rs}) == 1, f"{table.name} run {rid} mixes series"
        assert len({tuple(str(r[k]) for k in common.MACHINE_COLUMNS) for r in rs}) == 1, \
            f"{table.name} run {rid} mixes machines"
        assert rs[0].get("columns"), f"{table.name} run {rid}: its first row has no columns"


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_summary_is_generated_from_its_table(table, bench_modules):
    _, summarize = bench_modules
    md = table.with_suffix(".md")
    assert md.exists(), f"{md.name} missing: run python3 bench/summarize.py"
    assert md.read_text() == summarize.summary(table), \
        f"{md.name} differs from its table: run python3 bench/summarize.py (never edit a summary)"


def test_summary_shows_the_latest_run_per_machine(tmp_path, bench_modules):
    common, summarize = bench_modules
    run = {"cpu_model": "CPU A", "isa": "avx512", "threads": 1, "torch": "2.13.0", "commit": "abc"}
    old = common.result_rows("s", [{"x": 1.0}], ["x"], run={**run, "run": "r1", "date": "2026-01-01T00:00:00Z"})
    new = common.result_rows("s", [{"x": 2.0}], ["x"], run={**run, "run": "r2", "date": "2026-02-01T00:00:00Z"})
    other = common.result_rows("s", [{"x": 3.0}], ["x"],
                               run={**run, "cpu_model": "CPU B", "run": "r3", "date": "2025-01-01T00:00:00Z"})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in new + old + other))
    text = summarize.summary(path)
    assert "| 2 |" in text and "| 3 |" in text and "| 1 |" not in text
    assert text.index("CPU A") < text.index("CPU B")


def test_write_results_appends_and_regenerates(tmp_path, bench_modules, monkeypatch):
    common, summarize = bench_modules
    monkeypatch.setattr(common, "machine", lambda: {"cpu_model": "Test CPU", "threads": 3})
    for value in (1.5, 2.5):
        common.write_results("demo", "main", [{"case": "a", "ms": value}], ["case", "ms"], {"repeats": 7},
                             notes="a note", dry=False, results=tmp_path)
    rows = summarize.load(tmp_path / "demo.jsonl")
    assert [r["ms"] for r in rows] == [1.5, 2.5]
    assert len({r["run"] for r in rows}) == 2
    assert all(r["cpu_model"] == "Test CPU" and r["threads"] == 3 and r["params"] == {"repeats": 7} for r in rows)
    md = (tmp_path / "demo.md").read_text()
    assert md == summarize.summary(tmp_path / "demo.jsonl")
    assert "Test CPU" in md and "a note" in md


def test_write_results_dry_writes_nothing(tmp_path, bench_modules):
    common, _ = bench_modules
    common.write_results("demo", "main", [{"case": "a"}], ["case"], dry=True, results=tmp_path)
    assert not list(tmp_path.iterdir())


def test_reserved_columns_are_refused(bench_modules):
    common, _ = bench_modules
    with pytest.raises(ValueError, match="reserved column"):
        common.result_rows("s", [{"threads": 4}], ["threads"], run={"run": "r", "date": "d"})


def test_a_broken_line_names_its_file_and_line(tmp_path, bench_modules):
    _, summarize = bench_modules
    path = tmp_path / "bad.jsonl"
    path.write_text('{"run": "r"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        summarize.load(path)


def _cited():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = set()
    for doc in docs:
        for m in re.finditer(r"bench/results/([A-Za-z0-9_.]+\.(?:md|jsonl|json))", doc.read_text()):
            found.add((doc.relative_to(ROOT).as_posix(), m.group(1)))
    return sorted(found)


@pytest.mark.parametrize("doc, name", _cited())
def test_cited_results_exist(doc, name):
    assert (RESULTS / name).exists(), f"{doc} cites bench/results/{name}, which does not exist"
