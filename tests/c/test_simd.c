/*
 * tests/c/test_simd.c - kernels/simd_f32.h's exps against libm in double,
 * and its two x86 widths against each other, bit for bit: the attention
 * kernels rely on both (an fp32 softmax within a few ulp of exact, and the
 * AVX2 and AVX-512 paths giving the same values). On aarch64 the NEON
 * width's exps against the same bounds, its masks, its max's NaN rule, its
 * horizontal sums' order and its 16-bit loads.
 *
 * Arguments: a sweep of [-140, 140] in steps of 1/4096 (every quarter,
 * half and whole number among them, where rounding to nearest even picks
 * n), ten thousand random floats of the same range, and -inf, +inf, NaN,
 * +-0 and the edges of the clamps. Bounds: 2^x within 2 ulp of exp2 for
 * x in [-126, 127] (the Cephes polynomial is ~1 ulp; one more for the
 * product by 2^n); exactly 0 below -126.5 and for -inf; e^x within 3 ulp
 * for x in [-87, 88] (the argument reduction in two steps adds one).
 */
#include <string.h>

#include "kernels/simd_f32.h"
#include "tests/c/ng_test.h"

#if NG_X86 || NG_NEON

#define CHECK NG_CHECK

#define N_SWEEP (280 * 4096 + 1)
#define N_RAND 10000
#define N_SPECIAL 16

static int64_t fill_args(float *x) {
    int64_t n = 0;
    for (int64_t i = 0; i < N_SWEEP; i++) x[n++] = -140.0f + (float)i / 4096.0f;
    ng_rng r = {7};
    for (int i = 0; i < N_RAND; i++) x[n++] = (float)(140.0 * ng_rng_unif(&r));
    const float sp[N_SPECIAL] = {-INFINITY, INFINITY, NAN,     0.0f,    -0.0f,  -126.5f,
                                 -126.25f,  -126.0f,  -127.0f, -127.5f, 127.0f, 127.5f,
                                 128.0f,    -87.0f,   88.0f,   -0.5f};
    for (int i = 0; i < N_SPECIAL; i++) x[n++] = sp[i];
    return n;
}

/* |got - ref| in units of ref's fp32 ulp (2^(exponent - 23), normal refs). */
static double ulps(float got, double ref) {
    int e;
    frexp(ref, &e);
    return fabs((double)got - ref) / ldexp(1.0, e - 24);
}

#if NG_X86
NG_TARGET_AVX2 static void exps_8(const float *x, float *e2, float *e, int64_t n) {
    for (int64_t i = 0; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(e2 + i, ng_exp2_8(v));
        _mm256_storeu_ps(e + i, ng_exp8(v));
    }
}

NG_TARGET_AVX512 static void exps_16(const float *x, float *e2, float *e, int64_t n) {
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        _mm512_storeu_ps(e2 + i, ng_exp2_16(v));
        _mm512_storeu_ps(e + i, ng_exp16(v));
    }
}

#endif

/* The contract of ng_exp2_* and ng_exp* at one width, value by value. */
static void check_width(const char *w, const float *x, const float *e2, const float *e, int64_t n) {
    double worst2 = 0, worst = 0;
    int bad2 = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i];
        /* 2^x */
        int ok;
        if (isnan(a)) {
            ok = isnan(e2[i]);
        } else if (a < -126.5f) {
            ok = e2[i] == 0.0f;
        } else if (a < -126.0f) { /* 2^-126 x 2^f or 0 when n rounds to -127 */
            ok = e2[i] >= 0.0f && e2[i] <= ldexpf(1.0f, -126);
        } else if (a <= 127.0f) {
            const double u = ulps(e2[i], exp2((double)a));
            worst2 = fmax(worst2, u);
            ok = u <= 2.0;
        } else { /* clamped to 127 */
            ok = e2[i] == e2[i] && e2[i] >= ldexpf(1.0f, 126) && !isinf(e2[i]);
        }
        if (!ok && bad2++ < 5) printf("  %s ng_exp2(%.9g) = %.9g\n", w, (double)a, (double)e2[i]);
        /* e^x */
        if (isnan(a)) {
            ok = isnan(e[i]);
        } else if (a < -87.0f) {
            ok = e[i] == 0.0f;
        } else if (a <= 88.0f) {
            const double u = ulps(e[i], exp((double)a));
            worst = fmax(worst, u);
            ok = u <= 3.0;
        } else {
            ok = !isnan(e[i]) && e[i] >= expf(87.0f);
        }
        if (!ok && bad++ < 5) printf("  %s ng_exp(%.9g) = %.9g\n", w, (double)a, (double)e[i]);
    }
    CHECK(bad2 == 0, "%s: ng_exp2 broke its contract at %d arguments", w, bad2);
    CHECK(bad == 0, "%s: ng_exp broke its contract at %d arguments", w, bad);
    printf("test_simd: %s worst ulp: 2^x %.3f, e^x %.3f\n", w, worst2, worst);
}

