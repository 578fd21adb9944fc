/*
 * kernels/grad_guard.c - CPU gradient guard (see grad_guard.h for the two
 * passes and grad_guard_math.h for the arithmetic and the stats layout).
 *
 * Work is split into fixed blocks of NG_GG_CHUNK elements, never crossing a
 * tensor boundary. Pass 1 writes one partial per block (possibly on several
 * threads), then adds the partials serially in block order: the stats do not
 * depend on the thread count. Pass 2 multiplies each block in place.
 *
 * Per block the loops are plain `omp simd` loops (fp16 is widened into a
 * small fp32 buffer first; bf16 widens by a shift inside the loop), compiled
 * twice: for baseline x86-64 and with AVX2+FMA+F16C. On the AVX2 path the
 * norm-2 reduce of fp32 / fp16 is written with intrinsics (F16C widening in
 * registers, two fp64 accumulators). Machines with AVX-512 take the AVX2
 * path: the loops are bound by memory bandwidth. On aarch64 the neon path
 * has the same norm-2 reduce in NEON (fcvtl widening of fp16, four fp64
 * accumulators) and fp16 widening / narrowing by fcvtl / fcvtn; its other
 * loops are the baseline's `omp simd` loops, which NEON serves as it is
 * (fp64 is the baseline's).
 */
#include "kernels/grad_guard.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "kernels/cpu_isa.h"

#if NG_X86
#include <immintrin.h>
#endif
#if NG_NEON
#include <arm_neon.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define GG_INLINE static inline __attribute__((always_inline))
#else
#define GG_INLINE static inline
#endif

/* fp16/bf16 elements widened per step into an fp32 buffer (stays in L1). */
#define GG_SUB 1024

/* Elements per parallel task, on average: waking a pool thread costs tens
 * of microseconds on an idle machine and milliseconds on a loaded one, so a
 * task must carry about a millisecond of work (and smaller calls run on the
 * calling thread). */
#define GG_TASK_ELEMS ((int64_t)1 << 20)

/* Blocks per task so that a task holds about GG_TASK_ELEMS elements. */
static int64_t gg_grain(int64_t n_chunks, int64_t total) {
    int64_t g = (int64_t)((double)n_chunks * (double)GG_TASK_ELEMS / (double)total);
    return g < 1 ? 1 : g;
}

typedef void (*gg_reduce_fn)(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o);
typedef void (*gg_apply_fn)(void *x, int64_t n, float cf, double cd);

/* ---- block bodies (inlined into each ISA's wrapper) ------------------------ */

/* Exact NaN / Inf counts of n fp32 values (run only on a sub-block whose
 * fast loop saw a non-finite value, so its cost does not matter). */
GG_INLINE void gg_count_f32(const float *restrict x, int64_t n, ng_gg_partial *o) {
    for (int64_t i = 0; i < n; i++) {
        o->nan_count += ng_gg_isnan_f(x[i]);
        o->inf_count += ng_gg_isinf_f(x[i]);
    }
}

/* Fold n fp32 values into *o. The hot loop carries only the norm and a
 * sentinel z = sum(x * 0), which is NaN exactly when some x is NaN or Inf;
 * the exact counts come from a rescan of the (cache-resident) sub-block. */
GG_INLINE void gg_reduce_f32_body(const float *restrict x, int64_t n, float s, ng_gg_norm p,
                                  ng_gg_partial *o) {
    float z = 0.0f;
    if (p == NG_GG_NORM_2) {
        double acc = 0.0;
#pragma omp simd reduction(+ : acc, z)
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            acc += ng_gg_sq(ng_gg_unscale(v, s));
            z += v * 0.0f;
        }
        o->norm += acc;
    } else {
        float m = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : z)
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            float a = ng_gg_absf(ng_gg_unscale(v, s));
            m = a > m ? a : m;
            z += v * 0.0f;
        }
        o->norm = ng_gg_combine(o->norm, (double)m, NG_GG_NORM_INF);
    }
    if (z != 0.0f) gg_count_f32(x, n, o);
}

