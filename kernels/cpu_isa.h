/*
 * kernels/cpu_isa.h - run-time choice of the CPU code path.
 *
 * Shipped code is built for baseline x86-64. Hot loops are compiled a second
 * time with `__attribute__((target("avx2,fma")))` (and AVX-512 where the
 * compiler can) and the path is picked once at run time with
 * __builtin_cpu_supports. NANGUARD_CPU_ISA=baseline|avx2|avx512 caps the
 * choice (tests use it to run every path the machine has); a request the
 * CPU cannot serve falls back to the widest path it can.
 *
 * On aarch64 NEON (Advanced SIMD) is part of the base architecture: the
 * neon path needs no target attribute and no detection, and is the one
 * supported there. NANGUARD_CPU_ISA=baseline still forces the scalar loops
 * (tests run both); an x86 name asked of an aarch64 CPU, or neon of an x86
 * one, is a request it cannot serve. The paths are not ordered across the
 * two architectures: compare with >= only among the x86 ones, under NG_X86.
 */
#ifndef NG_KERNELS_CPU_ISA_H
#define NG_KERNELS_CPU_ISA_H

#include "kernels/common.h"

typedef enum ng_cpu_isa {
    NG_ISA_BASELINE = 0,
    NG_ISA_AVX2 = 1,   /* AVX2 + FMA */
    NG_ISA_AVX512 = 2, /* AVX-512 F/BW/VL */
    NG_ISA_NEON = 3,   /* aarch64 Advanced SIMD */
} ng_cpu_isa;

#define NG_ISA_COUNT 4

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define NG_X86 1
#define NG_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NG_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define NG_TARGET_AVX512_BF16                                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define NG_AMX 1 /* the compiler has the AMX intrinsics */
#define NG_TARGET_AMX                                                                              \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#endif
#else
#define NG_X86 0
#define NG_TARGET_AVX2
#define NG_TARGET_AVX512
#define NG_TARGET_AVX512_BF16
#endif
#ifndef NG_AMX
#define NG_AMX 0
#define NG_TARGET_AMX
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(__CUDACC__)
#define NG_NEON 1
#define NG_TARGET_NEON /* NEON is baseline on aarch64 */
#else
#define NG_NEON 0
#define NG_TARGET_NEON
#endif

/* Widest path this CPU supports. */
ng_cpu_isa ng_cpu_isa_supported(void);
/* Path in use: the supported one, capped by NANGUARD_CPU_ISA or ng_cpu_isa_set. */
ng_cpu_isa ng_cpu_isa_active(void);
/* Cap the path (tests). Returns NG_ERR_UNSUPPORTED when the CPU lacks it. */
ng_status ng_cpu_isa_set(ng_cpu_isa isa);
const char *ng_cpu_isa_name(ng_cpu_isa isa);

/* bf16 x bf16 dot products by vdpbf16ps (AVX512_BF16) on the AVX-512 path:
 * the exact products summed in fp32, two per lane and instruction. Whether
 * that is faster than widening to fp32 and FMA depends on the core, not on
 * the flag: on AMD Zen 4 one vdpbf16ps issues at the rate of one FMA, so
 * twice the multiply-adds; on Intel Sapphire Rapids it issues at half that
 * rate, so no more than the FMAs. Used by default where the CPU has it and
 * is AMD's; NANGUARD_CPU_BF16_DOT=1 / 0 asks for it or turns it off
 * (1 where the CPU lacks it, or on a path below AVX-512, has no effect). */
int ng_cpu_bf16_dot_supported(void);
/* 1 when the kernels use it now: supported, the AVX-512 path active, and
 * asked for (or by default). */
int ng_cpu_bf16_dot(void);
/* Turn it on or off (tests). NG_ERR_UNSUPPORTED when on is asked of a CPU
 * without it. */
ng_status ng_cpu_bf16_dot_set(int on);

/* The forward's bf16 score tiles and P V on AMX tiles (tdpbf16ps): the CPU
 * has AMX-TILE and AMX-BF16, the OS has enabled the tile state (XCR0) and
 * granted this process its use (Linux arch_prctl ARCH_REQ_XCOMP_PERM), and
 * the compiler has the intrinsics. Used by default where supported, before
 * vdpbf16ps; NANGUARD_CPU_AMX=0 turns it off. */
int ng_cpu_amx_supported(void);
/* 1 when the kernels use it now: supported, the AVX-512 path active, not
 * turned off. */
int ng_cpu_amx(void);
/* Turn it on or off (tests). NG_ERR_UNSUPPORTED when on is asked of a CPU
 * without it. */
ng_status ng_cpu_amx_set(int on);

/* 1 on an Intel CPU: the decode path's prefetch distance is the vendor's
 * (kernels/attention.c, NG_DEC_PF_BYTES). */
int ng_cpu_is_intel(void);

#endif /* NG_KERNELS_CPU_ISA_H */