#if NG_X86
NG_TARGET_AVX2 static int unord_8(float a, float b) {
    return _mm256_movemask_ps(NG_F32X8_MASK_UNORD(_mm256_set1_ps(a), _mm256_set1_ps(b))) == 0xff;
}

/* NG_F32X*_MASK_ANY of the lanes where x[i] > 0: nonzero with any. */
NG_TARGET_AVX2 static int any_8(const float *x) {
    return NG_F32X8_MASK_ANY(NG_F32X8_MASK_GT(_mm256_loadu_ps(x), _mm256_setzero_ps())) != 0;
}

NG_TARGET_AVX512 static int any_16(const float *x) {
    return NG_F32X16_MASK_ANY(NG_F32X16_MASK_GT(_mm512_loadu_ps(x), _mm512_setzero_ps())) != 0;
}

/* Each width's MASK_ANY with no lane, then each single lane, set. */
static void check_any(int width) {
    float v[16] = {0};
    int ok = !(width == 8 ? any_8(v) : any_16(v));
    for (int i = 0; i < width; i++) {
        v[i] = 1.0f;
        ok &= width == 8 ? any_8(v) : any_16(v);
        v[i] = 0.0f;
    }
    CHECK(ok, "NG_F32X%d_MASK_ANY: nonzero exactly when a lane is set", width);
}

int main(void) {
    const ng_cpu_isa isa = ng_cpu_isa_supported();
    if (isa < NG_ISA_AVX2) {
        printf("SKIP: no AVX2\n");
        return 77;
    }
    const int64_t cap = N_SWEEP + N_RAND + N_SPECIAL + 16;
    float *x = calloc((size_t)cap, sizeof(float)), *buf = calloc((size_t)(4 * cap), sizeof(float));
    if (!x || !buf) return 1;
    float *e2_8 = buf, *e_8 = buf + cap, *e2_16 = buf + 2 * cap, *e_16 = buf + 3 * cap;
    int64_t n = fill_args(x);
    n = (n + 15) / 16 * 16; /* the zero-filled tail is one more argument */

    exps_8(x, e2_8, e_8, n);
    check_width("avx2", x, e2_8, e_8, n);
    CHECK(unord_8(NAN, 1.0f) && unord_8(1.0f, NAN) && !unord_8(1.0f, -INFINITY),
          "NG_F32X8_MASK_UNORD: lanes where either operand is NaN");
    check_any(8);
    if (isa >= NG_ISA_AVX512) {
        check_any(16);
        exps_16(x, e2_16, e_16, n);
        check_width("avx512", x, e2_16, e_16, n);
        int64_t diff2 = 0, diff = 0;
        for (int64_t i = 0; i < n; i++) {
            diff2 += memcmp(&e2_8[i], &e2_16[i], sizeof(float)) != 0 &&
                     !(isnan(e2_8[i]) && isnan(e2_16[i]));
            diff +=
                memcmp(&e_8[i], &e_16[i], sizeof(float)) != 0 && !(isnan(e_8[i]) && isnan(e_16[i]));
        }
        CHECK(diff2 == 0, "ng_exp2_8 and ng_exp2_16 differ at %lld of %lld arguments",
              (long long)diff2, (long long)n);
        CHECK(diff == 0, "ng_exp8 and ng_exp16 differ at %lld of %lld arguments", (long long)diff,
              (long long)n);
    } else {
        printf("test_simd: no AVX-512 here, the widths are not compared\n");
    }
    free(x);
    free(buf);
    return ng_test_finish("test_simd");
}

#endif /* NG_X86 */

#if NG_NEON
static void exps_4(const float *x, float *e2, float *e, int64_t n) {
    for (int64_t i = 0; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(x + i);
        vst1q_f32(e2 + i, ng_exp2_4(v));
        vst1q_f32(e + i, ng_exp4(v));
    }
}

