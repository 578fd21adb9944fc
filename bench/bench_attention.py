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
L = S = 4096, no mask and causal, forward and forward+backward, safe_sdpa
(the tensor-core kernels) against F.scaled_dot_product_attention restricted
to PyTorch's flash backend; it reports TFLOP/s of both and their ratio.
--decode: one decode step, q [8, 32, 1, 128] against a KV cache of 2048 with
a boolean padding mask (the last quarter of the keys padded in half the
batch), 32 query heads over 8 kv heads (GQA, enable_gqa=True) and over 32,
fp32 and bf16, under torch.inference_mode. Reports both times, the ratio and
the KV cache's bytes (K and V, read once) per second of each against this
machine's measured copy bandwidth (bench/_common.py). nanguard skips key
blocks that the mask pads for every query row of a task (here 1/8 of the
cache), so the bytes it actually reads per second are those of the keys the
mask keeps: nanguard_attended_GBs. Results:
bench/results/attention_<device>_decode.{json,md}; NANGUARD_CPU_ISA=avx2
(the AVX2 kernels on an AVX-512 machine) adds _avx2 to the name, --threads N
adds _tN.

--forward: forward only under torch.inference_mode, [4, 8, L, 64] with L = S
in 512..4096, no mask, fp32 and bf16, against F.scaled_dot_product_attention.
Results: bench/results/attention_<device>_fwd.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys

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


def flops(L, causal, backward):
    """2 matmuls forward (4 B H L^2 D), 2.5x that for the backward; causal halves."""
    f = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


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
    """safe_sdpa vs PyTorch's flash backend, bf16, D=128, L=4096, on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    Bf, Hf, Lf, Df = 4, 16, 4096, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, gy = (torch.randn(Bf, Hf, Lf, Df, generator=g).to("cuda", torch.bfloat16) for _ in range(4))

    def flash(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    cands = {"nanguard": lambda q, k, v, c: safe_sdpa(q, k, v, is_causal=c), "flash": flash}
    rows = []
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            qg, kg, vg = (t.detach().requires_grad_(mode != "fwd") for t in (q, k, v))

            def mk(f):
                def run():
                    if mode == "fwd":
                        with torch.no_grad():
                            f(qg, kg, vg, causal)
                    else:
                        f(qg, kg, vg, causal).backward(gy)
                        qg.grad = kg.grad = vg.grad = None
                return run

            t = _common.time_fns({n: mk(f) for n, f in cands.items()}, repeats=repeats, warmup=3, device="cuda")
            fl = 4.0 * Bf * Hf * Lf * Lf * Df * (0.5 if causal else 1.0) * (3.5 if mode != "fwd" else 1.0)
            row = {"causal": causal, "mode": mode, "nanguard_ms": t["nanguard"] * 1e3, "flash_ms": t["flash"] * 1e3,
                   "nanguard_TFLOPs": fl / t["nanguard"] / 1e12, "flash_TFLOPs": fl / t["flash"] / 1e12,
                   "nanguard_vs_flash": t["flash"] / t["nanguard"]}
            rows.append(row)
            print(row, flush=True)
    cols = ["causal", "mode", "nanguard_ms", "flash_ms", "nanguard_TFLOPs", "flash_TFLOPs", "nanguard_vs_flash"]
    _common.write_results("attention_cuda_flash", rows, cols,
                          {"B": Bf, "H": Hf, "L": Lf, "D": Df, "dtype": "bfloat16",
                           "gpu": torch.cuda.get_device_name()})


DECODE = {"B": 8, "Hq": 32, "L": 1, "S": 2048, "D": 128}


def decode_compare(dev: str, repeats: int, hkv_list=(8, 32), dtypes=("float32", "bfloat16"), suffix="") -> None:
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
    _common.write_results(f"attention_{dev}_decode{suffix}", rows, cols,
                          {**DECODE, "mask": "bool padding [B,1,1,S]", "copy_GBs": copy_gbs, "repeats": repeats})


def forward_compare(dev: str, repeats: int, lengths=(512, 1024, 2048, 4096), suffix="") -> None:
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
    _common.write_results(f"attention_{dev}_fwd{suffix}", rows, cols,
                          {"B": B, "H": H, "D": D, "mask": "none", "mode": "inference_mode", "repeats": repeats})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3 if _common.quick() else 5)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory-child")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--flash", action="store_true", help="CUDA: bf16 D=128 L=4096 TFLOP/s against flash")
    p.add_argument("--decode", action="store_true", help="decode steps: time and KV-read bandwidth")
    p.add_argument("--forward", action="store_true", help="forward only under inference_mode, no mask")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads(N) first; results get a _tN suffix")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # NANGUARD_CPU_ISA=avx2 (or baseline) caps the CPU kernels' instruction set:
    # an AVX2 machine's numbers from an AVX-512 one; the results get a suffix
    isa = os.environ.get("NANGUARD_CPU_ISA", "")
    tag = (f"_{isa}" if isa and args.device == "cpu" else "") + (f"_t{args.threads}" if args.threads else "")
    if args.decode:
        decode_compare(args.device, max(args.repeats, 3 if _common.quick() else 15), suffix=tag)
        return
    if args.forward:
        lengths = (512, 1024, 2048, 4096) if args.lengths == ",".join(map(str, LENGTHS)) else \
            tuple(int(x) for x in args.lengths.split(","))
        forward_compare(args.device, max(args.repeats, 3 if _common.quick() else 7), lengths, suffix=tag)
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
                    }
                    if mode == "fwd+bwd" and L == max(lengths) and not args.no_memory:
                        for n in CANDIDATES:
                            row[f"{n}_peak_MiB"] = peak_memory(n, L, dtype, variant, dev) / 2**20
                    rows.append(row)
                    print(row, flush=True)
    cols = ["dtype", "L", "mask", "mode", "nanguard_ms", "torch_ms", "naive_ms", "vs_torch", "vs_naive",
            "nanguard_GFLOPs", "nanguard_peak_MiB", "torch_peak_MiB", "naive_peak_MiB"]
    _common.write_results(f"attention_{dev}", rows, cols, {"B": B, "H": H, "D": D})


if __name__ == "__main__":
    main()
