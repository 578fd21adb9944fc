/*
 * tests/c/test_grad_guard.c - CPU gradient guard (reduce + apply) vs a plain
 * fp64 loop: 1, 100 and 500 tensors of mixed sizes with empty ones, tensors
 * spanning several blocks, norm under and over max_norm, norm 2 and inf,
 * fp32/fp16/bf16/fp64, one NaN, one Inf, several of each (exact counts,
 * first tensor index, gradients untouched bit for bit), values whose fp32
 * squares overflow or underflow, stats combined over two groups (the
 * distributed path), thread-count independence, bad arguments; every CPU
 * path the machine has.
 *
 * Tolerances (|d| <= atol + rtol*|ref|):
 *   norm: rtol 1e-12 for a power-of-two inv_scale (every square exact in
 *     fp64, only the summation order differs), 1e-6 otherwise (u is rounded
 *     to fp32 before squaring, as torch's unscale_ does).
 *   gradients, per dtype: one multiply by an fp32 coefficient and one
 *     rounding to the dtype: fp64 1e-12 (the clip coefficient inherits the
 *     norm's summation-order error, up to ~1e-13 over 1e6 terms); fp32 3e-7
 *     (two fp32 roundings; the norm's error is far below);
 *     bf16 2^-8 and fp16 2^-11 relative (one rounding), with an atol of half
 *     the smallest fp16 subnormal for fp16.
 */
#include <string.h>

#include "kernels/grad_guard.h"
#include "tests/c/ng_test.h"

typedef struct tol {
    double atol, rtol;
} tol;

static tol grad_tol(ng_dtype t) {
    switch (t) {
    case NG_F64: return (tol){0.0, 1e-12};
    case NG_F32: return (tol){0.0, 3e-7};
    case NG_BF16: return (tol){0.0, 4e-3};
    case NG_F16: return (tol){3e-8, 6e-4};
    }
    return (tol){0, 0};
}

static void reverse_chunks(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    if (grain < 1) grain = 1;
    int64_t nchunks = NG_CEIL_DIV(n, grain);
    for (int64_t c = nchunks - 1; c >= 0; c--) fn(c * grain, NG_MIN(n, (c + 1) * grain), ctx);
}

/* One element per call: the finest split a runner can make. */
static void one_by_one(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    (void)grain;
    for (int64_t i = 0; i < n; i++) fn(i, i + 1, ctx);
}

typedef struct gset {
    ng_dtype dt;
    int64_t n;
    int64_t *numels;
    void **bufs;
    double **vals; /* values as stored (after rounding to dt) */
} gset;

static gset make_set(ng_dtype dt, int64_t n, const int64_t *numels, double mag, ng_rng *rng) {
    gset g = {dt, n, malloc((size_t)(n ? n : 1) * sizeof(int64_t)),
              malloc((size_t)(n ? n : 1) * sizeof(void *)),
              malloc((size_t)(n ? n : 1) * sizeof(double *))};
    for (int64_t t = 0; t < n; t++) {
        int64_t m = numels[t];
        g.numels[t] = m;
        g.bufs[t] = malloc((size_t)(m ? m : 1) * ng_dtype_size(dt));
        g.vals[t] = malloc((size_t)(m ? m : 1) * sizeof(double));
        for (int64_t i = 0; i < m; i++) {
            ng_store_f64(g.bufs[t], dt, i, ng_rng_unif(rng) * mag);
            g.vals[t][i] = ng_load_f64(g.bufs[t], dt, i);
        }
    }
    return g;
}

static void set_val(gset *g, int64_t t, int64_t i, double v) {
    ng_store_f64(g->bufs[t], g->dt, i, v);
    g->vals[t][i] = ng_load_f64(g->bufs[t], g->dt, i);
}

static void free_set(gset *g) {
    for (int64_t t = 0; t < g->n; t++) {
        free(g->bufs[t]);
        free(g->vals[t]);
    }
    free(g->numels);
    free(g->bufs);
    free(g->vals);
}

