/* kernels/cpu_isa.c - see cpu_isa.h. */
#include "kernels/cpu_isa.h"

#include <stdlib.h>
#include <string.h>

static int g_isa = -1; /* -1: not decided yet */

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
