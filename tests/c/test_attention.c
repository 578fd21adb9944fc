/*
 * tests/c/test_attention.c - safe_sdpa CPU kernels against a plain-loop fp64
 * reference, and the shared per-score math of kernels/attention_math.h (the
 * arithmetic the CUDA kernel runs too).
 *
 * The reference materializes every score row in fp64, from the inputs as
 * rounded to the tested dtype, and derives the backward analytically:
 *   P = softmax(s), Pd = P * keep / (1 - p), out = Pd V, dV = Pd^T dout,
 *   dP = dout V^T, D_i = sum_j Pd_ij dP_ij, dS = P (dP keep/(1-p) - D) g'(s),
 *   dQ = scale dS K, dK = scale dS^T Q.
 * Masked positions come from the generator's own flags, not from the kernel's
 * mask test, so the reference is independent of the code under test.
 * Every case runs on every CPU path this machine has (baseline, avx2, ...).
 * Pass: |kernel - ref| <= atol + rtol * |ref| element-wise, per-dtype table.
 */
#include <float.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/attention_mma.h"
#include "tests/c/attn_cases.h"
#include "tests/c/ng_test.h"

/* NG_EXPECT with a printf-style explanation. */
#define CHECK NG_CHECK

/* ---- tolerances: |d| <= aabs + rtol * |ref| (tolerance.h, afrac 0) ------- */

static tol tol_for(ng_dtype t, int grad) {
    switch (t) {
    case NG_F64: return (tol){1e-9, 0, 1e-10, "fp64 accumulation throughout"};
    case NG_F32:
        /* fp32 accumulation over up to 256-long dots and 129 keys, ~1 ulp exp */
        return grad ? (tol){5e-4, 0, 5e-5, "fp32 accumulation, gradients sum over keys and heads"}
                    : (tol){2e-4, 0, 2e-5, "fp32 accumulation"};
    case NG_F16:
        /* output rounded to fp16 (2^-11); backward reads the fp16-rounded out for D */
        return grad ? (tol){1e-2, 0, 1e-2, "fp16 output rounding, D from the rounded out"}
                    : (tol){4e-3, 0, 2e-3, "fp16 output rounding"};
    case NG_BF16:
        return grad ? (tol){4e-2, 0, 6e-2, "bf16 output rounding (2^-8), D from the rounded out"}
                    : (tol){1.6e-2, 0, 1.6e-2, "bf16 output rounding (2^-8)"};
    }
    return (tol){0, 0, 0, ""};
}

/* ---- deterministic inputs ------------------------------------------------ */
static ng_rng g_rng = {1};
static double urand(void) { return 0.5 * (ng_rng_unif(&g_rng) + 1.0); } /* [0, 1) */

/* ---- shared math tests --------------------------------------------------- */
static void test_philox(void) {
    /* Random123 kat_vectors, philox4x32 10 */
    static const uint32_t v[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int t = 0; t < 3; t++) {
        uint32_t out[4];
        ng_philox4x32_10(v[t], v[t] + 4, out);
        for (int w = 0; w < 4; w++)
            CHECK(out[w] == v[t][6 + w], "philox KAT %d word %d: %08x != %08x", t, w, out[w],
                  v[t][6 + w]);
    }
    /* keep rate of the dropout stream */
    const float p = 0.3f;
    int64_t kept = 0, n = 1 << 20;
    for (int64_t e = 0; e < n; e++) kept += ng_attn_dropout_keep(1234, 5, (uint64_t)e, p);
    double rate = (double)kept / (double)n; /* sd = sqrt(.21/n) ~ 4.5e-4 */
    CHECK(fabs(rate - 0.7) < 3e-3, "dropout keep rate %f, want 0.7", rate);
    /* different offsets give different masks */
    int diff = 0;
    for (uint64_t e = 0; e < 256; e++)
        diff += ng_attn_dropout_keep(1234, 5, e, 0.5f) != ng_attn_dropout_keep(1234, 6, e, 0.5f);
    CHECK(diff > 64, "offset changes the mask (%d of 256 differ)", diff);
}

static void test_math(void) {
    /* soft-cap and clamp derivatives by central differences */
    const double caps[] = {0.5, 5.0, 30.0};
    for (int ci = 0; ci < 3; ci++)
        for (double s = -40.0; s <= 40.0; s += 0.37) {
            double c = caps[ci], h = 1e-6;
            double fd = (ng_attn_softcap_f64(s + h, c) - ng_attn_softcap_f64(s - h, c)) / (2 * h);
            double g = ng_attn_softcap_grad_f64(s, c);
            CHECK(fabs(fd - g) <= 1e-6 + 1e-6 * fabs(g), "softcap' at s=%g c=%g: %g vs fd %g", s, c,
                  g, fd);
            float gf = ng_attn_softcap_grad_f32((float)s, (float)c);
            CHECK(fabs(gf - g) <= 1e-5, "softcap'_f32 at s=%g c=%g: %g vs %g", s, c, gf, g);
            double gt = ng_attn_transform_grad_f64(s, 3.0, c);
            double fdt =
                (ng_attn_transform_f64(s + h, 3.0, c) - ng_attn_transform_f64(s - h, 3.0, c)) /
                (2 * h);
            if (fabs(fabs(s) - 3.0) > 1e-3)
                CHECK(fabs(fdt - gt) <= 1e-6 + 1e-6 * fabs(gt), "transform' at s=%g: %g vs fd %g",
                      s, gt, fdt);
        }
    CHECK(ng_attn_clamp_f32(70000.0f, 50.0f) == 50.0f, "clamp high");
    CHECK(ng_attn_clamp_f32(-INFINITY, 50.0f) == -50.0f, "clamp -inf");
    CHECK(isnan(ng_attn_clamp_f32(NAN, 50.0f)), "clamp keeps NaN");
    CHECK(ng_attn_clamp_f32(1e30f, 0.0f) == 1e30f, "clamp off");
    CHECK(ng_attn_clamp_grad_f32(60.0f, 50.0f) == 0.0f &&
              ng_attn_clamp_grad_f32(10.0f, 50.0f) == 1.0f,
          "clamp'");
    CHECK(isnan(ng_attn_softcap_f32(NAN, 5.0f)), "softcap keeps NaN");
    CHECK(ng_attn_softcap_f32(INFINITY, 5.0f) == 5.0f, "softcap(inf) = cap");
    /* online-softmax edge cases: no 0/0, NaN kept */
    CHECK(ng_attn_rescale_f32(-INFINITY, 3.0f) == 0.0f, "rescale from empty");
    CHECK(ng_attn_rescale_f32(-INFINITY, -INFINITY) == 0.0f, "rescale empty to empty");
    CHECK(isnan(ng_attn_rescale_f32(-INFINITY, NAN)), "rescale to NaN");
    CHECK(ng_attn_exp_shift_f32(-INFINITY, -INFINITY) == 0.0f, "exp shift of empty row");
    CHECK(ng_attn_lse_f32(-INFINITY, 0.0f) == -INFINITY, "lse of empty row");
    CHECK(isnan(ng_attn_lse_f32(NAN, NAN)), "lse NaN");
    CHECK(ng_attn_inv_sum_f32(0.0f) == 0.0f, "1/l of empty row is 0");
    CHECK(ng_attn_prob_f32(-INFINITY, -INFINITY) == 0.0f, "prob in empty row");
    CHECK(isnan(ng_attn_max_nan_f32(1.0f, NAN)) && isnan(ng_attn_max_nan_f32(NAN, 1.0f)),
          "max keeps NaN");
    CHECK(ng_attn_max_nan_f32(-INFINITY, 2.0f) == 2.0f && ng_attn_max_nan_f32(3.0f, 2.0f) == 3.0f,
          "max");
    /* mask conventions */
    uint8_t bm[2] = {0, 1};
    CHECK(ng_attn_mask_value(bm, NG_MASK_BOOL, NG_F32, 0) == -INFINITY, "bool false masks");
    CHECK(ng_attn_mask_value(bm, NG_MASK_BOOL, NG_F32, 1) == 0.0, "bool true attends");
    float fm[3] = {-INFINITY, -FLT_MAX, -1e4f};
    CHECK(ng_attn_mask_value(fm, NG_MASK_ADD, NG_F32, 0) == -INFINITY, "-inf masks");
    CHECK(ng_attn_mask_value(fm, NG_MASK_ADD, NG_F32, 1) == -INFINITY, "finfo(f32).min masks");
    CHECK(ng_attn_mask_value(fm, NG_MASK_ADD, NG_F32, 2) == -1e4, "-1e4 is additive");
    uint16_t hm[2] = {0xfbffu, 0xc000u}; /* fp16 -65504, -2 */
    CHECK(ng_attn_mask_value(hm, NG_MASK_ADD, NG_F16, 0) == -INFINITY, "finfo(f16).min masks");
    CHECK(ng_attn_mask_value(hm, NG_MASK_ADD, NG_F16, 1) == -2.0, "fp16 -2 additive");
    uint16_t bfm[2] = {0xff7fu, 0xc000u}; /* bf16 lowest, -2 */
    CHECK(ng_attn_mask_value(bfm, NG_MASK_ADD, NG_BF16, 0) == -INFINITY, "finfo(bf16).min masks");
    CHECK(ng_attn_mask_value(bfm, NG_MASK_ADD, NG_BF16, 1) == -2.0, "bf16 -2 additive");
    double dm[1] = {-DBL_MAX};
    CHECK(ng_attn_mask_value(dm, NG_MASK_ADD, NG_F64, 0) == -INFINITY, "finfo(f64).min masks");
    CHECK(ng_attn_causal_masked(3, 4) && !ng_attn_causal_masked(4, 4), "causal top-left");
}