GG_INLINE void gg_reduce_f64_body(const double *restrict x, int64_t n, float s, ng_gg_norm p,
                                  ng_gg_partial *o) {
    int32_t nan = 0, inf = 0;
    double sd = (double)s;
    if (p == NG_GG_NORM_2) {
        double acc = 0.0;
#pragma omp simd reduction(+ : acc, nan, inf)
        for (int64_t i = 0; i < n; i++) {
            double v = x[i];
            double u = v * sd;
            acc += u * u;
            nan += ng_gg_isnan_d(v);
            inf += ng_gg_isinf_d(v);
        }
        o->norm += acc;
    } else {
        double m = 0.0;
#pragma omp simd reduction(max : m) reduction(+ : nan, inf)
        for (int64_t i = 0; i < n; i++) {
            double v = x[i];
            double u = v * sd;
            double a = u < 0.0 ? -u : u;
            m = a > m ? a : m;
            nan += ng_gg_isnan_d(v);
            inf += ng_gg_isinf_d(v);
        }
        o->norm = ng_gg_combine(o->norm, m, NG_GG_NORM_INF);
    }
    o->nan_count += nan;
    o->inf_count += inf;
}

GG_INLINE void gg_widen_f16(const uint16_t *restrict x, float *restrict buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = ng_f16_to_f32(x[i]);
}

GG_INLINE void gg_apply_f32_body(float *restrict x, int64_t n, float c) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * c;
}

GG_INLINE void gg_apply_f64_body(double *restrict x, int64_t n, double c) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * c;
}

/* bf16 * c rounded to nearest even. Pass 2 runs only when every value was
 * finite, so the NaN branch of ng_f32_to_bf16 is not needed here (an
 * overflow to inf rounds correctly through the same integer addition). */
GG_INLINE void gg_apply_bf16_body(uint16_t *restrict x, int64_t n, float c) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = ng_f32_bits(ng_bf16_to_f32(x[i]) * c);
        x[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* Fold n bf16 values: widening is a shift, done in the same loop. */
GG_INLINE void gg_reduce_bf16_body(const uint16_t *restrict x, int64_t n, float s, ng_gg_norm p,
                                   ng_gg_partial *o) {
    float z = 0.0f;
    if (p == NG_GG_NORM_2) {
        double acc = 0.0;
#pragma omp simd reduction(+ : acc, z)
        for (int64_t i = 0; i < n; i++) {
            float v = ng_bf16_to_f32(x[i]);
            acc += ng_gg_sq(ng_gg_unscale(v, s));
            z += v * 0.0f;
        }
        o->norm += acc;
    } else {
        float m = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : z)
        for (int64_t i = 0; i < n; i++) {
            float v = ng_bf16_to_f32(x[i]);
            float a = ng_gg_absf(ng_gg_unscale(v, s));
            m = a > m ? a : m;
            z += v * 0.0f;
        }
        o->norm = ng_gg_combine(o->norm, (double)m, NG_GG_NORM_INF);
    }
    if (z != 0.0f)
        for (int64_t i = 0; i < n; i++) {
            float v = ng_bf16_to_f32(x[i]);
            o->nan_count += ng_gg_isnan_f(v);
            o->inf_count += ng_gg_isinf_f(v);
        }
}

/* ---- baseline x86-64 (or any other CPU) ----------------------------------- */

static void gg_reduce_f32_base(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    gg_reduce_f32_body((const float *)x, n, s, p, o);
}

static void gg_reduce_f64_base(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    gg_reduce_f64_body((const double *)x, n, s, p, o);
}

static void gg_reduce_bf16_base(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    gg_reduce_bf16_body((const uint16_t *)x, n, s, p, o);
}

static void gg_reduce_f16_base(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    float buf[GG_SUB];
    const uint16_t *h = (const uint16_t *)x;
    for (int64_t i = 0; i < n; i += GG_SUB) {
        int64_t m = NG_MIN(GG_SUB, n - i);
        gg_widen_f16(h + i, buf, m);
        gg_reduce_f32_body(buf, m, s, p, o);
    }
}

