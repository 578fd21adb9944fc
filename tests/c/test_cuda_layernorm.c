/*
 * tests/c/test_cuda_layernorm.c - the LayerNorm / RMSNorm launchers against
 * the CPU kernels (the fixture's rules: cuda_fixture.h).
 *
 * Cases: LayerNorm and RMSNorm, fwd + bwd, fp32 / fp16 / bf16: widths 1 ..
 * 4097, 65539 rows (more than one grid), with and without weight / bias, dx
 * or parameter gradients alone, constant rows (eps 0 too), rows offset by
 * 1000, rows whose squares overflow fp32, NaN / Inf rows, zero-width rows;
 * fp64 must be refused.
 *
 * Tolerances: fp32 statistics reduced in another order (per CUDA block vs
 * per CPU row / block of rows), then one rounding of the output on each side
 * (one ulp apart at most: fp16 2^-10, bf16 2^-7 relative):
 *                 y                dx               dweight, dbias
 *        fp32   1e-5 / 1e-5      1e-4 / 1e-4      1e-4 / 1e-4
 *        fp16   2e-3 / 1e-3      2e-3 / 2e-3      2e-3 / 1e-3
 *        bf16   1e-2 / 8e-3      1e-2 / 1e-2      1e-2 / 8e-3
 * (rtol / afrac; afrac of the row's largest |y|, of rstd max |dy w| for dx,
 * of the whole vector for dweight / dbias). mean: rtol 2e-5, afrac 1e-6 of
 * max |x|; rstd: rtol 2e-5 (fp32 for every input dtype). Constant rows are
 * exact (y is the bias, rstd 1/sqrt(eps) or 0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/layernorm.h"
#include "tests/c/cuda_fixture.h"

enum { LN_PLAIN, LN_CONST, LN_OFFSET, LN_HUGE, LN_NONFINITE };
enum { G_DX = 1, G_DW = 2, G_DB = 4, G_ALL = 7 };

typedef struct lncase {
    const char *name;
    int64_t rows, cols;
    int rms, has_w, has_b;
    double eps;
    int special, grads; /* grads: G_* outputs of the backward; 0: forward only */
} lncase;

/* clang-format off */
static const lncase LN_CASES[] = {
    /* name               rows   cols  rms w  b  eps   special       grads */
    {"1x1",               1,     1,    0, 1, 1, 1e-5, LN_PLAIN,     G_ALL},
    {"7x33",              7,     33,   0, 1, 1, 1e-5, LN_PLAIN,     G_ALL},
    {"3x4097",            3,     4097, 0, 1, 1, 1e-5, LN_PLAIN,     G_ALL},
    {"129x1000_no_affine", 129,  1000, 0, 0, 0, 1e-5, LN_PLAIN,     G_DX},
    {"300x17_weight_only", 300,  17,   0, 1, 0, 1e-6, LN_PLAIN,     G_DX | G_DW},
    {"64x768_params_only", 64,   768,  0, 1, 1, 1e-5, LN_PLAIN,     G_DW | G_DB},
    {"65539x3_grid_loop", 65539, 3,    0, 1, 1, 1e-5, LN_PLAIN,     G_ALL},
    {"9x130_const_rows",  9,     130,  0, 1, 1, 1e-5, LN_CONST,     G_ALL},
    {"9x130_const_eps0",  9,     130,  0, 1, 1, 0.0,  LN_CONST,     G_ALL},
    {"17x513_offset",     17,    513,  0, 1, 1, 1e-5, LN_OFFSET,    G_ALL},
    {"5x257_huge_row",    5,     257,  0, 1, 1, 1e-5, LN_HUGE,      G_ALL},
    {"6x100_nonfinite",   6,     100,  0, 1, 1, 1e-5, LN_NONFINITE, G_DX | G_DB},
    {"3x0_empty_rows",    3,     0,    0, 1, 1, 1e-5, LN_PLAIN,     0},
    {"rms_7x33",          7,     33,   1, 1, 0, 1e-5, LN_PLAIN,     G_DX | G_DW},
    {"rms_3x4097",        3,     4097, 1, 1, 0, 1e-5, LN_PLAIN,     G_DX | G_DW},
    {"rms_129x1000_no_w", 129,   1000, 1, 0, 0, 1e-5, LN_PLAIN,     G_DX},
    {"rms_65539x3",       65539, 3,    1, 1, 0, 1e-6, LN_PLAIN,     G_DX | G_DW},
    {"rms_9x130_const_eps0", 9,  130,  1, 1, 0, 0.0,  LN_CONST,     G_DX | G_DW},
    {"rms_5x257_huge_row", 5,    257,  1, 1, 0, 1e-5, LN_HUGE,      G_DX | G_DW},
    {"rms_6x100_nonfinite", 6,   100,  1, 1, 0, 1e-5, LN_NONFINITE, G_DX},
};
/* clang-format on */