/* ---- kernel vs reference ------------------------------------------------- */

/* Cases, tensors, masks and arguments: attn_cases.h. Here the inputs are
 * [B, H, N, D] (lay LAY_BHSD) or [B, N, H, D] memory (LAY_BSHD); out, dq
 * and dv are written [B, H, N, D], dk in the inputs' layout. */

static void fill(atensor *x, ng_dtype t, double mag) {
    for (int64_t i = 0; i < x->span; i++) ng_store_f64(x->h, t, i, mag * (2.0 * urand() - 1.0));
}

static double get(const atensor *x, ng_dtype t, int64_t b, int64_t h, int64_t i, int64_t d) {
    return at_get(x, t, b, h, i, d);
}

typedef struct refout {
    double *out, *lse, *dq, *dk, *dv; /* dense [B,H,N,D] */
} refout;

/* The fp64 reference. masked[b,h,i,j] (dense) and addv (dense) describe the mask. */
static void reference(const acase *c, ng_dtype t, const atensor *q, const atensor *k,
                      const atensor *v, const atensor *dout, const uint8_t *masked,
                      const double *addv, double scale, uint64_t seed, uint64_t offset, refout *r) {
    const int64_t B = c->B, Hq = c->Hq, L = c->L, S = c->S, E = c->E, Ev = c->Ev,
                  grp = c->Hq / c->Hkv;
    double *s = malloc(sizeof(double) * (size_t)(S + 1)),
           *raw = malloc(sizeof(double) * (size_t)(S + 1));
    double *p = malloc(sizeof(double) * (size_t)(S + 1)),
           *kp = malloc(sizeof(double) * (size_t)(S + 1));
    double *dp = malloc(sizeof(double) * (size_t)(S + 1));
    double inv = 1.0 / (1.0 - c->dropout);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t hk = h / grp;
            for (int64_t i = 0; i < L; i++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    double d = 0;
                    for (int64_t e = 0; e < E; e++)
                        d += get(q, t, b, h, i, e) * get(k, t, b, hk, j, e);
                    raw[j] = scale * d;
                    double x = raw[j];
                    if (c->max_score > 0) x = fmin(fmax(x, -c->max_score), c->max_score);
                    if (c->softcap > 0) x = c->softcap * tanh(x / c->softcap);
                    int64_t mi = ((b * Hq + h) * L + i) * S + j;
                    if ((masked && masked[mi]) || (c->causal && j > i))
                        x = -INFINITY;
                    else if (addv)
                        x += addv[mi];
                    s[j] = x;
                    if (x > mx) mx = x;
                    uint64_t e64 = (uint64_t)mi;
                    kp[j] = c->dropout > 0
                                ? (ng_attn_dropout_keep(seed, offset, e64, (float)c->dropout) ? inv
                                                                                              : 0.0)
                                : 1.0;
                }
                double l = 0;
                for (int64_t j = 0; j < S; j++) {
                    p[j] = mx == -INFINITY ? 0.0 : exp(s[j] - mx);
                    l += p[j];
                }
                int64_t ro = ((b * Hq + h) * L + i);
                r->lse[ro] = l > 0 ? mx + log(l) : -INFINITY;
                for (int64_t j = 0; j < S; j++) p[j] = l > 0 ? p[j] / l : 0.0;
                double D = 0;
                for (int64_t j = 0; j < S; j++) {
                    dp[j] = 0;
                    for (int64_t d = 0; d < Ev; d++)
                        dp[j] += get(dout, t, b, h, i, d) * get(v, t, b, hk, j, d);
                    D += p[j] * kp[j] * dp[j];
                }
                for (int64_t d = 0; d < Ev; d++) {
                    double o = 0;
                    for (int64_t j = 0; j < S; j++) o += p[j] * kp[j] * get(v, t, b, hk, j, d);
                    r->out[ro * Ev + d] = o;
                }
                for (int64_t j = 0; j < S; j++) {
                    double g = 1.0;
                    if (c->max_score > 0 && fabs(raw[j]) > c->max_score) g = 0.0;
                    double x =
                        c->max_score > 0 ? fmin(fmax(raw[j], -c->max_score), c->max_score) : raw[j];
                    if (c->softcap > 0) {
                        double th = tanh(x / c->softcap);
                        g *= 1.0 - th * th;
                    }
                    double ds = p[j] * (dp[j] * kp[j] - D) * g * scale;
                    int64_t kro = (b * c->Hkv + hk) * S + j;
                    for (int64_t e = 0; e < E; e++) {
                        r->dq[ro * E + e] += ds * get(k, t, b, hk, j, e);
                        r->dk[kro * E + e] += ds * get(q, t, b, h, i, e);
                    }
                    for (int64_t d = 0; d < Ev; d++)
                        r->dv[kro * Ev + d] += p[j] * kp[j] * get(dout, t, b, h, i, d);
                }
            }
        }
    free(s);
    free(raw);
    free(p);
    free(kp);
    free(dp);
}

/* compare a strided kernel tensor with a dense reference */
static double g_worst;
static int compare(const char *what, const acase *c, ng_dtype t, const atensor *x,
                   const double *ref, int64_t H, int64_t N, int64_t D, tol tl) {
    int bad = 0;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < N; i++)
                for (int64_t d = 0; d < D; d++) {
                    double got = get(x, t, b, h, i, d), want = ref[((b * H + h) * N + i) * D + d];
                    double err = fabs(got - want), lim = tol_limit(tl, want, 0.0);
                    if (!(err <= lim)) {
                        if (bad < 3)
                            fprintf(
                                stderr,
                                "  %s %s %s [%lld,%lld,%lld,%lld]: got %.9g want %.9g (tol %.3g: %s)\n",
                                c->name, ng_dtype_name(t), what, (long long)b, (long long)h,
                                (long long)i, (long long)d, got, want, lim, tl.why);
                        bad++;
                    } else if (lim > 0 && err / lim > g_worst) {
                        g_worst = err / lim;
                    }
                }
    return bad;
}

/* A parallel runner that splits into uneven chunks and runs them backwards,
 * so range boundaries and task order are exercised without threads. */
static void chunky_par(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    int64_t step = grain < 3 ? 3 : grain;
    for (int64_t end = n; end > 0; end -= step) fn(end - step < 0 ? 0 : end - step, end, ctx);
}

/* Another split: one index per call, odd indices first, then even ones. */
static void striped_par(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    (void)grain;
    for (int64_t i = 1; i < n; i += 2) fn(i, i + 1, ctx);
    for (int64_t i = 0; i < n; i += 2) fn(i, i + 1, ctx);
}

typedef ng_status (*fwd_fn)(const ng_attention_args *a, ng_parallel_fn par);

