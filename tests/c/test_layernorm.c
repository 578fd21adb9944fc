/*
 * tests/c/test_layernorm.c - CPU LayerNorm / RMSNorm vs a plain-loop fp64
 * reference: odd widths (1, 3, 127, 4097), every dtype, with and without
 * weight / bias, forward and all gradients, on every CPU path the machine
 * has, serial and through a chunking parallel runner. Also: constant rows
 * give exactly the bias, a NaN row stays NaN and touches no other row; fp16 /
 * bf16 input with fp32 weight / bias (mixed_params_case).
 *
 * Tolerances (|d| <= atol + rtol*|ref|), per dtype of the data:
 *   fp64 1e-12/1e-12: same math, different summation order only.
 *   fp32 1e-5/1e-5:  fp32 accumulation over up to 4097 terms.
 *   bf16 / fp16: one rounding of the output to 8 / 11 significant bits
 *   (2^-8, 2^-11 relative) plus fp32 noise; inputs are rounded identically
 *   for the reference, so only the output rounding counts.
 */
#include <string.h>

#include "kernels/layernorm.h"
#include "tests/c/ng_test.h"

typedef struct tol {
    double atol, rtol;
} tol;

static tol tol_for(ng_dtype t) {
    switch (t) {
    case NG_F64: return (tol){1e-12, 1e-12};
    case NG_F32: return (tol){2e-5, 2e-5};
    case NG_BF16: return (tol){2e-2, 1e-2};
    case NG_F16: return (tol){2e-3, 2e-3};
    }
    return (tol){0, 0};
}

/* Reference: fp64, naive two-pass statistics. */
static void ref_fwd(const double *x, const double *w, const double *b, int64_t rows, int64_t n,
                    double eps, int rms, double *y, double *mean, double *rstd) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double m = 0.0, v = 0.0;
        if (!rms) {
            for (int64_t i = 0; i < n; i++) m += xr[i];
            m /= (double)n;
        }
        for (int64_t i = 0; i < n; i++) v += (xr[i] - m) * (xr[i] - m);
        v /= (double)n;
        double rs = 1.0 / sqrt(v + eps);
        mean[r] = m;
        rstd[r] = rs;
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] = (xr[i] - m) * rs * (w ? w[i] : 1.0) + (b && !rms ? b[i] : 0.0);
    }
}

static void ref_bwd(const double *x, const double *w, const double *dy, int64_t rows, int64_t n,
                    int rms, const double *mean, const double *rstd, double *dx, double *dw,
                    double *db) {
    for (int64_t i = 0; i < n; i++) dw[i] = db[i] = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        double sg = 0, sgx = 0;
        for (int64_t i = 0; i < n; i++) {
            double xh = (x[r * n + i] - mean[r]) * rstd[r];
            double g = dy[r * n + i] * (w ? w[i] : 1.0);
            sg += g;
            sgx += g * xh;
            dw[i] += dy[r * n + i] * xh;
            db[i] += dy[r * n + i];
        }
        for (int64_t i = 0; i < n; i++) {
            double xh = (x[r * n + i] - mean[r]) * rstd[r];
            double g = dy[r * n + i] * (w ? w[i] : 1.0);
            dx[r * n + i] = rstd[r] * (g - (rms ? 0.0 : sg / n) - xh * sgx / n);
        }
    }
}

/* A runner that splits [0, n) into grain-sized chunks and runs them in
 * reverse order: any dependence on order or on a single range shows up. */
static void reverse_chunks(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    if (grain < 1) grain = 1;
    int64_t nchunks = NG_CEIL_DIV(n, grain);
    for (int64_t c = nchunks - 1; c >= 0; c--) fn(c * grain, NG_MIN(n, (c + 1) * grain), ctx);
}

/* Buffers in dtype t filled from fp64 values, rounded to t; the rounded
 * values are written back so the reference sees the same inputs. */
static void *make_buf(ng_dtype t, double *vals, int64_t n) {
    void *p = malloc((size_t)(n ? n : 1) * ng_dtype_size(t));
    for (int64_t i = 0; i < n; i++) {
        ng_store_f64(p, t, i, vals[i]);
        vals[i] = ng_load_f64(p, t, i);
    }
    return p;
}