static tol ln_tol(ng_dtype t, int which) { /* 0 y, 1 dx, 2 dweight / dbias */
    static const double tab[3][3][2] = {
        /*          y             dx            dw, db        (rtol, afrac) */
        /* fp32 */ {{1e-5, 1e-5}, {1e-4, 1e-4}, {1e-4, 1e-4}},
        /* fp16 */ {{2e-3, 1e-3}, {2e-3, 2e-3}, {2e-3, 1e-3}},
        /* bf16 */ {{1e-2, 8e-3}, {1e-2, 1e-2}, {1e-2, 8e-3}},
    };
    const double *r = tab[t == NG_F32 ? 0 : t == NG_F16 ? 1 : 2][which];
    return (tol){r[0], r[1], 0, "fp32 statistics in another order, one output rounding each"};
}

static void ln_fill_row(void *x, ng_dtype t, int64_t r, int64_t cols, int special, ng_rng *rng) {
    const double huge = t == NG_F16 ? 3e4 : 1e20; /* squares overflow fp32 (not in fp16's range) */
    for (int64_t c = 0; c < cols; c++) {
        double v = ng_rng_unif(rng);
        if (special == LN_CONST && r < 3) v = r == 0 ? 3.0 : r == 1 ? 0.0 : -1.5;
        if (special == LN_OFFSET) v = 1000.0 + 2.0 * v;
        if (special == LN_HUGE && r == 1) v = (c % 2 ? -huge : huge) * (1.0 + 0.5 * urand(rng));
        if (special == LN_NONFINITE) {
            if (r == 0 && c == NG_MIN(5, cols - 1)) v = NAN;
            if (r == 2 && c == 0) v = INFINITY;
            if (r == 4 && c == cols - 1) v = -INFINITY;
        }
        ng_store_f64(x, t, r * cols + c, v);
    }
}

/* A case's buffers: host (the CPU kernel's) and device (the launcher's). */
typedef struct ln_io {
    size_t nb, cb, rb; /* bytes of x, of one row of parameters, of the stats */
    void *x, *dy, *w, *b, *y, *dx, *dw, *db;
    float *mean, *rstd;
    void *x_d, *dy_d, *w_d, *b_d, *y_d, *dx_d, *dw_d, *db_d, *mean_d, *rstd_d;
} ln_io;