/* The decode path's result must not depend on the runner: the same case
 * serially and under two runners that split the tasks differently gives
 * bit-identical out and lse; and ng_attention_fwd, which picks the decode
 * path for short query blocks, gives exactly the same. */
static void check_decode_runners(const acase *c, ng_dtype t, const ng_attention_args *a0,
                                 const atensor *o, const void *lse, size_t lse_bytes) {
    ng_attention_args a = *a0;
    size_t obytes = at_bytes(o);
    void *o2 = malloc(obytes + 1), *l2 = malloc(lse_bytes + 1);
    const ng_parallel_fn runners[3] = {NULL, chunky_par, striped_par};
    for (int ri = 0; ri < 4; ri++) {
        memset(o2, 0x7f, obytes + 1);
        memset(l2, 0x7f, lse_bytes + 1);
        a.out = o2;
        a.lse = l2;
        ng_status st =
            ri < 3 ? ng_attention_fwd_decode(&a, runners[ri]) : ng_attention_fwd(&a, chunky_par);
        if (ri == 3 && !(c->L <= NG_ATTN_CPU_DEC_MAX_L && c->S >= 1))
            break; /* the tiled path: not expected to match bits */
        CHECK(st == NG_OK && memcmp(o2, o->h, obytes) == 0 && memcmp(l2, lse, lse_bytes) == 0,
              "%s %s: decode forward with runner %d is not bit-identical to the serial run",
              c->name, ng_dtype_name(t), ri);
    }
    free(o2);
    free(l2);
}

/* The dense [B, Hq, L, S] flags (1: masked) and additive values the
 * reference reads, expanded from the stored broadcast mask. */
static void dense_mask(const acase *c, const amask *m, uint8_t *masked, double *addv) {
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < c->L; i++)
                for (int64_t j = 0; j < c->S; j++) {
                    int64_t mi = ((b * c->Hq + h) * c->L + i) * c->S + j;
                    int64_t x = b * m->st[0] + h * m->st[1] + i * m->st[2] + j;
                    masked[mi] = m->flag[x];
                    if (addv && !m->flag[x]) addv[mi] = ng_load_f64(m->p, m->dtype, x);
                }
}

static refout refout_new(const acase *c) {
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, L = c->L, S = c->S, E = c->E, Ev = c->Ev;
    refout r;
    r.out = calloc((size_t)(B * Hq * L * Ev + 1), sizeof(double));
    r.lse = calloc((size_t)(B * Hq * L + 1), sizeof(double));
    r.dq = calloc((size_t)(B * Hq * L * E + 1), sizeof(double));
    r.dk = calloc((size_t)(B * Hkv * S * E + 1), sizeof(double));
    r.dv = calloc((size_t)(B * Hkv * S * Ev + 1), sizeof(double));
    return r;
}

static void refout_free(refout *r) {
    free(r->out);
    free(r->lse);
    free(r->dq);
    free(r->dk);
    free(r->dv);
}

/* The decode forward: runner independence, and fully masked rows exactly 0. */
static void check_decode(const acase *c, ng_dtype t, const ng_attention_args *a, const aio *io,
                         const refout *r, size_t lse_bytes) {
    check_decode_runners(c, t, a, &io->o, a->lse, lse_bytes);
    int nonzero = 0;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < c->L; i++)
                if (r->lse[(b * c->Hq + h) * c->L + i] == -INFINITY)
                    for (int64_t d = 0; d < c->Ev; d++)
                        nonzero += get(&io->o, t, b, h, i, d) != 0.0;
    CHECK(nonzero == 0, "%s %s: %d outputs of fully masked rows are not 0", c->name,
          ng_dtype_name(t), nonzero);
}

/* Every output against the reference; the number of mismatches. */
static int compare_all(const acase *c, ng_dtype t, const aio *io, const void *lse,
                       const refout *r) {
    int bad = 0;
    tol tf = tol_for(t, 0), tg = tol_for(t, 1);
    bad += compare("out", c, t, &io->o, r->out, c->Hq, c->L, c->Ev, tf);
    for (int64_t x = 0; x < c->B * c->Hq * c->L; x++) {
        double got = t == NG_F64 ? ((const double *)lse)[x] : ((const float *)lse)[x],
               want = r->lse[x];
        int ok =
            (want == -INFINITY) ? got == -INFINITY : fabs(got - want) <= 1e-4 + 1e-5 * fabs(want);
        if (!ok) {
            if (bad < 3)
                fprintf(stderr, "  %s %s lse[%lld]: got %g want %g\n", c->name, ng_dtype_name(t),
                        (long long)x, got, want);
            bad++;
        }
    }
    /* SP_RISING's softmax is one-hot where the keys were scaled by 40: its
     * 16-bit gradients are the rounding of out (in D) times keys of ~80 */
    if (c->special == SP_RISING && ng_dtype_size(t) == 2) return bad;
    bad += compare("dq", c, t, &io->dq, r->dq, c->Hq, c->L, c->E, tg);
    bad += compare("dk", c, t, &io->dk, r->dk, c->Hkv, c->S, c->E, tg);
    bad += compare("dv", c, t, &io->dv, r->dv, c->Hkv, c->S, c->Ev, tg);
    return bad;
}

static void run_case(const acase *c, ng_dtype t, ng_parallel_fn par, fwd_fn fwd) {
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, L = c->L, S = c->S, E = c->E, Ev = c->Ev;
    g_rng.s =
        0x9E3779B97F4A7C15ull ^ (uint64_t)(L * 131 + S * 7 + E + Ev * 3 + (int64_t)t * 1000003);
    const int lay = c->lay;
    aio io = {at_new(t, B, Hq, L, E, lay),       at_new(t, B, Hkv, S, E, lay),
              at_new(t, B, Hkv, S, Ev, lay),     at_new(t, B, Hq, L, Ev, lay),
              at_new(t, B, Hq, L, Ev, LAY_BHSD), at_new(t, B, Hq, L, E, LAY_BHSD),
              at_new(t, B, Hkv, S, E, lay),      at_new(t, B, Hkv, S, Ev, LAY_BHSD)};
    fill(&io.q, t, c->mag);
    fill(&io.k, t, c->mag);
    if (c->special == SP_RISING)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t j = 64; j < NG_MIN(S, 192); j++)
                    for (int64_t d = 0; d < E; d++)
                        ng_store_f64(io.k.h, t, at_off(&io.k, b, h, j, d),
                                     (j < 128 ? 3.0 : 40.0) * get(&io.k, t, b, h, j, d));
    fill(&io.v, t, 1.0);
    fill(&io.dout, t, 1.0);
    size_t rs = t == NG_F64 ? 8 : 4;
    void *lse = calloc((size_t)(B * Hq * L + 1), rs);

    /* mask: the stored broadcast tensor, and its flags (dense) for the reference */
    amask m = amask_new(c, t, &g_rng);
    uint8_t *masked = NULL;
    double *addv = NULL;
    if (c->mask != AM_NONE) {
        masked = calloc((size_t)(B * Hq * L * S) + 1, 1);
        addv = c->mask == AM_BOOL ? NULL : calloc((size_t)(B * Hq * L * S) + 1, sizeof(double));
        dense_mask(c, &m, masked, addv);
    }

    double scale = 1.0 / sqrt((double)E);
    ng_attention_args a = attn_args(c, t, &io, 0, lse, &m, m.p, scale);
    refout r = refout_new(c);
    reference(c, t, &io.q, &io.k, &io.v, &io.dout, masked, addv, scale, a.seed, a.offset, &r);

    ng_status st = fwd(&a, par);
    CHECK(st == NG_OK, "%s %s fwd status %s", c->name, ng_dtype_name(t), ng_status_str(st));
    if (fwd == ng_attention_fwd_decode) check_decode(c, t, &a, &io, &r, rs * (size_t)(B * Hq * L));
    st = ng_attention_bwd(&a, par);
    CHECK(st == NG_OK, "%s %s bwd status %s", c->name, ng_dtype_name(t), ng_status_str(st));

    int bad = compare_all(c, t, &io, lse, &r);
    CHECK(bad == 0, "%s %s [%s]: %d mismatches", c->name, ng_dtype_name(t),
          ng_cpu_isa_name(ng_cpu_isa_active()), bad);

    atensor *all[8] = {&io.q, &io.k, &io.v, &io.dout, &io.o, &io.dq, &io.dk, &io.dv};
    for (int x = 0; x < 8; x++) free(all[x]->h);
    free(lse);
    free(masked);
    free(addv);
    amask_free(&m);
    refout_free(&r);
}

