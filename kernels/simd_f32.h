/*
 * kernels/simd_f32.h - fp32 SIMD vectors of each x86 width and of aarch64's
 * NEON behind one set of names (ggml's GGML_F32_VEC / GGML_F32_EPR idea), so
 * that a kernel is written once and compiled once per width.
 *
 * The build is baseline x86-64: nothing here is enabled by -m flags. Each
 * width carries its own target attribute, and a kernel written with these
 * names is compiled per width by defining NG_F32_W (8: AVX2 + FMA, 16:
 * AVX-512; on aarch64 4: NEON, no attribute) before its body and picked at
 * run time through cpu_isa.h:
 *
 *   NG_F32_ATTR           the width's target attribute, for each function
 *   NG_F32_ISA            its cpu_isa name token (avx2, avx512, neon): a suffix
 *   NG_F32_EPR            elements per register
 *   NG_F32_VEC            the register type
 *   NG_F32_VEC_ZERO()     all lanes 0
 *   NG_F32_VEC_SET1(x)    all lanes x
 *   NG_F32_VEC_LOAD(p)    EPR floats from p (unaligned)
 *   NG_F32_VEC_LOAD_BF16(p), NG_F32_VEC_LOAD_F16(p)
 *                         EPR bfloat16 / float16 values from p (a const
 *                         uint16_t *, unaligned), widened to floats exactly
 *                         (bf16: the high half of the fp32 bits; fp16:
 *                         F16C's vcvtph2ps, NEON's fcvtl)
 *   NG_F32_VEC_STORE(p,v) v to p (unaligned)
 *   NG_F32_VEC_FMA(a,b,c) a * b + c, one rounding
 *   NG_F32_VEC_ADD/SUB/MUL(a,b)  a + b, a - b, a * b
 *   NG_F32_VEC_MAX(a,b)   a > b ? a : b (b when either is NaN: callers that
 *                         must see a NaN track it with NG_F32_MASK_NAN)
 *   NG_F32_VEC_EXP(x)     exp(x) to ~1 ulp (the Cephes polynomial of
 *                         attention.c's ng_expf_poly), exp(-inf) = 0, NaN
 *                         stays NaN; the same value at either width
 *   NG_F32_VEC_EXP2(x)    2^x to ~1 ulp, 0 below -126.5 (ng_exp2_8 / _16)
 *   NG_F32_MASK           a lane mask (a vector of all-ones lanes for AVX2
 *                         and NEON, a k-register for AVX-512)
 *   NG_F32_MASK_NAN(x)    the lanes of x that are NaN
 *   NG_F32_MASK_UNORD(a,b) the lanes where a or b is NaN
 *   NG_F32_MASK_EQ(a,b), NG_F32_MASK_GT(a,b)  a == b, a > b (ordered)
 *   NG_F32_MASK_OR(m,n)   either
 *   NG_F32_MASK_NONE()    no lane
 *   NG_F32_MASK_ANY(m)    nonzero when m holds a lane
 *   NG_F32_SELECT(m,a,b)  m ? a : b per lane
 *   NG_F32_VEC_HSUM(v)    the sum of v's lanes, as a float
 *   NG_F32_VEC_HSUM4(a,b,c,d) the sums of four vectors' lanes, as an
 *                         NG_F32_SUM4 (__m128, float32x4_t)
 *   NG_F32_SUM4_STORE(p,s) those four sums to p (unaligned)
 *
 * Horizontal sums fold a 16-lane vector to 8 lanes (low half + high half)
 * first, then sum the 8 in one fixed order: each result depends on the
 * lanes only, never on where the vector came from. NEON's 4 lanes are
 * summed ((l0 + l1) + (l2 + l3)) by HSUM and HSUM4 alike. A kernel's
 * partial sums at 4 lanes are not those at 8 or 16, so its results on the
 * neon path match the x86 paths within the tests' tolerances, not bit for
 * bit; the exps are the same value at every width (the same operations,
 * lane by lane).
 */