/* The plain fp64 oracle: stats as grad_guard_math.h documents them. */
static void ref_stats(const gset *g, double s, ng_gg_norm p, double *st) {
    double acc = 0.0;
    int64_t nan = 0, inf = 0, first = -1;
    for (int64_t t = 0; t < g->n; t++)
        for (int64_t i = 0; i < g->numels[t]; i++) {
            double v = g->vals[t][i];
            if (isnan(v) || isinf(v)) {
                nan += isnan(v) ? 1 : 0;
                inf += isinf(v) ? 1 : 0;
                if (first < 0) first = t;
                continue;
            }
            /* u as the kernel sees it: fp32 for the 16/32-bit types */
            double u = g->dt == NG_F64 ? v * s : (double)((float)v * (float)s);
            /* a finite value whose unscaled value, stored in the dtype,
             * would be +-Inf counts as an Inf */
            unsigned char back[8];
            ng_store_f64(back, g->dt, 0, u);
            if (isinf(ng_load_f64(back, g->dt, 0))) {
                inf++;
                if (first < 0) first = t;
                continue;
            }
            if (p == NG_GG_NORM_2)
                acc += u * u;
            else if (fabs(u) > acc)
                acc = fabs(u);
        }
    st[NG_GG_NORM] = acc;
    st[NG_GG_NAN] = (double)nan;
    st[NG_GG_INF] = (double)inf;
    st[NG_GG_FIRST_BAD] = (double)first;
}

static int64_t total_numel(const gset *g) {
    int64_t s = 0;
    for (int64_t t = 0; t < g->n; t++) s += g->numels[t];
    return s;
}

/* Reduce + apply on g; check stats, norm, found_inf and every gradient. */
static void run_case(const char *name, gset *g, float inv_scale, double max_norm, ng_gg_norm p,
                     ng_parallel_fn par) {
    char what[160];
    double ref[NG_GG_NSTATS], st[NG_GG_NSTATS];
    ref_stats(g, inv_scale, p, ref);
    ng_status s = ng_grad_guard_reduce((const void *const *)g->bufs, g->numels, g->n, g->dt,
                                       &inv_scale, p, st, par);
    NG_EXPECT(s == NG_OK);
    int pow2 = inv_scale == ldexpf(1.0f, ilogbf(inv_scale));
    snprintf(what, sizeof what, "%s %s p=%s norm acc", name, ng_dtype_name(g->dt),
             p == NG_GG_NORM_2 ? "2" : "inf");
    /* an inv_scale not finite and above 0 skips the step whatever the counts */
    const int scale_ok = isfinite(inv_scale) && inv_scale > 0.0f;
    int finite = ref[NG_GG_NAN] == 0 && ref[NG_GG_INF] == 0 && scale_ok;
    if (finite)
        ng_expect_close(what, &st[NG_GG_NORM], &ref[NG_GG_NORM], 1, 0.0, pow2 ? 1e-12 : 1e-6);
    NG_EXPECT(st[NG_GG_NAN] == ref[NG_GG_NAN]);
    NG_EXPECT(st[NG_GG_INF] == ref[NG_GG_INF]);
    NG_EXPECT(st[NG_GG_FIRST_BAD] == ref[NG_GG_FIRST_BAD]);

    /* bit copies of the gradients to check "untouched" */
    int64_t tot = total_numel(g);
    size_t es = ng_dtype_size(g->dt);
    unsigned char *before = malloc((size_t)(tot ? tot : 1) * es);
    for (int64_t t = 0, o = 0; t < g->n; t++) {
        memcpy(before + o * es, g->bufs[t], (size_t)g->numels[t] * es);
        o += g->numels[t];
    }

    float found_inf = 0.0f;
    double tn = -1.0;
    s = ng_grad_guard_apply(g->bufs, g->numels, g->n, g->dt, &inv_scale, st, max_norm, p,
                            &found_inf, &tn, NG_F64, par);
    NG_EXPECT(s == NG_OK);
    float tn32 = -1.0f;
    NG_EXPECT(ng_grad_guard_apply(g->bufs, g->numels, 0, g->dt, &inv_scale, st, max_norm, p, NULL,
                                  &tn32, NG_F32, NULL) == NG_OK);
    NG_EXPECT(tn32 == (float)tn || (isnan(tn32) && isnan(tn)));

    double ref_total = !scale_ok ? NAN
                       : !finite ? (ref[NG_GG_NAN] > 0 ? NAN : INFINITY)
                                 : (p == NG_GG_NORM_2 ? sqrt(ref[NG_GG_NORM]) : ref[NG_GG_NORM]);
    snprintf(what, sizeof what, "%s %s total norm", name, ng_dtype_name(g->dt));
    ng_expect_close(what, &tn, &ref_total, 1, 0.0, pow2 ? 1e-12 : 1e-6);

    if (!finite) {
        NG_EXPECT(found_inf == 1.0f);
        int same = 1;
        for (int64_t t = 0, o = 0; t < g->n; t++) {
            same &= memcmp(before + o * es, g->bufs[t], (size_t)g->numels[t] * es) == 0;
            o += g->numels[t];
        }
        snprintf(what, sizeof what, "%s %s untouched", name, ng_dtype_name(g->dt));
        NG_EXPECT(same);
        if (!same) fprintf(stderr, "  (%s)\n", what);
    } else {
        NG_EXPECT(found_inf == 0.0f);
        double clip = max_norm / (ref_total + 1e-6);
        if (clip > 1.0) clip = 1.0;
        tol tl = grad_tol(g->dt);
        for (int64_t t = 0; t < g->n; t++) {
            int64_t m = g->numels[t];
            double *got = malloc((size_t)(m ? m : 1) * sizeof(double));
            double *want = malloc((size_t)(m ? m : 1) * sizeof(double));
            for (int64_t i = 0; i < m; i++) {
                got[i] = ng_load_f64(g->bufs[t], g->dt, i);
                want[i] = g->vals[t][i] * (double)inv_scale * clip;
            }
            snprintf(what, sizeof what, "%s %s grads[%lld]", name, ng_dtype_name(g->dt),
                     (long long)t);
            ng_expect_close(what, got, want, m, tl.atol, tl.rtol);
            free(got);
            free(want);
        }
    }
    free(before);
}