static void to_f64(const void *p, ng_dtype t, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = ng_load_f64(p, t, i);
}

static void stat_to_f64(const void *p, ng_dtype t, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = t == NG_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

static void run_case(ng_dtype t, int64_t rows, int64_t n, int rms, int has_w, int has_b,
                     ng_parallel_fn par, uint64_t seed) {
    ng_rng rng = {seed};
    int64_t total = rows * n;
    double *x = calloc((size_t)total + 1, sizeof(double)), *dy = calloc((size_t)total + 1, 8);
    double *w = calloc((size_t)n + 1, 8), *b = calloc((size_t)n + 1, 8);
    for (int64_t i = 0; i < total; i++) {
        x[i] = 3.0 * ng_rng_unif(&rng) + 0.5;
        dy[i] = ng_rng_unif(&rng);
    }
    for (int64_t i = 0; i < n; i++) {
        w[i] = 1.0 + 0.5 * ng_rng_unif(&rng);
        b[i] = 0.25 * ng_rng_unif(&rng);
    }
    void *xb = make_buf(t, x, total), *dyb = make_buf(t, dy, total);
    void *wb = make_buf(t, w, n), *bb = make_buf(t, b, n);
    size_t ss = t == NG_F64 ? 8 : 4;
    void *yb = malloc((size_t)(total + 1) * ng_dtype_size(t)),
         *dxb = malloc((size_t)(total + 1) * ng_dtype_size(t));
    void *mb = malloc((size_t)(rows + 1) * ss), *rb = malloc((size_t)(rows + 1) * ss);
    void *dwb = malloc((size_t)(n + 1) * ng_dtype_size(t)),
         *dbb = malloc((size_t)(n + 1) * ng_dtype_size(t));
    double eps = 1e-5;
    ng_layernorm_args a = {t,
                           rows,
                           n,
                           rms,
                           eps,
                           xb,
                           has_w ? wb : NULL,
                           has_b ? bb : NULL,
                           mb,
                           rb,
                           yb,
                           dyb,
                           dxb,
                           has_w ? dwb : NULL,
                           (has_b && !rms) ? dbb : NULL,
                           0};
    NG_EXPECT(ng_layernorm_fwd(&a, par) == NG_OK);
    NG_EXPECT(ng_layernorm_bwd(&a, par) == NG_OK);

    double *ry = malloc((size_t)(total + 1) * 8), *rm = malloc((size_t)(rows + 1) * 8),
           *rr = malloc((size_t)(rows + 1) * 8), *rdx = malloc((size_t)(total + 1) * 8),
           *rdw = malloc((size_t)(n + 1) * 8), *rdb = malloc((size_t)(n + 1) * 8),
           *got = malloc((size_t)(total + n + rows + 1) * 8);
    ref_fwd(x, has_w ? w : NULL, has_b ? b : NULL, rows, n, eps, rms, ry, rm, rr);
    ref_bwd(x, has_w ? w : NULL, dy, rows, n, rms, rm, rr, rdx, rdw, rdb);
    tol tl = tol_for(t);
    char what[128];
    snprintf(what, sizeof what, "%s rows=%lld n=%lld rms=%d w=%d b=%d y", ng_dtype_name(t),
             (long long)rows, (long long)n, rms, has_w, has_b);
    to_f64(yb, t, total, got);
    ng_expect_close(what, got, ry, total, tl.atol, tl.rtol);
    /* statistics are fp32 (fp64): an fp32 sum of n terms of size ~3 drifts
     * like a random walk, ~sqrt(n) * 2^-24 * 3; allow 4x that (and a floor) */
    double st = t == NG_F64 ? 1e-12 : 1e-6 + 1e-6 * sqrt((double)n);
    stat_to_f64(rb, t, rows, got);
    what[strlen(what) - 1] = 'r';
    ng_expect_close(what, got, rr, rows, st, st);
    if (!rms) {
        stat_to_f64(mb, t, rows, got);
        what[strlen(what) - 1] = 'm';
        ng_expect_close(what, got, rm, rows, st, st);
    }
    /* gradients: dx scales with rstd*|dy| ~ 1, dw sums `rows` terms */
    to_f64(dxb, t, total, got);
    what[strlen(what) - 1] = 'x';
    ng_expect_close(what, got, rdx, total, 2 * tl.atol, 2 * tl.rtol);
    if (has_w) {
        to_f64(dwb, t, n, got);
        what[strlen(what) - 1] = 'w';
        ng_expect_close(what, got, rdw, n, tl.atol * (double)rows, 2 * tl.rtol);
    }
    if (has_b && !rms) {
        to_f64(dbb, t, n, got);
        what[strlen(what) - 1] = 'b';
        ng_expect_close(what, got, rdb, n, tl.atol * (double)rows, 2 * tl.rtol);
    }
    free(x);
    free(dy);
    free(w);
    free(b);
    free(xb);
    free(dyb);
    free(wb);
    free(bb);
    free(yb);
    free(dxb);
    free(mb);
    free(rb);
    free(dwb);
    free(dbb);
    free(ry);
    free(rm);
    free(rr);
    free(rdx);
    free(rdw);
    free(rdb);
    free(got);
}

/* Constant rows: output is exactly the bias; eps = 0 gives no NaN either. */
static void constant_rows(ng_dtype t) {
    const int64_t rows = 3, n = 37;
    double vals[3] = {0.1, -7.25, 0.0};
    double *x = malloc(rows * n * 8), *w = malloc(n * 8), *b = malloc(n * 8);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) x[r * n + i] = vals[r];
    for (int64_t i = 0; i < n; i++) {
        w[i] = 2.0;
        b[i] = 0.5 + (double)i / 64.0;
    }
    void *xb = make_buf(t, x, rows * n), *wb = make_buf(t, w, n), *bb = make_buf(t, b, n);
    void *yb = malloc(rows * n * 8), *mb = malloc(rows * 8), *rb = malloc(rows * 8);
    for (int rms = 0; rms <= 1; rms++) {
        for (int e = 0; e < 2; e++) {
            ng_layernorm_args a = {t,  rows, n,  rms,  e ? 1e-5 : 0.0, xb,   wb,   bb,
                                   mb, rb,   yb, NULL, NULL,           NULL, NULL, 0};
            NG_EXPECT(ng_layernorm_fwd(&a, NULL) == NG_OK);
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t i = 0; i < n; i++) {
                    double y = ng_load_f64(yb, t, r * n + i);
                    NG_EXPECT(isfinite(y));
                    if (!rms) NG_EXPECT(y == b[i]);
                    if (rms && vals[r] == 0.0) NG_EXPECT(y == 0.0);
                }
            }
        }
    }
    free(x);
    free(w);
    free(b);
    free(xb);
    free(wb);
    free(bb);
    free(yb);
    free(mb);
    free(rb);
}