/* clang-format off */
static const acase g_cases[] = {
    /* name, B, Hq, Hkv, L, S, E, Ev, lay, out_lay (unused), mask, mshape, full rows, causal,
     * clamp, softcap, dropout, mag, mask_f32, special, offset, tail */
    {"plain",          2, 2, 2, 33,  47,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"L1",             1, 3, 3, 1,   5,   8,   8,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    /* L <= 16 against fewer keys than a tile: the forward's decode path */
    {"short_S_gqa_cau",2, 8, 2, 12,  24,  32,  32,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"short_S_guards", 1, 4, 4, 3,   17,  40,  24,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 3.0, 2.0, 0.3, 4, 0, SP_NONE, 42, 0},
    /* 17-20 rows also take it, 21 the tiled path */
    {"L17_gqa_causal", 1, 8, 2, 17,  300, 32,  32,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  1, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"L21_gqa_pad",    1, 8, 2, 21,  300, 32,  32,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"L7_S129_E40",    1, 2, 2, 7,   129, 40,  40,  LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"L129_E80",       1, 1, 1, 129, 70,  80,  80,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"E256",           1, 1, 1, 65,  66,  256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"Ev_ne_E",        1, 2, 1, 20,  30,  24,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"gqa",            2, 4, 2, 70,  65,  32,  32,  LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"causal",         1, 2, 2, 129, 129, 16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"causal_L_lt_S",  1, 2, 1, 7,   100, 16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"causal_L_gt_S",  1, 1, 1, 100, 7,   16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"bool",           2, 2, 2, 40,  70,  16,  16,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"bool_full_rows", 1, 2, 2, 23,  80,  8,   8,   LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"add_neginf",     2, 2, 1, 23,  31,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"add_lowest",     1, 2, 2, 23,  31,  16,  16,  LAY_BSHD, LAY_BHSD, AM_LOWEST,  MS_LS,   1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"pad_mask",       2, 2, 2, 9,   77,  16,  16,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"bool_causal",    1, 2, 2, 30,  30,  16,  16,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"clamp",          1, 2, 2, 20,  33,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 2.5, 0,   0,   4, 0, SP_NONE, 42, 0},
    {"softcap",        1, 2, 2, 20,  33,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   3.0, 0,   4, 0, SP_NONE, 42, 0},
    {"clamp_softcap",  1, 2, 1, 20,  33,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 1, 3.0, 2.0, 0,   4, 0, SP_NONE, 42, 0},
    {"dropout",        1, 2, 2, 37,  70,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1, 0, SP_NONE, 42, 0},
    {"dropout_mask",   1, 2, 1, 20,  20,  8,   8,   LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 1, 0,   0,   0.5, 1, 0, SP_NONE, 42, 0},
    {"empty_S",        1, 2, 2, 5,   0,   8,   8,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    /* >= 64 forward tasks: several query blocks share each K/V tile (nsub 2 and 4) */
    {"many_heads",     4, 8, 4, 300, 70,  8,   8,   LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"many_causal",    4, 8, 8, 260, 260, 8,   8,   LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"nsub2_drop",     2, 8, 8, 400, 40,  8,   8,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.2, 1, 0, SP_NONE, 42, 0},
    /* an additive padding mask (one value per key for every query) on the tiled path, in the
     * input's dtype and in fp32 */
    {"pad_add_tiled",  2, 2, 1, 70,  90,  32,  32,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"pad_add_f32",    1, 2, 2, 40,  70,  16,  16,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  0, 1, 0,   0,   0,   1, 1, SP_NONE, 42, 0},
    /* 64 heads x 9 query blocks: 8 blocks share each K / V tile on AMX (bf16), then 1 */
    {"nsub8_pad",      1, 64, 8, 520, 40, 32,  32,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    /* head dims of a whole number of AMX tiles (bf16 there), several key tiles, Ev != E */
    {"E128_gqa_pad",   1, 4, 2, 150, 200, 128, 64,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"E64_causal_drop",1, 2, 2, 130, 130, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   2.0, 0.1, 2, 0, SP_NONE, 42, 0},
    /* the forward's lazy running max: a key tile whose max moves by about its margin in some
     * query lanes and not in others, one far beyond exp's range, then tiles where it holds */
    {"rising_max",     1, 2, 2, 70,  200, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   2, 0, SP_RISING, 42, 0},
    {"rising_max_pad", 2, 4, 2, 40,  230, 16,  16,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 1, 0,   0,   0,   2, 0, SP_RISING, 42, 0},
};
/* clang-format on */

/* The decode path (ng_attention_fwd_decode, which ng_attention_fwd takes for
 * L <= 20 and S >= 1): short query blocks, GQA / MQA groups sharing each
 * K / V read, key ranges split across tasks (nsplit > 1 from about 512 keys
 * when there are few (batch, kv head) pairs), splits that see only masked
 * keys, E not a multiple of 8 (K converted, not read in place). Each case
 * also checks runner independence and that the backward, fed this forward's
 * out and lse, matches the reference. */
/* clang-format off */
static const acase g_dec_cases[] = {
    /* name, B, Hq, Hkv, L, S, E, Ev, lay, out_lay (unused), mask, mshape, full rows, causal,
     * clamp, softcap, dropout, mag, mask_f32, special, offset, tail */
    {"dec_S1",              1, 4,  2, 1,  1,    16,  16,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_S2_L3",           2, 2,  1, 3,  2,    8,   8,   LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L1_gqa_pad",      2, 8,  2, 1,  2048, 128, 128, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L1_mha_tail",     2, 3,  3, 1,  777,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 400},
    {"dec_L3_mqa_E36_Ev20", 1, 6,  1, 3,  3001, 36,  20,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_FULL, 1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L16_gqa_ls",      1, 8,  2, 16, 1500, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L16_grp8",        1, 16, 2, 16, 300,  32,  32,  LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L5_causal",       1, 4,  2, 5,  900,  32,  32,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L2_guards_drop",  1, 4,  2, 2,  1100, 32,  48,  LAY_BSHD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 3.0, 2.0, 0.3, 4, 0, SP_NONE, 42, 0},
    {"dec_L7_bshd_E128",    2, 4,  4, 7,  129,  128, 128, LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L4_split_tail",   1, 2,  1, 4,  3000, 64,  64,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 1000},
    {"dec_L9_drop_causal",  1, 4,  1, 9,  40,   16,  16,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 1, 0,   0,   0.5, 1, 0, SP_NONE, 42, 0},
    {"dec_L20_gqa_pad",     2, 8,  2, 20, 700,  64,  64,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L1_E256",         1, 2,  1, 1,  600,  256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
    {"dec_L12_E8_Ev24",     3, 4,  4, 12, 70,   8,   24,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_LS,   1, 0, 0,   0,   0,   1, 0, SP_NONE, 42, 0},
};
/* clang-format on */

/* Arguments for contiguous [B, heads, seq, dim] q, k, v and out (k and v
 * of Hkv heads), no mask, everything else off. */
static ng_attention_args bhsd_args(ng_dtype t, int64_t B, int64_t Hq, int64_t Hkv, int64_t L,
                                   int64_t S, int64_t E, int64_t Ev, const void *q, const void *k,
                                   const void *v, void *o, void *lse, double scale) {
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.B = B;
    a.Hq = Hq;
    a.Hkv = Hkv;
    a.L = L;
    a.S = S;
    a.E = E;
    a.Ev = Ev;
    const int64_t sq[3] = {Hq * L * E, L * E, E}, sk[3] = {Hkv * S * E, S * E, E};
    const int64_t sv[3] = {Hkv * S * Ev, S * Ev, Ev}, so[3] = {Hq * L * Ev, L * Ev, Ev};
    a.q = q;
    memcpy(a.q_stride, sq, sizeof sq);
    a.k = k;
    memcpy(a.k_stride, sk, sizeof sk);
    a.v = v;
    memcpy(a.v_stride, sv, sizeof sv);
    a.out = o;
    memcpy(a.out_stride, so, sizeof so);
    a.lse = lse;
    a.scale = scale;
    return a;
}

/* NaN on the decode path, with GQA heads sharing K / V and the keys split
 * four ways: a NaN in one query row reaches that row only; a NaN key that a
 * row attends makes the row NaN, whichever split it falls in; a NaN key
 * that every row masks changes nothing; a NaN value at an attended key
 * reaches every row. */
static void test_decode_nan(void) {
    enum { Hq = 4, L = 2, S = 1200, E = 16 };
    static float q[Hq * L * E], k[S * E], v[S * E], o[Hq * L * E], lse[Hq * L];
    static uint8_t mask[S];
    g_rng.s = 11;
    for (int x = 0; x < Hq * L * E; x++) q[x] = (float)urand();
    for (int x = 0; x < S * E; x++) k[x] = (float)urand();
    for (int x = 0; x < S * E; x++) v[x] = (float)urand();
    for (int j = 0; j < S; j++) mask[j] = j != 1180;
    ng_attention_args a = bhsd_args(NG_F32, 1, Hq, 1, L, S, E, E, q, k, v, o, lse, 0.25);
    /* count rows whose output is all NaN / all finite */
#define ROWS_NAN(nan_rows, fin_rows)                                                               \
    do {                                                                                           \
        nan_rows = fin_rows = 0;                                                                   \
        for (int r_ = 0; r_ < Hq * L; r_++) {                                                      \
            int n_ = 0, f_ = 0;                                                                    \
            for (int d_ = 0; d_ < E; d_++)                                                         \
                n_ += isnan(o[r_ * E + d_]), f_ += isfinite(o[r_ * E + d_]);                       \
            nan_rows += n_ == E;                                                                   \
            fin_rows += f_ == E;                                                                   \
        }                                                                                          \
    } while (0)
    int nr, fr;
    q[(1 * L + 0) * E + 5] = NAN; /* head 1, row 0 */
    CHECK(ng_attention_fwd_decode(&a, chunky_par) == NG_OK, "decode nan fwd");
    ROWS_NAN(nr, fr);
    CHECK(nr == 1 && fr == Hq * L - 1 && isnan(o[(1 * L + 0) * E]) && isnan(lse[1 * L]),
          "decode: NaN in one q row reaches that row only (%d NaN rows, %d finite)", nr, fr);
    q[(1 * L + 0) * E + 5] = 0.5f;
    k[1180 * E + 3] = NAN; /* key 1180, in the last split */
    CHECK(ng_attention_fwd_decode(&a, chunky_par) == NG_OK, "decode nan fwd");
    ROWS_NAN(nr, fr);
    CHECK(nr == Hq * L, "decode: a NaN key every row attends reaches every row (%d of %d)", nr,
          Hq * L);
    a.mask = mask;
    a.mask_kind = NG_MASK_BOOL;
    a.mask_stride[3] = 1; /* [1, 1, 1, S]: key 1180 masked */
    CHECK(ng_attention_fwd_decode(&a, chunky_par) == NG_OK, "decode nan fwd");
    ROWS_NAN(nr, fr);
    CHECK(fr == Hq * L, "decode: a NaN key every row masks changes nothing (%d of %d finite)", fr,
          Hq * L);
    k[1180 * E + 3] = 0.5f;
    v[5 * E + 2] = NAN;
    CHECK(ng_attention_fwd_decode(&a, chunky_par) == NG_OK, "decode nan fwd");
    int col = 0;
    for (int r = 0; r < Hq * L; r++) col += isnan(o[r * E + 2]);
    CHECK(col == Hq * L, "decode: a NaN value at an attended key reaches every row (%d of %d)", col,
          Hq * L);
    v[5 * E + 2] = 0.5f;
#undef ROWS_NAN
}

/* A query row's decode result does not depend on how many rows share its
 * kv head: 7 heads of one group (the kernels' 4-, 2- and 1-row blocks)
 * give each head's bits from a decode of that head alone (1-row blocks),
 * for every KV element type. E 40 and Ev 24 leave tails after the vector
 * blocks, E 64 and Ev 48 none; 301 keys leave a tail after the 4-key
 * blocks; one split either way. With mild scores each lse sums hundreds of
 * comparable terms, which can round away a last-bit difference in a score;
 * sharp ones (a large scale) let the row's largest scores decide its lse,
 * so that the dots' bits are compared more closely. */
static void test_decode_group_rows(void) {
    enum { Hq = 7, S = 301 };
    const ng_dtype types[3] = {NG_F32, NG_BF16, NG_F16};
    const int64_t dims[2][2] = {{40, 24}, {64, 48}};
    for (int ci = 0; ci < 12; ci++) {
        const ng_dtype t = types[ci % 3];
        const int64_t E = dims[ci / 3 % 2][0], Ev = dims[ci / 3 % 2][1];
        const int sharp = ci >= 6;
        const size_t es = ng_dtype_size(t);
        char *q = malloc(Hq * E * es), *k = malloc(S * E * es), *v = malloc(S * Ev * es);
        char *o = malloc(Hq * Ev * es), *o1 = malloc(Ev * es);
        float lse[Hq], lse1;
        g_rng.s = 5 + ci;
        for (int x = 0; x < Hq * E; x++) ng_store_f64(q, t, x, 2 * urand() - sharp);
        for (int x = 0; x < S * E; x++) ng_store_f64(k, t, x, 2 * urand() - sharp);
        for (int x = 0; x < S * Ev; x++) ng_store_f64(v, t, x, urand());
        ng_attention_args a = bhsd_args(t, 1, Hq, 1, 1, S, E, Ev, q, k, v, o, lse,
                                        sharp ? 16.0 : 1.0 / sqrt((double)E));
        CHECK(ng_attention_fwd_decode(&a, NULL) == NG_OK, "decode group rows %s", ng_dtype_name(t));
        int differ = 0;
        for (int h = 0; h < Hq; h++) {
            ng_attention_args one = a;
            one.Hq = 1;
            one.q = q + (size_t)h * E * es;
            one.out = o1;
            one.lse = &lse1;
            CHECK(ng_attention_fwd_decode(&one, NULL) == NG_OK, "decode one row %s",
                  ng_dtype_name(t));
            differ += memcmp(o1, o + (size_t)h * Ev * es, Ev * es) != 0 || lse1 != lse[h];
        }
        CHECK(differ == 0,
              "decode %s E %ld Ev %ld%s [%s]: %d of %d heads differ alone from in their group",
              ng_dtype_name(t), (long)E, (long)Ev, sharp ? " sharp" : "",
              ng_cpu_isa_name(ng_cpu_isa_active()), differ, Hq);
        free(q), free(k), free(v), free(o), free(o1);
    }
}

/* ng_attention_fwd takes the decode path for L <= NG_ATTN_CPU_DEC_MAX_L
 * against any S >= 1: its output and lse are ng_attention_fwd_decode's bits
 * (the tiled path sums in another order). Fewer keys than a tile, 17-20
 * rows, and the bound itself. */
static void test_decode_routing(void) {
    const int64_t shapes[][2] = {{1, 5}, {12, 24}, {17, 300}, {NG_ATTN_CPU_DEC_MAX_L, 300}};
    enum { Hq = 4, Hkv = 2, E = 32, Lmax = NG_ATTN_CPU_DEC_MAX_L, Smax = 300 };
    float *q = malloc(sizeof(float) * Hq * Lmax * E), *k = malloc(sizeof(float) * Hkv * Smax * E);
    float *v = malloc(sizeof(float) * Hkv * Smax * E), *o = malloc(sizeof(float) * Hq * Lmax * E);
    float *o1 = malloc(sizeof(float) * Hq * Lmax * E), lse[Hq * Lmax], lse1[Hq * Lmax];
    g_rng.s = 31;
    for (int x = 0; x < Hq * Lmax * E; x++) q[x] = (float)(2 * urand());
    for (int x = 0; x < Hkv * Smax * E; x++) k[x] = (float)(2 * urand()), v[x] = (float)urand();
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t L = shapes[si][0], S = shapes[si][1];
        ng_attention_args a = bhsd_args(NG_F32, 1, Hq, Hkv, L, S, E, E, q, k, v, o, lse, 0.2);
        ng_attention_args d = a;
        d.out = o1;
        d.lse = lse1;
        CHECK(ng_attention_fwd(&a, NULL) == NG_OK && ng_attention_fwd_decode(&d, NULL) == NG_OK,
              "routing L %ld S %ld", (long)L, (long)S);
        CHECK(memcmp(o, o1, sizeof(float) * (size_t)(Hq * L * E)) == 0 &&
                  memcmp(lse, lse1, sizeof(float) * (size_t)(Hq * L)) == 0,
              "L %ld against S %ld: ng_attention_fwd does not give the decode path's bits", (long)L,
              (long)S);
    }
    free(q), free(k), free(v), free(o), free(o1);
}

/* fp16 inputs whose q.k exceeds 65504: the output stays finite and matches. */
static void test_fp16_overflow(void) {
    acase c = {"fp16_overflow", 1, 1, 1, 8, 16, 64,  64, LAY_BHSD, LAY_BHSD, AM_NONE,
               MS_FULL,         0, 0, 0, 0, 0,  200, 0,  SP_NONE,  42,       0};
    ng_dtype t = NG_F16;
    g_rng.s = 77;
    atensor q = at_new(t, 1, 1, 8, 64, LAY_BHSD), k = at_new(t, 1, 1, 16, 64, LAY_BHSD),
            v = at_new(t, 1, 1, 16, 64, LAY_BHSD), o = at_new(t, 1, 1, 8, 64, LAY_BHSD);
    for (int64_t x = 0; x < q.span; x++) ng_store_f64(q.h, t, x, 150.0 + 50.0 * urand());
    for (int64_t x = 0; x < k.span; x++) ng_store_f64(k.h, t, x, 150.0 + 50.0 * urand());
    fill(&v, t, 1.0);
    float lse[8];
    ng_attention_args a = bhsd_args(t, 1, 1, 1, 8, 16, 64, 64, q.h, k.h, v.h, o.h, lse, 0.125);
    CHECK(ng_attention_fwd(&a, NULL) == NG_OK, "fp16 overflow fwd");
    refout r = refout_new(&c);
    atensor dummy = at_new(t, 1, 1, 8, 64, LAY_BHSD);
    reference(&c, t, &q, &k, &v, &dummy, NULL, NULL, 0.125, 0, 0, &r);
    double dot = 0;
    for (int e = 0; e < 64; e++) dot += get(&q, t, 0, 0, 0, e) * get(&k, t, 0, 0, 0, e);
    CHECK(dot > 65504.0, "the case overflows fp16 (q.k = %g)", dot);
    int finite = 1;
    for (int64_t x = 0; x < o.span; x++) finite &= isfinite(ng_load_f64(o.h, t, x));
    CHECK(finite, "fp16 overflow case: output finite");
    CHECK(compare("out", &c, t, &o, r.out, 1, 8, 64, tol_for(t, 0)) == 0,
          "fp16 overflow case matches fp64");
    free(q.h);
    free(k.h);
    free(v.h);
    free(o.h);
    free(dummy.h);
    refout_free(&r);
}

/* NaN in an input reaches the outputs it affects; nothing is hidden. */
static void test_nan_propagates(void) {
    const int64_t L = 6, S = 9, E = 8;
    float q[6 * 8], k[9 * 8], v[9 * 8], o[6 * 8], lse[6];
    g_rng.s = 5;
    for (int x = 0; x < L * E; x++) q[x] = (float)urand();
    for (int x = 0; x < S * E; x++) k[x] = (float)urand();
    for (int x = 0; x < S * E; x++) v[x] = (float)urand();
    q[2 * E + 3] = NAN; /* row 2 of q */
    ng_attention_args a = bhsd_args(NG_F32, 1, 1, 1, L, S, E, E, q, k, v, o, lse, 0.3);
    a.max_score = 5.0; /* the clamp must not swallow the NaN */
    CHECK(ng_attention_fwd(&a, NULL) == NG_OK, "nan fwd");
    int row2 = 1, others = 1;
    for (int64_t i = 0; i < L; i++)
        for (int64_t d = 0; d < E; d++) {
            if (i == 2)
                row2 &= isnan(o[i * E + d]);
            else
                others &= isfinite(o[i * E + d]);
        }
    CHECK(row2 && others, "NaN in q row 2 gives NaN in out row 2 only");
    q[2 * E + 3] = 0.5f;
    k[4 * E] = INFINITY; /* every row sees key 4 */
    a.max_score = 0;
    CHECK(ng_attention_fwd(&a, NULL) == NG_OK, "inf fwd");
    int all = 1;
    for (int64_t x = 0; x < L * E; x++) all &= !isfinite(o[x]);
    CHECK(all, "Inf in k reaches every output row as non-finite");
}

/* NaN on the tiled forward (fp32, or bf16 on each of its paths, AMX's
 * included) in a key tile after the first, where the lazy running max
 * takes one pass over the scores: a NaN score (key 150, seen
 * by every row) makes every output row and logsumexp NaN; a NaN value at
 * key 150 makes that dim of every output row NaN; a NaN in query row 30
 * only that row. */
static void test_nan_late_tile(ng_dtype t) {
    enum { L = 40, S = 200, E = 16 };
    static float q[L * E], k[S * E], v[S * E], o[L * E], lse[L]; /* room for either dtype */
    g_rng.s = 11;
    for (int x = 0; x < L * E; x++) ng_store_f64(q, t, x, 2 * urand() - 1);
    for (int x = 0; x < S * E; x++) ng_store_f64(k, t, x, 2 * urand() - 1);
    for (int x = 0; x < S * E; x++) ng_store_f64(v, t, x, 2 * urand() - 1);
    ng_attention_args a = bhsd_args(t, 1, 1, 1, L, S, E, E, q, k, v, o, lse, 0.25);
    for (int what = 0; what < 3; what++) {
        void *buf = what == 0 ? (void *)k : what == 1 ? (void *)v : (void *)q;
        const int64_t at = what == 0 ? 150 * E + 5 : what == 1 ? 150 * E + 2 : 30 * E + 7;
        const double keep = ng_load_f64(buf, t, at);
        ng_store_f64(buf, t, at, NAN);
        CHECK(ng_attention_fwd(&a, NULL) == NG_OK, "late NaN %d fwd", what);
        int ok = 1;
        for (int64_t i = 0; i < L; i++) {
            const int hit = what < 2 || i == 30;
            for (int64_t d = 0; d < E; d++) {
                const int nan = hit && (what != 1 || d == 2); /* a value reaches its own dim */
                const double x = ng_load_f64(o, t, i * E + d);
                ok &= nan ? isnan(x) : isfinite(x);
            }
            ok &= what == 1 ? isfinite(lse[i]) : hit ? isnan(lse[i]) : isfinite(lse[i]);
        }
        CHECK(ok,
              "late NaN %d in %s (0: key 150, 1: value 150, 2: q row 30) reaches the rows it must",
              what, ng_dtype_name(t));
        ng_store_f64(buf, t, at, keep);
    }
}

static void test_bad_args(void) {
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F32;
    a.B = 1;
    a.Hq = 3;
    a.Hkv = 2;
    a.L = 1;
    a.S = 1;
    a.E = 8;
    a.Ev = 8;
    a.scale = 1;
    CHECK(ng_attention_fwd(&a, NULL) == NG_ERR_INVALID_ARG, "Hq %% Hkv != 0 rejected");
    a.Hkv = 3;
    a.E = 300;
    CHECK(ng_attention_fwd(&a, NULL) == NG_ERR_INVALID_ARG, "E > 256 rejected");
    a.E = 8;
    CHECK(ng_attention_fwd(&a, NULL) == NG_ERR_INVALID_ARG, "NULL pointers rejected");
    a.dtype = (ng_dtype)9;
    CHECK(ng_attention_fwd(&a, NULL) == NG_ERR_DTYPE, "bad dtype rejected");
    a.dtype = NG_F32;
    a.dropout_p = 1.0;
    CHECK(ng_attention_check(&a, 0) == NG_ERR_INVALID_ARG, "dropout_p = 1 rejected");
    CHECK(ng_attention_check(NULL, 0) == NG_ERR_INVALID_ARG, "NULL args rejected");
    /* scalars fp32 scores cannot take: a scale or soft-cap past FLT_MAX (inf
     * there), a clamp or soft-cap that rounds to 0 (off); fp64 scores take
     * them. B = 0: nothing else is checked. */
    a.dropout_p = 0.0;
    a.B = 0;
    CHECK(ng_attention_check(&a, 0) == NG_OK, "B = 0 with good scalars accepted");
    const struct {
        double scale, max_score, softcap;
        const char *what;
    } bad[] = {{-1e39, 0.0, 0.0, "scale past FLT_MAX"},
               {1.0, 0.0, 1e39, "softcap past FLT_MAX"},
               {1.0, 0x1p-150, 0.0, "max_score that fp32 rounds to 0"},
               {1.0, 0.0, 0x1p-150, "softcap that fp32 rounds to 0"}};
    for (int i = 0; i < 4; i++) {
        a.scale = bad[i].scale, a.max_score = bad[i].max_score, a.softcap = bad[i].softcap;
        const ng_dtype dts[4] = {NG_F32, NG_F16, NG_BF16, NG_F64};
        for (int d = 0; d < 4; d++) {
            a.dtype = dts[d];
            CHECK(ng_attention_check(&a, d % 2) == (dts[d] == NG_F64 ? NG_OK : NG_ERR_INVALID_ARG),
                  "%s, %s", bad[i].what, ng_dtype_name(dts[d]));
        }
    }
    a.dtype = NG_F32, a.scale = 1.0, a.softcap = 0.0,
    a.max_score = 0x1p-149; /* the smallest: kept */
    CHECK(ng_attention_check(&a, 0) == NG_OK, "max_score 2^-149 accepted");
}

/* ---- tensor-core fragments (kernels/attention_mma.h) ----------------------
 * The CUDA kernels' fragment loads run here on plain memory, one call per
 * lane, and are checked against the PTX ISA's fragment tables for
 * mma.m16n8k16 (written out below, independently of the loads). An emulated
 * warp-wide mma built on the same tables then multiplies tiles the way the
 * kernels do (S = Q K^T over k-steps, P V through ng_mma_c_to_a). Values are
 * small integers, exact in fp16 and in fp32 sums, so every check is exact. */

static void spec_a(int lane, int i, int *row, int *col) { /* a0..a7 */
    int g = lane >> 2, t = lane & 3;
    *row = g + (((i >= 2 && i < 4) || i >= 6) ? 8 : 0);
    *col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
}

static void spec_b(int lane, int i, int *row, int *col) { /* b0..b3 */
    int g = lane >> 2, t = lane & 3;
    *row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
    *col = g;
}

static void spec_c(int lane, int i, int *row, int *col) { /* c0..c3 */
    int g = lane >> 2, t = lane & 3;
    *row = g + (i >= 2 ? 8 : 0);
    *col = 2 * t + (i & 1);
}

/* Element i of a fragment: register i / 2, the low half first. */
static uint16_t frag_elem(const uint32_t *regs, int i) {
    return (uint16_t)(regs[i / 2] >> (16 * (i & 1)));
}

/* The 16x16 A matrix the warp's registers describe; every element must be
 * held by exactly one (lane, i). */
static int gather_a(double m[16][16], uint32_t a[32][4]) {
    int seen[16][16] = {{0}}, ok = 1;
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 8; i++) {
            int r, c;
            spec_a(lane, i, &r, &c);
            m[r][c] = ng_f16_to_f32(frag_elem(a[lane], i));
            seen[r][c]++;
        }
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) ok &= seen[r][c] == 1;
    return ok;
}

static int gather_b(double m[16][8], uint32_t b[32][2]) {
    int seen[16][8] = {{0}}, ok = 1;
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            int r, c;
            spec_b(lane, i, &r, &c);
            m[r][c] = ng_f16_to_f32(frag_elem(b[lane], i));
            seen[r][c]++;
        }
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 8; c++) ok &= seen[r][c] == 1;
    return ok;
}

/* Emulated mma.m16n8k16 with fp32 accumulators: c[lane] += (A B)[spec_c]. */
static void emulate_mma(float c[32][4], uint32_t a[32][4], uint32_t b[32][2]) {
    double A[16][16], B[16][8];
    CHECK(gather_a(A, a), "A fragment covers the 16x16 block once");
    CHECK(gather_b(B, b), "B fragment covers the 16x8 block once");
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            int r, col;
            spec_c(lane, i, &r, &col);
            double acc = 0.0;
            for (int k = 0; k < 16; k++) acc += A[r][k] * B[k][col];
            c[lane][i] += (float)acc;
        }
}

