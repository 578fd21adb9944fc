/*
 * kernels/cpu_info.c - see cpu_info.h.
 *
 * The text follows each kernel's dispatch on ng_cpu_isa_active():
 *   attention (attention.c ng_attn_pick): fp32 on the active path; fp64 on
 *     at most AVX2 (no AVX-512 variant); fp16 / bf16 widened to fp32 tiles on
 *     load, then the fp32 path, but for the decode path on AVX2 / AVX-512,
 *     which reads a 16-bit KV cache in place (ng_dots_bf16 / ng_pv_bf16, and
 *     the fp16 pair: NG_DEC_16); bf16 forward and backward products on AMX
 *     tiles where ng_cpu_amx() (NG_AMX_FWD), else the products of bf16
 *     inputs (forward S^T = K Q^T; backward S = Q K^T, dP = dout V^T) by
 *     vdpbf16ps where ng_cpu_bf16_dot() (NG_BF16_DOT,
 *     attention_tile_bf16dot.inc).
 *     On aarch64: fp32 (and fp16 / bf16 widened) on neon when active, the
 *     decode forward reading a 16-bit KV cache in place; fp64 baseline.
 *   layernorm (layernorm.c pick_path): fp32 / fp16 / bf16 rows in fp32 on
 *     AVX2 when active >= avx2, on NEON when active is neon; fp64 in scalar
 *     fp64 loops.
 *   grad_guard (grad_guard.c gg_pick): every dtype on AVX2 when active >=
 *     avx2; on NEON fp32 / fp16 / bf16 when active is neon, fp64 baseline.
 *   tensor_stats (tensor_stats.c ts_pick): every dtype on the active x86
 *     path; baseline on aarch64.
 * A kernel whose dispatch changes updates its line here.
 * Exported from libnanguard.so (read through ctypes by python/nanguard/_info.py).
 */
#include "kernels/cpu_info.h"

#include <stdio.h>
#include <stdlib.h>

#include "kernels/cpu_isa.h"

/* The x86 path a kernel takes when it has none wider than cap (neon and
 * the x86 paths are not ordered: a kernel without a NEON form runs the
 * baseline there). */
static const char *ng_min_isa(ng_cpu_isa a, ng_cpu_isa cap) {
    if (a == NG_ISA_NEON) return ng_cpu_isa_name(NG_ISA_BASELINE);
    return ng_cpu_isa_name(a < cap ? a : cap);
}

__attribute__((visibility("default"))) const char *ng_cpu_info(void) {
    static char buf[2048];
    const ng_cpu_isa sup = ng_cpu_isa_supported(), act = ng_cpu_isa_active();
    const char *env = getenv("NANGUARD_CPU_ISA");
    const int neon = act == NG_ISA_NEON;
    const char *a = ng_cpu_isa_name(act);
    const char *ln = neon ? a : ng_min_isa(act, NG_ISA_AVX2);
    const char *gg64 = ng_min_isa(act, NG_ISA_AVX2), *ts = ng_min_isa(act, NG_ISA_AVX512);
    char tiles[96], widened[112], bf16[192];
    snprintf(tiles, sizeof tiles, "widened to fp32 tiles%s",
             act != NG_ISA_BASELINE ? " (the decode forward reads the KV cache in place)" : "");
    snprintf(widened, sizeof widened, "%s, %s", a, tiles);
    if (ng_cpu_amx())
        snprintf(bf16, sizeof bf16,
                 "%s, forward and backward products on AMX tiles (amx_bf16; P and dS rounded to "
                 "bf16, fp32 sums and statistics)",
                 a);
    else if (ng_cpu_bf16_dot())
        snprintf(bf16, sizeof bf16, "%s, scores and dP by vdpbf16ps (avx512_bf16), the rest %s", a,
                 tiles);
    else
        snprintf(bf16, sizeof bf16, "%s", widened);
    snprintf(
        buf, sizeof buf,
        "supported=%s\nactive=%s\nrequested=%s\n"
        "attention.f32=%s\nattention.f64=%s\nattention.bf16=%s\nattention.f16=%s\n"
        "layernorm.f32=%s\nlayernorm.f64=baseline, fp64 loops\n"
        "layernorm.bf16=%s, fp32 rows\nlayernorm.f16=%s, fp32 rows\n"
        "grad_guard.f32=%s\ngrad_guard.f64=%s\ngrad_guard.bf16=%s\ngrad_guard.f16=%s\n"
        "tensor_stats.f32=%s\ntensor_stats.f64=%s\ntensor_stats.bf16=%s\ntensor_stats.f16=%s\n",
        ng_cpu_isa_name(sup), a, env ? env : "", a, ng_min_isa(act, NG_ISA_AVX2), bf16, widened, ln,
        ln, ln, ln, gg64, ln, ln, ts, ts, ts, ts);
    return buf;
}
