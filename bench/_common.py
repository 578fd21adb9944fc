"""Shared benchmark helpers: same-process timing with medians, the machine's
copy bandwidth, and JSON + Markdown output under bench/results/.

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


def copy_bandwidth(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Measured GB/s of a large tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fns({"copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=2, device=device)["copy"]
    return 2 * nbytes / t / 1e9


def machine() -> dict:
    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=pathlib.Path(__file__).parent, timeout=10,
        ).stdout.strip()
    except Exception:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(name: str, rows: list[dict], columns: list[str], extra: dict | None = None) -> None:
    """Write bench/results/<name>.json and .md and print the table."""
    RESULTS.mkdir(exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), "rows": rows, **(extra or {})}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n{json.dumps(payload['machine'])}\n\n{md}\n")
    print(md)
    print(f"\nwrote {RESULTS / (name + '.json')} and .md")


def quick() -> bool:
    """NANGUARD_BENCH_QUICK=1 shrinks repeats (for a smoke run, not for numbers)."""
    return os.environ.get("NANGUARD_BENCH_QUICK") == "1"