/* Host inputs and outputs, and the CPU kernel's arguments. */
static ng_layernorm_args ln_host(const lncase *c, ng_dtype t, ln_io *io) {
    const int64_t R = c->rows, C = c->cols, n = R * C;
    const size_t es = ng_dtype_size(t);
    io->nb = (size_t)n * es, io->cb = (size_t)C * es, io->rb = (size_t)R * 4;
    ng_rng rng = {0x5eed0000u + (uint64_t)(R * 7919 + C) * 4 + (uint64_t)t};
    io->x = malloc(io->nb + 1), io->dy = malloc(io->nb + 1);
    io->w = malloc(io->cb + 1), io->b = malloc(io->cb + 1);
    for (int64_t r = 0; r < R; r++) ln_fill_row(io->x, t, r, C, c->special, &rng);
    for (int64_t i = 0; i < n; i++) ng_store_f64(io->dy, t, i, ng_rng_unif(&rng));
    for (int64_t i = 0; i < C; i++) ng_store_f64(io->w, t, i, 1.0 + 0.5 * ng_rng_unif(&rng));
    for (int64_t i = 0; i < C; i++) ng_store_f64(io->b, t, i, 0.3 * ng_rng_unif(&rng));
    io->y = calloc(io->nb + 1, 1), io->dx = calloc(io->nb + 1, 1);
    io->dw = calloc(io->cb + 1, 1), io->db = calloc(io->cb + 1, 1);
    io->mean = calloc((size_t)R + 1, 4), io->rstd = calloc((size_t)R + 1, 4);

    ng_layernorm_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.rows = R;
    a.cols = C;
    a.rms = c->rms;
    a.eps = c->eps;
    a.x = C ? io->x : NULL;
    a.weight = c->has_w ? io->w : NULL;
    a.bias = c->has_b ? io->b : NULL;
    a.mean = c->rms ? NULL : io->mean;
    a.rstd = io->rstd;
    a.y = C ? io->y : NULL;
    a.dy = C ? io->dy : NULL;
    a.dx = (c->grads & G_DX) ? io->dx : NULL;
    a.dweight = (c->grads & G_DW) ? io->dw : NULL;
    a.dbias = (c->grads & G_DB) ? io->db : NULL;
    return a;
}

/* Device copies of the inputs, poisoned outputs, and the same arguments
 * with device pointers. */
static ng_layernorm_args ln_device(const ng_layernorm_args *a, ln_io *io) {
    io->x_d = dupload(io->x, io->nb), io->dy_d = dupload(io->dy, io->nb);
    io->w_d = dupload(io->w, io->cb), io->b_d = dupload(io->b, io->cb);
    io->y_d = dmalloc(io->nb), io->dx_d = dmalloc(io->nb);
    io->dw_d = dmalloc(io->cb), io->db_d = dmalloc(io->cb);
    io->mean_d = dmalloc(io->rb), io->rstd_d = dmalloc(io->rb);
    dpoison(io->y_d, io->nb);
    dpoison(io->mean_d, io->rb);
    dpoison(io->rstd_d, io->rb);
    ng_layernorm_args ad = *a;
    ad.x = a->x ? io->x_d : NULL;
    ad.weight = a->weight ? io->w_d : NULL;
    ad.bias = a->bias ? io->b_d : NULL;
    ad.mean = a->mean ? io->mean_d : NULL;
    ad.rstd = io->rstd_d;
    ad.y = a->y ? io->y_d : NULL;
    ad.dy = a->dy ? io->dy_d : NULL;
    ad.dx = a->dx ? io->dx_d : NULL;
    ad.dweight = a->dweight ? io->dw_d : NULL;
    ad.dbias = a->dbias ? io->db_d : NULL;
    return ad;
}

static void ln_free(ln_io *io) {
    dfree(io->x_d), dfree(io->dy_d), dfree(io->w_d), dfree(io->b_d), dfree(io->y_d);
    dfree(io->dx_d), dfree(io->dw_d), dfree(io->db_d), dfree(io->mean_d), dfree(io->rstd_d);
    free(io->x), free(io->dy), free(io->w), free(io->b), free(io->y), free(io->dx), free(io->dw);
    free(io->db), free(io->mean), free(io->rstd);
}

/* mean: afrac relative to the row's largest finite |x| */
static void ln_check_mean(const ln_io *io, ng_dtype t, int64_t R, int64_t C, const float *mg) {
    double *xs = malloc(sizeof(double) * (size_t)(R + 1)), *mr = to_f64(io->mean, NG_F32, R),
           *mc = to_f64(mg, NG_F32, R);
    for (int64_t r = 0; r < R; r++) {
        xs[r] = 0.0;
        for (int64_t i = 0; i < C; i++) {
            double v = fabs(ng_load_f64(io->x, t, r * C + i));
            if (isfinite(v) && v > xs[r]) xs[r] = v;
        }
    }
    close_rows("mean", mc, mr, R, 1, (tol){2e-5, 1e-6, 0, "fp32 statistics"}, xs);
    free(xs);
    free(mr);
    free(mc);
}