static void gg_apply_f32_base(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    gg_apply_f32_body((float *)x, n, cf);
}

static void gg_apply_f64_base(void *x, int64_t n, float cf, double cd) {
    (void)cf;
    gg_apply_f64_body((double *)x, n, cd);
}

static void gg_apply_bf16_base(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    gg_apply_bf16_body((uint16_t *)x, n, cf);
}

static void gg_apply_f16_base(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    uint16_t *h = (uint16_t *)x;
    for (int64_t i = 0; i < n; i++) h[i] = ng_f32_to_f16(ng_f16_to_f32(h[i]) * cf);
}

/* Rare path: multiplier below FLT_MIN, product formed in fp64. */
static void gg_apply_wide_f32(void *x, int64_t n, float cf, double cd) {
    (void)cf;
    float *f = (float *)x;
    for (int64_t i = 0; i < n; i++) f[i] = (float)((double)f[i] * cd);
}

static void gg_apply_wide_f16(void *x, int64_t n, float cf, double cd) {
    (void)cf;
    uint16_t *h = (uint16_t *)x;
    for (int64_t i = 0; i < n; i++) h[i] = ng_f32_to_f16((float)((double)ng_f16_to_f32(h[i]) * cd));
}

static void gg_apply_wide_bf16(void *x, int64_t n, float cf, double cd) {
    (void)cf;
    uint16_t *h = (uint16_t *)x;
    for (int64_t i = 0; i < n; i++)
        h[i] = ng_f32_to_bf16((float)((double)ng_bf16_to_f32(h[i]) * cd));
}

/* ---- AVX2 + FMA + F16C ------------------------------------------------------ */
#if NG_X86

NG_TARGET_AVX2 static void gg_reduce_f64_avx2(const void *x, int64_t n, float s, ng_gg_norm p,
                                              ng_gg_partial *o) {
    gg_reduce_f64_body((const double *)x, n, s, p, o);
}

NG_TARGET_AVX2 static void gg_reduce_bf16_avx2(const void *x, int64_t n, float s, ng_gg_norm p,
                                               ng_gg_partial *o) {
    gg_reduce_bf16_body((const uint16_t *)x, n, s, p, o);
}

/* Hardware fp16 -> fp32 (exact, as ng_f16_to_f32). */
NG_TARGET_AVX2 static void gg_widen_f16_avx2(const uint16_t *x, float *buf, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) buf[i] = ng_f16_to_f32(x[i]);
}

/* Norm 2 with explicit AVX2: widen 8 values to fp32 in registers (F16C for
 * fp16), unscale, square into two fp64 accumulators, carry the NaN sentinel.
 * is_f16 selects the loader; the loop is otherwise the same for fp32. */
