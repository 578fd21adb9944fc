/*
 * kernels/simd_f32.h - fp32 SIMD vectors of either x86 width behind one set
 * of names (ggml's GGML_F32_VEC / GGML_F32_EPR idea), so that a kernel is
 * written once and compiled once per width.
 *
 * The build is baseline x86-64: nothing here is enabled by -m flags. Each
 * width carries its own target attribute, and a kernel written with these
 * names is compiled per width by defining NG_F32_W (8: AVX2 + FMA, 16:
 * AVX-512) before its body and picked at run time through cpu_isa.h:
 *
 *   NG_F32_ATTR           the width's target attribute, for each function
 *   NG_F32_ISA            its cpu_isa name token (avx2, avx512): a suffix
 *   NG_F32_EPR            elements per register
 *   NG_F32_VEC            the register type
 *   NG_F32_VEC_ZERO()     all lanes 0
 *   NG_F32_VEC_SET1(x)    all lanes x
 *   NG_F32_VEC_LOAD(p)    EPR floats from p (unaligned)
 *   NG_F32_VEC_LOAD_BF16(p), NG_F32_VEC_LOAD_F16(p)
 *                         EPR bfloat16 / float16 values from p (a const
 *                         uint16_t *, unaligned), widened to floats exactly
 *                         (bf16: the high half of the fp32 bits; fp16:
 *                         F16C's vcvtph2ps)
 *   NG_F32_VEC_STORE(p,v) v to p (unaligned)
 *   NG_F32_VEC_FMA(a,b,c) a * b + c, one rounding
 *   NG_F32_VEC_HSUM(v)    the sum of v's lanes, as a float
 *   NG_F32_VEC_HSUM4(a,b,c,d) the sums of four vectors' lanes, as an __m128
 *
 * Horizontal sums fold a 16-lane vector to 8 lanes (low half + high half)
 * first, then sum the 8 in one fixed order: each result depends on the
 * lanes only, never on where the vector came from.
 */
#ifndef NG_KERNELS_SIMD_F32_H
#define NG_KERNELS_SIMD_F32_H

#include "kernels/cpu_isa.h"

#if NG_X86
#include <immintrin.h>

/* Sum of the 8 lanes of v: (lo + hi) over 4 lanes, then over 2, then 1. */
NG_TARGET_AVX2 static inline float ng_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The four sums of a0..a3's lanes, in that order. */
NG_TARGET_AVX2 static inline __m128 ng_hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* 16 lanes to 8: low half + high half. */
NG_TARGET_AVX512 static inline __m256 ng_fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* 8 lanes: AVX2 + FMA */
#define NG_F32X8_ATTR NG_TARGET_AVX2
#define NG_F32X8_ISA avx2
#define NG_F32X8_EPR 8
#define NG_F32X8_VEC __m256
#define NG_F32X8_VEC_ZERO() _mm256_setzero_ps()
#define NG_F32X8_VEC_SET1(x) _mm256_set1_ps(x)
#define NG_F32X8_VEC_LOAD(p) _mm256_loadu_ps(p)
#define NG_F32X8_VEC_STORE(p, v) _mm256_storeu_ps(p, v)
#define NG_F32X8_VEC_LOAD_BF16(p)                                                                  \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define NG_F32X8_VEC_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define NG_F32X8_VEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define NG_F32X8_VEC_HSUM(v) ng_hsum8(v)
#define NG_F32X8_VEC_HSUM4(a, b, c, d) ng_hsum4x8(a, b, c, d)

/* 16 lanes: AVX-512 F */
#define NG_F32X16_ATTR NG_TARGET_AVX512
#define NG_F32X16_ISA avx512
#define NG_F32X16_EPR 16
#define NG_F32X16_VEC __m512
#define NG_F32X16_VEC_ZERO() _mm512_setzero_ps()
#define NG_F32X16_VEC_SET1(x) _mm512_set1_ps(x)
#define NG_F32X16_VEC_LOAD(p) _mm512_loadu_ps(p)
#define NG_F32X16_VEC_STORE(p, v) _mm512_storeu_ps(p, v)
#define NG_F32X16_VEC_LOAD_BF16(p)                                                                 \
    _mm512_castsi512_ps(                                                                           \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define NG_F32X16_VEC_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define NG_F32X16_VEC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define NG_F32X16_VEC_HSUM(v) ng_hsum8(ng_fold16(v))
#define NG_F32X16_VEC_HSUM4(a, b, c, d)                                                            \
    ng_hsum4x8(ng_fold16(a), ng_fold16(b), ng_fold16(c), ng_fold16(d))

/* The names of the width NG_F32_W, resolved where they are used. */
#define NG_F32_CAT3_(a, b, c) a##b##c
#define NG_F32_CAT3(a, b, c) NG_F32_CAT3_(a, b, c)
#define NG_F32_(name) NG_F32_CAT3(NG_F32X, NG_F32_W, _##name)
#define NG_F32_ATTR NG_F32_(ATTR)
#define NG_F32_ISA NG_F32_(ISA)
#define NG_F32_EPR NG_F32_(EPR)
#define NG_F32_VEC NG_F32_(VEC)
#define NG_F32_VEC_ZERO NG_F32_(VEC_ZERO)
#define NG_F32_VEC_SET1 NG_F32_(VEC_SET1)
#define NG_F32_VEC_LOAD NG_F32_(VEC_LOAD)
#define NG_F32_VEC_STORE NG_F32_(VEC_STORE)
#define NG_F32_VEC_LOAD_BF16 NG_F32_(VEC_LOAD_BF16)
#define NG_F32_VEC_LOAD_F16 NG_F32_(VEC_LOAD_F16)
#define NG_F32_VEC_FMA NG_F32_(VEC_FMA)
#define NG_F32_VEC_HSUM NG_F32_(VEC_HSUM)
#define NG_F32_VEC_HSUM4 NG_F32_(VEC_HSUM4)

#endif /* NG_X86 */

#endif /* NG_KERNELS_SIMD_F32_H */