/* NG_F32X4_MASK_ANY of the lanes where x[i] > 0, as check_any does. */
static int any_4(const float *x) {
    return NG_F32X4_MASK_ANY(NG_F32X4_MASK_GT(vld1q_f32(x), vdupq_n_f32(0.0f))) != 0;
}

static int all_lanes(uint32x4_t m) { return vminvq_u32(m) == 0xffffffffu; }

static void check_neon_ops(void) {
    float v[4] = {0};
    int ok = !any_4(v);
    for (int i = 0; i < 4; i++) {
        v[i] = 1.0f;
        ok &= any_4(v);
        v[i] = 0.0f;
    }
    CHECK(ok, "NG_F32X4_MASK_ANY: nonzero exactly when a lane is set");
    const float32x4_t nan = vdupq_n_f32(NAN), one = vdupq_n_f32(1.0f);
    CHECK(all_lanes(NG_F32X4_MASK_UNORD(nan, one)) && all_lanes(NG_F32X4_MASK_UNORD(one, nan)) &&
              !NG_F32X4_MASK_ANY(NG_F32X4_MASK_UNORD(one, vdupq_n_f32(-INFINITY))),
          "NG_F32X4_MASK_UNORD: lanes where either operand is NaN");
    CHECK(all_lanes(NG_F32X4_MASK_NAN(nan)) && !NG_F32X4_MASK_ANY(NG_F32X4_MASK_NAN(one)),
          "NG_F32X4_MASK_NAN");
    /* max: a > b ? a : b, so b where either is NaN (maxps' rule) */
    float m[4];
    vst1q_f32(m, NG_F32X4_VEC_MAX(nan, one));
    CHECK(m[0] == 1.0f, "NG_F32X4_VEC_MAX(NaN, 1) = %g, want 1", (double)m[0]);
    vst1q_f32(m, NG_F32X4_VEC_MAX(one, nan));
    CHECK(isnan(m[0]), "NG_F32X4_VEC_MAX(1, NaN) = %g, want NaN", (double)m[0]);
    /* horizontal sums: ((l0 + l1) + (l2 + l3)), HSUM and each lane of HSUM4
     * alike; lanes chosen so that any other order rounds differently */
    const float l[4] = {1.0f, 0x1p-24f, -1.0f, 0x1p-24f};
    const float want = (l[0] + l[1]) + (l[2] + l[3]);
    const float32x4_t a = vld1q_f32(l);
    float s4[4];
    NG_F32X4_SUM4_STORE(s4, NG_F32X4_VEC_HSUM4(a, a, a, a));
    CHECK(NG_F32X4_VEC_HSUM(a) == want && s4[0] == want && s4[3] == want,
          "NEON horizontal sums: %g / %g, want %g", (double)NG_F32X4_VEC_HSUM(a), (double)s4[0],
          (double)want);
    /* the 16-bit loads widen exactly */
    const uint16_t bf[4] = {0x3f80, 0xbfc0, 0x7f80, 0x0001},
                   hf[4] = {0x3c00, 0xbe00, 0x7c00, 0x0001};
    float wb[4], wh[4];
    vst1q_f32(wb, NG_F32X4_VEC_LOAD_BF16(bf));
    vst1q_f32(wh, NG_F32X4_VEC_LOAD_F16(hf));
    int exact = 1;
    for (int i = 0; i < 4; i++)
        exact &= wb[i] == ng_bf16_to_f32(bf[i]) && wh[i] == ng_f16_to_f32(hf[i]);
    CHECK(exact, "NG_F32X4_VEC_LOAD_BF16 / _F16 widen exactly");
}

int main(void) {
    if (ng_cpu_isa_supported() != NG_ISA_NEON) {
        printf("SKIP: no NEON\n");
        return 77;
    }
    const int64_t cap = N_SWEEP + N_RAND + N_SPECIAL + 16;
    float *x = calloc((size_t)cap, sizeof(float)), *buf = calloc((size_t)(2 * cap), sizeof(float));
    if (!x || !buf) return 1;
    float *e2_4 = buf, *e_4 = buf + cap;
    int64_t n = fill_args(x);
    n = (n + 15) / 16 * 16;
    exps_4(x, e2_4, e_4, n);
    check_width("neon", x, e2_4, e_4, n);
    check_neon_ops();
    free(x);
    free(buf);
    return ng_test_finish("test_simd");
}
#endif /* NG_NEON */

#else
int main(void) {
    printf("SKIP: neither x86-64 nor aarch64\n");
    return 77;
}
#endif
