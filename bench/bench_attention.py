"""safe_sdpa against torch.nn.functional.scaled_dot_product_attention and the
naive module people write to dodge NaN ("matmul, clamp, masked_fill(-1e4),
softmax, matmul").

B=4, H=8, D=64, L = S in {512, 1024, 2048}, fp32 and bf16, with no mask, a
padding mask (bool [B, 1, 1, S], the last quarter of keys padded in half the
batch) and causal; forward and forward+backward, in the same process and run,
candidates interleaved. Reports median times, ratios (other time / nanguard
time: > 1 means nanguard is faster), achieved GFLOP/s, and the peak memory of
one forward+backward of each candidate (CPU: peak RSS growth of a fresh
process beyond its inputs, read from VmHWM; CUDA: torch.cuda.max_memory_allocated
beyond the inputs).

    python bench/bench_attention.py [--device cuda] [--repeats 5] [--no-memory]
    python bench/bench_attention.py --flash      # CUDA: TFLOP/s against flash
    python bench/bench_attention.py --decode     # decode steps, KV-read bandwidth
    python bench/bench_attention.py --forward    # forward only, inference mode

--flash (a CUDA device only) is the GPU headline: bf16, B=4, H=16, D=128,
L = S = 4096, no mask, causal and a bool padding mask, forward and
forward+backward, safe_sdpa (the tensor-core kernels) against
F.scaled_dot_product_attention restricted to PyTorch's flash backend (which
takes no mask: unmasked in the padding rows) and, with the mask, to its
memory-efficient one; it reports TFLOP/s and the ratios.
--decode: one decode step, q [8, 32, 1, 128] against a KV cache of 2048 with
a boolean padding mask (the last quarter of the keys padded in half the
batch), 32 query heads over 8 kv heads (GQA, enable_gqa=True) and over 32,
fp32 and bf16, under torch.inference_mode. Reports both times, the ratio and
the KV cache's bytes (K and V, read once) per second of each against this
machine's measured copy bandwidth (bench/_common.py). nanguard skips key
blocks that the mask pads for every query row of a task (here 1/8 of the
cache), so the bytes it actually reads per second are those of the keys the
mask keeps: nanguard_attended_GBs. Series decode.

--calls: the cost of one small call, where the host's work is most of it:
a decode step of one sequence, q [1, 8, 1, 64] against S in {16, 256} keys
of 2 kv heads (GQA) with a bool padding mask, fp32 and bf16, under
torch.no_grad, as a generation loop calls attention. safe_sdpa against
F.scaled_dot_product_attention, and (with transformers installed) the
attention function `nanguard.patch` gives a Hugging Face model against
transformers' own sdpa one, each called as a model calls it; and a small
training call (16 query rows against the same keys, inputs that require
grad, forward and backward of the output's sum; columns train_*). Reports
microseconds per call (medians of 200-call runs, 50 for training) and the
ratios. Series calls.

--forward: forward only under torch.inference_mode, [4, 8, L, 64] with L = S
in 512..4096, no mask, fp32 and bf16, against F.scaled_dot_product_attention.
Series fwd.

--table: the CPU against the machine, not only against PyTorch. Forward
(inference_mode, no mask) fp32 and bf16 [4, 8, 2048, 64], fp32 head dim 128
and L 4096; forward + backward fp32 L 1024 (head dim 64 and 128) and L 2048
causal; decode (as --decode) fp32 and bf16, GQA 32/8 and MHA 32/32. Each
forward / backward case reports the ratio to F.scaled_dot_product_attention,
the GFLOP/s of both, and, timed in the same repeats, torch.mm's GFLOP/s on
the attention's own GEMMs (8 heads' Q K^T and P V) and on 2048^2 of the
case's dtype; each decode case the KV read rate (bytes of K and V per
second) of both against, in the same repeats, torch's read of those very
K and V bytes (a sum: STREAM-like) and the copy rate of a 256 MiB tensor
measured at the start of the run. Results name the CPU model, its ISA
flags and the CPU path nanguard runs (`python -m nanguard info`).
Series table (or --name) and <name>_decode.

Results: rows appended to bench/results/attention_<device>.jsonl (the
machine in every row: CPU model, ISA flags, nanguard's CPU path, threads,
torch, commit; bench/_common.py), summarised in attention_<device>.md.
--series NAME files the rows of any mode under NAME instead (for example
flash_nanguard, decode_simt: scripts/gpu_check.sh). With no mode: series
sweep, the older L sweep against the naive and PyTorch implementations.

FLOP convention (every mode): a forward is two GEMMs per (batch, head),
Q K^T and P V: 2 L S E + 2 L S Ev = 4 B H L S E for Ev = E. The backward
counts 2.5x the forward (five GEMMs: S = Q K^T recomputed, dP = dO V^T,
dV = P^T dO, dK = dS^T Q, dQ = dS K), so forward + backward is 3.5x. Causal
halves both (the L (L + 1) / 2 attended pairs, rounded to L^2 / 2). Softmax,
masking and the exp are not counted.

--isa avx2 (or baseline, avx512, or a comma list) runs the chosen mode again
in a child process with NANGUARD_CPU_ISA set (the kernels read it once, at
their first call: kernels/cpu_isa.c caps the widest supported path at the
request; a request above what the CPU has is ignored); the rows' isa column
names the path.
PyTorch is capped the same way in that child (ATEN_CPU_CAPABILITY for its
own kernels, MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA for its GEMMs),
so that the child measures what a machine with only that instruction set
gets from both; results record torch's capability beside nanguard's path.
--quick: 2 repeats, prints the tables, writes nothing (a smoke run).
Ratios are medians over repeats of the per-repeat time ratio (candidates
interleaved in alternating order, bench/_common.py); the repeat count is in
each result file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

from nanguard.functional import safe_sdpa  # noqa: E402

B, H, D = 4, 8, 64
LENGTHS = [512, 1024, 2048]
VARIANTS = ["none", "padding", "causal"]


def naive(q, k, v, mask, causal):
    """The hand-written NaN dodge: clamp, masked_fill(-1e4), softmax."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = s.clamp(-1e4, 1e4)
    if mask is not None:
        s = s.masked_fill(~mask, -1e4)
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1), -1e4)
    return torch.softmax(s, -1) @ v