/* The forward launch's y, rstd and mean against the CPU's. */
static void ln_check_fwd(const lncase *c, ng_dtype t, const ln_io *io) {
    const int64_t R = c->rows, C = c->cols, n = R * C;
    const size_t es = ng_dtype_size(t);
    void *yg = ddownload(io->y_d, io->nb);
    float *mg = ddownload(io->mean_d, io->rb), *rg = ddownload(io->rstd_d, io->rb);
    double *yr = to_f64(io->y, t, n), *yc = to_f64(yg, t, n);
    close_rows("y", yc, yr, R, C, ln_tol(t, 0), NULL);
    double *sr = to_f64(io->rstd, NG_F32, R), *sc = to_f64(rg, NG_F32, R);
    close_rows("rstd", sc, sr, R, 1, (tol){2e-5, 0, 0, "fp32 statistics"}, NULL);
    if (!c->rms) ln_check_mean(io, t, R, C, mg);
    if (c->special == LN_CONST) {
        /* exact: a constant row (LayerNorm) or a zero row (both) has y = bias (or 0)
         * and rstd = 1/sqrt(eps) (or 0 for eps = 0) on both sides */
        for (int64_t r = 0; r < NG_MIN(R, 3); r++) {
            if (c->rms && r != 1) continue;
            CHECK(memcmp((char *)yg + (size_t)(r * C) * es, (char *)io->y + (size_t)(r * C) * es,
                         (size_t)C * es) == 0,
                  "constant row %lld: y differs from the CPU's bit pattern", (long long)r);
            CHECK(memcmp(rg + r, io->rstd + r, 4) == 0,
                  "constant row %lld: rstd cuda %.9g cpu %.9g", (long long)r, (double)rg[r],
                  (double)io->rstd[r]);
        }
    }
    free(yg);
    free(mg);
    free(rg);
    free(yr);
    free(yc);
    free(sr);
    free(sc);
}

/* dx = rstd (g - mean(g) - xhat mean(g xhat)) is a difference of terms of
 * size rstd max|g| that can cancel almost completely (a row of 3 has one
 * degree of freedom left): afrac is relative to that scale, not to the
 * row's dx */
static void ln_check_dx(const lncase *c, ng_dtype t, const ln_io *io) {
    const int64_t R = c->rows, C = c->cols, n = R * C;
    void *g = ddownload(io->dx_d, io->nb);
    double *r = to_f64(io->dx, t, n), *d = to_f64(g, t, n);
    double *gs = calloc((size_t)R, sizeof(double));
    for (int64_t rr = 0; rr < R; rr++) {
        double gm = 0.0;
        for (int64_t cc = 0; cc < C; cc++) {
            double gv = fabs(ng_load_f64(io->dy, t, rr * C + cc) *
                             (c->has_w ? ng_load_f64(io->w, t, cc) : 1.0));
            if (isfinite(gv) && gv > gm) gm = gv;
        }
        gs[rr] = isfinite(io->rstd[rr]) ? gm * io->rstd[rr] : 0.0;
    }
    close_rows("dx", d, r, R, C, ln_tol(t, 1), gs);
    free(g), free(r), free(d), free(gs);
}

/* One parameter gradient (dweight or dbias) over the whole vector. */
static void ln_check_param(const char *what, ng_dtype t, int64_t C, const void *cpu,
                           const void *dev, size_t cb) {
    void *g = ddownload(dev, cb);
    double *r = to_f64(cpu, t, C), *d = to_f64(g, t, C);
    close_rows(what, d, r, 1, C, ln_tol(t, 2), NULL);
    free(g), free(r), free(d);
}