static const ng_dtype k_types[] = {NG_F32, NG_F16, NG_BF16, NG_F64};

/* Random sizes: a mix of empty, tiny, odd and multi-block tensors. */
static void mixed_sizes(int64_t *numels, int64_t n, ng_rng *rng) {
    for (int64_t t = 0; t < n; t++) {
        uint64_t r = ng_rng_u64(rng) % 10;
        numels[t] = r == 0  ? 0
                    : r < 6 ? (int64_t)(ng_rng_u64(rng) % 300) + 1
                    : r < 9 ? (int64_t)(ng_rng_u64(rng) % 5000) + 1
                            : (int64_t)(ng_rng_u64(rng) % 150000) + 1;
    }
}

static void test_finite(uint64_t seed) {
    ng_rng rng = {seed};
    const int64_t counts[] = {1, 100, 500};
    ng_parallel_fn runners[] = {NULL, reverse_chunks};
    for (int ti = 0; ti < 4; ti++)
        for (int ci = 0; ci < 3; ci++)
            for (int p = 0; p < 2; p++)
                for (int over = 0; over < 2; over++) {
                    int64_t n = counts[ci];
                    int64_t numels[500];
                    mixed_sizes(numels, n, &rng);
                    if (n == 1) numels[0] = 3 * NG_GG_CHUNK + 17; /* several blocks */
                    /* loss-scaled values: |g| ~ 1000, inv_scale 2^-10 -> |u| ~ 1 */
                    gset g = make_set(k_types[ti], n, numels, 1000.0, &rng);
                    double st[NG_GG_NSTATS];
                    float s = 1.0f / 1024.0f;
                    ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, g.n, g.dt, &s,
                                         (ng_gg_norm)p, st, NULL);
                    double norm = p == 0 ? sqrt(st[NG_GG_NORM]) : st[NG_GG_NORM];
                    /* under: max_norm above the norm (clip = 1); over: clip ~ 0.3 */
                    double max_norm = over ? 0.3 * norm : 2.0 * norm + 1.0;
                    run_case(over ? "over" : "under", &g, s, max_norm, (ng_gg_norm)p,
                             runners[(ci + over) & 1]);
                    free_set(&g);
                }
}