NG_TARGET_AVX2 static inline __m256 gg_load8_avx2(const void *x, int64_t i, int is_f16) {
    if (is_f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    return _mm256_loadu_ps((const float *)x + i);
}

NG_TARGET_AVX2 static inline float gg_load1(const void *x, int64_t i, int is_f16) {
    return is_f16 ? ng_f16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

NG_TARGET_AVX2 static void gg_reduce_norm2_avx2(const void *h, int64_t n, float s, int is_f16,
                                                ng_gg_partial *o) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    __m256 z = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
    const __m256 sv = _mm256_set1_ps(s), zero = _mm256_setzero_ps();
    int64_t i = 0;
    /* 16 values per step: four independent fp64 chains hide the FMA latency */
    for (; i + 16 <= n; i += 16) {
        __m256 v = gg_load8_avx2(h, i, is_f16);
        __m256 w = gg_load8_avx2(h, i + 8, is_f16);
        __m256 u = _mm256_mul_ps(v, sv);
        __m256 t = _mm256_mul_ps(w, sv);
        __m256d l0 = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
        __m256d h0 = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
        __m256d l1 = _mm256_cvtps_pd(_mm256_castps256_ps128(t));
        __m256d h1 = _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1));
        a0 = _mm256_fmadd_pd(l0, l0, a0);
        a1 = _mm256_fmadd_pd(h0, h0, a1);
        a2 = _mm256_fmadd_pd(l1, l1, a2);
        a3 = _mm256_fmadd_pd(h1, h1, a3);
        z = _mm256_add_ps(z, _mm256_mul_ps(v, zero));
        z1 = _mm256_add_ps(z1, _mm256_mul_ps(w, zero));
    }
    a0 = _mm256_add_pd(a0, a2);
    a1 = _mm256_add_pd(a1, a3);
    z = _mm256_add_ps(z, z1);
    for (; i + 8 <= n; i += 8) {
        __m256 v = gg_load8_avx2(h, i, is_f16);
        __m256 u = _mm256_mul_ps(v, sv);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0); /* exact squares: fma == mul + add */
        a1 = _mm256_fmadd_pd(hi, hi, a1);
        z = _mm256_add_ps(z, _mm256_mul_ps(v, zero)); /* NaN iff a NaN / Inf was seen */
    }
    double ad[4], acc = 0.0;
    float zf[8], zz = 0.0f;
    _mm256_storeu_pd(ad, _mm256_add_pd(a0, a1));
    _mm256_storeu_ps(zf, z);
    for (int k = 0; k < 4; k++) acc += ad[k];
    for (int k = 0; k < 8; k++) zz += zf[k];
    for (; i < n; i++) {
        float v = gg_load1(h, i, is_f16);
        acc += ng_gg_sq(ng_gg_unscale(v, s));
        zz += v * 0.0f;
    }
    o->norm += acc;
    if (zz != 0.0f)
        for (int64_t k = 0; k < n; k++) {
            float v = gg_load1(h, k, is_f16);
            o->nan_count += ng_gg_isnan_f(v);
            o->inf_count += ng_gg_isinf_f(v);
        }
}

NG_TARGET_AVX2 static void gg_reduce_f32_avx2(const void *x, int64_t n, float s, ng_gg_norm p,
                                              ng_gg_partial *o) {
    if (p == NG_GG_NORM_2)
        gg_reduce_norm2_avx2(x, n, s, 0, o);
    else
        gg_reduce_f32_body((const float *)x, n, s, p, o);
}

NG_TARGET_AVX2 static void gg_reduce_f16_avx2(const void *x, int64_t n, float s, ng_gg_norm p,
                                              ng_gg_partial *o) {
    float buf[GG_SUB];
    const uint16_t *h = (const uint16_t *)x;
    if (p == NG_GG_NORM_2) {
        gg_reduce_norm2_avx2(h, n, s, 1, o);
        return;
    }
    for (int64_t i = 0; i < n; i += GG_SUB) {
        int64_t m = NG_MIN(GG_SUB, n - i);
        gg_widen_f16_avx2(h + i, buf, m);
        gg_reduce_f32_body(buf, m, s, p, o);
    }
}

NG_TARGET_AVX2 static void gg_apply_f32_avx2(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    gg_apply_f32_body((float *)x, n, cf);
}

NG_TARGET_AVX2 static void gg_apply_f64_avx2(void *x, int64_t n, float cf, double cd) {
    (void)cf;
    gg_apply_f64_body((double *)x, n, cd);
}

NG_TARGET_AVX2 static void gg_apply_bf16_avx2(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    gg_apply_bf16_body((uint16_t *)x, n, cf);
}

/* fp16 * c rounded back to fp16, nearest even (as ng_f32_to_f16). */
NG_TARGET_AVX2 static void gg_apply_f16_avx2(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    uint16_t *h = (uint16_t *)x;
    __m256 c = _mm256_set1_ps(cf);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i)));
        __m128i r =
            _mm256_cvtps_ph(_mm256_mul_ps(v, c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(h + i), r);
    }
    for (; i < n; i++) h[i] = ng_f32_to_f16(ng_f16_to_f32(h[i]) * cf);
}

#endif /* NG_X86 */

/* ---- NEON (aarch64) ---------------------------------------------------------- */
#if NG_NEON