/* The backward launch, fed the CPU forward's statistics, against the CPU's. */
static void ln_check_bwd(const lncase *c, ng_dtype t, const ng_layernorm_args *ad, ln_io *io) {
    /* the dweight / dbias partials over row chunks */
    const int64_t wsb = ng_layernorm_bwd_cuda_workspace_bytes(ad);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;
    /* the CPU forward's statistics are the backward's inputs on both sides */
    dcopy_to(io->rstd_d, io->rstd, io->rb);
    if (!c->rms) dcopy_to(io->mean_d, io->mean, io->rb);
    dpoison(io->dx_d, io->nb);
    dpoison(io->dw_d, io->cb);
    dpoison(io->db_d, io->cb);
    if (LAUNCHED(ng_layernorm_bwd_cuda_ws(ad, ws_d, wsb, g_stream))) {
        if (c->grads & G_DX) ln_check_dx(c, t, io);
        if (c->grads & G_DW) ln_check_param("dweight", t, c->cols, io->dw, io->dw_d, io->cb);
        if (c->grads & G_DB) ln_check_param("dbias", t, c->cols, io->db, io->db_d, io->cb);
        /* outputs not asked for (NULL) stay untouched */
        void *g1 = ddownload(io->dx_d, io->nb), *g2 = ddownload(io->dw_d, io->cb),
             *g3 = ddownload(io->db_d, io->cb);
        CHECK(((c->grads & G_DX) || all_ff(g1, io->nb)) &&
                  ((c->grads & G_DW) || all_ff(g2, io->cb)) &&
                  ((c->grads & G_DB) || all_ff(g3, io->cb)),
              "an output that was not requested (NULL) was written");
        free(g1), free(g2), free(g3);
    }
    dfree(ws_d);
}

static void ln_case(const lncase *c, ng_dtype t) {
    if (!case_begin("layernorm  %-24s %s", c->name, ng_dtype_name(t))) return;
    ln_io io;
    memset(&io, 0, sizeof io);
    ng_layernorm_args a = ln_host(c, t, &io);
    ng_status st = ng_layernorm_fwd(&a, NULL);
    CHECK(st == NG_OK, "CPU forward: %s", ng_status_str(st));
    if (st == NG_OK && c->grads) {
        st = ng_layernorm_bwd(&a, NULL);
        CHECK(st == NG_OK, "CPU backward: %s", ng_status_str(st));
    }
    ng_layernorm_args ad = ln_device(&a, &io);
    if (st == NG_OK && LAUNCHED(ng_layernorm_fwd_cuda(&ad, g_stream))) ln_check_fwd(c, t, &io);
    if (st == NG_OK && c->grads) ln_check_bwd(c, t, &ad, &io);
    ln_free(&io);
    case_end();
}

static void ln_rejects_fp64(void) {
    if (!case_begin("layernorm  %-24s %s", "rejects", "float64")) return;
    double x[4] = {1, 2, 3, 4}, *x_d = dupload(x, sizeof x);
    float *s_d = dmalloc(2 * sizeof(float));
    ng_layernorm_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F64;
    a.rows = 2;
    a.cols = 2;
    a.eps = 1e-5;
    a.x = x_d;
    a.y = x_d;
    a.dy = x_d;
    a.dx = x_d;
    a.mean = s_d;
    a.rstd = s_d;
    ng_status s1 = ng_layernorm_fwd_cuda(&a, g_stream), s2 = ng_layernorm_bwd_cuda(&a, g_stream);
    CHECK(s1 == NG_ERR_DTYPE && s2 == NG_ERR_DTYPE, "fp64: fwd %s, bwd %s (want %s)",
          ng_status_str(s1), ng_status_str(s2), ng_status_str(NG_ERR_DTYPE));
    CU(cudaStreamSynchronize(g_stream));
    dfree(x_d), dfree(s_d);
    case_end();
}

/* ---- layernorm: fp32 weight / bias of fp16 / bf16 input ------------------
 *
 * Self-contained: params_f32 set, x / dy / y / dx in the 16-bit dtype,
 * weight / bias / dweight / dbias fp32 (values 16 bits cannot hold). Against
 * an fp64 reference from the same inputs: y is the reference rounded once
 * (an element may miss the correctly rounded value only where the reference
 * sits within fp32 noise, 4e-6, of it, or by one ulp in at most 1% of the
 * elements); dweight / dbias are fp32 sums (fp32 tolerance, with the
 * workspace's row chunks when rows allow); dx against the CPU kernel with the
 * same parameters. */
