/*
 * kernels/cpu_isa.h - run-time choice of the CPU code path.
 *
 * Shipped code is built for baseline x86-64. Hot loops are compiled a second
 * time with `__attribute__((target("avx2,fma")))` (and AVX-512 where the
 * compiler can) and the path is picked once at run time with
 * __builtin_cpu_supports. NANGUARD_CPU_ISA=baseline|avx2|avx512 caps the
 * choice (tests use it to run every path the machine has); a request the
 * CPU cannot serve falls back to the widest path it can.
 */
#ifndef NG_KERNELS_CPU_ISA_H
#define NG_KERNELS_CPU_ISA_H

#include "kernels/common.h"

typedef enum ng_cpu_isa {
    NG_ISA_BASELINE = 0,
    NG_ISA_AVX2 = 1,   /* AVX2 + FMA */
    NG_ISA_AVX512 = 2, /* AVX-512 F/BW/VL */
} ng_cpu_isa;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define NG_X86 1
#define NG_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NG_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else
#define NG_X86 0
#define NG_TARGET_AVX2
#define NG_TARGET_AVX512
#endif

/* Widest path this CPU supports. */
ng_cpu_isa ng_cpu_isa_supported(void);
/* Path in use: the supported one, capped by NANGUARD_CPU_ISA or ng_cpu_isa_set. */
ng_cpu_isa ng_cpu_isa_active(void);
/* Cap the path (tests). Returns NG_ERR_UNSUPPORTED when the CPU lacks it. */
ng_status ng_cpu_isa_set(ng_cpu_isa isa);
const char *ng_cpu_isa_name(ng_cpu_isa isa);

#endif /* NG_KERNELS_CPU_ISA_H */