static void test_nonfinite(uint64_t seed) {
    ng_rng rng = {seed};
    for (int ti = 0; ti < 4; ti++)
        for (int p = 0; p < 2; p++)
            for (int kind = 0; kind < 4; kind++) {
                int64_t numels[100];
                mixed_sizes(numels, 100, &rng);
                numels[37] = NG_GG_CHUNK + 500;
                numels[60] = 1000;
                numels[80] = 2000;
                gset g = make_set(k_types[ti], 100, numels, 100.0, &rng);
                const char *name = "?";
                switch (kind) {
                case 0: /* one NaN, in the second block of tensor 37 */
                    set_val(&g, 37, NG_GG_CHUNK + 3, NAN);
                    name = "one nan";
                    break;
                case 1: /* one -Inf */
                    set_val(&g, 60, 999, -INFINITY);
                    name = "one inf";
                    break;
                case 2: /* several of each, in later tensors first */
                    for (int k = 0; k < 5; k++) set_val(&g, 80, 10 * k, NAN);
                    set_val(&g, 60, 0, INFINITY);
                    set_val(&g, 60, 1, -INFINITY);
                    set_val(&g, 80, 1999, INFINITY);
                    name = "several";
                    break;
                case 3: /* NaN in the first element of the first non-empty tensor */
                    for (int64_t t = 0; t < 100; t++)
                        if (numels[t] > 0) {
                            set_val(&g, t, 0, NAN);
                            break;
                        }
                    name = "first elem";
                    break;
                }
                run_case(name, &g, 1.0f / 65536.0f, 1.0, (ng_gg_norm)p,
                         kind & 1 ? reverse_chunks : NULL);
                free_set(&g);
            }
}

/* |g| near the fp32 limits: fp32 squares overflow (1e20^2) or underflow
 * (1e-25^2); an fp64 sum of squares of fp32 values does neither. fp32 and
 * bf16 (the dtypes with fp32's exponent range). */
static void test_extremes(void) {
    ng_rng rng = {77};
    const double mags[] = {3.0e38, 1.0e30, 1.0e20, 1.0e-25, 1.0e-40};
    const ng_dtype wide_range[2] = {NG_F32, NG_BF16}; /* the dtypes with fp32's exponent range */
    for (int di = 0; di < 2; di++)
        for (int mi = 0; mi < 5; mi++)
            for (int p = 0; p < 2; p++) {
                int64_t numels[3] = {5000, 0, 2 * NG_GG_CHUNK + 1};
                gset g = make_set(wide_range[di], 3, numels, mags[mi], &rng);
                double st[NG_GG_NSTATS];
                float s = 1.0f;
                NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, 3, g.dt, &s,
                                               (ng_gg_norm)p, st, reverse_chunks) == NG_OK);
                NG_EXPECT(isfinite(st[NG_GG_NORM]) && st[NG_GG_NORM] > 0.0);
                run_case("extreme", &g, 1.0f, 1.0, (ng_gg_norm)p, NULL);
                free_set(&g);
            }
    /* fp16 at its maximum with a loss scale: the unscaled values are small */
    int64_t n1 = 4097;
    gset h = make_set(NG_F16, 1, &n1, 65504.0, &rng);
    run_case("f16 max", &h, 1.0f / 65536.0f, 0.5, NG_GG_NORM_2, NULL);
    free_set(&h);
    /* fp64 beyond 1e154: sum of squares overflows, treated as non-finite
     * (documented), counts stay 0 and nothing is written. */
    int64_t n2 = 10;
    gset d = make_set(NG_F64, 1, &n2, 1.0, &rng);
    set_val(&d, 0, 3, 1e200);
    double st[NG_GG_NSTATS];
    float one = 1.0f, found = 0.0f;
    double tn;
    ng_grad_guard_reduce((const void *const *)d.bufs, d.numels, 1, NG_F64, &one, NG_GG_NORM_2, st,
                         NULL);
    NG_EXPECT(isinf(st[NG_GG_NORM]) && st[NG_GG_NAN] == 0 && st[NG_GG_INF] == 0);
    NG_EXPECT(ng_grad_guard_apply(d.bufs, d.numels, 1, NG_F64, &one, st, 1.0, NG_GG_NORM_2, &found,
                                  &tn, NG_F64, NULL) == NG_OK);
    NG_EXPECT(found == 1.0f && isinf(tn) && ((double *)d.bufs[0])[3] == 1e200);
    free_set(&d);
}