#ifndef NG_KERNELS_SIMD_F32_H
#define NG_KERNELS_SIMD_F32_H

#include "kernels/cpu_isa.h"

/* The Cephes expf core (attention.c's ng_expf_poly, FMA-contracted) at
 * every width: from the clamped argument xc and n = round(xc log2 e), the
 * remainder r = xc - n ln 2 in two steps and y = 1 + r + r^2 p(r), the
 * value before the factor 2^n, declared as the V y. */
#define NG_EXP_CORE(V, FMA, FNMA, MUL, ADD, SET1, xc, n, y)                                        \
    const V y##_r1 = FNMA(n, SET1(0.693359375f), xc);                                              \
    const V y##_r = FNMA(n, SET1(-2.12194440e-4f), y##_r1);                                        \
    const V y##_p = FMA(FMA(FMA(FMA(FMA(SET1(1.9875691500e-4f), y##_r, SET1(1.3981999507e-3f)),    \
                                    y##_r, SET1(8.3334519073e-3f)),                                \
                                y##_r, SET1(4.1665795894e-2f)),                                    \
                            y##_r, SET1(1.6666665459e-1f)),                                        \
                        y##_r, SET1(5.0000001201e-1f));                                            \
    const V y = ADD(FMA(y##_p, MUL(y##_r, y##_r), y##_r), SET1(1.0f))

/* Cephes' exp2f polynomial of f in [-1/2, 1/2] (ng_exp2_* below). */
#define NG_EXP2_POLY(FMA, SET1, f)                                                                 \
    FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.535336188319500e-4f), f, SET1(1.339887440266574e-3f)), f,       \
                        SET1(9.618437357674640e-3f)),                                              \
                    f, SET1(5.550332471162809e-2f)),                                               \
                f, SET1(2.402264791363012e-1f)),                                                   \
            f, SET1(6.931472028550421e-1f)),                                                       \
        f, SET1(1.0f))

#if NG_X86
#include <immintrin.h>

/* Sum of the 8 lanes of v: (lo + hi) over 4 lanes, then over 2, then 1. */
NG_TARGET_AVX2 static inline float ng_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ng_hsum4x8's last steps, from h01 = hadd(a0, a1) and h23 = hadd(a2, a3):
 * for a caller that cannot hold all four vectors at once. */
NG_TARGET_AVX2 static inline __m128 ng_hsum4x8_pairs(__m256 h01, __m256 h23) {
    const __m256 t = _mm256_hadd_ps(h01, h23);
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* The four sums of a0..a3's lanes, in that order. */
NG_TARGET_AVX2 static inline __m128 ng_hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return ng_hsum4x8_pairs(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
}

/* 16 lanes to 8: low half + high half. */
NG_TARGET_AVX512 static inline __m256 ng_fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* exp on 8 lanes; exp(-inf) = 0 and NaN stays NaN (max / min return their
 * second operand when one is NaN: a NaN x flows through the clamp and every
 * step, and the result is NaN). */
NG_TARGET_AVX2 static inline __m256 ng_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    NG_EXP_CORE(__m256, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_add_ps,
                _mm256_set1_ps, xc, n, y);
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), /* exp(-inf) = 0 */
                            _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* ng_exp8 on 16 lanes: the same operations lane by lane, so the same values;
 * 2^n by vscalefps, which equals the exponent-field product for the n in
 * [-126, 127] that the clamp leaves. */
NG_TARGET_AVX512 static inline __m512 ng_exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lo, x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    NG_EXP_CORE(__m512, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_add_ps,
                _mm512_set1_ps, xc, n, y);
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), y, n); /* exp(-inf) = 0 */
}