/* fcvtl fp16 -> fp32 (exact, as ng_f16_to_f32). */
static void gg_widen_f16_neon(const uint16_t *x, float *buf, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(buf + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x + i))));
    for (; i < n; i++) buf[i] = ng_f16_to_f32(x[i]);
}

static inline float32x4_t gg_load4_neon(const void *x, int64_t i, int is_f16) {
    if (is_f16) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)x + i)));
    return vld1q_f32((const float *)x + i);
}

static inline float gg_load1_neon(const void *x, int64_t i, int is_f16) {
    return is_f16 ? ng_f16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* gg_reduce_norm2_avx2 in NEON: 8 values per step, unscaled in fp32 (one
 * rounding, as ng_gg_unscale), widened to fp64 and squared into four fp64
 * accumulators (exact squares: fma == mul + add), the NaN sentinel carried
 * in fp32 lanes. */
static void gg_reduce_norm2_neon(const void *h, int64_t n, float s, int is_f16, ng_gg_partial *o) {
    float64x2_t a0 = vdupq_n_f64(0.0), a1 = a0, a2 = a0, a3 = a0;
    float32x4_t z = vdupq_n_f32(0.0f), z1 = z;
    const float32x4_t zero = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float32x4_t v = gg_load4_neon(h, i, is_f16), w = gg_load4_neon(h, i + 4, is_f16);
        const float32x4_t u = vmulq_n_f32(v, s), t = vmulq_n_f32(w, s);
        const float64x2_t l0 = vcvt_f64_f32(vget_low_f32(u)), h0 = vcvt_high_f64_f32(u);
        const float64x2_t l1 = vcvt_f64_f32(vget_low_f32(t)), h1 = vcvt_high_f64_f32(t);
        a0 = vfmaq_f64(a0, l0, l0);
        a1 = vfmaq_f64(a1, h0, h0);
        a2 = vfmaq_f64(a2, l1, l1);
        a3 = vfmaq_f64(a3, h1, h1);
        z = vaddq_f32(z, vmulq_f32(v, zero)); /* NaN iff a NaN / Inf was seen */
        z1 = vaddq_f32(z1, vmulq_f32(w, zero));
    }
    double ad[2], acc = 0.0;
    float zf[4], zz = 0.0f;
    vst1q_f64(ad, vaddq_f64(vaddq_f64(a0, a2), vaddq_f64(a1, a3)));
    vst1q_f32(zf, vaddq_f32(z, z1));
    for (int k = 0; k < 2; k++) acc += ad[k];
    for (int k = 0; k < 4; k++) zz += zf[k];
    for (; i < n; i++) {
        float v = gg_load1_neon(h, i, is_f16);
        acc += ng_gg_sq(ng_gg_unscale(v, s));
        zz += v * 0.0f;
    }
    o->norm += acc;
    if (zz != 0.0f)
        for (int64_t k = 0; k < n; k++) {
            float v = gg_load1_neon(h, k, is_f16);
            o->nan_count += ng_gg_isnan_f(v);
            o->inf_count += ng_gg_isinf_f(v);
        }
}

static void gg_reduce_f32_neon(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    if (p == NG_GG_NORM_2)
        gg_reduce_norm2_neon(x, n, s, 0, o);
    else
        gg_reduce_f32_body((const float *)x, n, s, p, o);
}

static void gg_reduce_f16_neon(const void *x, int64_t n, float s, ng_gg_norm p, ng_gg_partial *o) {
    float buf[GG_SUB];
    const uint16_t *h = (const uint16_t *)x;
    if (p == NG_GG_NORM_2) {
        gg_reduce_norm2_neon(h, n, s, 1, o);
        return;
    }
    for (int64_t i = 0; i < n; i += GG_SUB) {
        int64_t m = NG_MIN(GG_SUB, n - i);
        gg_widen_f16_neon(h + i, buf, m);
        gg_reduce_f32_body(buf, m, s, p, o);
    }
}

/* fp16 * c rounded back to fp16 by fcvtn, nearest even under the default
 * rounding mode (as ng_f32_to_f16). */