/* NaN / Inf in one row: that row is NaN everywhere, the others are finite. */
static void nonfinite_rows(ng_dtype t) {
    const int64_t rows = 4, n = 19;
    double *x = malloc(rows * n * 8);
    ng_rng rng = {5};
    for (int64_t i = 0; i < rows * n; i++) x[i] = ng_rng_unif(&rng);
    x[1 * n + 7] = NAN;
    x[2 * n + 3] = INFINITY;
    void *xb = make_buf(t, x, rows * n);
    void *yb = malloc(rows * n * 8), *mb = malloc(rows * 8), *rb = malloc(rows * 8);
    for (int rms = 0; rms <= 1; rms++) {
        ng_layernorm_args a = {t,  rows, n,  rms,  1e-5, xb,   NULL, NULL,
                               mb, rb,   yb, NULL, NULL, NULL, NULL, 0};
        NG_EXPECT(ng_layernorm_fwd(&a, NULL) == NG_OK);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) {
                double y = ng_load_f64(yb, t, r * n + i);
                if (r == 1 || r == 2)
                    NG_EXPECT(isnan(y));
                else
                    NG_EXPECT(isfinite(y));
            }
    }
    free(x);
    free(xb);
    free(yb);
    free(mb);
    free(rb);
}

/* fp16 rows near the top of the range: finite and correct. */
static void fp16_large(void) {
    const int64_t n = 64;
    double x[64], y[64], m, r;
    ng_rng rng = {9};
    for (int i = 0; i < n; i++) x[i] = 6.0e4 + 5000.0 * ng_rng_unif(&rng);
    void *xb = make_buf(NG_F16, x, n);
    uint16_t yb[64];
    float mb, rb;
    ng_layernorm_args a = {NG_F16, 1,   n,  0,    1e-5, xb,   NULL, NULL,
                           &mb,    &rb, yb, NULL, NULL, NULL, NULL, 0};
    NG_EXPECT(ng_layernorm_fwd(&a, NULL) == NG_OK);
    ref_fwd(x, NULL, NULL, 1, n, 1e-5, 0, y, &m, &r);
    double got[64];
    to_f64(yb, NG_F16, n, got);
    ng_expect_close("fp16 near 6e4", got, y, n, 4e-3, 4e-3);
    free(xb);
}