/* Unscaling past what the dtype holds (an inv_scale above 1): the value
 * that would be written back as +-Inf counts as an Inf and skips the step,
 * and one just inside the range does not. An inv_scale that is not a finite
 * number above 0 (NaN, +-Inf, negative, +-0) skips the step with a NaN total
 * norm. */
static void test_overflow(void) {
    ng_rng rng = {55};
    /* per dtype: a planted value, an inv_scale that keeps its unscaled value
     * finite in the dtype and one that does not (bf16: below FLT_MAX, fp32
     * and fp64: to Inf) */
    static const struct {
        ng_dtype dt;
        double x_in, x_out; /* fp64: one whose square the sum holds, for norm 2 */
        float s_in, s_out;
    } c[] = {{NG_F16, 16376.0, 16376.0, 4.0004f, 4.001f},
             {NG_BF16, 8.29e34, 8.29e34, 4100.0f, 4108.0f},
             {NG_F32, 1e35, 1e35, 3.4f, 4108.0f},
             {NG_F64, 1e100, 1e308, 1.7f, 4108.0f}};
    for (int k = 0; k < 4; k++)
        for (int p = 0; p < 2; p++)
            for (int out = 0; out < 2; out++) {
                int64_t numels[3] = {100, 0, NG_GG_CHUNK + 9};
                gset g = make_set(c[k].dt, 3, numels, 1.0, &rng);
                set_val(&g, 2, NG_GG_CHUNK + 3, out ? c[k].x_out : c[k].x_in);
                float s = out ? c[k].s_out : c[k].s_in;
                double st[NG_GG_NSTATS];
                NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, 3, g.dt, &s,
                                               (ng_gg_norm)p, st, NULL) == NG_OK);
                /* not only the oracle's word: the planted value is counted exactly when out */
                NG_EXPECT(st[NG_GG_INF] == (out ? 1.0 : 0.0) && st[NG_GG_NAN] == 0.0);
                NG_EXPECT(st[NG_GG_FIRST_BAD] == (out ? 2.0 : -1.0));
                run_case(out ? "overflow" : "no overflow", &g, s, 1e30, (ng_gg_norm)p, one_by_one);
                free_set(&g);
            }
    const float bad_scales[6] = {NAN, INFINITY, -INFINITY, -0.5f, 0.0f, -0.0f};
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 6; b++) {
            int64_t n = 300;
            gset g = make_set(k_types[k], 1, &n, 1.0, &rng);
            run_case("inv_scale not finite and > 0", &g, bad_scales[b], 1.0, (ng_gg_norm)(b % 2),
                     NULL);
            free_set(&g);
        }
}

/* Thread-count independence: any split of the work gives identical bits. */
static void test_determinism(void) {
    ng_rng rng = {99};
    int64_t numels[50];
    mixed_sizes(numels, 50, &rng);
    numels[7] = 5 * NG_GG_CHUNK + 3;
    for (int ti = 0; ti < 4; ti++) {
        gset g = make_set(k_types[ti], 50, numels, 1.0, &rng);
        double a[NG_GG_NSTATS], b[NG_GG_NSTATS], c[NG_GG_NSTATS];
        float s = 0.37f;
        ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, 50, g.dt, &s, NG_GG_NORM_2, a,
                             NULL);
        ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, 50, g.dt, &s, NG_GG_NORM_2, b,
                             reverse_chunks);
        ng_grad_guard_reduce((const void *const *)g.bufs, g.numels, 50, g.dt, &s, NG_GG_NORM_2, c,
                             one_by_one);
        NG_EXPECT(memcmp(a, b, sizeof a) == 0 && memcmp(a, c, sizeof a) == 0);
        run_case("inv_scale 0.37", &g, s, 0.1, NG_GG_NORM_2, one_by_one);
        free_set(&g);
    }
}