static void gg_apply_f16_neon(void *x, int64_t n, float cf, double cd) {
    (void)cd;
    uint16_t *h = (uint16_t *)x;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i)));
        vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vmulq_n_f32(v, cf))));
    }
    for (; i < n; i++) h[i] = ng_f32_to_f16(ng_f16_to_f32(h[i]) * cf);
}

#endif /* NG_NEON */

static ng_status gg_pick(ng_dtype dt, gg_reduce_fn *r, gg_apply_fn *a) {
    int avx2 = 0;
#if NG_X86
    avx2 = ng_cpu_isa_active() >= NG_ISA_AVX2;
#endif
    switch (dt) {
    case NG_F32:
        *r = gg_reduce_f32_base;
        *a = gg_apply_f32_base;
        break;
    case NG_F64:
        *r = gg_reduce_f64_base;
        *a = gg_apply_f64_base;
        break;
    case NG_F16:
        *r = gg_reduce_f16_base;
        *a = gg_apply_f16_base;
        break;
    case NG_BF16:
        *r = gg_reduce_bf16_base;
        *a = gg_apply_bf16_base;
        break;
    default: return NG_ERR_DTYPE;
    }
#if NG_X86
    if (avx2) {
        switch (dt) {
        case NG_F32:
            *r = gg_reduce_f32_avx2;
            *a = gg_apply_f32_avx2;
            break;
        case NG_F64:
            *r = gg_reduce_f64_avx2;
            *a = gg_apply_f64_avx2;
            break;
        case NG_F16:
            *r = gg_reduce_f16_avx2;
            *a = gg_apply_f16_avx2;
            break;
        case NG_BF16:
            *r = gg_reduce_bf16_avx2;
            *a = gg_apply_bf16_avx2;
            break;
        }
    }
#else
    (void)avx2;
#endif
#if NG_NEON
    if (ng_cpu_isa_active() == NG_ISA_NEON) {
        switch (dt) {
        case NG_F32: *r = gg_reduce_f32_neon; break;
        case NG_F16:
            *r = gg_reduce_f16_neon;
            *a = gg_apply_f16_neon;
            break;
        default: break; /* the baseline's loops */
        }
    }
#endif
    return NG_OK;
}

/* ---- blocks over the tensor list ------------------------------------------- */

typedef struct gg_ctx {
    const void *const *grads;
    const int64_t *numels;
    int64_t n_tensors;
    const int64_t *first_chunk; /* n_tensors + 1 prefix sums of block counts */
    size_t esize;
    float s;
    ng_gg_norm p;
    ng_gg_partial *partials;
    gg_reduce_fn reduce;
    gg_apply_fn apply;
    float cf;
    double cd;
    ng_dtype dtype;
} gg_ctx;

/* Tensor owning block c: the largest t with first_chunk[t] <= c (empty
 * tensors own no block and are skipped by this rule). */
