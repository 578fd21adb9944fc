/* kernels/cpu_isa.c - see cpu_isa.h. */
#include "kernels/cpu_isa.h"

#include <stdlib.h>
#include <string.h>

static int g_isa = -1;      /* -1: not decided yet */
static int g_bf16_dot = -1; /* the same */

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
    return NG_ISA_BASELINE;
}

const char *ng_cpu_isa_name(ng_cpu_isa isa) {
    switch (isa) {
    case NG_ISA_BASELINE: return "baseline";
    case NG_ISA_AVX2: return "avx2";
    case NG_ISA_AVX512: return "avx512";
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
            if (want < isa) isa = want;
        }
        g_isa = (int)isa;
    }
    return (ng_cpu_isa)g_isa;
}

ng_status ng_cpu_isa_set(ng_cpu_isa isa) {
    if (isa > ng_cpu_isa_supported()) return NG_ERR_UNSUPPORTED;
    g_isa = (int)isa;
    return NG_OK;
}

int ng_cpu_bf16_dot_supported(void) {
#if NG_X86
    __builtin_cpu_init();
    return ng_cpu_isa_supported() >= NG_ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
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
    return g_bf16_dot && ng_cpu_isa_active() >= NG_ISA_AVX512;
}

ng_status ng_cpu_bf16_dot_set(int on) {
    if (on && !ng_cpu_bf16_dot_supported()) return NG_ERR_UNSUPPORTED;
    g_bf16_dot = on != 0;
    return NG_OK;
}
