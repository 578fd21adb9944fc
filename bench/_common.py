"""Shared benchmark helpers: same-process timing with medians, the machine's
copy bandwidth, and the results tables under bench/results/.

Results are data: each benchmark appends its rows to one table of its own,
bench/results/<table>.jsonl, one JSON object per measured row, every row
carrying the machine it ran on (MACHINE_COLUMNS) and the run it belongs to
(RUN_COLUMNS). bench/results/<table>.md is generated from it (summarize.py):
the latest run of each series on each machine.

Timings on a shared machine are noisy: every comparison is a ratio measured
in the same run, each number the median of many repeats, candidates
interleaved so that drift hits both sides alike.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
import uuid
from typing import Callable

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_samples(fns: dict[str, Callable[[], object]], repeats: int = 30, warmup: int = 3,
                 device: str = "cpu") -> dict[str, list[float]]:
    """Seconds of each call of each fn, the fns interleaved per repeat, in
    reverse order every other repeat (whichever runs right after another can
    find the caches and the allocator in a different state: a bias of a few
    percent on a multi-second generate())."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for rep in range(repeats):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - t0)
    return samples


def time_fns(fns: dict[str, Callable[[], object]], repeats: int = 30, warmup: int = 3,
             device: str = "cpu") -> dict[str, float]:
    """Median seconds per call of each fn (time_samples)."""
    return {k: statistics.median(v) for k, v in time_samples(fns, repeats, warmup, device).items()}


def paired_times(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int = 15, warmup: int = 1,
                 device: str = "cpu") -> tuple[tuple[float, float], float]:
    """Both fns once per repeat, in alternating order (time_samples): ((median
    seconds of a, median seconds of b), median over repeats of b's time / a's
    time)."""
    t = time_samples({"a": fn_a, "b": fn_b}, repeats, warmup, device)
    ratio = statistics.median(b / a for a, b in zip(t["a"], t["b"]))
    return (statistics.median(t["a"]), statistics.median(t["b"])), ratio


def paired_ratio(samples: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median, first and third quartile over repeats of samples[num][i] /
    samples[den][i] (time_samples: the two ran next to each other in each
    repeat, so a drift of the machine's speed mostly cancels)."""
    r = sorted(a / b for a, b in zip(samples[num], samples[den]))
    if len(r) < 2:
        return r[0], r[0], r[0]
    q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive")
    return statistics.median(r), q1, q3


def copy_bandwidth(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Measured GB/s of a large tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fns({"copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=2, device=device)["copy"]
    return 2 * nbytes / t / 1e9


def read_bandwidth(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Measured GB/s of reading a large fp32 tensor once (torch.sum: a
    STREAM-like read, the bytes read counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    t = time_fns({"read": lambda: src.sum()}, repeats=repeats, warmup=2, device=device)["read"]
    return nbytes / t / 1e9


#: CPU flags (as /proc/cpuinfo spells them) that decide nanguard's or
#: PyTorch's CPU code paths.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_model() -> str:
    """lscpu's 'Model name' (else /proc/cpuinfo's 'model name', else platform's)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of ISA_FLAGS this CPU has (Linux /proc/cpuinfo; [] elsewhere)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def nanguard_cpu_isa() -> str:
    """The instruction set nanguard's CPU kernels run ("avx512", "avx2 (capped
    by NANGUARD_CPU_ISA=avx2)", ...), from the loaded library."""
    try:
        from nanguard import _info

        p = _info.cpu_paths()
    except Exception as e:  # an older nanguard: no _info.cpu_paths
        return f"unknown ({type(e).__name__})"
    if "error" in p:
        return f"unknown ({p['error']})"
    if p.get("capped"):
        return f"{p['active']} (capped by NANGUARD_CPU_ISA={p.get('requested', '')}; supports {p['supported']})"
    return str(p.get("active"))


# the reserved columns are summarize.py's (stdlib only, beside this file)
from summarize import MACHINE_COLUMNS, RUN_COLUMNS  # noqa: E402


def machine() -> dict:
    """The machine and software a run measures (MACHINE_COLUMNS)."""
    try:
        import nanguard

        version = nanguard.__version__
    except Exception as e:  # the benchmarks also time a nanguard that fails to load
        version = f"unknown ({type(e).__name__})"
    info = {
        "cpu_model": cpu_model(),
        "isa": nanguard_cpu_isa(),
        "cpu_flags": " ".join(cpu_flags()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "nanguard": version,
        "python": platform.python_version(),
        "commit": None,
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=pathlib.Path(__file__).parent, timeout=10,
        ).stdout.strip() or None
    except Exception:
        pass
    return info


def describe() -> str:
    """One line naming the machine a benchmark runs on: CPU model, ISA flags,
    nanguard's CPU path, threads, torch."""
    return (f"CPU: {cpu_model()}; flags: {' '.join(cpu_flags()) or '-'}; nanguard CPU path: "
            f"{nanguard_cpu_isa()}; torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; "
            f"threads: {torch.get_num_threads()}; torch {torch.__version__}")


def md_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of rows' columns: floats to 3 significant digits,
    None (not measured) as '-'."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else "-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def result_rows(series: str, rows: list[dict], columns: list[str], extra: dict | None = None,
                notes: str = "", run: dict | None = None) -> list[dict]:
    """The table rows of one run: each measured row after the machine and run
    columns (run: machine() and the run's id and date, made here unless
    given). A measured row may not use those names."""
    if run is None:
        now = time.gmtime()
        run = {"run": time.strftime("%Y%m%dT%H%M%SZ", now) + "-" + uuid.uuid4().hex[:8],
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", now), **machine()}
    out = []
    for i, r in enumerate(rows):
        clash = set(r) & set(MACHINE_COLUMNS + RUN_COLUMNS)
        if clash:
            raise ValueError(f"result row {i} of series {series!r} uses reserved column(s) {sorted(clash)}")
        head = {"run": run["run"], "date": run["date"], "series": series,
                **{k: run.get(k) for k in MACHINE_COLUMNS}, "params": extra or {}}
        if i == 0:
            head["columns"] = list(columns)
            head["notes"] = notes
        out.append({**head, **r})
    return out


def write_results(table: str, series: str, rows: list[dict], columns: list[str],
                  extra: dict | None = None, notes: str = "", dry: bool | None = None,
                  results: pathlib.Path | None = None) -> None:
    """Append rows (one series of a run) to <results>/<table>.jsonl
    (default bench/results) and regenerate <table>.md; print the table.
    columns: those the summary shows; extra: the run's parameters; notes: a
    paragraph under the table. dry=True (default: a smoke run, quick())
    prints only."""
    dry = quick() if dry is None else dry
    print(md_table(rows, columns) + (f"\n\n{notes}" if notes else ""))
    if dry:
        print("\n(smoke run: nothing written)")
        return
    from summarize import write_summary  # bench/summarize.py, beside this file

    results = RESULTS if results is None else results
    results.mkdir(exist_ok=True)
    path = results / f"{table}.jsonl"
    with open(path, "a") as f:
        for r in result_rows(series, rows, columns, extra, notes):
            f.write(json.dumps(r, sort_keys=False) + "\n")
    write_summary(path)
    print(f"\nappended {len(rows)} rows to {path}; wrote {path.with_suffix('.md')}")


def quick() -> bool:
    """NANGUARD_BENCH_QUICK=1 shrinks repeats (for a smoke run, not for numbers)."""
    return os.environ.get("NANGUARD_BENCH_QUICK") == "1"