/* 2^x on 8 / 16 lanes: x = n + f with n = round(x), f in [-1/2, 1/2], 2^f
 * by Cephes' exp2f polynomial (~1 ulp) and 2^n by the exponent field.
 * 0 below -126.5 (where n would be -127 or less, 2^x subnormal) and for
 * -inf; NaN stays NaN (max / min return their second operand when one is
 * NaN, so it flows through). The same value at both widths.
 *
 * 8 lanes: n by the round-to-nearest-even of adding 1.5 x 2^23 (whose
 * unit is 1 there, so the sum's low mantissa bits are n) and the exponent
 * field from those bits, with no convert and no compare: x is clamped to
 * [-127, 127] and n = -127 gives the exponent field 0, the factor 0. That
 * is 14 operations against the 18 of a vroundps / vcvtps2dq form, nearly
 * all on the ports the multiply-adds use; the forward's softmax takes one
 * per 8 scores. 16 lanes: vroundscaleps and vscalefps, masked to 0 below
 * -126.5, equal lane by lane (n and f are the same, and both factors
 * exact). */
NG_TARGET_AVX2 static inline __m256 ng_exp2_8(__m256 x) {
    const __m256 shift = _mm256_set1_ps(12582912.0f); /* 1.5 x 2^23 */
    const __m256 xc =
        _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    const __m256 y = _mm256_add_ps(xc, shift); /* low bits: n, rounded to nearest even */
    const __m256 f = _mm256_sub_ps(xc, _mm256_sub_ps(y, shift));
    const __m256 p = NG_EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, f);
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(y), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

NG_TARGET_AVX512 static inline __m512 ng_exp2_16(__m512 x) {
    const __m512 xc =
        _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), x));
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    const __m512 p = NG_EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, f);
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.5f), _CMP_NLT_UQ), p,
                                  n);
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
#define NG_F32X8_VEC_ADD(a, b) _mm256_add_ps(a, b)
#define NG_F32X8_VEC_SUB(a, b) _mm256_sub_ps(a, b)
#define NG_F32X8_VEC_MUL(a, b) _mm256_mul_ps(a, b)
#define NG_F32X8_VEC_MAX(a, b) _mm256_max_ps(a, b)
#define NG_F32X8_VEC_EXP(x) ng_exp8(x)
#define NG_F32X8_VEC_EXP2(x) ng_exp2_8(x)
#define NG_F32X8_MASK __m256
#define NG_F32X8_MASK_NAN(x) _mm256_cmp_ps(x, x, _CMP_UNORD_Q)
#define NG_F32X8_MASK_UNORD(a, b) _mm256_cmp_ps(a, b, _CMP_UNORD_Q)
#define NG_F32X8_MASK_EQ(a, b) _mm256_cmp_ps(a, b, _CMP_EQ_OQ)
#define NG_F32X8_MASK_GT(a, b) _mm256_cmp_ps(a, b, _CMP_GT_OQ)
#define NG_F32X8_MASK_OR(m, n) _mm256_or_ps(m, n)
#define NG_F32X8_MASK_NONE() _mm256_setzero_ps()
#define NG_F32X8_MASK_ANY(m) _mm256_movemask_ps(m)
#define NG_F32X8_SELECT(m, a, b) _mm256_blendv_ps(b, a, m)
#define NG_F32X8_VEC_HSUM(v) ng_hsum8(v)
#define NG_F32X8_VEC_HSUM4(a, b, c, d) ng_hsum4x8(a, b, c, d)
#define NG_F32X8_SUM4 __m128
#define NG_F32X8_SUM4_STORE(p, s) _mm_storeu_ps(p, s)

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
#define NG_F32X16_VEC_ADD(a, b) _mm512_add_ps(a, b)
#define NG_F32X16_VEC_SUB(a, b) _mm512_sub_ps(a, b)
#define NG_F32X16_VEC_MUL(a, b) _mm512_mul_ps(a, b)
#define NG_F32X16_VEC_MAX(a, b) _mm512_max_ps(a, b)
#define NG_F32X16_VEC_EXP(x) ng_exp16(x)
#define NG_F32X16_VEC_EXP2(x) ng_exp2_16(x)
#define NG_F32X16_MASK __mmask16
#define NG_F32X16_MASK_NAN(x) _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
#define NG_F32X16_MASK_UNORD(a, b) _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q)
#define NG_F32X16_MASK_EQ(a, b) _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)
#define NG_F32X16_MASK_GT(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)
#define NG_F32X16_MASK_OR(m, n) _kor_mask16(m, n)
#define NG_F32X16_MASK_NONE() ((__mmask16)0)
#define NG_F32X16_MASK_ANY(m) (m)
#define NG_F32X16_SELECT(m, a, b) _mm512_mask_mov_ps(b, m, a)
#define NG_F32X16_VEC_HSUM(v) ng_hsum8(ng_fold16(v))
#define NG_F32X16_VEC_HSUM4(a, b, c, d)                                                            \
    ng_hsum4x8(ng_fold16(a), ng_fold16(b), ng_fold16(c), ng_fold16(d))