/* The distributed / multi-dtype path: reduce two halves separately, combine
 * the stats as the caller does (sum, sum, sum, min of >= 0), apply each half
 * with the combined stats: same gradients as one call over everything. */
static void test_combined_groups(void) {
    for (int p = 0; p < 2; p++)
        for (int bad = 0; bad < 2; bad++) {
            ng_rng r1 = {5}, r2 = {5};
            int64_t numels[40];
            ng_rng rs = {6};
            mixed_sizes(numels, 40, &rs);
            numels[30] = 100;
            gset all = make_set(NG_F32, 40, numels, 10.0, &r1);
            gset parts = make_set(NG_F32, 40, numels, 10.0, &r2);
            if (bad) {
                set_val(&all, 30, 5, NAN);
                set_val(&parts, 30, 5, NAN);
            }
            float s = 0.5f, f1 = 0.0f, f2 = 0.0f;
            double st[NG_GG_NSTATS], sa[NG_GG_NSTATS], sb[NG_GG_NSTATS], comb[NG_GG_NSTATS];
            ng_gg_norm nt = (ng_gg_norm)p;
            ng_grad_guard_reduce((const void *const *)all.bufs, numels, 40, NG_F32, &s, nt, st,
                                 NULL);
            ng_grad_guard_apply(all.bufs, numels, 40, NG_F32, &s, st, 1.0, nt, &f1, NULL, NG_F32,
                                NULL);
            ng_grad_guard_reduce((const void *const *)parts.bufs, numels, 25, NG_F32, &s, nt, sa,
                                 NULL);
            ng_grad_guard_reduce((const void *const *)(parts.bufs + 25), numels + 25, 15, NG_F32,
                                 &s, nt, sb, NULL);
            comb[NG_GG_NORM] = ng_gg_combine(sa[NG_GG_NORM], sb[NG_GG_NORM], nt);
            comb[NG_GG_NAN] = sa[NG_GG_NAN] + sb[NG_GG_NAN];
            comb[NG_GG_INF] = sa[NG_GG_INF] + sb[NG_GG_INF];
            comb[NG_GG_FIRST_BAD] = sa[NG_GG_FIRST_BAD] >= 0   ? sa[NG_GG_FIRST_BAD]
                                    : sb[NG_GG_FIRST_BAD] >= 0 ? 25 + sb[NG_GG_FIRST_BAD]
                                                               : -1;
            NG_EXPECT(comb[NG_GG_NAN] == st[NG_GG_NAN] &&
                      comb[NG_GG_FIRST_BAD] == st[NG_GG_FIRST_BAD]);
            double d = fabs(comb[NG_GG_NORM] - st[NG_GG_NORM]);
            NG_EXPECT(bad || d <= 1e-12 * st[NG_GG_NORM]);
            ng_grad_guard_apply(parts.bufs, numels, 25, NG_F32, &s, comb, 1.0, nt, &f2, NULL,
                                NG_F32, NULL);
            ng_grad_guard_apply(parts.bufs + 25, numels + 25, 15, NG_F32, &s, comb, 1.0, nt, &f2,
                                NULL, NG_F32, NULL);
            NG_EXPECT(f1 == (bad ? 1.0f : 0.0f) && f2 == f1);
            for (int64_t t = 0; t < 40; t++) {
                double *want = malloc((size_t)(numels[t] ? numels[t] : 1) * sizeof(double));
                double *got = malloc((size_t)(numels[t] ? numels[t] : 1) * sizeof(double));
                for (int64_t i = 0; i < numels[t]; i++) {
                    want[i] = ((float *)all.bufs[t])[i];
                    got[i] = ((float *)parts.bufs[t])[i];
                }
                ng_expect_close("combined groups", got, want, numels[t], 0.0, 3e-7);
                free(want);
                free(got);
            }
            free_set(&all);
            free_set(&parts);
        }
}

/* Empty list, all-empty tensors, inv_scale = 1 under max_norm (no write),
 * and arguments the kernels must refuse. */