/* bf16 / fp32 rows of finite values whose squares overflow fp32: the scaled
 * fallback gives the right, finite answer (LayerNorm and RMSNorm). */
static void huge_rows(ng_dtype t) {
    const int64_t n = 50;
    double x[50], y[50], m, r, got[50];
    ng_rng rng = {11};
    for (int i = 0; i < n; i++) x[i] = 1e30 * (ng_rng_unif(&rng) + (i % 2 ? 2.0 : -2.0));
    void *xb = make_buf(t, x, n);
    float yb[50], mb, rb;
    for (int rms = 0; rms <= 1; rms++) {
        ng_layernorm_args a = {t,   1,   n,  rms,  1e-5, xb,   NULL, NULL,
                               &mb, &rb, yb, NULL, NULL, NULL, NULL, 0};
        NG_EXPECT(ng_layernorm_fwd(&a, NULL) == NG_OK);
        ref_fwd(x, NULL, NULL, 1, n, 1e-5, rms, y, &m, &r);
        to_f64(yb, t, n, got);
        tol tl = tol_for(t);
        ng_expect_close(rms ? "huge rms" : "huge ln", got, y, n, tl.atol, tl.rtol);
    }
    free(xb);
}

/* Rows whose first value (the shift of the statistics) sits far from the
 * mean: moderately, and as an outlier 1000 away. The corrected second pass
 * must repair the rounding of the shifted first sum in both. */
static void shifted_rows(ng_dtype t) {
    /* wide rows: the first sum's rounding grows with n */
    enum { n = 4097 };
    const int64_t rows = 2;
    static double x[2 * n], y[2 * n], got[2 * n];
    double m[2], r[2];
    ng_rng rng = {13};
    for (int64_t i = 0; i < rows * n; i++) x[i] = ng_rng_unif(&rng);
    x[0] = -1.7;   /* var ~ 1/3, md ~ 1.7 */
    x[n] = 1000.0; /* an outlier first */
    void *xb = make_buf(t, x, rows * n);
    void *yb = malloc(sizeof y), *mb = malloc(16), *rb = malloc(16);
    ng_layernorm_args a = {t,  rows, n,  0,    1e-5, xb,   NULL, NULL,
                           mb, rb,   yb, NULL, NULL, NULL, NULL, 0};
    NG_EXPECT(ng_layernorm_fwd(&a, NULL) == NG_OK);
    ref_fwd(x, NULL, NULL, rows, n, 1e-5, 0, y, m, r);
    to_f64(yb, t, rows * n, got);
    tol tl = tol_for(t);
    ng_expect_close("shifted rows y", got, y, rows * n, tl.atol, tl.rtol);
    stat_to_f64(rb, t, rows, got);
    ng_expect_close("shifted rows rstd", got, r, rows, 1e-5, 1e-5);
    free(xb);
    free(yb);
    free(mb);
    free(rb);
}

/* fp16 / bf16 input with fp32 weight and bias (params_f32): the parameters
 * are applied unrounded, in fp32, so the output is the fp64 reference
 * rounded once to the input dtype, up to fp32 noise: an element may differ
 * from the correctly rounded value only where the reference sits within
 * fp32 noise of a rounding boundary (allowed: 1% of the elements, by one
 * unit in the last place at most; a miss within 4e-6 of the reference, the
 * fp32 noise itself, counts as none: small fp16 outputs have ulps below it). Rounding the parameters to 16 bits first
 * misses in about a third of the elements (bf16). dweight / dbias come back
 * as fp32 sums of fp32 products: fp32 tolerance. */