#define NG_F32X16_SUM4 __m128
#define NG_F32X16_SUM4_STORE(p, s) _mm_storeu_ps(p, s)

#endif /* NG_X86 */

#if NG_NEON
#include <arm_neon.h>

/* Sum of the 4 lanes of v: ((l0 + l1) + (l2 + l3)). */
static inline float ng_hsum4(float32x4_t v) { return vpadds_f32(vget_low_f32(vpaddq_f32(v, v))); }

/* The four sums of a0..a3's lanes, in that order, each as ng_hsum4 adds. */
static inline float32x4_t ng_hsum4x4(float32x4_t a0, float32x4_t a1, float32x4_t a2,
                                     float32x4_t a3) {
    return vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
}

/* a > b ? a : b, b when either is NaN (as maxps; fmax would return the NaN) */
static inline float32x4_t ng_max4(float32x4_t a, float32x4_t b) {
    return vbslq_f32(vcgtq_f32(a, b), a, b);
}

/* ng_exp8 on 4 lanes: the same operations lane by lane, so the same values.
 * FMA(a, b, c) = a b + c is vfmaq_f32(c, a, b), FNMA = c - a b vfmsq_f32;
 * vrndnq_f32 rounds to nearest even as vroundps does. vmaxq / vminq return
 * NaN for a NaN x, so a NaN flows through as in ng_exp8. */
#define NG_NEON_FMA(a, b, c) vfmaq_f32(c, a, b)
#define NG_NEON_FNMA(a, b, c) vfmsq_f32(c, a, b)
static inline float32x4_t ng_exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.0f);
    const float32x4_t xc = vminq_f32(vdupq_n_f32(88.0f), vmaxq_f32(lo, x));
    const float32x4_t n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(1.44269504088896341f)));
    NG_EXP_CORE(float32x4_t, NG_NEON_FMA, NG_NEON_FNMA, vmulq_f32, vaddq_f32, vdupq_n_f32, xc, n,
                y);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t r = vmulq_f32(y, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(r), vcltq_f32(x, lo)));
}