static int64_t gg_owner(const int64_t *first_chunk, int64_t n_tensors, int64_t c) {
    int64_t lo = 0, hi = n_tensors - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (first_chunk[mid] <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Finite values of n elements of x whose unscaled value x * s the dtype
 * cannot hold (grad_guard_math.h): they count as Inf. Run only for |s| > 1,
 * the one case where there can be any (|x * s| <= |x| otherwise), so the hot
 * loops above never test for it. */
static int64_t gg_count_overflow(const void *x, int64_t n, ng_dtype dt, float s) {
    int64_t k = 0;
    if (dt == NG_F64) {
        const double *d = (const double *)x;
        for (int64_t i = 0; i < n; i++)
            k += ng_gg_isfinite_d(d[i]) && ng_gg_isinf_d(d[i] * (double)s);
        return k;
    }
    const float lim = dt == NG_F16    ? NG_GG_F16_OVERFLOW
                      : dt == NG_BF16 ? NG_GG_BF16_OVERFLOW
                                      : INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float v = ng_load_f32(x, dt, i);
        k += ng_gg_isfinite_d((double)v) && ng_gg_absf(ng_gg_unscale(v, s)) >= lim;
    }
    return k;
}

static void gg_reduce_range(int64_t begin, int64_t end, void *vctx) {
    const gg_ctx *ctx = (const gg_ctx *)vctx;
    int64_t t = gg_owner(ctx->first_chunk, ctx->n_tensors, begin);
    for (int64_t c = begin; c < end; c++) {
        while (c >= ctx->first_chunk[t + 1]) t++;
        int64_t off = (c - ctx->first_chunk[t]) * NG_GG_CHUNK;
        int64_t len = NG_MIN(NG_GG_CHUNK, ctx->numels[t] - off);
        ng_gg_partial *o = &ctx->partials[c];
        o->norm = 0.0;
        o->nan_count = 0;
        o->inf_count = 0;
        const void *x = (const char *)ctx->grads[t] + (size_t)off * ctx->esize;
        ctx->reduce(x, len, ctx->s, ctx->p, o);
        if (ng_gg_absf(ctx->s) > 1.0f)
            o->inf_count += gg_count_overflow(x, len, ctx->dtype, ctx->s);
    }
}

static void gg_apply_range(int64_t begin, int64_t end, void *vctx) {
    const gg_ctx *ctx = (const gg_ctx *)vctx;
    int64_t t = gg_owner(ctx->first_chunk, ctx->n_tensors, begin);
    for (int64_t c = begin; c < end; c++) {
        while (c >= ctx->first_chunk[t + 1]) t++;
        int64_t off = (c - ctx->first_chunk[t]) * NG_GG_CHUNK;
        int64_t len = NG_MIN(NG_GG_CHUNK, ctx->numels[t] - off);
        /* the list is const for pass 1 only; pass 2 owns the buffers */
        void *x = (char *)(uintptr_t)ctx->grads[t] + (size_t)off * ctx->esize;
        ctx->apply(x, len, ctx->cf, ctx->cd);
    }
}

static ng_status gg_check_list(const void *const *grads, const int64_t *numels, int64_t n,
                               int64_t *total) {
    if (n < 0 || (n > 0 && (!grads || !numels))) return NG_ERR_INVALID_ARG;
    int64_t sum = 0;
    for (int64_t t = 0; t < n; t++) {
        if (numels[t] < 0 || (numels[t] > 0 && !grads[t])) return NG_ERR_INVALID_ARG;
        sum += numels[t];
    }
    *total = sum;
    return NG_OK;
}

/* first_chunk prefix sums; returns the number of blocks. Caller frees. */
static int64_t *gg_first_chunks(const int64_t *numels, int64_t n, int64_t *n_chunks) {
    int64_t *fc = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
    if (!fc) return NULL;
    fc[0] = 0;
    for (int64_t t = 0; t < n; t++) fc[t + 1] = fc[t] + NG_CEIL_DIV(numels[t], NG_GG_CHUNK);
    *n_chunks = fc[n];
    return fc;
}

ng_status ng_grad_guard_reduce(const void *const *grads, const int64_t *numels, int64_t n_tensors,
                               ng_dtype dtype, const float *inv_scale, ng_gg_norm norm,
                               double *stats, ng_parallel_fn par) {
    int64_t total;
    if (!inv_scale || !stats || (norm != NG_GG_NORM_2 && norm != NG_GG_NORM_INF))
        return NG_ERR_INVALID_ARG;
    NG_TRY(gg_check_list(grads, numels, n_tensors, &total));
    gg_reduce_fn rf;
    gg_apply_fn af;
    NG_TRY(gg_pick(dtype, &rf, &af));

    stats[NG_GG_NORM] = 0.0;
    stats[NG_GG_NAN] = 0.0;
    stats[NG_GG_INF] = 0.0;
    stats[NG_GG_FIRST_BAD] = -1.0;
    if (total == 0) return NG_OK;

    int64_t m = 0;
    int64_t *fc = gg_first_chunks(numels, n_tensors, &m);
    ng_gg_partial *parts = fc ? (ng_gg_partial *)malloc((size_t)m * sizeof *parts) : NULL;
    if (!parts) {
        free(fc);
        return NG_ERR_ALLOC;
    }
    gg_ctx ctx = {grads, numels, n_tensors, fc,   ng_dtype_size(dtype), *inv_scale, norm, parts, rf,
                  af,    1.0f,   1.0,       dtype};
    ng_parallel_run(total < GG_TASK_ELEMS ? NULL : par, m, gg_grain(m, total), gg_reduce_range,
                    &ctx);

    /* Blocks in order: fixed summation order, first bad block = first bad tensor. */
    double acc = 0.0;
    int64_t nan = 0, inf = 0, first_bad = -1, t = 0;
    for (int64_t c = 0; c < m; c++) {
        while (c >= fc[t + 1]) t++;
        acc = ng_gg_combine(acc, parts[c].norm, norm);
        nan += parts[c].nan_count;
        inf += parts[c].inf_count;
        if (first_bad < 0 && parts[c].nan_count + parts[c].inf_count > 0) first_bad = t;
    }
    stats[NG_GG_NORM] = acc;
    stats[NG_GG_NAN] = (double)nan;
    stats[NG_GG_INF] = (double)inf;
    stats[NG_GG_FIRST_BAD] = (double)first_bad;
    free(parts);
    free(fc);
    return NG_OK;
}

ng_status ng_grad_guard_apply(void *const *grads, const int64_t *numels, int64_t n_tensors,
                              ng_dtype dtype, const float *inv_scale, const double *stats,
                              double max_norm, ng_gg_norm norm, float *found_inf, void *total_norm,
                              ng_dtype norm_dtype, ng_parallel_fn par) {
    int64_t total;
    if (!inv_scale || !stats || (norm != NG_GG_NORM_2 && norm != NG_GG_NORM_INF) ||
        !(max_norm >= 0.0) || (norm_dtype != NG_F32 && norm_dtype != NG_F64))
        return NG_ERR_INVALID_ARG;
    NG_TRY(gg_check_list((const void *const *)grads, numels, n_tensors, &total));
    gg_reduce_fn rf;
    gg_apply_fn af;
    NG_TRY(gg_pick(dtype, &rf, &af));

    double tn = ng_gg_step_norm(stats, *inv_scale, norm);
    if (total_norm) {
        if (norm_dtype == NG_F64)
            *(double *)total_norm = tn;
        else
            *(float *)total_norm = (float)tn;
    }
    double coef;
    if (!ng_gg_coef(stats, *inv_scale, max_norm, norm, &coef)) {
        if (found_inf) *found_inf = 1.0f;
        return NG_OK;
    }
    float cf = (float)coef;
    /* A multiplier below the fp32 normal range (a huge norm clipped to a small
     * max_norm) would lose its bits as an fp32 subnormal: multiply in fp64. */
    int wide = dtype != NG_F64 && coef != 0.0 && fabs(coef) < (double)FLT_MIN;
    /* A multiplier of exactly 1 (bf16 without a scaler, norm under max_norm)
     * leaves every value as it is: skip the second pass. */
    if (total == 0 || (dtype == NG_F64 ? coef == 1.0 : cf == 1.0f)) return NG_OK;

    int64_t m = 0;
    int64_t *fc = gg_first_chunks(numels, n_tensors, &m);
    if (!fc) return NG_ERR_ALLOC;
    gg_ctx ctx = {(const void *const *)grads,
                  numels,
                  n_tensors,
                  fc,
                  ng_dtype_size(dtype),
                  *inv_scale,
                  norm,
                  NULL,
                  rf,
                  af,
                  cf,
                  coef,
                  dtype};
    if (wide) {
        switch (dtype) {
        case NG_F32: ctx.apply = gg_apply_wide_f32; break;
        case NG_F16: ctx.apply = gg_apply_wide_f16; break;
        case NG_BF16: ctx.apply = gg_apply_wide_bf16; break;
        default: break;
        }
    }
    ng_parallel_run(total < GG_TASK_ELEMS ? NULL : par, m, gg_grain(m, total), gg_apply_range,
                    &ctx);
    free(fc);
    return NG_OK;
}