static void mixed_params_case(ng_dtype t, int64_t rows, int64_t n, int rms, int has_b,
                              ng_parallel_fn par, uint64_t seed) {
    ng_rng rng = {seed};
    const int64_t total = rows * n;
    double *x = malloc((size_t)total * 8), *dy = malloc((size_t)total * 8);
    double *w = malloc((size_t)n * 8), *b = malloc((size_t)n * 8);
    for (int64_t i = 0; i < total; i++) {
        x[i] = 3.0 * ng_rng_unif(&rng) + 0.5;
        dy[i] = ng_rng_unif(&rng);
    }
    for (int64_t i = 0; i < n; i++) {
        w[i] = 1.0 + 0.5 * ng_rng_unif(&rng); /* fp32 values that 16 bits cannot hold */
        b[i] = 0.25 * ng_rng_unif(&rng);
    }
    void *xb = make_buf(t, x, total), *dyb = make_buf(t, dy, total);
    void *wb = make_buf(NG_F32, w, n), *bb = make_buf(NG_F32, b, n);
    const size_t es = ng_dtype_size(t);
    void *yb = malloc((size_t)total * es), *dxb = malloc((size_t)total * es);
    float *mb = malloc((size_t)rows * 4), *rb = malloc((size_t)rows * 4);
    float *dwb = malloc((size_t)n * 4), *dbb = malloc((size_t)n * 4);
    const double eps = 1e-5;
    ng_layernorm_args a = {t,
                           rows,
                           n,
                           rms,
                           eps,
                           xb,
                           wb,
                           has_b ? bb : NULL,
                           mb,
                           rb,
                           yb,
                           dyb,
                           dxb,
                           dwb,
                           has_b ? dbb : NULL,
                           1};
    NG_EXPECT(ng_layernorm_fwd(&a, par) == NG_OK);
    NG_EXPECT(ng_layernorm_bwd(&a, par) == NG_OK);
    double *ry = malloc((size_t)total * 8), *rm = malloc((size_t)rows * 8),
           *rr = malloc((size_t)rows * 8), *rdx = malloc((size_t)total * 8),
           *rdw = malloc((size_t)n * 8), *rdb = malloc((size_t)n * 8),
           *got = malloc((size_t)total * 8);
    ref_fwd(x, w, has_b ? b : NULL, rows, n, eps, rms, ry, rm, rr);
    ref_bwd(x, w, dy, rows, n, rms, rm, rr, rdx, rdw, rdb);
    char what[128];
    snprintf(what, sizeof what, "mixed %s/fp32 rows=%lld n=%lld rms=%d b=%d", ng_dtype_name(t),
             (long long)rows, (long long)n, rms, has_b);
    int64_t off = 0, far = 0;
    uint16_t one[4] = {0}, nb[4] = {0}; /* sized for any dtype, used as t */
    for (int64_t i = 0; i < total; i++) {
        ng_store_f64(one, t, 0, ry[i]);
        const double want = ng_load_f64(one, t, 0), y = ng_load_f64(yb, t, i);
        /* fp32 noise: an absolute ~1e-6 on values ~1 (centring of x ~ 3.5,
         * times rstd and weight); only where it decides a rounding */
        if (y == want || fabs(y - ry[i]) <= 4e-6) continue;
        off++;
        /* one unit in the last place of want, from its 16-bit neighbour */
        nb[0] = (uint16_t)(one[0] + ((y > want) == (want > 0) ? 1 : -1));
        if (fabs(y - want) > fabs(ng_load_f64(nb, t, 0) - want)) far++;
    }
    if (off * 100 > total || far) {
        printf("FAIL %s: %lld of %lld outputs not the correctly rounded reference, %lld by more "
               "than one ulp\n",
               what, (long long)off, (long long)total, (long long)far);
        NG_EXPECT(0);
    }
    tol tl = tol_for(t), t32 = tol_for(NG_F32);
    to_f64(dxb, t, total, got);
    ng_expect_close(what, got, rdx, total, 2 * tl.atol, 2 * tl.rtol);
    stat_to_f64(dwb, NG_F32, n, got);
    ng_expect_close(what, got, rdw, n, t32.atol * (double)rows, t32.rtol);
    if (has_b) {
        stat_to_f64(dbb, NG_F32, n, got);
        ng_expect_close(what, got, rdb, n, t32.atol * (double)rows, t32.rtol);
    }
    free(x);
    free(dy);
    free(w);
    free(b);
    free(xb);
    free(dyb);
    free(wb);
    free(bb);
    free(yb);
    free(dxb);
    free(mb);
    free(rb);
    free(dwb);
    free(dbb);
    free(ry);
    free(rm);
    free(rr);
    free(rdx);
    free(rdw);
    free(rdb);
    free(got);
}

