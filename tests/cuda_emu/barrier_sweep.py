#!/usr/bin/env python3
"""Barrier-deletion sweep of the CUDA kernels on the emulator (run by hand).

For every ``__syncthreads()`` and ``__syncwarp(...)`` statement in
``kernels/*.cu`` and ``kernels/*.cuh`` (comments excluded), one at a time:
copy ``kernels/`` into the build tree with that one statement deleted, build
``test_cuda_sweep`` (the CUDA test linked against the copied kernel ahead of
the real ones; tests/cuda_emu/CMakeLists.txt, NG_EMU_SWEEP_*) and run the
emulator cases of that kernel. A deletion is *killed* when a run fails (a
wrong result, a schedule disagreement, a race, a barrier error), *survived*
when every run passes. Every survivor needs a reason: a barrier the emulator
should catch, or one that is redundant.

    python3 tests/cuda_emu/barrier_sweep.py [--build DIR] [--sanitize]
                                            [--only SUBSTRING] [--list]

--build DIR  the CMake build tree (default build/sweep, or build/sweep-san
             with --sanitize); configured with NG_TORCH=OFF, NG_CUDA=OFF.
--sanitize   the ASan + UBSan build (no race detector): what is left to the
             schedules and poisons alone.
--only S     only the barriers whose "file:line" contains S.
--list       print the barriers found and exit.

Each kernel's cases run unsharded (the whole sample, both halves of what
ctest's cuda_emu / cuda_emu_shard2 run), and for attention also its sm_75
and sm_86 sets and the SIMT decode, stopping at the first failing run. The
unmutated copy is built and run first; it must pass, or the sweep stops.
Prints a table: file, line, the statement's line, verdict, the first
failure's message, seconds. Exit status 0 when it ran; the verdicts are the
result.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
BARRIER = re.compile(r"__syncthreads\s*\(\s*\)\s*;|__syncwarp\s*\([^;]*\)\s*;")
# the emulator runs of each kernel: (environment, test_cuda arguments)
RUNS = {
    "layernorm": [({}, ["layernorm "])],
    "grad_guard": [({}, ["grad_guard "])],
    "tensor_stats": [({}, ["tensor_stats "])],
    "attention": [
        ({}, ["attention ", "errors "]),
        ({"NG_EMU_SM": "75"}, ["--set=sm75"]),
        ({"NG_EMU_SM": "86"}, ["--set=sm86"]),
        ({"NANGUARD_CUDA_DECODE": "simt"}, ["decode_"]),
    ],
}
TIMEOUT_S = 1800  # a run this long is a hang: counted as killed


@dataclass
class Barrier:
    path: Path  # kernels/<file>
    start: int  # character offsets of the statement
    end: int
    line: int
    text: str  # the source line, stripped

    @property
    def site(self) -> str:
        return f"{self.path.name}:{self.line}"


def code_only(src: str) -> str:
    """The source with comments and string literals blanked (newlines kept)."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src[i] == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def find_barriers() -> list[Barrier]:
    found = []
    for path in sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh")):
        src = path.read_text()
        lines = src.splitlines()
        for m in BARRIER.finditer(code_only(src)):
            line = src.count("\n", 0, m.start()) + 1
            found.append(Barrier(path, m.start(), m.end(), line, lines[line - 1].strip()))
    return found


def kernels_of(path: Path) -> list[str]:
    """The kernel translation units (kernels/<k>.cu) that compile `path`."""
    if path.suffix == ".cu":
        return [path.stem]
    units, todo, seen = [], [path.name], set()
    while todo:  # the .cu files that include it, directly or through other headers
        name = todo.pop()
        pat = re.compile(r'#\s*include\s+"(?:kernels/)?' + re.escape(name) + '"')
        for other in sorted(KERNELS.glob("*.cu*")):
            if other.name not in seen and pat.search(other.read_text()):
                seen.add(other.name)
                (units.append(other.stem) if other.suffix == ".cu" else todo.append(other.name))
    return units


def runs_of(kernel: str):
    for prefix, runs in RUNS.items():
        if kernel.startswith(prefix):
            return runs
    return [({}, [])]  # an unknown kernel: every case


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def configure(build: Path, sweep_dir: Path, kernels: list[str], sanitize: bool) -> None:
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DNG_TORCH=OFF",
           "-DNG_CUDA=OFF", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
           f"-DNG_SANITIZE={'ON' if sanitize else 'OFF'}", f"-DNG_EMU_SWEEP_DIR={sweep_dir}",
           "-DNG_EMU_SWEEP_KERNELS=" + ";".join(kernels)]
    r = sh(cmd)
    if r.returncode:
        sys.exit(f"barrier_sweep: cmake failed:\n{r.stdout}{r.stderr}")