static void ln_fp32_params_case(const char *name, int64_t R, int64_t C, int rms, ng_dtype t) {
    if (!case_begin("layernorm  %-24s %s", name, ng_dtype_name(t))) return;
    const int64_t n = R * C;
    const size_t es = ng_dtype_size(t), nb = (size_t)n * es, cb = (size_t)C * 4, rb = (size_t)R * 4;
    ng_rng rng = {0xf32f0000u + (uint64_t)(R * 31 + C) * 4 + (uint64_t)t};
    void *x = malloc(nb + 1), *dy = malloc(nb + 1);
    float *w = malloc(cb + 4), *b = malloc(cb + 4);
    double *xd = malloc(sizeof(double) * (size_t)n), *dyd = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        ng_store_f64(x, t, i, 3.0 * ng_rng_unif(&rng) + 0.5);
        ng_store_f64(dy, t, i, ng_rng_unif(&rng));
        xd[i] = ng_load_f64(x, t, i);
        dyd[i] = ng_load_f64(dy, t, i);
    }
    for (int64_t i = 0; i < C; i++) {
        w[i] = (float)(1.0 + 0.5 * ng_rng_unif(&rng));
        b[i] = (float)(0.25 * ng_rng_unif(&rng));
    }
    /* fp64 reference (naive two-pass) */
    double *yr = malloc(sizeof(double) * (size_t)n), *dwr = calloc((size_t)C, sizeof(double)),
           *dbr = calloc((size_t)C, sizeof(double)), *gs = calloc((size_t)R, sizeof(double));
    for (int64_t r = 0; r < R; r++) {
        double m = 0.0, v = 0.0, gm = 0.0;
        if (!rms) {
            for (int64_t c = 0; c < C; c++) m += xd[r * C + c];
            m /= (double)C;
        }
        for (int64_t c = 0; c < C; c++) v += (xd[r * C + c] - m) * (xd[r * C + c] - m);
        const double rs = 1.0 / sqrt(v / (double)C + 1e-5);
        for (int64_t c = 0; c < C; c++) {
            const double xh = (xd[r * C + c] - m) * rs;
            yr[r * C + c] = xh * w[c] + (rms ? 0.0 : b[c]);
            dwr[c] += dyd[r * C + c] * xh;
            dbr[c] += dyd[r * C + c];
            if (fabs(dyd[r * C + c] * w[c]) > gm) gm = fabs(dyd[r * C + c] * w[c]);
        }
        gs[r] = gm * rs; /* the scale of the row's dx terms */
    }
    /* the CPU kernel's dx with the same parameters */
    void *dxc = malloc(nb + 1);
    float *mean = malloc(rb + 4), *rstd = malloc(rb + 4), *dwc = malloc(cb + 4),
          *dbc = malloc(cb + 4);
    void *yc = malloc(nb + 1);
    ng_layernorm_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t, a.rows = R, a.cols = C, a.rms = rms, a.eps = 1e-5, a.params_f32 = 1;
    a.x = x, a.weight = w, a.bias = rms ? NULL : b, a.mean = rms ? NULL : mean, a.rstd = rstd;
    a.y = yc, a.dy = dy, a.dx = dxc, a.dweight = dwc, a.dbias = rms ? NULL : dbc;
    ng_status st = ng_layernorm_fwd(&a, NULL);
    if (st == NG_OK) st = ng_layernorm_bwd(&a, NULL);
    CHECK(st == NG_OK, "CPU kernels: %s", ng_status_str(st));

    void *x_d = dupload(x, nb), *dy_d = dupload(dy, nb), *w_d = dupload(w, cb),
         *b_d = dupload(b, cb);
    void *y_d = dmalloc(nb), *dx_d = dmalloc(nb), *dw_d = dmalloc(cb), *db_d = dmalloc(cb);
    void *mean_d = dmalloc(rb), *rstd_d = dmalloc(rb);
    dpoison(y_d, nb), dpoison(dx_d, nb), dpoison(dw_d, cb), dpoison(db_d, cb);
    ng_layernorm_args ad = a;
    ad.x = x_d, ad.weight = w_d, ad.bias = rms ? NULL : b_d, ad.mean = rms ? NULL : mean_d;
    ad.rstd = rstd_d, ad.y = y_d, ad.dy = dy_d, ad.dx = dx_d, ad.dweight = dw_d;
    ad.dbias = rms ? NULL : db_d;
    const int64_t wsb = ng_layernorm_bwd_cuda_workspace_bytes(&ad);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;
    if (st == NG_OK && LAUNCHED(ng_layernorm_fwd_cuda(&ad, g_stream)) &&
        LAUNCHED(ng_layernorm_bwd_cuda_ws(&ad, ws_d, wsb, g_stream))) {
        void *yg = ddownload(y_d, nb), *dxg = ddownload(dx_d, nb);
        float *dwg = ddownload(dw_d, cb), *dbg = ddownload(db_d, cb);
        int64_t off = 0, far = 0;
        uint16_t one[4] = {0}, nb16[4] = {0}; /* sized for any dtype, used as t */
        for (int64_t i = 0; i < n; i++) {
            ng_store_f64(one, t, 0, yr[i]);
            const double want = ng_load_f64(one, t, 0), y = ng_load_f64(yg, t, i);
            if (y == want || fabs(y - yr[i]) <= 4e-6) continue;
            off++;
            nb16[0] = (uint16_t)(one[0] + ((y > want) == (want > 0) ? 1 : -1));
            if (fabs(y - want) > fabs(ng_load_f64(nb16, t, 0) - want)) far++;
        }
        CHECK(off * 100 <= n && far == 0,
              "y: %lld of %lld not the correctly rounded reference, %lld by more than one ulp",
              (long long)off, (long long)n, (long long)far);
        double *dwgd = to_f64(dwg, NG_F32, C), *dbgd = to_f64(dbg, NG_F32, C);
        /* fp32 sums of R products of size ~1 */
        close_rows("dweight", dwgd, dwr, 1, C,
                   (tol){1e-5, 0, 1e-6 * (double)R, "fp32 sums of R products of size ~1"}, NULL);
        if (!rms)
            close_rows("dbias", dbgd, dbr, 1, C,
                       (tol){1e-5, 0, 1e-6 * (double)R, "fp32 sums of R products of size ~1"},
                       NULL);
        double *dxgd = to_f64(dxg, t, n), *dxcd = to_f64(dxc, t, n);
        close_rows("dx", dxgd, dxcd, R, C, ln_tol(t, 1), gs);
        free(yg), free(dxg), free(dwg), free(dbg), free(dwgd), free(dbgd), free(dxgd), free(dxcd);
    }
    /* fp32 parameters of fp64 input: refused */
    ng_layernorm_args a64 = ad;
    a64.dtype = NG_F64;
    CHECK(ng_layernorm_fwd_cuda(&a64, g_stream) == NG_ERR_DTYPE,
          "fp64 input with params_f32 not refused");
    dfree(x_d), dfree(dy_d), dfree(w_d), dfree(b_d), dfree(y_d), dfree(dx_d), dfree(dw_d),
        dfree(db_d);
    dfree(mean_d), dfree(rstd_d), dfree(ws_d);
    free(x), free(dy), free(w), free(b), free(xd), free(dyd), free(yr), free(dwr), free(dbr),
        free(gs);
    free(dxc), free(mean), free(rstd), free(dwc), free(dbc), free(yc);
    case_end();
}

static void test_layernorm_fp32_params(void) {
    for (int di = 1; di < 3; di++) { /* float16, bfloat16 */
        ln_fp32_params_case("fp32_params_7x33", 7, 33, 0, FLOAT_TYPES[di]);
        ln_fp32_params_case("fp32_params_600x40", 600, 40, 0, FLOAT_TYPES[di]); /* 2 row chunks */
        ln_fp32_params_case("fp32_params_rms_5x257", 5, 257, 1, FLOAT_TYPES[di]);
    }
}

void test_cuda_layernorm(void) {
    for (size_t ci = 0; ci < sizeof LN_CASES / sizeof LN_CASES[0]; ci++)
        for (int di = 0; di < 3; di++) {
            /* sample: the grids of more than 65535 rows in one dtype each */
            if (g_sample && LN_CASES[ci].rows > 65535 && di != (LN_CASES[ci].rms ? 2 : 0)) continue;
            ln_case(&LN_CASES[ci], FLOAT_TYPES[di]);
        }
    ln_rejects_fp64();
    test_layernorm_fp32_params();
}