/* ng_exp2_8 on 4 lanes, the same operations (n by adding 1.5 x 2^23). */
static inline float32x4_t ng_exp2_4(float32x4_t x) {
    const float32x4_t shift = vdupq_n_f32(12582912.0f); /* 1.5 x 2^23 */
    const float32x4_t xc = vminq_f32(vdupq_n_f32(127.0f), vmaxq_f32(vdupq_n_f32(-127.0f), x));
    const float32x4_t y = vaddq_f32(xc, shift); /* low bits: n, rounded to nearest even */
    const float32x4_t f = vsubq_f32(xc, vsubq_f32(y, shift));
    const float32x4_t p = NG_EXP2_POLY(NG_NEON_FMA, vdupq_n_f32, f);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vreinterpretq_s32_f32(y), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* 4 lanes: NEON */
#define NG_F32X4_ATTR NG_TARGET_NEON
#define NG_F32X4_ISA neon
#define NG_F32X4_EPR 4
#define NG_F32X4_VEC float32x4_t
#define NG_F32X4_VEC_ZERO() vdupq_n_f32(0.0f)
#define NG_F32X4_VEC_SET1(x) vdupq_n_f32(x)
#define NG_F32X4_VEC_LOAD(p) vld1q_f32(p)
#define NG_F32X4_VEC_STORE(p, v) vst1q_f32(p, v)
#define NG_F32X4_VEC_LOAD_BF16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))
#define NG_F32X4_VEC_LOAD_F16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define NG_F32X4_VEC_FMA(a, b, c) vfmaq_f32(c, a, b)
#define NG_F32X4_VEC_ADD(a, b) vaddq_f32(a, b)
#define NG_F32X4_VEC_SUB(a, b) vsubq_f32(a, b)
#define NG_F32X4_VEC_MUL(a, b) vmulq_f32(a, b)
#define NG_F32X4_VEC_MAX(a, b) ng_max4(a, b)
#define NG_F32X4_VEC_EXP(x) ng_exp4(x)
#define NG_F32X4_VEC_EXP2(x) ng_exp2_4(x)
#define NG_F32X4_MASK uint32x4_t
#define NG_F32X4_MASK_NAN(x) vmvnq_u32(vceqq_f32(x, x))
#define NG_F32X4_MASK_UNORD(a, b) vmvnq_u32(vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b)))
#define NG_F32X4_MASK_EQ(a, b) vceqq_f32(a, b)
#define NG_F32X4_MASK_GT(a, b) vcgtq_f32(a, b)
#define NG_F32X4_MASK_OR(m, n) vorrq_u32(m, n)
#define NG_F32X4_MASK_NONE() vdupq_n_u32(0)
#define NG_F32X4_MASK_ANY(m) (vmaxvq_u32(m) != 0)
#define NG_F32X4_SELECT(m, a, b) vbslq_f32(m, a, b)
#define NG_F32X4_VEC_HSUM(v) ng_hsum4(v)
#define NG_F32X4_VEC_HSUM4(a, b, c, d) ng_hsum4x4(a, b, c, d)
#define NG_F32X4_SUM4 float32x4_t
#define NG_F32X4_SUM4_STORE(p, s) vst1q_f32(p, s)
#endif /* NG_NEON */

#if NG_X86 || NG_NEON
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
#define NG_F32_VEC_ADD NG_F32_(VEC_ADD)
#define NG_F32_VEC_SUB NG_F32_(VEC_SUB)
#define NG_F32_VEC_MUL NG_F32_(VEC_MUL)
#define NG_F32_VEC_MAX NG_F32_(VEC_MAX)
#define NG_F32_VEC_EXP NG_F32_(VEC_EXP)
#define NG_F32_VEC_EXP2 NG_F32_(VEC_EXP2)
#define NG_F32_MASK NG_F32_(MASK)
#define NG_F32_MASK_NAN NG_F32_(MASK_NAN)
#define NG_F32_MASK_UNORD NG_F32_(MASK_UNORD)
#define NG_F32_MASK_EQ NG_F32_(MASK_EQ)
#define NG_F32_MASK_GT NG_F32_(MASK_GT)
#define NG_F32_MASK_OR NG_F32_(MASK_OR)
#define NG_F32_MASK_NONE NG_F32_(MASK_NONE)
#define NG_F32_MASK_ANY NG_F32_(MASK_ANY)
#define NG_F32_SELECT NG_F32_(SELECT)
#define NG_F32_VEC_HSUM NG_F32_(VEC_HSUM)
#define NG_F32_VEC_HSUM4 NG_F32_(VEC_HSUM4)
#define NG_F32_SUM4 NG_F32_(SUM4)
#define NG_F32_SUM4_STORE NG_F32_(SUM4_STORE)

#endif

#endif /* NG_KERNELS_SIMD_F32_H */