enum { MMA_D = 64, MMA_LD = MMA_D + 8, MMA_ROWS = 64 };

/* Tile element (r, c) = a small signed integer unique per position mod 31. */
static void fill_tile(uint16_t *tile, int salt) {
    for (int r = 0; r < MMA_ROWS; r++)
        for (int c = 0; c < MMA_LD; c++)
            tile[r * MMA_LD + c] = ng_f32_to_f16((float)((r * 7 + c * 3 + salt) % 31 - 15));
}

static double tile_at(const uint16_t *tile, int r, int c) {
    return ng_f16_to_f32(tile[r * MMA_LD + c]);
}

static void test_mma_fragments(void) {
    static uint16_t x[MMA_ROWS * MMA_LD], y[MMA_ROWS * MMA_LD];
    fill_tile(x, 1);
    fill_tile(y, 5);

    /* loads against the tables, at offsets that are not 0 */
    uint32_t a[32][4], b[32][2];
    double A[16][16], B[16][8];
    int bad = 0;
    for (int lane = 0; lane < 32; lane++) ng_mma_frag_a(a[lane], x, MMA_LD, 16, 32, lane);
    CHECK(gather_a(A, a), "frag_a covers the block once");
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) bad += A[r][c] != tile_at(x, 16 + r, 32 + c);
    CHECK(bad == 0, "frag_a(r0=16, k0=32): %d elements differ from tile[16+r][32+c]", bad);

    bad = 0;
    for (int lane = 0; lane < 32; lane++) ng_mma_frag_b_rows(b[lane], y, MMA_LD, 24, 16, lane);
    CHECK(gather_b(B, b), "frag_b_rows covers the block once");
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++) bad += B[k][n] != tile_at(y, 24 + n, 16 + k);
    CHECK(bad == 0, "frag_b_rows(n0=24, k0=16): %d elements differ from tile[24+n][16+k]", bad);

    bad = 0;
    for (int lane = 0; lane < 32; lane++) ng_mma_frag_b_cols(b[lane], y, MMA_LD, 32, 40, lane);
    CHECK(gather_b(B, b), "frag_b_cols covers the block once");
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++) bad += B[k][n] != tile_at(y, 32 + k, 40 + n);
    CHECK(bad == 0, "frag_b_cols(k0=32, n0=40): %d elements differ from tile[32+k][40+n]", bad);

    /* C fragments of two 8-column halves -> A fragment of the 16x16 block */
    bad = 0;
    for (int lane = 0; lane < 32; lane++) {
        uint32_t half[2][2];
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 2; p++) {
                int r0, c0, r1, c1;
                spec_c(lane, 2 * p, &r0, &c0);
                spec_c(lane, 2 * p + 1, &r1, &c1);
                half[h][p] = ng_mma_pack(x[r0 * MMA_LD + 8 * h + c0], x[r1 * MMA_LD + 8 * h + c1]);
            }
        ng_mma_c_to_a(a[lane], half[0], half[1]);
    }
    CHECK(gather_a(A, a), "c_to_a covers the block once");
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) bad += A[r][c] != tile_at(x, r, c);
    CHECK(bad == 0, "c_to_a: %d elements differ from the accumulator block", bad);

    /* S = X[16:32] Y^T over 64 rows of y and D = 64 columns, as mma_xyt does,
     * then O = S' Y with S' = S mod 7 - 3 (small again) as mma_wy does. */
    float s[8][32][4] = {{{0}}}, o[MMA_D / 8][32][4] = {{{0}}};
    for (int k0 = 0; k0 < MMA_D; k0 += 16) {
        for (int lane = 0; lane < 32; lane++) ng_mma_frag_a(a[lane], x, MMA_LD, 16, k0, lane);
        for (int nt = 0; nt < 8; nt++) {
            for (int lane = 0; lane < 32; lane++)
                ng_mma_frag_b_rows(b[lane], y, MMA_LD, nt * 8, k0, lane);
            emulate_mma(s[nt], a, b);
        }
    }
    bad = 0;
    for (int nt = 0; nt < 8; nt++)
        for (int lane = 0; lane < 32; lane++)
            for (int i = 0; i < 4; i++) {
                int r, c;
                spec_c(lane, i, &r, &c);
                double want = 0.0;
                for (int d = 0; d < MMA_D; d++)
                    want += tile_at(x, 16 + r, d) * tile_at(y, nt * 8 + c, d);
                bad += s[nt][lane][i] != (float)want;
                s[nt][lane][i] = (float)(((int)s[nt][lane][i] % 7 + 7) % 7 - 3);
            }
    CHECK(bad == 0, "X Y^T through fragments: %d of 4096 scores differ", bad);
    for (int kt = 0; kt < 4; kt++) {
        for (int lane = 0; lane < 32; lane++) {
            const float *lo = s[2 * kt][lane], *hi = s[2 * kt + 1][lane];
            uint32_t l2[2] = {ng_mma_pack(ng_f32_to_f16(lo[0]), ng_f32_to_f16(lo[1])),
                              ng_mma_pack(ng_f32_to_f16(lo[2]), ng_f32_to_f16(lo[3]))};
            uint32_t h2[2] = {ng_mma_pack(ng_f32_to_f16(hi[0]), ng_f32_to_f16(hi[1])),
                              ng_mma_pack(ng_f32_to_f16(hi[2]), ng_f32_to_f16(hi[3]))};
            ng_mma_c_to_a(a[lane], l2, h2);
        }
        for (int dt = 0; dt < MMA_D / 8; dt++) {
            for (int lane = 0; lane < 32; lane++)
                ng_mma_frag_b_cols(b[lane], y, MMA_LD, kt * 16, dt * 8, lane);
            emulate_mma(o[dt], a, b);
        }
    }
    /* the reference reads S' back by position through the C table */
    static double sp[16][64];
    for (int nt = 0; nt < 8; nt++)
        for (int lane = 0; lane < 32; lane++)
            for (int i = 0; i < 4; i++) {
                int r, c;
                spec_c(lane, i, &r, &c);
                sp[r][nt * 8 + c] = s[nt][lane][i];
            }
    bad = 0;
    for (int dt = 0; dt < MMA_D / 8; dt++)
        for (int lane = 0; lane < 32; lane++)
            for (int i = 0; i < 4; i++) {
                int r, c;
                spec_c(lane, i, &r, &c);
                double want = 0.0;
                for (int j = 0; j < 64; j++) want += sp[r][j] * tile_at(y, j, dt * 8 + c);
                bad += o[dt][lane][i] != (float)want;
            }
    CHECK(bad == 0, "P Y through c_to_a and frag_b_cols: %d of 1024 outputs differ", bad);
}