def write_copy(sweep_dir: Path, mutated: Barrier | None) -> None:
    """kernels/ copied under sweep_dir, with `mutated`'s statement deleted;
    a file is rewritten only when its content changes, so that ninja rebuilds
    only what includes it."""
    dst = sweep_dir / "kernels"
    dst.mkdir(parents=True, exist_ok=True)
    for src in KERNELS.iterdir():
        if not src.is_file():
            continue
        text = src.read_text()
        if mutated is not None and src == mutated.path:
            keep = text[mutated.start:mutated.end]
            text = text[:mutated.start] + " " * len(keep) + text[mutated.end:]
        out = dst / src.name
        if not out.exists() or out.read_text() != text:
            out.write_text(text)


def build_and_run(build: Path, kernels: list[str]) -> tuple[str, str]:
    """("passed" | "killed" | "build error", the first failure's message)."""
    jobs = os.environ.get("NG_SWEEP_JOBS", "2")
    r = sh(["cmake", "--build", str(build), "-j", jobs, "--target", "test_cuda_sweep"])
    if r.returncode:
        return "build error", (r.stdout + r.stderr).strip().splitlines()[-1][:160]
    exe = build / "test_cuda_sweep"
    runs = []
    for k in kernels:
        for run in runs_of(k):
            if run not in runs:
                runs.append(run)
    for env, args in runs:
        try:
            r = sh([str(exe), *args], env={**os.environ, **env}, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "killed", f"no end after {TIMEOUT_S} s ({' '.join(args)})"
        if r.returncode:
            out = (r.stdout + "\n" + r.stderr).splitlines()
            first = next((ln for ln in out if ln.startswith("cuda_emu:") or "FAIL" in ln),
                         out[-1] if out else f"exit {r.returncode}")
            tag = " ".join(f"{k}={v}" for k, v in env.items())
            return "killed", (f"[{tag}] " if tag else "") + first.strip()[:200]
    return "passed", ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path)
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    o = ap.parse_args()
    barriers = [b for b in find_barriers() if o.only in b.site]
    if o.list:
        for b in barriers:
            print(f"{b.site:28} {','.join(kernels_of(b.path)):14} {b.text}")
        return 0
    build = (o.build or ROOT / ("build/sweep-san" if o.sanitize else "build/sweep")).resolve()
    sweep_dir = build / "sweep_src"
    shutil.rmtree(sweep_dir, ignore_errors=True)
    rows = []
    current = None
    for b in barriers:
        kernels = kernels_of(b.path)
        if not kernels:
            rows.append((b, "not compiled", "no kernels/*.cu includes it", 0.0))
            continue
        if kernels != current:
            configure(build, sweep_dir, kernels, o.sanitize)
            write_copy(sweep_dir, None)
            t0 = time.monotonic()
            verdict, why = build_and_run(build, kernels)
            print(f"baseline {','.join(kernels)}: {verdict} ({time.monotonic() - t0:.0f} s) {why}",
                  flush=True)
            if verdict != "passed":
                sys.exit("barrier_sweep: the unmutated kernels do not pass; nothing to sweep")
            current = kernels
        write_copy(sweep_dir, b)
        t0 = time.monotonic()
        verdict, why = build_and_run(build, kernels)
        dt = time.monotonic() - t0
        verdict = "survived" if verdict == "passed" else verdict
        rows.append((b, verdict, why, dt))
        print(f"{b.site:28} {verdict:9} {dt:6.0f} s  {b.text}  {why}", flush=True)
    write_copy(sweep_dir, None)
    print("\n| file:line | statement | verdict | first failure | s |\n|---|---|---|---|---|")
    for b, verdict, why, dt in rows:
        print(f"| {b.site} | `{b.text}` | {verdict} | {why.replace('|', '/')} | {dt:.0f} |")
    killed = sum(v == "killed" for _, v, _, _ in rows)
    print(f"\n{killed} of {len(rows)} deletions killed ({'sanitizer' if o.sanitize else 'normal'} "
          "build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