int main(void) {
    const int64_t widths[] = {1, 3, 127, 4097};
    const ng_dtype types[] = {NG_F64, NG_F32, NG_BF16, NG_F16};
    uint64_t seed = 1;
    NG_FOR_EACH_ISA(isa) {
        printf("path %s\n", ng_cpu_isa_name((ng_cpu_isa)isa));
        for (int ti = 0; ti < 4; ti++) {
            for (int wi = 0; wi < 4; wi++) {
                int64_t n = widths[wi], rows = n > 1000 ? 9 : 70;
                for (int rms = 0; rms <= 1; rms++)
                    for (int opt = 0; opt < 3; opt++) /* none, weight, weight+bias */
                        run_case(types[ti], rows, n, rms, opt >= 1, opt == 2,
                                 (opt & 1) ? reverse_chunks : NULL, seed++);
            }
            /* bias without weight */
            run_case(types[ti], 5, 33, 0, 0, 1, reverse_chunks, seed++);
            constant_rows(types[ti]);
            nonfinite_rows(types[ti]);
        }
        fp16_large();
        huge_rows(NG_F32);
        huge_rows(NG_BF16);
        shifted_rows(NG_F32);
        shifted_rows(NG_F64);
        shifted_rows(NG_BF16);
        for (int ti = 2; ti < 4; ti++) /* bf16, fp16 */
            for (int wi = 1; wi < 4; wi++)
                for (int rms = 0; rms <= 1; rms++)
                    mixed_params_case(types[ti], widths[wi] > 1000 ? 9 : 70, widths[wi], rms, !rms,
                                      (wi & 1) ? reverse_chunks : NULL, seed++);
    }
    /* empty shapes */
    float m[2], r[2];
    ng_layernorm_args e = {NG_F32, 0, 8,    0,    1e-5, NULL, NULL, NULL,
                           m,      r, NULL, NULL, NULL, NULL, NULL, 0};
    NG_EXPECT(ng_layernorm_fwd(&e, NULL) == NG_OK);
    NG_EXPECT(ng_layernorm_bwd(&e, NULL) == NG_OK);
    e.eps = -1.0;
    NG_EXPECT(ng_layernorm_fwd(&e, NULL) == NG_ERR_INVALID_ARG);
    /* the checks the CUDA launchers share: RMSNorm has no bias gradient */
    float db[8];
    e.eps = 1e-5;
    e.rms = 1;
    e.dbias = db;
    NG_EXPECT(ng_layernorm_check(&e, 0) == NG_OK);
    NG_EXPECT(ng_layernorm_check(&e, 1) == NG_ERR_INVALID_ARG);
    NG_EXPECT(ng_layernorm_bwd(&e, NULL) == NG_ERR_INVALID_ARG);
    /* fp32 parameters: fp16 / bf16 / fp32 input, not fp64 */
    e.params_f32 = 1;
    e.dtype = NG_BF16;
    NG_EXPECT(ng_layernorm_check(&e, 0) == NG_OK);
    e.dtype = NG_F64;
    NG_EXPECT(ng_layernorm_check(&e, 0) == NG_ERR_DTYPE);
    e.params_f32 = 0;
    e.dtype = (ng_dtype)7;
    NG_EXPECT(ng_layernorm_check(&e, 0) == NG_ERR_DTYPE);
    NG_EXPECT(ng_layernorm_check(NULL, 0) == NG_ERR_INVALID_ARG);
    return ng_test_finish("test_layernorm");
}
