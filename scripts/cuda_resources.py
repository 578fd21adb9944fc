#!/usr/bin/env python3
"""Per-kernel GPU resources of nanguard's CUDA kernels, from the compiler.

Compiles every kernels/*.cu with nvcc for each architecture asked for
(sm_80 and sm_90 by default) with `-Xptxas -v`, the flags of the CMake
build, and writes one row per kernel instantiation: registers, spill
stores / loads, stack frame, static shared memory, barriers, and the
resident warps per SM that the register count alone allows (65536
registers per SM, allocated per warp in units of 256; 64 warps per SM on
sm_80 / sm_90). No GPU is needed; the numbers are what ptxas decided.

It also counts the instructions the tensor-core paths are meant to use
(`ldmatrix`, `cp.async`, `mma.sync`) in each kernel's and each file's PTX.

    python3 scripts/cuda_resources.py                  # markdown to stdout
    python3 scripts/cuda_resources.py --out bench/results/cuda_resources
        # writes <out>.md and <out>.json
    python3 scripts/cuda_resources.py --check-spills attention
        # exit 1 if any kernel whose name contains 'attention' spills
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-O3", "-DNDEBUG", "-std=c++17", "--expt-relaxed-constexpr", "-I", ROOT]
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
PTX_OPS = ("ldmatrix", "cp.async", "mma.sync")


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def _warps_by_regs(regs: int) -> int:
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(MAX_WARPS_PER_SM, REGS_PER_SM // per_warp)


def compile_one(nvcc: str, src: str, arch: str, tmp: str) -> tuple[list[dict], dict[str, int]]:
    ptx = os.path.join(tmp, os.path.basename(src) + f".{arch}.ptx")
    cmd = [nvcc, *FLAGS, f"-arch=sm_{arch}", "-Xptxas", "-v", "-c", "-o", os.devnull, src]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"nvcc failed on {src} for sm_{arch}:\n{res.stderr}")
    rows: list[dict] = []
    cur: dict | None = None
    for line in res.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", line)
        if m:
            cur = {
                "mangled": m.group(1),
                "arch": f"sm_{m.group(2)}",
                "regs": 0,
                "smem": 0,
                "stack": 0,
                "spill_stores": 0,
                "spill_loads": 0,
                "barriers": 0,
            }
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            s = re.search(r"(\d+) bytes smem", line)
            cur["barriers"] = int(b.group(1)) if b else 0
            cur["smem"] = int(s.group(1)) if s else 0
    subprocess.run([nvcc, *FLAGS, f"-arch=sm_{arch}", "-ptx", "-o", ptx, src], check=True, capture_output=True)
    with open(ptx) as f:
        text = f.read()
    counts = _count_ops(text)
    # per kernel: the PTX between one .entry and the next (device functions
    # are inlined into their kernels at -O3, so this is what each one runs)
    entries = list(re.finditer(r"^\s*(?:\.visible\s+|\.weak\s+)*\.entry\s+([\w$]+)\s*\(", text, re.M))
    per_entry = {
        e.group(1): _count_ops(text[e.start() : entries[i + 1].start() if i + 1 < len(entries) else len(text)])
        for i, e in enumerate(entries)
    }
    for row in rows:
        row["ptx"] = per_entry.get(row["mangled"], {op: 0 for op in PTX_OPS})
    return rows, counts


def _count_ops(text: str) -> dict[str, int]:
    return {op: len(re.findall(r"\b" + re.escape(op), text)) for op in PTX_OPS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["80", "90"], help="SM versions (default 80 90)")
    ap.add_argument("--out", help="write <out>.md and <out>.json instead of printing markdown")
    ap.add_argument(
        "--check-spills", metavar="SUBSTR", help="exit 1 if a kernel whose name contains SUBSTR spills registers"
    )
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("nvcc not found", file=sys.stderr)
        return 2
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    ver_line = next((line for line in ver.splitlines() if "release" in line), ver.strip())
    srcs = sorted(
        os.path.join(ROOT, "kernels", f) for f in os.listdir(os.path.join(ROOT, "kernels")) if f.endswith(".cu")
    )
    rows: list[dict] = []
    ptx: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            for src in srcs:
                r, counts = compile_one(nvcc, src, arch, tmp)
                for row in r:
                    row["file"] = os.path.relpath(src, ROOT)
                rows += r
                ptx.append({"file": os.path.relpath(src, ROOT), "arch": f"sm_{arch}", **counts})
    names = _demangle([r["mangled"] for r in rows])
    for r in rows:
        r["kernel"] = names[r["mangled"]]
        r["warps_by_regs"] = _warps_by_regs(r["regs"])
    lines = [
        f"# nanguard CUDA kernels: resources per instantiation ({ver_line.strip()})",
        "",
        "From `python3 scripts/cuda_resources.py` (ptxas -v, -O3). warps/SM: resident warps",
        "the register count alone allows (of 64); shared memory and the launch's block size",
        "may allow fewer. smem: static shared memory only (dynamic is sized at launch).",
        "The last column counts those PTX instructions in the kernel's own .entry (cp.async",
        "includes its commit_group / wait_group).",
        "",
    ]
    for arch in args.arch:
        lines += [
            f"## sm_{arch}",
            "",
            "| file | kernel | regs | spill st/ld (B) | stack (B) | smem (B) | warps/SM "
            "| ldmatrix / cp.async / mma.sync |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted((r for r in rows if r["arch"] == f"sm_{arch}"), key=lambda r: (r["file"], -r["regs"])):
            k = r["kernel"].replace("|", "\\|")
            if len(k) > 110:
                k = k[:107] + "..."
            lines.append(
                f"| {r['file']} | `{k}` | {r['regs']} | {r['spill_stores']}/"
                f"{r['spill_loads']} | {r['stack']} | {r['smem']} | {r['warps_by_regs']} | "
                + " / ".join(str(r["ptx"][o]) for o in PTX_OPS)
                + " |"
            )
        lines.append("")
    lines += [
        "## PTX instructions",
        "",
        "| file | arch | " + " | ".join(PTX_OPS) + " |",
        "|---|---|" + "---|" * len(PTX_OPS),
    ]
    for p in ptx:
        lines.append(f"| {p['file']} | {p['arch']} | " + " | ".join(str(p[o]) for o in PTX_OPS) + " |")
    md = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(md)
        with open(args.out + ".json", "w") as f:
            json.dump({"nvcc": ver_line.strip(), "kernels": rows, "ptx": ptx}, f, indent=1)
    else:
        sys.stdout.write(md)
    if args.check_spills:
        bad = [r for r in rows if args.check_spills in r["kernel"] and (r["spill_stores"] or r["spill_loads"])]
        for r in bad:
            print(f"spills: {r['arch']} {r['kernel']}: {r['spill_stores']}/{r['spill_loads']} B", file=sys.stderr)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