/* fp16 dS scaling: smallest e >= 0 with max_abs * 2^-e < 2^15. */
static void test_mma_ds_exponent(void) {
    CHECK(ng_mma_ds_exponent(0.0f) == 0, "0");
    CHECK(ng_mma_ds_exponent(32767.0f) == 0, "32767 fits");
    CHECK(ng_mma_ds_exponent(32768.0f) == 1, "2^15 needs one halving");
    CHECK(ng_mma_ds_exponent(65504.0f) == 1, "fp16 max");
    CHECK(ng_mma_ds_exponent(65536.0f) == 2, "2^16");
    CHECK(ng_mma_ds_exponent(INFINITY) == 0, "inf propagates unscaled");
    CHECK(ng_mma_ds_exponent(NAN) == 0, "NaN propagates unscaled");
    CHECK(ng_mma_ds_exponent(FLT_MAX) == 128 - 15, "FLT_MAX");
    int bad = 0;
    for (int k = 0; k < 4000; k++) {
        float x = (float)exp(urand() * 88.0);
        int e = ng_mma_ds_exponent(x);
        float scaled = ldexpf(x, -e);
        bad += !(scaled < 32768.0f) || (e > 0 && !(ldexpf(x, 1 - e) >= 32768.0f));
        /* what the kernel sends to fp16 stays finite */
        bad += isinf(ng_f16_to_f32(ng_f32_to_f16(scaled)));
    }
    CHECK(bad == 0, "%d exponents not minimal or overflowing fp16", bad);
}

