/* kernels/cpu_isa.c - see cpu_isa.h. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall() under -std=c11 */
#endif
#include "kernels/cpu_isa.h"

#include <stdlib.h>
#include <string.h>
#if NG_X86
#include <cpuid.h>
#endif
#if NG_AMX && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int g_isa = -1;      /* -1: not decided yet */
static int g_bf16_dot = -1; /* the same */
static int g_amx_sup = -1;  /* the same */
static int g_amx = -1;      /* the same */

ng_cpu_isa ng_cpu_isa_supported(void) {
#if NG_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
        return NG_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return NG_ISA_AVX2;
#endif
#if NG_NEON
    return NG_ISA_NEON;
#endif
    return NG_ISA_BASELINE;
}

/* Whether this CPU can run path isa: baseline always; an x86 path up to the
 * widest supported; neon on aarch64. */
static int ng_cpu_isa_runs(ng_cpu_isa isa) {
    const ng_cpu_isa sup = ng_cpu_isa_supported();
    if (isa == NG_ISA_BASELINE) return 1;
    if (isa == NG_ISA_NEON || sup == NG_ISA_NEON) return isa == sup;
    return (unsigned)isa <= (unsigned)sup;
}

const char *ng_cpu_isa_name(ng_cpu_isa isa) {
    switch (isa) {
    case NG_ISA_BASELINE: return "baseline";
    case NG_ISA_AVX2: return "avx2";
    case NG_ISA_AVX512: return "avx512";
    case NG_ISA_NEON: return "neon";
    }
    return "?";
}

ng_cpu_isa ng_cpu_isa_active(void) {
    /* Racy first use is benign: every thread computes the same value. */
    if (g_isa < 0) {
        ng_cpu_isa isa = ng_cpu_isa_supported();
        const char *env = getenv("NANGUARD_CPU_ISA");
        if (env) {
            ng_cpu_isa want = isa;
            if (strcmp(env, "baseline") == 0)
                want = NG_ISA_BASELINE;
            else if (strcmp(env, "avx2") == 0)
                want = NG_ISA_AVX2;
            else if (strcmp(env, "avx512") == 0)
                want = NG_ISA_AVX512;
            else if (strcmp(env, "neon") == 0)
                want = NG_ISA_NEON;
            /* a cap below the widest path, of this CPU's architecture */
            if (want == NG_ISA_BASELINE || (want < isa && ng_cpu_isa_runs(want))) isa = want;
        }
        g_isa = (int)isa;
    }
    return (ng_cpu_isa)g_isa;
}

ng_status ng_cpu_isa_set(ng_cpu_isa isa) {
    if ((unsigned)isa >= NG_ISA_COUNT || !ng_cpu_isa_runs(isa)) return NG_ERR_UNSUPPORTED;
    g_isa = (int)isa;
    return NG_OK;
}

int ng_cpu_bf16_dot_supported(void) {
#if NG_X86
    __builtin_cpu_init();
    return ng_cpu_isa_supported() == NG_ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int ng_cpu_bf16_dot(void) {
    if (g_bf16_dot < 0) {
        int on = 0;
#if NG_X86
        on = __builtin_cpu_is("amd"); /* see cpu_isa.h */
#endif
        const char *env = getenv("NANGUARD_CPU_BF16_DOT");
        if (env && (strcmp(env, "0") == 0 || strcmp(env, "1") == 0)) on = env[0] == '1';
        g_bf16_dot = on && ng_cpu_bf16_dot_supported();
    }
    return g_bf16_dot && ng_cpu_isa_active() == NG_ISA_AVX512;
}

ng_status ng_cpu_bf16_dot_set(int on) {
    if (on && !ng_cpu_bf16_dot_supported()) return NG_ERR_UNSUPPORTED;
    g_bf16_dot = on != 0;
    return NG_OK;
}

int ng_cpu_is_intel(void) {
#if NG_X86
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
#else
    return 0;
#endif
}

/* CPUID leaf 7 EDX: AMX-BF16 (bit 22) and AMX-TILE (24); XCR0 bits 17 and 18
 * (XTILECFG, XTILEDATA) say the OS saves the tile state; Linux then hands
 * the 8 KiB of tile data to a process that asks for it (5.16 and later). */
static int ng_amx_probe(void) {
#if NG_AMX && defined(__linux__)
    unsigned a, b, c, d;
    if (ng_cpu_isa_supported() != NG_ISA_AVX512 || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

int ng_cpu_amx_supported(void) {
    if (g_amx_sup < 0) g_amx_sup = ng_amx_probe(); /* the request is idempotent */
    return g_amx_sup;
}

int ng_cpu_amx(void) {
    if (g_amx < 0) {
        const char *env = getenv("NANGUARD_CPU_AMX");
        g_amx = !(env && strcmp(env, "0") == 0) && ng_cpu_amx_supported();
    }
    return g_amx && ng_cpu_isa_active() == NG_ISA_AVX512;
}

ng_status ng_cpu_amx_set(int on) {
    if (on && !ng_cpu_amx_supported()) return NG_ERR_UNSUPPORTED;
    g_amx = on != 0;
    return NG_OK;
}