static void test_edges(void) {
    double st[NG_GG_NSTATS] = {9, 9, 9, 9};
    float one = 1.0f, found = 0.0f, tn = -1.0f;
    NG_EXPECT(ng_grad_guard_reduce(NULL, NULL, 0, NG_F32, &one, NG_GG_NORM_2, st, NULL) == NG_OK);
    NG_EXPECT(st[0] == 0 && st[1] == 0 && st[2] == 0 && st[3] == -1);
    NG_EXPECT(ng_grad_guard_apply(NULL, NULL, 0, NG_F32, &one, st, 1.0, NG_GG_NORM_2, &found, &tn,
                                  NG_F32, NULL) == NG_OK);
    NG_EXPECT(found == 0.0f && tn == 0.0f);

    int64_t zeros[3] = {0, 0, 0};
    void *nulls[3] = {NULL, NULL, NULL};
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)nulls, zeros, 3, NG_BF16, &one,
                                   NG_GG_NORM_INF, st, NULL) == NG_OK);
    NG_EXPECT(st[0] == 0 && st[3] == -1);

    /* bf16 without a scaler, under max_norm: the bits do not move */
    ng_rng rng = {3};
    int64_t n = 1000;
    gset g = make_set(NG_BF16, 1, &n, 1e-3, &rng);
    uint16_t *copy = malloc(2000);
    memcpy(copy, g.bufs[0], 2000);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &n, 1, NG_BF16, &one, NG_GG_NORM_2,
                                   st, NULL) == NG_OK);
    NG_EXPECT(ng_grad_guard_apply(g.bufs, &n, 1, NG_BF16, &one, st, 1.0, NG_GG_NORM_2, &found, NULL,
                                  NG_F32, NULL) == NG_OK);
    NG_EXPECT(memcmp(copy, g.bufs[0], 2000) == 0 && found == 0.0f);

    /* refused */
    int64_t neg = -1;
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &neg, 1, NG_BF16, &one,
                                   NG_GG_NORM_2, st, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)nulls, &n, 1, NG_BF16, &one, NG_GG_NORM_2,
                                   st, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &n, 1, NG_BF16, NULL, NG_GG_NORM_2,
                                   st, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &n, 1, NG_BF16, &one, NG_GG_NORM_2,
                                   NULL, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &n, 1, (ng_dtype)7, &one,
                                   NG_GG_NORM_2, st, NULL) == NG_ERR_DTYPE);
    NG_EXPECT(ng_grad_guard_reduce((const void *const *)g.bufs, &n, 1, NG_BF16, &one, (ng_gg_norm)5,
                                   st, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_apply(g.bufs, &n, 1, NG_BF16, &one, st, -1.0, NG_GG_NORM_2, &found,
                                  NULL, NG_F32, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_apply(g.bufs, &n, 1, NG_BF16, &one, st, NAN, NG_GG_NORM_2, &found, NULL,
                                  NG_F32, NULL) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_grad_guard_apply(g.bufs, &n, 1, NG_BF16, &one, st, 1.0, NG_GG_NORM_2, &found, &tn,
                                  NG_F16, NULL) == NG_ERR_INVALID_ARG);
    free(copy);
    free_set(&g);

    /* the clip coefficient itself */
    NG_EXPECT(ng_gg_clip_coef(NAN, 1.0) == 1.0 && ng_gg_clip_coef(INFINITY, 1.0) == 1.0);
    NG_EXPECT(ng_gg_clip_coef(0.5, 1.0) == 1.0 && ng_gg_clip_coef(2.0, 1.0) < 0.5);
    NG_EXPECT(ng_gg_clip_coef(0.0, INFINITY) == 1.0);
}

int main(void) {
    NG_FOR_EACH_ISA(isa) {
        printf("grad_guard: cpu path %s\n", ng_cpu_isa_name((ng_cpu_isa)isa));
        test_finite(1000 + (uint64_t)isa);
        test_nonfinite(2000 + (uint64_t)isa);
        test_extremes();
        test_overflow();
        test_determinism();
        test_combined_groups();
        test_edges();
    }
    return ng_test_finish("grad_guard");
}