int main(void) {
    test_philox();
    test_math();
    test_bad_args();
    test_mma_fragments();
    test_mma_ds_exponent();
    const ng_dtype dtypes[4] = {NG_F64, NG_F32, NG_F16, NG_BF16};
    int paths = 0;
    NG_FOR_EACH_ISA(isa) {
        paths++;
        int before = ng_test_failures;
        for (size_t ci = 0; ci < sizeof g_cases / sizeof g_cases[0]; ci++)
            for (int di = 0; di < 4; di++)
                run_case(&g_cases[ci], dtypes[di], (ci % 2) ? chunky_par : NULL, ng_attention_fwd);
        for (size_t ci = 0; ci < sizeof g_dec_cases / sizeof g_dec_cases[0]; ci++)
            for (int di = 0; di < 4; di++)
                run_case(&g_dec_cases[ci], dtypes[di], (ci % 2) ? chunky_par : NULL,
                         ng_attention_fwd_decode);
        test_decode_nan();
        test_decode_group_rows();
        test_decode_routing();
        test_fp16_overflow();
        test_nan_propagates();
        test_nan_late_tile(NG_F32);
        test_nan_late_tile(NG_BF16);
        printf("path %s: %s\n", ng_cpu_isa_name((ng_cpu_isa)isa),
               ng_test_failures == before ? "ok" : "FAILED");
    }
    /* bf16 on AVX-512 every other way this CPU has (the loop above ran its
     * default): scores and P V on AMX tiles, scores by vdpbf16ps, or
     * widened to fp32 */
    if (ng_cpu_isa_set(NG_ISA_AVX512) == NG_OK) {
        const int amx0 = ng_cpu_amx(), dot0 = ng_cpu_bf16_dot();
        const int way0 = amx0 ? 0 : dot0 ? 1 : 2;
        static const char *const ways[3] = {"AMX tiles", "scores by vdpbf16ps", "widened"};
        for (int way = 0; way < 3; way++) {
            if (way == way0 || (way == 0 && !ng_cpu_amx_supported()) ||
                (way == 1 && !ng_cpu_bf16_dot_supported()))
                continue;
            int before = ng_test_failures;
            NG_EXPECT(ng_cpu_amx_set(way == 0) == NG_OK && ng_cpu_amx() == (way == 0));
            if (way > 0) NG_EXPECT(ng_cpu_bf16_dot_set(way == 1) == NG_OK);
            for (size_t ci = 0; ci < sizeof g_cases / sizeof g_cases[0]; ci++)
                run_case(&g_cases[ci], NG_BF16, (ci % 2) ? chunky_par : NULL, ng_attention_fwd);
            test_nan_propagates();
            test_nan_late_tile(NG_BF16);
            paths++;
            printf("path avx512, bf16 %s: %s\n", ways[way],
                   ng_test_failures == before ? "ok" : "FAILED");
        }
        ng_cpu_amx_set(amx0);
        if (ng_cpu_bf16_dot_supported()) ng_cpu_bf16_dot_set(dot0);
    }
    if (!ng_cpu_amx_supported())
        NG_EXPECT(ng_cpu_amx_set(1) == NG_ERR_UNSUPPORTED && !ng_cpu_amx());
    if (!ng_cpu_bf16_dot_supported())
        NG_EXPECT(ng_cpu_bf16_dot_set(1) == NG_ERR_UNSUPPORTED && !ng_cpu_bf16_dot());
    printf("test_attention: %d CPU paths, worst err/tol %.3f\n", paths, g_worst);
    return ng_test_finish("test_attention");
}