CANDIDATES = {
    "nanguard": lambda q, k, v, m, c: safe_sdpa(q, k, v, attn_mask=m, is_causal=c),
    "torch": lambda q, k, v, m, c: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c),
    "naive": naive,
}


def inputs(L, dtype, variant, device):
    g = torch.Generator().manual_seed(0)
    q, k, v, gy = (torch.randn(B, H, L, D, generator=g).to(device, dtype) for _ in range(4))
    mask = None
    if variant == "padding":
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        mask[: B // 2, ..., 3 * L // 4 :] = False
        mask = mask.to(device)
    return q, k, v, gy, mask, variant == "causal"


def attn_flops(b, h, L, S, E, Ev, causal, backward):
    """The module docstring's convention: 2 L S (E + Ev) per head forward,
    3.5x for forward + backward, halved when causal."""
    f = 2.0 * b * h * L * S * (E + Ev) * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def flops(L, causal, backward):
    """2 matmuls forward (4 B H L^2 D), 2.5x that for the backward; causal halves."""
    return attn_flops(B, H, L, L, D, D, causal, backward)


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _memory_child(spec: str) -> None:
    """Run one fwd+bwd of one candidate and print the peak memory it added
    beyond its inputs (bytes)."""
    name, L, dtype, variant, device = json.loads(spec)
    dtype = getattr(torch, dtype)
    q, k, v, gy, mask, causal = inputs(L, dtype, variant, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (VmHWM)
            f.write("5")
        base = _rss_kib("VmRSS")
        CANDIDATES[name](q, k, v, mask, causal).backward(gy)
        print((_rss_kib("VmHWM") - base) * 1024)
    else:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        CANDIDATES[name](q, k, v, mask, causal).backward(gy)
        torch.cuda.synchronize()
        print(torch.cuda.max_memory_allocated() - base)


def peak_memory(name, L, dtype, variant, device):
    spec = json.dumps([name, L, str(dtype).replace("torch.", ""), variant, device])
    r = subprocess.run([sys.executable, __file__, "--memory-child", spec], capture_output=True, text=True,
                       timeout=600)
    try:
        return int(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return -1


def flash_compare(repeats: int) -> None:
    """safe_sdpa vs PyTorch's flash backend, bf16, D=128, L=4096, on CUDA.

    Variants: no mask, causal, and a bool padding mask [B, 1, 1, S] (the last
    quarter of the keys padded in half the batch, as --decode pads). Flash
    takes no mask: in the padding rows it runs unmasked over every key (what
    a padded batch costs a user of flash who does not unpad it), and
    PyTorch's memory-efficient backend, which takes the mask, runs it too
    (nanguard_vs_efficient). TFLOP/s count every key of every row, masked or
    not (4 B H L S D a forward, 3.5x that forward + backward, half with
    causal), so they compare times; nanguard computes no key block that the
    mask pads for every query (1/8 of them here).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    Bf, Hf, Lf, Df = 4, 16, 4096, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, gy = (torch.randn(Bf, Hf, Lf, Df, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    pad = torch.ones(Bf, 1, 1, Lf, dtype=torch.bool)
    pad[::2, ..., Lf - Lf // 4:] = False
    pad = pad.to("cuda")

    def flash(q, k, v, causal, mask):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def efficient(q, k, v, causal, mask):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    rows = []
    for variant in ("none", "causal", "padding"):
        causal, mask = variant == "causal", pad if variant == "padding" else None
        cands = {"nanguard": lambda q, k, v, c, m: safe_sdpa(q, k, v, attn_mask=m, is_causal=c), "flash": flash}
        if mask is not None:
            cands["efficient"] = efficient
        for mode in ("fwd", "fwd+bwd"):
            qg, kg, vg = (t.detach().requires_grad_(mode != "fwd") for t in (q, k, v))

            def mk(f):
                def run():
                    if mode == "fwd":
                        with torch.no_grad():
                            f(qg, kg, vg, causal, mask)
                    else:
                        f(qg, kg, vg, causal, mask).backward(gy)
                        qg.grad = kg.grad = vg.grad = None
                return run

            t = _common.time_fns({n: mk(f) for n, f in cands.items()}, repeats=repeats, warmup=3, device="cuda")
            fl = 4.0 * Bf * Hf * Lf * Lf * Df * (0.5 if causal else 1.0) * (3.5 if mode != "fwd" else 1.0)
            row = {"variant": variant, "mode": mode, "nanguard_ms": t["nanguard"] * 1e3, "flash_ms": t["flash"] * 1e3,
                   "nanguard_TFLOPs": fl / t["nanguard"] / 1e12, "flash_TFLOPs": fl / t["flash"] / 1e12,
                   "nanguard_vs_flash": t["flash"] / t["nanguard"],
                   "nanguard_vs_efficient": t["efficient"] / t["nanguard"] if "efficient" in t else None}
            rows.append(row)
            print(row, flush=True)
    cols = ["variant", "mode", "nanguard_ms", "flash_ms", "nanguard_TFLOPs", "flash_TFLOPs", "nanguard_vs_flash",
            "nanguard_vs_efficient"]
    _common.write_results("attention_cuda", _SERIES or "flash", rows, cols,
                          {"B": Bf, "H": Hf, "L": Lf, "D": Df, "dtype": "bfloat16",
                           "mask": "padding: bool [B,1,1,S], the last quarter of the keys padded in half the batch",
                           "gpu": torch.cuda.get_device_name()})


DECODE = {"B": 8, "Hq": 32, "L": 1, "S": 2048, "D": 128}


def decode_compare(dev: str, repeats: int, hkv_list=(8, 32), dtypes=("float32", "bfloat16")) -> None:
    """One decode step against F.sdpa: times, ratio, KV-read bandwidth."""
    B, Hq, L, S, D = (DECODE[x] for x in ("B", "Hq", "L", "S", "D"))
    copy_gbs = _common.copy_bandwidth(dev)
    print(f"threads: {torch.get_num_threads()}, copy bandwidth {copy_gbs:.1f} GB/s", flush=True)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for hkv in hkv_list:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(B, Hq, L, D, generator=g).to(dev, dtype)
            k, v = (torch.randn(B, hkv, S, D, generator=g).to(dev, dtype) for _ in range(2))
            mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
            mask[: B // 2, ..., 3 * S // 4 :] = False
            mask = mask.to(dev)
            gqa = hkv != Hq

            def mk(f):
                def run():
                    with torch.inference_mode():
                        f(q, k, v, attn_mask=mask, enable_gqa=gqa)
                return run

            t = _common.time_fns({"nanguard": mk(safe_sdpa), "torch": mk(F.scaled_dot_product_attention)},
                                 repeats=repeats, warmup=3, device=dev)
            kv_bytes = 2 * k.numel() * k.element_size()
            attended = kv_bytes * mask.float().mean().item()
            row = {
                "dtype": dtype_name,
                "heads": f"{Hq}/{hkv}",
                "nanguard_ms": t["nanguard"] * 1e3,
                "torch_ms": t["torch"] * 1e3,
                "vs_torch": t["torch"] / t["nanguard"],
                "nanguard_KV_GBs": kv_bytes / t["nanguard"] / 1e9,
                "torch_KV_GBs": kv_bytes / t["torch"] / 1e9,
                "nanguard_pct_copy": 100 * kv_bytes / t["nanguard"] / 1e9 / copy_gbs,
                "nanguard_attended_GBs": attended / t["nanguard"] / 1e9,
            }
            rows.append(row)
            print(row, flush=True)
    cols = ["dtype", "heads", "nanguard_ms", "torch_ms", "vs_torch", "nanguard_KV_GBs", "torch_KV_GBs",
            "nanguard_pct_copy", "nanguard_attended_GBs"]
    _common.write_results(f"attention_{dev}", _SERIES or "decode", rows, cols,
                          {**DECODE, "mask": "bool padding [B,1,1,S]", "copy_GBs": copy_gbs, "repeats": repeats})


def calls_compare(dev: str, repeats: int) -> None:
    """Microseconds per small decode call: safe_sdpa against F.sdpa, and the
    Hugging Face attention functions (nanguard's, transformers' sdpa)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from nanguard.patching._hf_attention import _hf_attention
    except ImportError:
        sdpa_attention_forward = _hf_attention = None
    n_calls, hq, hkv, d = 200, 8, 2, 64

    class Attn(torch.nn.Module):  # what the HF functions read from a model's attention module
        num_key_value_groups, is_causal = hq // hkv, True

    module = Attn()
    rows = []
    for dtype_name in ("float32", "bfloat16"):
        for S in (16, 256):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, hq, 1, d, generator=g).to(dev, getattr(torch, dtype_name))
            k, v = (torch.randn(1, hkv, S, d, generator=g).to(dev, q.dtype) for _ in range(2))
            mask = torch.ones(1, 1, 1, S, dtype=torch.bool, device=dev)
            calls = {
                "nanguard": lambda: safe_sdpa(q, k, v, attn_mask=mask, enable_gqa=True),
                "torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            }
            if _hf_attention is not None:
                calls["hf_nanguard"] = lambda: _hf_attention(module, q, k, v, mask, dropout=0.0, scaling=d**-0.5)
                calls["hf_sdpa"] = lambda: sdpa_attention_forward(module, q, k, v, mask, dropout=0.0,
                                                                  scaling=d**-0.5)

            def mk(f):
                def run():
                    with torch.no_grad():
                        for _ in range(n_calls):
                            f()
                return run

            t = _common.time_fns({n: mk(f) for n, f in calls.items()}, repeats=repeats, warmup=2, device=dev)
            # a training call: 16 query rows, inputs that require grad,
            # forward and backward (of the output's sum) on both sides
            qt, kt, vt = (t_.detach().expand(*t_.shape[:2], 16 if t_ is q else S, d).clone().requires_grad_()
                          for t_ in (q, k, v))
            mt = torch.ones(1, 1, 16, S, dtype=torch.bool, device=dev)

            def train(f):
                def run():
                    for _ in range(n_calls // 4):
                        f(qt, kt, vt, attn_mask=mt, enable_gqa=True).sum().backward()
                return run

            t.update(_common.time_fns({"nanguard_train": train(safe_sdpa),
                                       "torch_train": train(F.scaled_dot_product_attention)},
                                      repeats=repeats, warmup=2, device=dev))
            us = {n: t[n] / (n_calls // 4 if n.endswith("_train") else n_calls) * 1e6 for n in t}
            row = {"dtype": dtype_name, "S": S, "nanguard_us": us["nanguard"], "torch_us": us["torch"],
                   "vs_torch": us["torch"] / us["nanguard"]}
            if "hf_nanguard" in us:
                row.update(hf_nanguard_us=us["hf_nanguard"], hf_sdpa_us=us["hf_sdpa"],
                           hf_vs_sdpa=us["hf_sdpa"] / us["hf_nanguard"])
            row.update(train_nanguard_us=us["nanguard_train"], train_torch_us=us["torch_train"],
                       train_vs_torch=us["torch_train"] / us["nanguard_train"])
            rows.append(row)
            print(row, flush=True)
    cols = ["dtype", "S", "nanguard_us", "torch_us", "vs_torch", "hf_nanguard_us", "hf_sdpa_us", "hf_vs_sdpa",
            "train_nanguard_us", "train_torch_us", "train_vs_torch"]
    _common.write_results(f"attention_{dev}", _SERIES or "calls", rows, cols,
                          {"q": [1, hq, 1, d], "kv_heads": hkv, "mask": "bool [1,1,1,S]",
                           "train": "q [1, 8, 16, 64], mask [1, 1, 16, S], forward + backward of the sum",
                           "calls_per_run": n_calls, "train_calls_per_run": n_calls // 4, "repeats": repeats})


def forward_compare(dev: str, repeats: int, lengths=(512, 1024, 2048, 4096)) -> None:
    """Forward only, no mask, under inference_mode, against F.sdpa."""
    print(f"threads: {torch.get_num_threads()}, device: {dev}", flush=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for L in lengths:
            q, k, v, _, _, _ = inputs(L, dtype, "none", dev)

            def mk(f):
                def run():
                    with torch.inference_mode():
                        f(q, k, v)
                return run

            t = _common.time_fns({"nanguard": mk(safe_sdpa), "torch": mk(F.scaled_dot_product_attention)},
                                 repeats=repeats, warmup=1, device=dev)
            fl = flops(L, False, False)
            row = {"dtype": str(dtype).replace("torch.", ""), "L": L, "nanguard_ms": t["nanguard"] * 1e3,
                   "torch_ms": t["torch"] * 1e3, "vs_torch": t["torch"] / t["nanguard"],
                   "nanguard_GFLOPs": fl / t["nanguard"] / 1e9, "torch_GFLOPs": fl / t["torch"] / 1e9}
            rows.append(row)
            print(row, flush=True)
    cols = ["dtype", "L", "nanguard_ms", "torch_ms", "vs_torch", "nanguard_GFLOPs", "torch_GFLOPs"]
    _common.write_results(f"attention_{dev}", _SERIES or "fwd", rows, cols,
                          {"B": B, "H": H, "D": D, "mask": "none", "mode": "inference_mode", "repeats": repeats})


# ---- --table: against the machine's GEMM and copy rates ---------------------

#: (mode, dtype, B, H, L = S, E = Ev, causal)
TABLE = [
    ("fwd", "float32", 4, 8, 2048, 64, False),
    ("fwd", "bfloat16", 4, 8, 2048, 64, False),
    ("fwd", "float32", 4, 8, 2048, 128, False),
    ("fwd", "float32", 4, 8, 4096, 64, False),
    ("fwd+bwd", "float32", 4, 8, 1024, 64, False),
    ("fwd+bwd", "float32", 4, 8, 1024, 128, False),
    ("fwd+bwd", "float32", 4, 8, 2048, 64, True),
    # the ends of the GEMM-rate targets: L 1024 and 4096, head dim 64 and 128
    ("fwd", "float32", 4, 8, 1024, 64, False),
    ("fwd", "float32", 4, 8, 1024, 128, False),
    ("fwd", "float32", 1, 8, 4096, 128, False),
    ("fwd+bwd", "float32", 1, 8, 4096, 64, False),
    ("fwd+bwd", "float32", 1, 8, 4096, 128, False),
    ("fwd+bwd", "bfloat16", 4, 8, 1024, 64, False),
]
#: (dtype, kv heads) against DECODE's 32 query heads
DECODE_TABLE = [("float32", 8), ("float32", 32), ("bfloat16", 8), ("bfloat16", 32)]
MM_N = 2048
MM_HEADS = 8


def _iqr(q1, q3):
    return f"{q1:.2f}-{q3:.2f}"


#: 16-bit torch.mm slower than this share of fp32's: PyTorch has no native
#: kernel for the dtype on this CPU (no avx512_bf16 / fp16, or capped), and a
#: 2048^2 product would take a minute a repeat to report a meaningless rate
MM_NATIVE_SHARE = 0.1
_mm_native_cache: dict = {}


def _mm_native(dtype, dev):
    """Whether torch.mm in dtype runs at a native rate here, probed once on
    512^2 against fp32 (best of 3 each)."""
    if dtype == torch.float32 or dev != "cpu":
        return True
    if dtype not in _mm_native_cache:
        def rate(dt):
            a, b = (torch.randn(512, 512).to(dt) for _ in range(2))
            torch.mm(a, b)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - t0)
            return 2 * 512**3 / best / 1e9
        r16, r32 = rate(dtype), rate(torch.float32)
        _mm_native_cache[dtype] = r16 >= MM_NATIVE_SHARE * r32
        if not _mm_native_cache[dtype]:
            print(f"torch.mm {dtype}: {r16:.2f} GFLOP/s at 512^2 against {r32:.1f} in fp32, no native kernel "
                  "here; its mm columns are not timed", flush=True)
    return _mm_native_cache[dtype]


def _attn_case(mode, dtype_name, b, h, L, E, causal, dev, repeats):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, gy = (torch.randn(b, h, L, E, generator=g).to(dev, dtype) for _ in range(4))
    if mode == "fwd":
        def mk(f):
            def run():
                with torch.inference_mode():
                    f(q, k, v, is_causal=causal)
            return run
    else:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def mk(f):
            def run():
                f(qg, kg, vg, is_causal=causal).backward(gy)
                qg.grad = kg.grad = vg.grad = None
            return run
    # torch.mm on this case's GEMMs (per head: Q K^T [L, E] x [E, S], P V
    # [L, S] x [S, E]; MM_HEADS heads into preallocated outputs, so that the
    # call lasts long enough to time) and on 2048^2, in the case's dtype
    mq, mkt, mv = (torch.randn(*s, generator=g).to(dev, dtype) for s in ((L, E), (E, L), (L, E)))
    ms, mo = torch.empty(L, L, dtype=dtype, device=dev), torch.empty(L, E, dtype=dtype, device=dev)
    ma, mb = (torch.randn(MM_N, MM_N, generator=g).to(dev, dtype) for _ in range(2))
    heads = min(b * h, MM_HEADS)

    def mm_attn():
        with torch.inference_mode():
            for _ in range(heads):
                torch.mm(mq, mkt, out=ms)
                torch.mm(ms, mv, out=mo)

    def mm_sq():
        with torch.inference_mode():
            torch.mm(ma, mb)

    fns = {"nanguard": mk(safe_sdpa), "torch": mk(F.scaled_dot_product_attention)}
    mm = _mm_native(dtype, dev)
    if mm:
        fns.update(mm_attn=mm_attn, mm_2048=mm_sq)
    t = _common.time_samples(fns, repeats=repeats, warmup=1, device=dev)
    med = {n: statistics.median(x) for n, x in t.items()}
    fl = attn_flops(b, h, L, L, E, E, causal, mode != "fwd")
    fl_attn_mm, fl_sq = 4.0 * L * L * E * heads, 2.0 * MM_N**3
    ratio, q1, q3 = _common.paired_ratio(t, "torch", "nanguard")
    # share of the same repeat's torch.mm rate: (fl / t_ng) / (fl_mm / t_mm)
    mm_cols = dict.fromkeys(("mm_attn_GFLOPs", "mm_2048_GFLOPs", "nanguard_pct_mm_attn", "nanguard_pct_mm_2048",
                             "torch_pct_mm_2048"))
    if mm:
        mm_cols.update({
            "mm_attn_GFLOPs": fl_attn_mm / med["mm_attn"] / 1e9, "mm_2048_GFLOPs": fl_sq / med["mm_2048"] / 1e9,
            "nanguard_pct_mm_attn": 100 * _common.paired_ratio(t, "mm_attn", "nanguard")[0] * fl / fl_attn_mm,
            "nanguard_pct_mm_2048": 100 * _common.paired_ratio(t, "mm_2048", "nanguard")[0] * fl / fl_sq,
            "torch_pct_mm_2048": 100 * _common.paired_ratio(t, "mm_2048", "torch")[0] * fl / fl_sq,
        })
    return {
        "case": f"{mode} {dtype_name} [{b},{h},{L},{E}]" + (" causal" if causal else ""),
        "mode": mode, "dtype": dtype_name, "B": b, "H": h, "L": L, "E": E, "causal": causal,
        "nanguard_ms": med["nanguard"] * 1e3, "torch_ms": med["torch"] * 1e3,
        "vs_torch": ratio, "vs_torch_iqr": _iqr(q1, q3),
        "nanguard_GFLOPs": fl / med["nanguard"] / 1e9, "torch_GFLOPs": fl / med["torch"] / 1e9,
        **mm_cols,
    }


def _decode_case(dtype_name, hkv, dev, repeats, copy_gbs):
    b, hq, L, S, E = (DECODE[x] for x in ("B", "Hq", "L", "S", "D"))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, L, E, generator=g).to(dev, dtype)
    k, v = (torch.randn(b, hkv, S, E, generator=g).to(dev, dtype) for _ in range(2))
    mask = torch.ones(b, 1, 1, S, dtype=torch.bool)
    mask[: b // 2, ..., 3 * S // 4 :] = False
    mask = mask.to(dev)
    gqa = hkv != hq
    # the same K and V bytes read once by torch (viewed as fp32: a bf16 pair
    # per element, so the sum reads every byte at fp32's speed)
    kf, vf = (x.view(torch.float32) for x in (k, v))

    def mk(f):
        def run():
            with torch.inference_mode():
                f(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return run

    def kv_read():
        kf.sum()
        vf.sum()

    t = _common.time_samples({"nanguard": mk(safe_sdpa), "torch": mk(F.scaled_dot_product_attention),
                              "kv_read": kv_read}, repeats=repeats, warmup=3, device=dev)
    med = {n: statistics.median(x) for n, x in t.items()}
    kv_bytes = 2 * k.numel() * k.element_size()
    keep = mask.float().mean().item()
    ratio, q1, q3 = _common.paired_ratio(t, "torch", "nanguard")
    ng_gbs = kv_bytes / med["nanguard"] / 1e9
    return {
        "case": f"decode {dtype_name} {hq}/{hkv}", "dtype": dtype_name, "heads": f"{hq}/{hkv}",
        "KV_MiB": kv_bytes / 2**20,
        "nanguard_ms": med["nanguard"] * 1e3, "torch_ms": med["torch"] * 1e3,
        "vs_torch": ratio, "vs_torch_iqr": _iqr(q1, q3),
        "nanguard_KV_GBs": ng_gbs, "torch_KV_GBs": kv_bytes / med["torch"] / 1e9,
        "kv_read_GBs": kv_bytes / med["kv_read"] / 1e9,
        "nanguard_pct_read": 100 * _common.paired_ratio(t, "kv_read", "nanguard")[0],
        "nanguard_pct_copy": 100 * ng_gbs / copy_gbs,
        "nanguard_attended_GBs": ng_gbs * keep,
    }


#: --series: the series every mode's rows are filed under (default: the mode's)
_SERIES: str | None = None


def table_compare(dev, repeats, dec_repeats, name, dry, cases=None):
    print(_common.describe(), flush=True)
    copy_gbs = _common.copy_bandwidth(dev, repeats=max(5, repeats))
    read_gbs = _common.read_bandwidth(dev, repeats=max(5, repeats))
    print(f"copy {copy_gbs:.1f} GB/s (read + write counted), read {read_gbs:.1f} GB/s (256 MiB fp32)", flush=True)
    rows, dec_rows = [], []
    for c in TABLE:
        if cases and not any(s in " ".join(map(str, c)) for s in cases):
            continue
        rows.append(_attn_case(*c, dev, repeats))
        print(rows[-1], flush=True)
    for dtype_name, hkv in DECODE_TABLE:
        if cases and not any(s in f"decode {dtype_name} {hkv}" for s in cases):
            continue
        dec_rows.append(_decode_case(dtype_name, hkv, dev, dec_repeats, copy_gbs))
        print(dec_rows[-1], flush=True)
    cols = ["case", "nanguard_ms", "torch_ms", "vs_torch", "vs_torch_iqr", "nanguard_GFLOPs", "torch_GFLOPs",
            "mm_attn_GFLOPs", "mm_2048_GFLOPs", "nanguard_pct_mm_attn", "nanguard_pct_mm_2048", "torch_pct_mm_2048"]
    dcols = ["case", "KV_MiB", "nanguard_ms", "torch_ms", "vs_torch", "vs_torch_iqr", "nanguard_KV_GBs",
             "torch_KV_GBs", "kv_read_GBs", "nanguard_pct_read", "nanguard_pct_copy", "nanguard_attended_GBs"]

    notes = (
        f"copy rate {copy_gbs:.1f} GB/s (256 MiB fp32 copy_, read + write counted); read rate {read_gbs:.1f} GB/s "
        f"(256 MiB fp32 sum). Forward / backward: {repeats} repeats, decode: {dec_repeats}; medians, ratios "
        "median of per-repeat ratios (vs_torch_iqr: their quartiles). GFLOP/s: 4 B H L S E forward, 3.5x "
        "for forward + backward, halved when causal. mm_attn: torch.mm on the case's per-head Q K^T and P V "
        f"({MM_HEADS} heads, outputs preallocated); mm_{MM_N}: torch.mm {MM_N}^2 of the case's dtype, both "
        "timed in the same repeats; '-' where torch.mm has no native kernel for a 16-bit dtype on this CPU "
        f"(below {MM_NATIVE_SHARE:g}x its fp32 rate at 512^2). Decode: "
        f"q [{DECODE['B']}, 32, 1, {DECODE['D']}], S {DECODE['S']}, bool padding mask (1/8 of the keys "
        "padded); KV_GBs = bytes of K and V / time; kv_read = torch reading those K and V bytes once (sum), "
        "in the same repeats; nanguard_pct_read = nanguard's KV rate / that; attended = the bytes of the "
        "keys the mask keeps (series " + name + "_decode)."
    )
    params = {"copy_GBs": copy_gbs, "read_GBs": read_gbs, "repeats": repeats, "decode_repeats": dec_repeats,
              "flops": "4 B H L S E forward; x3.5 forward + backward; x0.5 causal", "decode": DECODE}
    name = _SERIES or name
    _common.write_results(f"attention_{dev}", name, rows, cols, params, notes=notes, dry=dry)
    if dec_rows:
        _common.write_results(f"attention_{dev}", f"{name}_decode", dec_rows, dcols, params, dry=dry)


#: the environment that caps PyTorch at nanguard's --isa: its ATen kernels, MKL, oneDNN
TORCH_ISA_CAP = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                 "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def run_isa(isas: str) -> None:
    """This script again, without --isa, once per instruction set, each in a
    child process with NANGUARD_CPU_ISA set."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--isa":
            skip = True
            continue
        if a.startswith("--isa="):
            continue
        argv.append(a)
    for isa in isas.split(","):
        env = {**os.environ, "NANGUARD_CPU_ISA": isa, **TORCH_ISA_CAP.get(isa, {})}
        print(f"== NANGUARD_CPU_ISA={isa}", *(f"{k}={v}" for k, v in TORCH_ISA_CAP.get(isa, {}).items()),
              flush=True)
        r = subprocess.run([sys.executable, __file__, *argv], env=env)
        if r.returncode:
            raise SystemExit(r.returncode)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=None,
                   help="default 5 (--table: 11 forward / backward, 31 decode); --quick: 2")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory-child")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--flash", action="store_true", help="CUDA: bf16 D=128 L=4096 TFLOP/s against flash")
    p.add_argument("--decode", action="store_true", help="decode steps: time and KV-read bandwidth")
    p.add_argument("--forward", action="store_true", help="forward only under inference_mode, no mask")
    p.add_argument("--calls", action="store_true", help="microseconds per small decode call (host cost)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads(N) first (the rows' threads column)")
    p.add_argument("--table", action="store_true",
                   help="CPU: the cases of the table against PyTorch, torch.mm GFLOP/s and the copy rate")
    p.add_argument("--name", default=None, help="--table: the series in attention_<device>.jsonl "
                   "(default table; its decode rows: <name>_decode)")
    p.add_argument("--cases", default="", help="--table: only the cases whose description has one of these "
                   "comma-separated strings (e.g. 'decode,fwd+bwd')")
    p.add_argument("--decode-repeats", type=int, default=None, help="--table: repeats of the decode cases")
    p.add_argument("--isa", default="", help="run again in a child with NANGUARD_CPU_ISA=<isa> per comma-"
                   "separated entry (avx2, baseline, avx512)")
    p.add_argument("--series", default=None, help="the series the rows are filed under (default: the mode's)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, nothing written")
    args = p.parse_args()
    global _SERIES
    _SERIES = args.series
    if args.quick:
        os.environ["NANGUARD_BENCH_QUICK"] = "1"
    if args.isa:
        run_isa(args.isa)
        return
    quick = _common.quick()
    if args.table:
        if args.threads:
            torch.set_num_threads(args.threads)
        name = args.name or "table"
        reps = 2 if quick else (args.repeats or 11)
        dec_reps = 3 if quick else (args.decode_repeats or args.repeats or 31)
        table_compare(args.device, reps, dec_reps, name, quick,
                      [c for c in args.cases.split(",") if c])
        return
    if args.repeats is None:
        args.repeats = 3 if quick else 5
    if args.threads:
        torch.set_num_threads(args.threads)
    # NANGUARD_CPU_ISA=avx2 (or baseline) caps the CPU kernels' instruction set
    # (an AVX2 machine's numbers from an AVX-512 one): the rows' isa column
    if args.decode:
        decode_compare(args.device, max(args.repeats, 3 if _common.quick() else 15))
        return
    if args.calls:
        calls_compare(args.device, max(args.repeats, 3 if _common.quick() else 21))
        return
    if args.forward:
        lengths = (512, 1024, 2048, 4096) if args.lengths == ",".join(map(str, LENGTHS)) else \
            tuple(int(x) for x in args.lengths.split(","))
        forward_compare(args.device, max(args.repeats, 3 if _common.quick() else 7), lengths)
        return
    if args.flash:
        if not torch.cuda.is_available():
            raise SystemExit("--flash needs a CUDA device")
        flash_compare(max(args.repeats, 10))
        return
    if args.memory_child:
        _memory_child(args.memory_child)
        return
    dev = args.device
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"threads: {torch.get_num_threads()}, device: {dev}")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for L in lengths:
            for variant in VARIANTS:
                q, k, v, gy, mask, causal = inputs(L, dtype, variant, dev)
                for mode in ("fwd", "fwd+bwd"):
                    if mode == "fwd":
                        def mk(f):
                            def run():
                                with torch.no_grad():
                                    f(q, k, v, mask, causal)
                            return run
                    else:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                        def mk(f, qg=qg, kg=kg, vg=vg):
                            def run():
                                f(qg, kg, vg, mask, causal).backward(gy)
                                qg.grad = kg.grad = vg.grad = None
                            return run
                    fns = {n: mk(f) for n, f in CANDIDATES.items()}
                    t = _common.time_fns(fns, repeats=args.repeats, warmup=1, device=dev)
                    fl = flops(L, causal, mode != "fwd")
                    row = {
                        "dtype": str(dtype).replace("torch.", ""),
                        "L": L,
                        "mask": variant,
                        "mode": mode,
                        "nanguard_ms": t["nanguard"] * 1e3,
                        "torch_ms": t["torch"] * 1e3,
                        "naive_ms": t["naive"] * 1e3,
                        "vs_torch": t["torch"] / t["nanguard"],
                        "vs_naive": t["naive"] / t["nanguard"],
                        "nanguard_GFLOPs": fl / t["nanguard"] / 1e9,
                        "torch_GFLOPs": fl / t["torch"] / 1e9,
                    }
                    if mode == "fwd+bwd" and L == max(lengths) and not args.no_memory:
                        for n in CANDIDATES:
                            row[f"{n}_peak_MiB"] = peak_memory(n, L, dtype, variant, dev) / 2**20
                    rows.append(row)
                    print(row, flush=True)
    cols = ["dtype", "L", "mask", "mode", "nanguard_ms", "torch_ms", "naive_ms", "vs_torch", "vs_naive",
            "nanguard_GFLOPs", "torch_GFLOPs", "nanguard_peak_MiB", "torch_peak_MiB", "naive_peak_MiB"]
    _common.write_results(f"attention_{dev}", _SERIES or "sweep", rows, cols, {"B": B, "H": H, "D": D})


if __name__ == "__main__":
    main()
