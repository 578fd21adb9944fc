/*
 * tests/c/test_cuda.c - every CUDA launcher (the .cu files of kernels/)
 * against the CPU kernel of the same op, on the same inputs.
 *
 * The CPU kernels are the oracle (the other ctest binaries check them against
 * plain fp64 loops). A case fills one argument struct with host pointers,
 * runs the CPU kernel serially (par = NULL), then hands the CUDA launcher the
 * same struct with device pointers swapped in and compares. Launches go to a
 * non-blocking stream of the test's own, which is also the only stream the
 * copies use: work a launcher put on the legacy default stream instead would
 * race with the copies rather than be ordered by accident. Device outputs
 * are filled with 0xff bytes (NaN in every float type) before each launch, so
 * an element the launcher never writes cannot pass, and padding between rows
 * and neighbouring stats slots must keep those bytes. A backward pass gets
 * the CPU forward's results (attention out / lse, LayerNorm mean / rstd) on
 * both sides, so it is judged on its own; the grad-guard apply pass likewise
 * gets the CPU's stats.
 *
 * Cases (fixed seeds, odd shapes):
 *   layernorm     LayerNorm and RMSNorm, fwd + bwd, fp32 / fp16 / bf16: widths
 *                 1 .. 4097, 65539 rows (more than one grid), with and
 *                 without weight / bias, dx or parameter gradients alone,
 *                 constant rows (eps 0 too), rows offset by 1000, rows whose
 *                 squares overflow fp32, NaN / Inf rows, zero-width rows;
 *                 fp64 must be refused.
 *   grad_guard    reduce + apply, fp32 / fp16 / bf16 / fp64, norm 2 and inf:
 *                 one tensor, mixed sizes with empty tensors and multi-block
 *                 tensors, 1100 tensors (more blocks than one launch's
 *                 table), a base one element off 16 bytes, an empty list;
 *                 no clip, clip, a multiplier of exactly 1, NaN + Inf (step
 *                 skipped, gradients untouched), a multiplier below FLT_MIN.
 *   tensor_stats  fp32 / fp16 / bf16 / fp64: scalar, empty, 1 .. 6.3M
 *                 elements (one block, many, the capped grid), transposed,
 *                 sliced, expanded (stride 0) and 8-d permuted views, all
 *                 zeros, all non-finite, extremes; written into the middle
 *                 slot of three.
 *   attention     fwd + bwd, fp32 / fp16 / bf16: E == Ev in {64, 128} (the
 *                 tensor-core path for fp16 / bf16) over every L, S in
 *                 {1, 7, 64, 129, 300}, plain and causal; then head dims 1,
 *                 40, 80, 256 and E != Ev; GQA (Hq 4, Hkv 2) and MQA; bool and
 *                 additive masks (-inf, finfo.min, fp32 masks on 16-bit data)
 *                 in [B,Hq,L,S], [B,1,1,S] and [L,S] shapes with fully masked
 *                 rows; clamp and soft-cap; dropout with fixed seed / offset
 *                 (also above 2^32); [B,S,H,D] strides, padded rows and a
 *                 base off 16 bytes (the tensor cores' unaligned staging);
 *                 scores beyond fp16's range; a NaN in q; L or S = 0; fp64
 *                 and Hq % Hkv != 0 must be refused.
 *
 * Usage: build/test_cuda [filter ...]. One line per case on stdout, "ok" or
 * "FAIL" with the worst error seen as a fraction of its limit; mismatches in
 * detail on stderr. With filters only the cases whose line contains one of
 * them run ("attention", "bfloat16", "gqa", ...); with NG_TEST_VERBOSE set in the
 * environment every comparison's worst error goes to stderr. Without a usable
 * CUDA device (cudaGetDeviceCount fails or finds none) it prints "SKIP: no
 * CUDA device" and exits 77, which ctest reports as skipped. A failing CUDA
 * runtime call ends the run (the context may be unusable after it); a
 * launcher returning anything but NG_OK fails its case with ng_status_str.
 *
 * Tolerances: |cuda - cpu| <= aabs + afrac * rowmax + rtol * |cpu|, rowmax
 * being the largest finite |cpu| in the same row of the tensor (its last
 * dimension; the whole vector for dweight / dbias; max |x| of the row for
 * the LayerNorm mean). A NaN must be a NaN and an infinity the same infinity.
 *
 *   tensor_stats  exact: both sides reduce the same bit patterns with exact
 *                 integer counts and max / min.
 *   grad_guard    stats exact except the sum of squares (rtol 1e-12: exact
 *                 fp64 squares summed in another order); found_inf exact.
 *                 Apply: same stats, same coefficient arithmetic, so the
 *                 gradients should match bit for bit; one unit in the last
 *                 place is allowed (fp32 3e-7, fp16 1e-3, bf16 8e-3, fp64
 *                 1e-12 relative, plus one subnormal step).
 *   layernorm     fp32 statistics reduced in another order (per CUDA block
 *                 vs per CPU row / block of rows), then one rounding of the
 *                 output on each side (one ulp apart at most: fp16 2^-10,
 *                 bf16 2^-7 relative):
 *                          y                dx               dweight, dbias
 *                 fp32   1e-5 / 1e-5      1e-4 / 1e-4      1e-4 / 1e-4
 *                 fp16   2e-3 / 1e-3      2e-3 / 2e-3      2e-3 / 1e-3
 *                 bf16   1e-2 / 8e-3      1e-2 / 1e-2      1e-2 / 8e-3
 *                 (rtol / afrac). mean: rtol 2e-5, afrac 1e-6 of max |x|;
 *                 rstd: rtol 2e-5 (fp32 for every input dtype). Constant
 *                 rows are exact (y is the bias, rstd 1/sqrt(eps) or 0).
 *   attention                out               lse (fp32)          dq, dk, dv
 *                 fp32   1e-4 / 1e-4      1e-5 rtol, 1e-4 aabs   2e-4 / 2e-4 / 2e-6
 *                 fp16   2e-2 / 3e-3      1e-5 rtol, 2e-3 aabs   2e-2 / 1e-2 / 4e-6
 *                 bf16   2e-2 / 1e-2      1e-5 rtol, 8e-3 aabs   3e-2 / 2e-2 / 1e-5
 *                 fp32: the same fp32 arithmetic in another order, and
 *                 CUDA's expf against the CPU's polynomial exp (~1 ulp).
 *                 fp16 / bf16: the tensor-core path (E == Ev, 64 or 128)
 *                 rounds probabilities (and dS in the backward) to the input
 *                 dtype before its matrix products, 2^-11 / 2^-8 per term
 *                 where the CPU keeps fp32, and each side rounds the output
 *                 once; its lse may come from a sum of rounded
 *                 probabilities. (rtol / afrac / aabs; the gradients' aabs
 *                 is scaled by the q, k magnitude and the square root of the
 *                 number of terms summed: rows with a single key have
 *                 dP - D = rounding noise.) Fully masked rows are exact:
 *                 out and dq rows 0, lse -inf. Inputs are chosen so that no
 *                 result hangs on a rounding difference: clamp cases put q,
 *                 k on a 1/8 grid with scale 1/8 (raw scores exact, so both
 *                 sides clamp the same ones), and the scores beyond fp16's
 *                 range are integers far apart (an exactly one-hot softmax).
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels/attention.h"
#include "kernels/cuda_status.h"
#include "kernels/grad_guard.h"
#include "kernels/layernorm.h"
#include "kernels/tensor_stats.h"
#include "tests/c/ng_test.h"

static const ng_dtype FLOAT_TYPES[3] = {NG_F32, NG_F16, NG_BF16};

/* ---- cases and checks ---------------------------------------------------- */

static char **g_filters;     /* run only the cases whose line contains one of these */
static int g_nfilters;
/* Run a sample of the cases. On the CPU emulator of the CUDA execution model
 * (tests/cuda_emu) a warp intrinsic costs about a microsecond per warp, so
 * the SIMT attention kernels, the 65539-row LayerNorms and the 1100-tensor
 * gradient lists take minutes: there a sample runs, chosen so that every
 * kernel and every template instantiation still runs (each dtype, both
 * tensor-core head dims and the SIMT ones, every mask kind, dropout, GQA,
 * ragged tails, zero sizes, multi-table gradient lists, 16/32/64-bit
 * tensor_stats). NG_EMU_FULL=1 runs every case there too; a GPU always does. */
static int g_sample;
static int g_verbose;       /* NG_TEST_VERBOSE set: the worst error of every comparison on stderr */
static char g_case[192];    /* the current case's line */
static int g_case_bad;      /* failed checks in the current case */
static double g_case_worst; /* worst |d| / limit among the values that passed */
static int g_cases, g_cases_failed;

__attribute__((format(printf, 1, 2))) static int case_begin(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_case, sizeof g_case, fmt, ap);
    va_end(ap);
    if (g_nfilters) {
        int hit = 0;
        for (int f = 0; f < g_nfilters && !hit; f++) hit = strstr(g_case, g_filters[f]) != NULL;
        if (!hit) return 0;
    }
    g_case_bad = 0;
    g_case_worst = 0.0;
    g_cases++;
    return 1;
}

static void case_end(void) {
    if (g_case_bad) g_cases_failed++;
    printf("%-64s %s (worst %.3f of tol)\n", g_case, g_case_bad ? "FAIL" : "ok", g_case_worst);
    fflush(stdout);
}

__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...) {
    va_list ap;
    ng_test_failures++;
    g_case_bad++;
    fprintf(stderr, "FAIL %s: ", g_case);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        ng_test_checks++;                                                                          \
        if (!(cond)) fail(__VA_ARGS__);                                                            \
    } while (0)

typedef struct tol {
    double rtol, afrac, aabs;
} tol;

/* Compare rows x cols values (see the header for the rule). rowscale, when
 * given, replaces each row's own largest |ref| in the afrac term. */
static void close_rows(const char *what, const double *got, const double *ref, int64_t rows,
                       int64_t cols, tol t, const double *rowscale) {
    int64_t bad = 0;
    double worst = 0.0;
    ng_test_checks++;
    for (int64_t r = 0; r < rows; r++) {
        const double *g = got + r * cols, *w = ref + r * cols;
        double rowmax = 0.0;
        if (rowscale) {
            rowmax = rowscale[r];
        } else {
            for (int64_t c = 0; c < cols; c++)
                if (isfinite(w[c]) && fabs(w[c]) > rowmax) rowmax = fabs(w[c]);
        }
        for (int64_t c = 0; c < cols; c++) {
            double d = fabs(g[c] - w[c]), lim = t.aabs + t.afrac * rowmax + t.rtol * fabs(w[c]);
            int ok = isnan(w[c])   ? isnan(g[c])
                     : isinf(w[c]) ? g[c] == w[c]
                                   : (isfinite(g[c]) && d <= lim);
            if (!ok) {
                if (bad < 3)
                    fprintf(stderr, "  %s: %s[%lld, %lld]: cuda %.9g cpu %.9g (limit %.3g)\n",
                            g_case, what, (long long)r, (long long)c, g[c], w[c], lim);
                bad++;
            } else if (d > 0.0 && d / lim > worst) {
                worst = d / lim;
            }
        }
    }
    if (worst > g_case_worst) g_case_worst = worst;
    if (bad) {
        ng_test_failures++;
        g_case_bad++;
        fprintf(stderr, "FAIL %s: %s: %lld of %lld values outside rtol %g afrac %g aabs %g\n",
                g_case, what, (long long)bad, (long long)(rows * cols), t.rtol, t.afrac, t.aabs);
    } else if (g_verbose) {
        fprintf(stderr, "  %s: %s: worst %.3f of tol\n", g_case, what, worst);
    }
}

static double *to_f64(const void *src, ng_dtype t, int64_t n) {
    double *d = calloc((size_t)(n + 1), sizeof(double));
    for (int64_t i = 0; i < n; i++)
        d[i] = ng_load_f64(src, t, i);
    return d;
}

static double urand(ng_rng *r) {
    return 0.5 * (ng_rng_unif(r) + 1.0);
} /* [0, 1) */

/* ---- device plumbing ------------------------------------------------------ */

static cudaStream_t g_stream;

static void cuda_fatal(cudaError_t e, const char *stmt, const char *file, int line) {
    ng_test_failures++;
    fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", file, line, stmt, cudaGetErrorName(e),
            cudaGetErrorString(e));
    printf("test_cuda: stopped at a CUDA error in %s: %s\n", g_case[0] ? g_case : "setup",
           cudaGetErrorName(e));
    exit(ng_test_finish("test_cuda"));
}

/* Every CUDA runtime call goes through this. */
#define CU(stmt)                                                                                   \
    do {                                                                                           \
        cudaError_t cu_e_ = (stmt);                                                                \
        if (cu_e_ != cudaSuccess) cuda_fatal(cu_e_, #stmt, __FILE__, __LINE__);                    \
    } while (0)

/* A launcher's status: anything but NG_OK fails the case. On success the
 * stream is synchronized, so a fault inside the kernels surfaces here. */
#define LAUNCHED(stmt) launched((stmt), #stmt, __LINE__)
static int launched(ng_status s, const char *stmt, int line) {
    ng_test_checks++;
    if (s != NG_OK) {
        fail("line %d: %s returned %s", line, stmt, ng_status_str(s));
        return 0;
    }
    CU(cudaStreamSynchronize(g_stream));
    return 1;
}

static void *dmalloc(size_t bytes) {
    void *p = NULL;
    CU(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static void dfree(void *p) {
    if (p) CU(cudaFree(p));
}

static void *dupload(const void *h, size_t bytes) {
    void *d = dmalloc(bytes);
    if (bytes) CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, g_stream));
    return d;
}

static void dcopy_to(void *d, const void *h, size_t bytes) {
    if (bytes) CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, g_stream));
}

static void dpoison(void *d, size_t bytes) {
    if (bytes) CU(cudaMemsetAsync(d, 0xff, bytes, g_stream));
}

/* Copy back and wait; returns a malloc'd host buffer. */
static void *ddownload(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    if (bytes) CU(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, g_stream));
    CU(cudaStreamSynchronize(g_stream));
    return h;
}

static int all_ff(const void *p, size_t bytes) {
    const uint8_t *b = p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i] != 0xff) return 0;
    return 1;
}

/* ---- layernorm ------------------------------------------------------------ */

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
    static const tol tab[3][3] = {
        /*          y                     dx                    dw, db */
        /* fp32 */ {{1e-5, 1e-5, 0}, {1e-4, 1e-4, 0}, {1e-4, 1e-4, 0}},
        /* fp16 */ {{2e-3, 1e-3, 0}, {2e-3, 2e-3, 0}, {2e-3, 1e-3, 0}},
        /* bf16 */ {{1e-2, 8e-3, 0}, {1e-2, 1e-2, 0}, {1e-2, 8e-3, 0}},
    };
    return tab[t == NG_F32 ? 0 : t == NG_F16 ? 1 : 2][which];
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

static void ln_case(const lncase *c, ng_dtype t) {
    if (!case_begin("layernorm  %-24s %s", c->name, ng_dtype_name(t))) return;
    const int64_t R = c->rows, C = c->cols, n = R * C;
    const size_t es = ng_dtype_size(t), nb = (size_t)n * es, cb = (size_t)C * es,
                 rb = (size_t)R * 4;
    ng_rng rng = {0x5eed0000u + (uint64_t)(R * 7919 + C) * 4 + (uint64_t)t};

    void *x = malloc(nb + 1), *dy = malloc(nb + 1), *w = malloc(cb + 1), *b = malloc(cb + 1);
    for (int64_t r = 0; r < R; r++)
        ln_fill_row(x, t, r, C, c->special, &rng);
    for (int64_t i = 0; i < n; i++)
        ng_store_f64(dy, t, i, ng_rng_unif(&rng));
    for (int64_t i = 0; i < C; i++)
        ng_store_f64(w, t, i, 1.0 + 0.5 * ng_rng_unif(&rng));
    for (int64_t i = 0; i < C; i++)
        ng_store_f64(b, t, i, 0.3 * ng_rng_unif(&rng));
    void *y = calloc(nb + 1, 1), *dx = calloc(nb + 1, 1), *dw = calloc(cb + 1, 1),
         *db = calloc(cb + 1, 1);
    float *mean = calloc((size_t)R + 1, 4), *rstd = calloc((size_t)R + 1, 4);

    ng_layernorm_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.rows = R;
    a.cols = C;
    a.rms = c->rms;
    a.eps = c->eps;
    a.x = C ? x : NULL;
    a.weight = c->has_w ? w : NULL;
    a.bias = c->has_b ? b : NULL;
    a.mean = c->rms ? NULL : mean;
    a.rstd = rstd;
    a.y = C ? y : NULL;
    a.dy = C ? dy : NULL;
    a.dx = (c->grads & G_DX) ? dx : NULL;
    a.dweight = (c->grads & G_DW) ? dw : NULL;
    a.dbias = (c->grads & G_DB) ? db : NULL;

    ng_status st = ng_layernorm_fwd(&a, NULL);
    CHECK(st == NG_OK, "CPU forward: %s", ng_status_str(st));
    if (st == NG_OK && c->grads) {
        st = ng_layernorm_bwd(&a, NULL);
        CHECK(st == NG_OK, "CPU backward: %s", ng_status_str(st));
    }

    /* device copies; outputs poisoned */
    void *x_d = dupload(x, nb), *dy_d = dupload(dy, nb), *w_d = dupload(w, cb),
         *b_d = dupload(b, cb);
    void *y_d = dmalloc(nb), *dx_d = dmalloc(nb), *dw_d = dmalloc(cb), *db_d = dmalloc(cb);
    void *mean_d = dmalloc(rb), *rstd_d = dmalloc(rb);
    dpoison(y_d, nb);
    dpoison(mean_d, rb);
    dpoison(rstd_d, rb);
    ng_layernorm_args ad = a;
    ad.x = a.x ? x_d : NULL;
    ad.weight = a.weight ? w_d : NULL;
    ad.bias = a.bias ? b_d : NULL;
    ad.mean = a.mean ? mean_d : NULL;
    ad.rstd = rstd_d;
    ad.y = a.y ? y_d : NULL;
    ad.dy = a.dy ? dy_d : NULL;
    ad.dx = a.dx ? dx_d : NULL;
    ad.dweight = a.dweight ? dw_d : NULL;
    ad.dbias = a.dbias ? db_d : NULL;
    /* the dweight / dbias partials over row chunks */
    const int64_t wsb = ng_layernorm_bwd_cuda_workspace_bytes(&ad);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;

    if (st == NG_OK && LAUNCHED(ng_layernorm_fwd_cuda(&ad, g_stream))) {
        void *yg = ddownload(y_d, nb);
        float *mg = ddownload(mean_d, rb), *rg = ddownload(rstd_d, rb);
        double *yr = to_f64(y, t, n), *yc = to_f64(yg, t, n);
        close_rows("y", yc, yr, R, C, ln_tol(t, 0), NULL);
        double *sr = to_f64(rstd, NG_F32, R), *sc = to_f64(rg, NG_F32, R);
        close_rows("rstd", sc, sr, R, 1, (tol){2e-5, 0, 0}, NULL);
        if (!c->rms) {
            double *xs = malloc(sizeof(double) * (size_t)(R + 1)), *mr = to_f64(mean, NG_F32, R),
                   *mc = to_f64(mg, NG_F32, R);
            for (int64_t r = 0; r < R; r++) {
                xs[r] = 0.0;
                for (int64_t i = 0; i < C; i++) {
                    double v = fabs(ng_load_f64(x, t, r * C + i));
                    if (isfinite(v) && v > xs[r]) xs[r] = v;
                }
            }
            close_rows("mean", mc, mr, R, 1, (tol){2e-5, 1e-6, 0}, xs);
            free(xs);
            free(mr);
            free(mc);
        }
        if (c->special == LN_CONST) {
            /* exact: a constant row (LayerNorm) or a zero row (both) has y = bias (or 0)
             * and rstd = 1/sqrt(eps) (or 0 for eps = 0) on both sides */
            for (int64_t r = 0; r < NG_MIN(R, 3); r++) {
                if (c->rms && r != 1) continue;
                CHECK(memcmp((char *)yg + (size_t)(r * C) * es, (char *)y + (size_t)(r * C) * es,
                             (size_t)C * es) == 0,
                      "constant row %lld: y differs from the CPU's bit pattern", (long long)r);
                CHECK(memcmp(rg + r, rstd + r, 4) == 0,
                      "constant row %lld: rstd cuda %.9g cpu %.9g", (long long)r, (double)rg[r],
                      (double)rstd[r]);
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

    if (st == NG_OK && c->grads) {
        /* the CPU forward's statistics are the backward's inputs on both sides */
        dcopy_to(rstd_d, rstd, rb);
        if (!c->rms) dcopy_to(mean_d, mean, rb);
        dpoison(dx_d, nb);
        dpoison(dw_d, cb);
        dpoison(db_d, cb);
        if (LAUNCHED(ng_layernorm_bwd_cuda_ws(&ad, ws_d, wsb, g_stream))) {
            if (c->grads & G_DX) {
                void *g = ddownload(dx_d, nb);
                double *r = to_f64(dx, t, n), *d = to_f64(g, t, n);
                /* dx = rstd (g - mean(g) - xhat mean(g xhat)) is a difference
                 * of terms of size rstd max|g| that can cancel almost
                 * completely (a row of 3 has one degree of freedom left):
                 * afrac is relative to that scale, not to the row's dx */
                double *gs = calloc((size_t)R, sizeof(double));
                for (int64_t rr = 0; rr < R; rr++) {
                    double gm = 0.0;
                    for (int64_t cc = 0; cc < C; cc++) {
                        double gv = fabs(ng_load_f64(dy, t, rr * C + cc) * (c->has_w ? ng_load_f64(w, t, cc) : 1.0));
                        if (isfinite(gv) && gv > gm) gm = gv;
                    }
                    gs[rr] = isfinite(rstd[rr]) ? gm * rstd[rr] : 0.0;
                }
                close_rows("dx", d, r, R, C, ln_tol(t, 1), gs);
                free(g), free(r), free(d), free(gs);
            }
            if (c->grads & G_DW) {
                void *g = ddownload(dw_d, cb);
                double *r = to_f64(dw, t, C), *d = to_f64(g, t, C);
                close_rows("dweight", d, r, 1, C, ln_tol(t, 2), NULL);
                free(g), free(r), free(d);
            }
            if (c->grads & G_DB) {
                void *g = ddownload(db_d, cb);
                double *r = to_f64(db, t, C), *d = to_f64(g, t, C);
                close_rows("dbias", d, r, 1, C, ln_tol(t, 2), NULL);
                free(g), free(r), free(d);
            }
            /* outputs not asked for (NULL) stay untouched */
            void *g1 = ddownload(dx_d, nb), *g2 = ddownload(dw_d, cb), *g3 = ddownload(db_d, cb);
            CHECK(((c->grads & G_DX) || all_ff(g1, nb)) && ((c->grads & G_DW) || all_ff(g2, cb)) &&
                      ((c->grads & G_DB) || all_ff(g3, cb)),
                  "an output that was not requested (NULL) was written");
            free(g1), free(g2), free(g3);
        }
    }

    dfree(x_d), dfree(dy_d), dfree(w_d), dfree(b_d), dfree(y_d), dfree(dx_d), dfree(dw_d),
        dfree(db_d);
    dfree(mean_d), dfree(rstd_d), dfree(ws_d);
    free(x), free(dy), free(w), free(b), free(y), free(dx), free(dw), free(db), free(mean),
        free(rstd);
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

static void test_layernorm(void) {
    for (size_t ci = 0; ci < sizeof LN_CASES / sizeof LN_CASES[0]; ci++)
        for (int di = 0; di < 3; di++) {
            /* sample: the grids of more than 65535 rows in one dtype each */
            if (g_sample && LN_CASES[ci].rows > 65535 && di != (LN_CASES[ci].rms ? 2 : 0)) continue;
            ln_case(&LN_CASES[ci], FLOAT_TYPES[di]);
        }
    ln_rejects_fp64();
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
    float *mean = malloc(rb + 4), *rstd = malloc(rb + 4), *dwc = malloc(cb + 4), *dbc = malloc(cb + 4);
    void *yc = malloc(nb + 1);
    ng_layernorm_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t, a.rows = R, a.cols = C, a.rms = rms, a.eps = 1e-5, a.params_f32 = 1;
    a.x = x, a.weight = w, a.bias = rms ? NULL : b, a.mean = rms ? NULL : mean, a.rstd = rstd;
    a.y = yc, a.dy = dy, a.dx = dxc, a.dweight = dwc, a.dbias = rms ? NULL : dbc;
    ng_status st = ng_layernorm_fwd(&a, NULL);
    if (st == NG_OK) st = ng_layernorm_bwd(&a, NULL);
    CHECK(st == NG_OK, "CPU kernels: %s", ng_status_str(st));

    void *x_d = dupload(x, nb), *dy_d = dupload(dy, nb), *w_d = dupload(w, cb), *b_d = dupload(b, cb);
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
        close_rows("dweight", dwgd, dwr, 1, C, (tol){1e-5, 0, 1e-6 * (double)R}, NULL);
        if (!rms) close_rows("dbias", dbgd, dbr, 1, C, (tol){1e-5, 0, 1e-6 * (double)R}, NULL);
        double *dxgd = to_f64(dxg, t, n), *dxcd = to_f64(dxc, t, n);
        close_rows("dx", dxgd, dxcd, R, C, ln_tol(t, 1), gs);
        free(yg), free(dxg), free(dwg), free(dbg), free(dwgd), free(dbgd), free(dxgd), free(dxcd);
    }
    /* fp32 parameters of fp64 input: refused */
    ng_layernorm_args a64 = ad;
    a64.dtype = NG_F64;
    CHECK(ng_layernorm_fwd_cuda(&a64, g_stream) == NG_ERR_DTYPE, "fp64 input with params_f32 not refused");
    dfree(x_d), dfree(dy_d), dfree(w_d), dfree(b_d), dfree(y_d), dfree(dx_d), dfree(dw_d), dfree(db_d);
    dfree(mean_d), dfree(rstd_d), dfree(ws_d);
    free(x), free(dy), free(w), free(b), free(xd), free(dyd), free(yr), free(dwr), free(dbr), free(gs);
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

/* ---- gradient guard -------------------------------------------------------- */

enum { GL_ONE, GL_MIXED, GL_MANY, GL_MISALIGNED, GL_EMPTY, GL_COUNT };
static const char *const GL_NAMES[GL_COUNT] = {"1_tensor", "mixed_sizes", "1100_tensors",
                                               "misaligned", "empty_list"};
enum { GS_NOCLIP, GS_CLIP, GS_ONE, GS_NONFINITE, GS_WIDE, GS_COUNT };
static const char *const GS_NAMES[GS_COUNT] = {"no_clip", "clip", "coef_1", "nan_inf", "tiny_coef"};

/* Tensor sizes of a list; returns the count. mixed: empty tensors, one that
 * spans two blocks with a tail, one of exactly two blocks. many: more blocks
 * than one launch's descriptor table holds. */
static int64_t gg_list(int list, int64_t *numels, int *misalign) {
    *misalign = 0;
    switch (list) {
    case GL_ONE: numels[0] = 1; return 1;
    case GL_MIXED: {
        static const int64_t m[] = {0, 3, NG_GG_CHUNK + 7, 1000, 0, 2 * NG_GG_CHUNK, 17};
        memcpy(numels, m, sizeof m);
        return 7;
    }
    case GL_MANY:
        for (int64_t i = 0; i < 1100; i++)
            numels[i] = 1 + (i * 37) % 50;
        return 1100;
    case GL_MISALIGNED: /* one element past a 16-byte boundary: the scalar loads */
        *misalign = 1;
        numels[0] = 3 * NG_GG_CHUNK + 5;
        numels[1] = 33;
        return 2;
    case GL_EMPTY:
        numels[0] = 0;
        numels[1] = 0;
        return 2;
    }
    return 0;
}

static tol gg_tol(ng_dtype t) {
    switch (t) {
    case NG_F64: return (tol){1e-12, 0, 5e-324};
    case NG_F32: return (tol){3e-7, 0, 1.5e-45};
    case NG_F16: return (tol){1e-3, 0, 6e-8};
    case NG_BF16: return (tol){8e-3, 0, 1e-40};
    }
    return (tol){0, 0, 0};
}

static void gg_case(ng_dtype t, ng_gg_norm norm, int list, int scen) {
    if (!case_begin("grad_guard %s %s %s %s", norm == NG_GG_NORM_2 ? "norm2" : "norm_inf",
                    GL_NAMES[list], GS_NAMES[scen], ng_dtype_name(t)))
        return;
    int64_t numels[1100];
    int misalign;
    const int64_t n = gg_list(list, numels, &misalign);
    const size_t es = ng_dtype_size(t);
    ng_rng rng = {0x6e6700u + (uint64_t)(list * 64 + scen * 8 + (int)norm * 4) + (uint64_t)t};
    const double mag = t == NG_F16 ? 8.0 : 4.0;

    void *host[1100], *orig[1100], *dbase[1100], *dptr[1100];
    for (int64_t i = 0; i < n; i++) {
        size_t bytes = (size_t)numels[i] * es;
        host[i] = malloc(bytes + 1);
        for (int64_t e = 0; e < numels[i]; e++)
            ng_store_f64(host[i], t, e, mag * ng_rng_unif(&rng));
    }
    if (scen == GS_NONFINITE) { /* a NaN in the first non-empty tensor after #1, Infs in the last */
        int64_t first = -1, last = -1;
        for (int64_t i = 0; i < n; i++)
            if (numels[i] > 0) {
                if (first < 0 && i >= 1) first = i;
                last = i;
            }
        if (first >= 0) ng_store_f64(host[first], t, numels[first] / 2, NAN);
        if (last >= 0) {
            ng_store_f64(host[last], t, 0, INFINITY);
            ng_store_f64(host[last], t, numels[last] - 1, -INFINITY);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        size_t bytes = (size_t)numels[i] * es;
        orig[i] = malloc(bytes + 1);
        memcpy(orig[i], host[i], bytes);
        dbase[i] = dmalloc(bytes + (size_t)misalign * es);
        dptr[i] = (char *)dbase[i] + (size_t)misalign * es;
        dcopy_to(dptr[i], host[i], bytes);
    }

    const float inv_scale = scen == GS_NOCLIP ? 1.0f / 1024.0f : scen == GS_ONE ? 1.0f : 0.37f;
    const ng_dtype ndt = (list + scen) % 2 ? NG_F64 : NG_F32;
    double stats[NG_GG_NSTATS];
    ng_status st = ng_grad_guard_reduce((const void *const *)host, numels, n, t, &inv_scale, norm,
                                        stats, NULL);
    CHECK(st == NG_OK, "CPU reduce: %s", ng_status_str(st));
    double total = ng_gg_total_norm(stats, norm);
    double max_norm = scen == GS_CLIP ? 0.25 * total : scen == GS_WIDE ? 1e-40 : 1e30;
    if (!(max_norm >= 0.0)) max_norm = 1.0; /* non-finite total: any max_norm */
    float found = 0.0f;
    union {
        double d;
        float f;
    } tn = {0.0};
    if (st == NG_OK) {
        st = ng_grad_guard_apply(host, numels, n, t, &inv_scale, stats, max_norm, norm, &found, &tn,
                                 ndt, NULL);
        CHECK(st == NG_OK, "CPU apply: %s", ng_status_str(st));
    }

    /* device side */
    const int64_t ws_bytes = ng_grad_guard_cuda_workspace_bytes(numels, n);
    void *ws = ws_bytes ? dmalloc((size_t)ws_bytes) : NULL;
    float *inv_d = dupload(&inv_scale, sizeof inv_scale);
    double *stats_d = dmalloc(sizeof stats);
    float zero = 0.0f, *found_d = dupload(&zero, sizeof zero);
    double *tn_d = dmalloc(sizeof(double));
    dpoison(stats_d, sizeof stats);
    if (st == NG_OK &&
        LAUNCHED(ng_grad_guard_reduce_cuda((const void *const *)dptr, numels, n, t, inv_d, norm,
                                           stats_d, ws, ws_bytes, g_stream))) {
        double *sg = ddownload(stats_d, sizeof stats);
        /* NaN / Inf in the gradients make the sum of squares NaN / Inf on both sides */
        const double ng = sg[NG_GG_NORM], nc = stats[NG_GG_NORM], nd = fabs(ng - nc);
        const double lim = norm == NG_GG_NORM_2 ? 1e-12 * fabs(nc) : 0.0;
        CHECK((isnan(ng) && isnan(nc)) || ng == nc || nd <= lim, "%s: cuda %.17g cpu %.17g",
              norm == NG_GG_NORM_2 ? "sum of squares" : "max |u|", ng, nc);
        if (isfinite(nd) && nd > 0.0 && lim > 0.0 && nd / lim > g_case_worst)
            g_case_worst = nd / lim;
        CHECK(sg[NG_GG_NAN] == stats[NG_GG_NAN] && sg[NG_GG_INF] == stats[NG_GG_INF] &&
                  sg[NG_GG_FIRST_BAD] == stats[NG_GG_FIRST_BAD],
              "counts: cuda nan %g inf %g first %g, cpu nan %g inf %g first %g", sg[NG_GG_NAN],
              sg[NG_GG_INF], sg[NG_GG_FIRST_BAD], stats[NG_GG_NAN], stats[NG_GG_INF],
              stats[NG_GG_FIRST_BAD]);
        free(sg);

        /* apply with the CPU's stats on both sides */
        dcopy_to(stats_d, stats, sizeof stats);
        dpoison(tn_d, sizeof(double));
        if (LAUNCHED(ng_grad_guard_apply_cuda(dptr, numels, n, t, inv_d, stats_d, max_norm, norm,
                                              found_d, tn_d, ndt, g_stream))) {
            float *fg = ddownload(found_d, sizeof(float));
            void *tg = ddownload(tn_d, sizeof(double));
            CHECK(*fg == found, "found_inf: cuda %g cpu %g", (double)*fg, (double)found);
            double tgv;
            if (ndt == NG_F64) {
                memcpy(&tgv, tg, sizeof tgv);
            } else {
                float f;
                memcpy(&f, tg, sizeof f);
                tgv = f;
            }
            double tcv = ndt == NG_F64 ? tn.d : (double)tn.f;
            CHECK((isnan(tcv) && isnan(tgv)) || tgv == tcv || fabs(tgv - tcv) <= 1e-12 * fabs(tcv),
                  "total norm (%s): cuda %.17g cpu %.17g", ng_dtype_name(ndt), tgv, tcv);
            for (int64_t i = 0; i < n; i++) {
                size_t bytes = (size_t)numels[i] * es;
                void *g = ddownload(dptr[i], bytes);
                char what[48];
                snprintf(what, sizeof what, "grad %lld", (long long)i);
                if (found != 0.0f || scen == GS_ONE) { /* untouched, bit for bit */
                    CHECK(memcmp(g, orig[i], bytes) == 0, "%s: changed although the step is %s",
                          what, found != 0.0f ? "skipped" : "a multiply by 1");
                } else {
                    double *r = to_f64(host[i], t, numels[i]), *d = to_f64(g, t, numels[i]);
                    close_rows(what, d, r, 1, numels[i], gg_tol(t), NULL);
                    free(r), free(d);
                }
                free(g);
            }
            free(fg);
            free(tg);
        }
    }

    for (int64_t i = 0; i < n; i++) {
        dfree(dbase[i]);
        free(host[i]);
        free(orig[i]);
    }
    dfree(ws), dfree(inv_d), dfree(stats_d), dfree(found_d), dfree(tn_d);
    case_end();
}

static void test_grad_guard(void) {
    const ng_dtype types[4] = {NG_F32, NG_F16, NG_BF16, NG_F64};
    for (int di = 0; di < 4; di++)
        for (int list = 0; list < GL_COUNT; list++) {
            /* sample: the lists that need two launches (1100 tensors) once
             * per dtype: norm 2 clipping (fp32, fp64) or norm inf skipping a
             * non-finite step (fp16, bf16) */
            const int many = g_sample && list == GL_MANY;
            for (int scen = 0; scen < GS_COUNT; scen++)
                if (!many || (di % 3 == 0 && scen == GS_CLIP)) gg_case(types[di], NG_GG_NORM_2, list, scen);
            if (!many) gg_case(types[di], NG_GG_NORM_INF, list, GS_CLIP);
            if (!many || di % 3 != 0) gg_case(types[di], NG_GG_NORM_INF, list, GS_NONFINITE);
        }
}

/* ---- tensor_stats ---------------------------------------------------------- */

typedef struct tsview {
    const char *name;
    int64_t ndim, sizes[NG_TS_MAX_DIMS], strides[NG_TS_MAX_DIMS];
    int fill; /* TF_* */
} tsview;

enum { TF_MIXED, TF_ZEROS, TF_NONFINITE, TF_EXTREMES };

/* clang-format off */
static const tsview TS_VIEWS[] = {
    {"scalar", 0, {0}, {0}, TF_MIXED},
    {"empty", 1, {0}, {1}, TF_MIXED},
    {"empty_3d", 3, {4, 0, 5}, {0, 5, 1}, TF_MIXED},
    {"contig_1", 1, {1}, {1}, TF_MIXED},
    {"contig_7", 1, {7}, {1}, TF_MIXED},
    {"contig_2047", 1, {2047}, {1}, TF_MIXED},
    {"contig_2049", 1, {2049}, {1}, TF_MIXED},
    {"contig_70001", 1, {70001}, {1}, TF_MIXED},
    {"contig_6291461_capped_grid", 1, {3 * 2097152 + 5}, {1}, TF_MIXED},
    {"zeros_37", 1, {37}, {1}, TF_ZEROS},
    {"zeros_5000", 1, {5000}, {1}, TF_ZEROS},
    {"nonfinite_37", 1, {37}, {1}, TF_NONFINITE},
    {"nonfinite_9000", 1, {9000}, {1}, TF_NONFINITE},
    {"extremes", 1, {2}, {1}, TF_EXTREMES},
    {"transposed_33x65", 2, {33, 65}, {1, 33}, TF_MIXED},
    {"sliced_5x13x4", 3, {5, 13, 4}, {360, 27, 2}, TF_MIXED},
    {"expanded_4x1000x3", 3, {4, 1000, 3}, {0, 3, 1}, TF_MIXED},
    {"permuted_8d_small", 8, {2, 3, 2, 3, 2, 3, 2, 3}, {1, 2, 6, 12, 36, 72, 216, 432}, TF_MIXED},
    {"permuted_8d_14400", 8, {3, 4, 5, 2, 3, 4, 5, 2}, {1, 3, 12, 60, 120, 360, 1440, 7200}, TF_MIXED},
    {"expanded_8d", 8, {2, 1, 3, 5, 1, 7, 4, 9}, {0, 0, 315, 63, 0, 9, 0, 1}, TF_MIXED},
};
/* clang-format on */

static void ts_fill(void *buf, ng_dtype t, int64_t n, int fill, ng_rng *rng) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t k = ng_rng_u64(rng) % 1000;
        double v = ng_rng_unif(rng) * (k % 2 ? 3e3 : 0.5);
        if (fill == TF_ZEROS)
            v = i % 2 ? 0.0 : -0.0;
        else if (fill == TF_NONFINITE)
            v = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
        else if (k < 5)
            v = k == 0 ? NAN : k % 2 ? INFINITY : -INFINITY;
        else if (k < 20)
            v = 0.0;
        else if (k < 30)
            v = (k & 1 ? -1.0 : 1.0) * 1e-6; /* subnormal in fp16 */
        ng_store_f64(buf, t, i, v);
    }
    if (fill == TF_MIXED && n > 2 && t != NG_F64) { /* a NaN with a payload, a negative NaN */
        if (t == NG_F32)
            ((uint32_t *)buf)[n / 2] = 0xffc00001u;
        else
            ((uint16_t *)buf)[n / 2] = 0xfe01u;
    }
    if (fill == TF_EXTREMES && n >= 2) { /* largest finite, smallest subnormal */
        if (t == NG_F16)
            ((uint16_t *)buf)[0] = 0x7bffu, ((uint16_t *)buf)[1] = 0x8001u;
        else if (t == NG_BF16)
            ((uint16_t *)buf)[0] = 0xff7fu, ((uint16_t *)buf)[1] = 0x0001u;
        else if (t == NG_F32)
            ((uint32_t *)buf)[0] = 0x7f7fffffu, ((uint32_t *)buf)[1] = 0x80000001u;
        else
            ((uint64_t *)buf)[0] = 0xffefffffffffffffull, ((uint64_t *)buf)[1] = 1u;
    }
}

static void ts_case(const tsview *vw, ng_dtype t) {
    if (!case_begin("tensor_stats %-26s %s", vw->name, ng_dtype_name(t))) return;
    int64_t span = 1, numel = 1; /* elements the buffer needs: 1 + max offset */
    for (int64_t d = 0; d < vw->ndim; d++) {
        numel *= vw->sizes[d];
        span += (vw->sizes[d] - 1) * vw->strides[d];
    }
    if (numel == 0) span = 0;
    const size_t es = ng_dtype_size(t), bytes = (size_t)span * es;
    ng_rng rng = {0x75000u + (uint64_t)span * 4 + (uint64_t)t};
    void *x = span ? malloc(bytes) : NULL;
    ts_fill(x, t, span, vw->fill, &rng);

    ng_tensor_stats_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.x = x;
    a.ndim = vw->ndim;
    memcpy(a.sizes, vw->sizes, sizeof a.sizes);
    memcpy(a.strides, vw->strides, sizeof a.strides);
    int64_t counts[NG_TS_NCOUNTS];
    double values[NG_TS_NVALUES];
    a.counts = counts;
    a.values = values;
    ng_status st = ng_tensor_stats(&a, NULL);
    CHECK(st == NG_OK, "CPU: %s", ng_status_str(st));

    /* the CUDA result goes to slot 1 of 3; slots 0 and 2 must keep their fill */
    void *x_d = span ? dupload(x, bytes) : NULL;
    int64_t *counts_d = dmalloc(3 * NG_TS_NCOUNTS * sizeof(int64_t));
    double *values_d = dmalloc(3 * NG_TS_NVALUES * sizeof(double));
    dpoison(counts_d, 3 * NG_TS_NCOUNTS * sizeof(int64_t));
    dpoison(values_d, 3 * NG_TS_NVALUES * sizeof(double));
    ng_tensor_stats_args ad = a;
    ad.x = x_d;
    ad.counts = counts_d + NG_TS_NCOUNTS;
    ad.values = values_d + NG_TS_NVALUES;
    if (st == NG_OK && LAUNCHED(ng_tensor_stats_cuda(&ad, g_stream))) {
        int64_t *cg = ddownload(counts_d, 3 * NG_TS_NCOUNTS * sizeof(int64_t));
        double *vg = ddownload(values_d, 3 * NG_TS_NVALUES * sizeof(double));
        const int64_t *c1 = cg + NG_TS_NCOUNTS;
        const double *v1 = vg + NG_TS_NVALUES;
        CHECK(c1[NG_TS_NAN] == counts[NG_TS_NAN] && c1[NG_TS_POSINF] == counts[NG_TS_POSINF] &&
                  c1[NG_TS_NEGINF] == counts[NG_TS_NEGINF],
              "counts: cuda %lld %lld %lld, cpu %lld %lld %lld", (long long)c1[0], (long long)c1[1],
              (long long)c1[2], (long long)counts[0], (long long)counts[1], (long long)counts[2]);
        CHECK(memcmp(v1, values, sizeof values) == 0,
              "values: cuda max %.17g min %.17g, cpu max %.17g min %.17g", v1[NG_TS_MAX_ABS],
              v1[NG_TS_MIN_ABS], values[NG_TS_MAX_ABS], values[NG_TS_MIN_ABS]);
        CHECK(all_ff(cg, NG_TS_NCOUNTS * sizeof(int64_t)) &&
                  all_ff(cg + 2 * NG_TS_NCOUNTS, NG_TS_NCOUNTS * sizeof(int64_t)) &&
                  all_ff(vg, NG_TS_NVALUES * sizeof(double)) &&
                  all_ff(vg + 2 * NG_TS_NVALUES, NG_TS_NVALUES * sizeof(double)),
              "a neighbouring stats slot was written");
        free(cg);
        free(vg);
    }
    dfree(x_d), dfree(counts_d), dfree(values_d);
    free(x);
    case_end();
}

static void test_tensor_stats(void) {
    const ng_dtype types[4] = {NG_F32, NG_F16, NG_BF16, NG_F64};
    for (size_t vi = 0; vi < sizeof TS_VIEWS / sizeof TS_VIEWS[0]; vi++)
        for (int di = 0; di < 4; di++)
            ts_case(&TS_VIEWS[vi], types[di]);
}

/* ---- attention ------------------------------------------------------------- */

/* LAY_PAD: [B, H, N, D] with rows D + PAD_EXTRA apart; LAY_SHIFT: [B, H, N, D]
 * starting one element into its buffer (rows not 16-byte aligned) */
enum { LAY_BHSD, LAY_BSHD, LAY_PAD, LAY_SHIFT };
#define PAD_EXTRA 5
enum { AM_NONE, AM_BOOL, AM_NEG_INF, AM_LOWEST };
enum { MS_FULL, MS_PAD, MS_LS }; /* mask shape: [B, Hq, L, S], [B, 1, 1, S], [L, S] */
enum { SP_NONE, SP_LARGE, SP_NAN, SP_NAN_DOUT, SP_PAD_TAIL };

typedef struct acase {
    const char *name;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    int lay, out_lay; /* inputs (q, k, v, dout), outputs (out, dq, dk, dv) */
    int mask, mshape, full_rows, causal;
    double max_score, softcap, dropout, mag;
    int mask_f32;    /* additive mask stored as fp32 whatever the data dtype */
    int special;     /* SP_LARGE: q.k far beyond fp16's range (see attn_case; forward
                        only: its softmax is one-hot, so its gradients are rounding
                        noise); SP_NAN: one NaN in q; SP_NAN_DOUT: one NaN
                        in dout; SP_PAD_TAIL: batch 0's keys past S / 3
                        masked too */
    uint64_t offset; /* dropout counter offset */
} acase;

#define HI_OFFSET ((1ull << 32) + 7)

/* clang-format off */
static const acase ATTN_CASES[] = {
    /* name                     B  Hq Hkv L    S    E    Ev   lay       out_lay   mask        mshape   full caus clamp soft drop mag  mf32 special   offset */
    {"E40",                     1, 2, 2,  129, 300, 40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E80_bshd",                2, 2, 2,  300, 129, 80,  80,  LAY_BSHD, LAY_BSHD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E256",                    1, 2, 2,  64,  129, 256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E256_causal_pad",         1, 1, 1,  129, 129, 256, 256, LAY_PAD,  LAY_PAD,  AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E64_Ev128",               1, 2, 2,  64,  129, 64,  128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E128_Ev64_gqa",           1, 2, 1,  129, 64,  128, 64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E24_Ev40",                2, 2, 2,  7,   300, 24,  40,  LAY_BHSD, LAY_PAD,  AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E1_Ev3",                  1, 1, 1,  7,   7,   1,   3,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"E256_Ev8",                1, 1, 1,  33,  65,  256, 8,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"gqa_E64",                 2, 4, 2,  129, 64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"gqa_E128_causal",         1, 4, 2,  300, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"gqa_E80_bool_full_rows",  1, 4, 2,  64,  129, 80,  80,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"mqa_E64",                 1, 4, 1,  129, 129, 64,  64,  LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"bool_full_rows_E64",      2, 2, 2,  64,  129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"bool_full_rows_E128_bshd", 1, 2, 2, 129, 300, 128, 128, LAY_BSHD, LAY_BSHD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"neginf_full_rows_E64_gqa", 2, 2, 1, 129, 64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"lowest_LS_causal_E128",   1, 2, 2,  129, 129, 128, 128, LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_LS,   1, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"pad_mask_E64",            3, 2, 2,  64,  300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"f32_mask_E64",            1, 2, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   0,   0,   1,   1, SP_NONE, 42},
    {"f32_lowest_mask_E40",     1, 2, 2,  64,  7,   40,  40,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_FULL, 1, 0, 0,   0,   0,   1,   1, SP_NONE, 42},
    {"bool_causal_E40",         1, 2, 2,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"additive_E128",           1, 2, 2,  300, 7,   128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"clamp_E64",               1, 2, 2,  64,  129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 2.5, 0,   0,   4,   0, SP_NONE, 42},
    {"softcap_E128",            1, 2, 2,  129, 64,  128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   3.0, 0,   4,   0, SP_NONE, 42},
    {"clamp_softcap_E80_mask",  1, 2, 1,  64,  64,  80,  80,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 1, 3.0, 2.0, 0,   4,   0, SP_NONE, 42},
    {"clamp_softcap_E64_gqa",   1, 4, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 3.0, 5.0, 0,   4,   0, SP_NONE, 42},
    {"dropout_E64",             1, 2, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42},
    {"dropout_E128_causal_gqa", 1, 4, 2,  129, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0.2, 1,   0, SP_NONE, 42},
    {"dropout_bool_E40",        1, 2, 1,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 1, 0,   0,   0.5, 1,   0, SP_NONE, 42},
    {"dropout_E256",            1, 1, 1,  64,  64,  256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.1, 1,   0, SP_NONE, 42},
    {"dropout_hi_offset_E64",   2, 2, 2,  7,   129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1,   0, SP_NONE, HI_OFFSET},
    {"dropout_softcap_E128_mask", 1, 2, 2, 64, 129, 128, 128, LAY_PAD,  LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   4.0, 0.25, 3,  0, SP_NONE, 42},
    {"pad_rows_E64",            1, 2, 2,  129, 129, 64,  64,  LAY_PAD,  LAY_PAD,  AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"shifted_base_E64",        1, 2, 2,  129, 300, 64,  64,  LAY_SHIFT, LAY_SHIFT, AM_NONE,  MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"shifted_base_E128_gqa_mask", 2, 4, 2, 64, 129, 128, 128, LAY_SHIFT, LAY_BHSD, AM_BOOL,  MS_FULL, 1, 1, 0,   0,   0.2, 1,   0, SP_NONE, 42},
    {"pad_rows_E128_causal",    2, 2, 2,  64,  300, 128, 128, LAY_BSHD, LAY_PAD,  AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"many_heads_E64",          3, 6, 3,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"large_scores_E64",        1, 2, 2,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_LARGE, 42},
    {"large_scores_E128",       1, 1, 1,  7,   129, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_LARGE, 42},
    {"nan_in_q_E64",            1, 2, 2,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NAN, 42},
    {"nan_in_q_E40_clamp",      1, 1, 1,  7,   33,  40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 5.0, 0,   0,   1,   0, SP_NAN, 42},
    /* a NaN in a row that also has masked positions: masked pairs add exactly
     * nothing to any gradient, on both sides, whatever the tile sizes */
    {"nan_in_q_causal_mask_E64", 1, 2, 2, 129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NAN, 42},
    {"nan_in_dout_pad_mask_E128", 2, 2, 2, 64, 129, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NAN_DOUT, 42},
    {"nan_in_dout_causal_E40",  1, 2, 2,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NAN_DOUT, 42},
    /* decode shapes (L <= 16, S >= 32: the CPU kernel's split-KV decode path) */
    {"decode_L1_S300_pad_gqa",  2, 8, 2,  1,   300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L5_S129_causal_E40", 1, 4, 1, 5,  129, 40,  40,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L16_S1000_softcap", 1, 2, 2, 16, 1000, 128, 128, LAY_BSHD, LAY_BHSD, AM_LOWEST,  MS_PAD,  0, 0, 0,   3.0, 0,   3,   0, SP_NONE, 42},
    /* the CPU's decode cases (tests/python/test_attention.py DECODE_CASES) */
    {"decode_L1_gqa_bool_pad",  2, 8, 2,  1,   600, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L1_mha_S2048_E128", 1, 4, 4, 1,  2048, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L1_mqa_neginf",    1, 4, 1,  1,  1500, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L4_mqa_lowest_full_rows", 1, 6, 1, 4, 1100, 40, 24, LAY_BHSD, LAY_BHSD, AM_LOWEST, MS_FULL, 1, 0, 0, 0,   0,   1,   0, SP_NONE, 42},
    {"decode_L3_bool_full_rows_ls", 2, 4, 2, 3, 333, 16,  16,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L16_gqa_additive", 1, 8, 2,  16,  513, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L3_causal",        1, 4, 2,  3,   700, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L2_guards_mask",   1, 4, 2,  2,   900, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_LS,   0, 0, 3.0, 2.0, 0,   4,   0, SP_NONE, 42},
    {"decode_L7_S33_odd",       1, 3, 1,  7,   33,  20,  12,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"decode_L3_S200_dropout",  1, 2, 2,  3,   200, 8,   5,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.4, 1,   0, SP_NONE, 5},
    {"decode_L1_S77_dropout_gqa", 2, 6, 3, 1,  77,  64,  64,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42},
    {"decode_L2_nan_in_q_gqa",  1, 4, 2,  2,   300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NAN, 42},
    {"decode_L2_S700_dropout_splits", 1, 4, 2, 2, 700, 64, 64, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42},
    {"decode_L3_padded_layouts", 2, 6, 2, 3,   520, 40,  40,  LAY_PAD,  LAY_PAD,  AM_LOWEST,  MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    /* head dim 256: the decode kernel's shared memory must fit sm_75's 64 KiB */
    {"decode_L2_E256_gqa",      1, 4, 2,  2,   400, 256, 256, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    /* batch 1 all padding, batch 0 padding past S / 3: whole key splits
     * see only masked keys and must weigh nothing in the combine */
    {"decode_L1_pad_tail_splits", 2, 8, 2, 1,  900, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_PAD_TAIL, 42},
    /* more heads than gridDim.y / z allow (65535) */
    {"heads_65537",             1, 65537, 65537, 1, 3,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"empty_S",                 1, 2, 2,  5,   0,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
    {"empty_L",                 1, 2, 2,  0,   7,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42},
};
/* fp16 / bf16 only (the tensor-core path): a dropout keep factor 1/(1-p) =
 * 2^17, above fp16's 65504. With S = 2 every row has a probability >= 1/2,
 * and Philox offset 14771 keeps 2 of the 256 elements (found by search), so
 * p * keep exceeds fp16's range where it is kept. */
static const acase ATTN_CASES_16[] = {
    {"dropout_scale_above_fp16_max_E64", 1, 2, 2, 64, 2, 64, 64, LAY_BHSD, LAY_BHSD, AM_NONE, MS_FULL, 0, 0, 0, 0, 1.0 - 1.0 / 131072.0, 1, 0, SP_NONE, 14771},
};
/* clang-format on */

typedef struct atensor {
    int64_t B, H, N, D, st[3], shift, span; /* span: elements of the buffer, view at `shift` */
    size_t es;
    void *h, *d; /* the CPU kernel's buffer, the launcher's */
} atensor;

static atensor at_new(ng_dtype t, int64_t B, int64_t H, int64_t N, int64_t D, int lay) {
    atensor x;
    memset(&x, 0, sizeof x);
    x.B = B, x.H = H, x.N = N, x.D = D;
    x.es = ng_dtype_size(t);
    if (lay == LAY_BSHD) {
        x.st[0] = N * H * D, x.st[1] = D, x.st[2] = H * D;
        x.span = B * N * H * D;
    } else {
        const int64_t rs = lay == LAY_PAD ? D + PAD_EXTRA : D;
        x.st[0] = H * N * rs, x.st[1] = N * rs, x.st[2] = rs;
        x.span = B * H * N * rs;
    }
    if (lay == LAY_SHIFT && x.span) x.shift = 1, x.span += 1;
    x.h = x.span ? calloc((size_t)x.span, x.es) : NULL;
    x.d = x.span ? dmalloc((size_t)x.span * x.es) : NULL;
    return x;
}

/* Offset in the buffer (the view's own offset plus its shift). */
static int64_t at_off(const atensor *x, int64_t b, int64_t h, int64_t n, int64_t d) {
    return x->shift + b * x->st[0] + h * x->st[1] + n * x->st[2] + d;
}

/* The view's first element in buf (x->h or x->d): what the kernels get. */
static void *at_view(const atensor *x, void *buf) {
    return buf ? (char *)buf + (size_t)x->shift * x->es : NULL;
}

static size_t at_bytes(const atensor *x) {
    return (size_t)x->span * x->es;
}

static void at_free(atensor *x) {
    free(x->h);
    dfree(x->d);
}

/* Dense [B, H, N, D] fp64 copy of a buffer laid out like x. */
static double *at_dense(const atensor *x, ng_dtype t, const void *buf) {
    double *o = malloc(sizeof(double) * (size_t)(x->B * x->H * x->N * x->D + 1));
    int64_t k = 0;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t n = 0; n < x->N; n++)
                for (int64_t d = 0; d < x->D; d++)
                    o[k++] = ng_load_f64(buf, t, at_off(x, b, h, n, d));
    return o;
}

/* Elements of the buffer outside the view (row padding) must keep the 0xff fill. */
static void at_check_gaps(const char *what, const atensor *x, const void *buf) {
    if (!x->span) return;
    uint8_t *used = calloc((size_t)x->span, 1);
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t n = 0; n < x->N; n++)
                for (int64_t d = 0; d < x->D; d++)
                    used[at_off(x, b, h, n, d)] = 1;
    int64_t bad = 0;
    for (int64_t i = 0; i < x->span; i++)
        if (!used[i] && !all_ff((const char *)buf + (size_t)i * x->es, x->es)) bad++;
    CHECK(bad == 0, "%s: %lld elements outside the view were written", what, (long long)bad);
    free(used);
}

/* Download x's device buffer, compare with the CPU's over rows of D, check
 * the padding; returns the downloaded buffer. */
/* leak_row >= 0: a dk / dv of a causal case with a NaN in query row
 * leak_row of (b 0, kv head 0). The pairs that causality masks for that row
 * add exactly nothing on both sides, but the row's NaN q / dout values still
 * meet their zero coefficients inside the dense tile products (0 * NaN), so
 * keys j > leak_row that share a tile with the row may come out NaN, and
 * which ones depends on the tile sizes (CPU and CUDA differ): there, NaN on
 * one side only is accepted. Every other element compares as usual. */
static void *at_compare_leak(const char *what, const atensor *x, ng_dtype t, tol tl, int64_t leak_row) {
    void *g = ddownload(x->d, at_bytes(x));
    double *r = at_dense(x, t, x->h), *d = at_dense(x, t, g);
    for (int64_t j = leak_row + 1; leak_row >= 0 && j < x->N; j++)
        for (int64_t e = 0; e < x->D; e++) {
            const int64_t at = j * x->D + e; /* b 0, head 0 */
            if (isnan(r[at]) != isnan(d[at])) r[at] = d[at] = 0.0;
        }
    close_rows(what, d, r, x->B * x->H * x->N, x->D, tl, NULL);
    at_check_gaps(what, x, g);
    free(r);
    free(d);
    return g;
}

static void *at_compare(const char *what, const atensor *x, ng_dtype t, tol tl) {
    return at_compare_leak(what, x, t, tl, -1);
}

/* Elements of the fully masked rows (empty_row[(b * H + h) * N + i]) of a
 * downloaded [B, H, N, D] tensor that are not exactly 0. */
static int64_t empty_row_nonzeros(const void *g, ng_dtype t, const atensor *x, const uint8_t *empty_row) {
    int64_t nonzero = 0;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t i = 0; i < x->N; i++)
                if (empty_row[(b * x->H + h) * x->N + i])
                    for (int64_t d = 0; d < x->D; d++) nonzero += ng_load_f64(g, t, at_off(x, b, h, i, d)) != 0.0;
    return nonzero;
}

/* Gradients get an absolute floor too: a row with a single key (S = 1, the
 * first row of a causal mask) has dP - D = 0 up to rounding, so its dq and
 * that key's dk are pure fp32 rounding noise on both sides (~5e-8 per term
 * for unit q, k), summed over `terms` rows or keys; fp16 results that small
 * are subnormals 6e-8 apart. The floor is aabs * mag * sqrt(terms). */
static tol attn_tol(ng_dtype t, int which, double mag,
                    int64_t terms) { /* 0 out, 1 lse, 2 gradients */
    static const tol tab[3][3] = {
        /*          out                   lse                    dq, dk, dv */
        /* fp32 */ {{1e-4, 1e-4, 0}, {1e-5, 0, 1e-4}, {2e-4, 2e-4, 2e-6}},
        /* fp16 */ {{2e-2, 3e-3, 0}, {1e-5, 0, 2e-3}, {2e-2, 1e-2, 4e-6}},
        /* bf16 */ {{2e-2, 1e-2, 0}, {1e-5, 0, 8e-3}, {3e-2, 2e-2, 1e-5}},
    };
    tol r = tab[t == NG_F32 ? 0 : t == NG_F16 ? 1 : 2][which];
    if (which == 2) r.aabs *= mag * sqrt((double)NG_MAX(terms, (int64_t)1));
    return r;
}

static void attn_case(const acase *c, ng_dtype t) {
    if (!case_begin("attention  %-34s %s", c->name, ng_dtype_name(t))) return;
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, L = c->L, S = c->S, E = c->E, Ev = c->Ev;
    ng_rng rng = {0x9E3779B97F4A7C15ull ^
                  (uint64_t)(L * 131 + S * 7 + E + Ev * 3 + B * 17 + Hq * 5 + c->mask * 1009 +
                             c->causal * 4099 + (int64_t)t * 1000003)};
    atensor q = at_new(t, B, Hq, L, E, c->lay), k = at_new(t, B, Hkv, S, E, c->lay);
    atensor v = at_new(t, B, Hkv, S, Ev, c->lay), dout = at_new(t, B, Hq, L, Ev, c->lay);
    atensor o = at_new(t, B, Hq, L, Ev, c->out_lay), dq = at_new(t, B, Hq, L, E, c->out_lay);
    atensor dk = at_new(t, B, Hkv, S, E, c->out_lay), dv = at_new(t, B, Hkv, S, Ev, c->out_lay);

    /* inputs (the padding of a padded layout holds values too: they must not matter) */
    const int grid = c->max_score > 0.0;
    for (int64_t i = 0; i < q.span; i++) {
        double x = c->mag * ng_rng_unif(&rng);
        ng_store_f64(q.h, t, i, grid ? round(8.0 * x) / 8.0 : x);
    }
    for (int64_t i = 0; i < k.span; i++) {
        double x = c->mag * ng_rng_unif(&rng);
        ng_store_f64(k.h, t, i, grid ? round(8.0 * x) / 8.0 : x);
    }
    if (c->special == SP_LARGE) {
        /* even integers: q in [100, 150], key j = one vector in [100, 120]
         * plus 2 * (37 j mod S) everywhere, exact in fp16 and bf16; every q.k
         * is an integer below 2^24 (exact in fp32 in any order) and far
         * beyond 65504, and a row's scores are at least 2 * sum(q) * scale
         * > 1000 apart, so the softmax is exactly one-hot on both sides */
        double base[NG_ATTN_MAX_HEAD_DIM];
        for (int64_t e = 0; e < E; e++)
            base[e] = 2.0 * floor(50.0 + 10.0 * urand(&rng));
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hq; h++)
                for (int64_t i = 0; i < L; i++)
                    for (int64_t e = 0; e < E; e++)
                        ng_store_f64(q.h, t, at_off(&q, b, h, i, e),
                                     2.0 * floor(50.0 + 25.0 * urand(&rng)));
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t j = 0; j < S; j++)
                    for (int64_t e = 0; e < E; e++)
                        ng_store_f64(k.h, t, at_off(&k, b, h, j, e),
                                     base[e] + 2.0 * (double)((j * 37) % S));
    }
    for (int64_t i = 0; i < v.span; i++)
        ng_store_f64(v.h, t, i, ng_rng_unif(&rng));
    for (int64_t i = 0; i < dout.span; i++)
        ng_store_f64(dout.h, t, i, ng_rng_unif(&rng));
    if (c->special == SP_NAN && L > 0)
        ng_store_f64(q.h, t, at_off(&q, 0, 0, NG_MIN(2, L - 1), NG_MIN(3, E - 1)), NAN);
    if (c->special == SP_NAN_DOUT && L > 0)
        ng_store_f64(dout.h, t, at_off(&dout, 0, 0, NG_MIN(2, L - 1), NG_MIN(3, Ev - 1)), NAN);

    /* mask, stored broadcast: strides 0 on the broadcast dims */
    const ng_dtype mdt = c->mask_f32 ? NG_F32 : t;
    void *mask = NULL;
    size_t mask_bytes = 0;
    int64_t mst[4] = {0, 0, 0, 0};
    if (c->mask != AM_NONE) {
        const int64_t mB = c->mshape == MS_LS ? 1 : B, mH = c->mshape == MS_FULL ? Hq : 1,
                      mL = c->mshape == MS_PAD ? 1 : L, n = mB * mH * mL * S;
        mst[0] = mB > 1 ? mH * mL * S : 0;
        mst[1] = mH > 1 ? mL * S : 0;
        mst[2] = mL > 1 ? S : 0;
        mst[3] = 1;
        mask_bytes = (size_t)n * (c->mask == AM_BOOL ? 1 : ng_dtype_size(mdt));
        mask = malloc(mask_bytes + 1);
        for (int64_t x = 0; x < n; x++) {
            const int64_t row = x / S, i = row % mL, j = x % S;
            int m = urand(&rng) < 0.3;
            if (c->full_rows && mL > 1 && i % 5 == 2) m = 1;    /* fully masked query rows */
            if (c->full_rows && mL == 1 && row % 2 == 1) m = 1; /* a fully padded batch */
            if (j == 0 && !c->full_rows) m = 0;                 /* otherwise no row is empty */
            if (c->special == SP_PAD_TAIL && row == 0 && j >= S / 3) m = 1;
            if (c->mask == AM_BOOL) {
                ((uint8_t *)mask)[x] = (uint8_t)!m;
            } else {
                double lowest = mdt == NG_F32   ? -(double)FLT_MAX
                                : mdt == NG_F16 ? -65504.0
                                                : -3.3895313892515355e38;
                ng_store_f64(mask, mdt, x,
                             m ? (c->mask == AM_NEG_INF ? -INFINITY : lowest) : -1.5 * urand(&rng));
            }
        }
    }

    const size_t lse_bytes = (size_t)(B * Hq * L) * sizeof(float);
    float *lse = L ? calloc((size_t)(B * Hq * L), sizeof(float)) : NULL;

    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.L = L, a.S = S, a.E = E, a.Ev = Ev;
    a.q = at_view(&q, q.h), memcpy(a.q_stride, q.st, sizeof q.st);
    a.k = at_view(&k, k.h), memcpy(a.k_stride, k.st, sizeof k.st);
    a.v = at_view(&v, v.h), memcpy(a.v_stride, v.st, sizeof v.st);
    a.out = at_view(&o, o.h), memcpy(a.out_stride, o.st, sizeof o.st);
    a.lse = lse;
    a.dout = at_view(&dout, dout.h), memcpy(a.dout_stride, dout.st, sizeof dout.st);
    a.dq = at_view(&dq, dq.h), memcpy(a.dq_stride, dq.st, sizeof dq.st);
    a.dk = at_view(&dk, dk.h), memcpy(a.dk_stride, dk.st, sizeof dk.st);
    a.dv = at_view(&dv, dv.h), memcpy(a.dv_stride, dv.st, sizeof dv.st);
    if (c->mask != AM_NONE) {
        a.mask = mask;
        a.mask_kind = c->mask == AM_BOOL ? NG_MASK_BOOL : NG_MASK_ADD;
        a.mask_dtype = mdt;
        memcpy(a.mask_stride, mst, sizeof mst);
    }
    a.is_causal = c->causal;
    /* clamp cases: q, k on a 1/8 grid and scale 1/8 make every raw score
     * exact in fp32 whatever the summation order, so both sides clamp the
     * same scores (a score a rounding error away from the bound would get
     * clamp' = 0 on one side and 1 on the other) */
    a.scale = grid ? 0.125 : 1.0 / sqrt((double)E);
    a.max_score = c->max_score;
    a.softcap = c->softcap;
    a.dropout_p = c->dropout;
    a.seed = 0x1234567887654321ull;
    a.offset = c->offset;

    ng_status st = ng_attention_fwd(&a, NULL);
    CHECK(st == NG_OK, "CPU forward: %s", ng_status_str(st));
    /* sample: the decode_* cases check the decode forward; their backward is
     * the tiled one, which the grid's L 1 and L 7 cases run */
    const int do_bwd = c->special != SP_LARGE && !(g_sample && strncmp(c->name, "decode_", 7) == 0);
    if (st == NG_OK && do_bwd) {
        st = ng_attention_bwd(&a, NULL);
        CHECK(st == NG_OK, "CPU backward: %s", ng_status_str(st));
    }

    /* the same arguments with device pointers */
    void *mask_d = mask ? dupload(mask, mask_bytes) : NULL;
    float *lse_d = L ? dmalloc(lse_bytes) : NULL;
    if (q.span) dcopy_to(q.d, q.h, at_bytes(&q));
    if (k.span) dcopy_to(k.d, k.h, at_bytes(&k));
    if (v.span) dcopy_to(v.d, v.h, at_bytes(&v));
    if (dout.span) dcopy_to(dout.d, dout.h, at_bytes(&dout));
    ng_attention_args ad = a;
    ad.q = at_view(&q, q.d), ad.k = at_view(&k, k.d), ad.v = at_view(&v, v.d),
    ad.out = at_view(&o, o.d);
    ad.lse = lse_d;
    ad.dout = at_view(&dout, dout.d), ad.dq = at_view(&dq, dq.d), ad.dk = at_view(&dk, dk.d);
    ad.dv = at_view(&dv, dv.d);
    ad.mask = mask_d;

    /* rows the CPU left fully masked (lse -inf): exact zeros expected */
    uint8_t *empty_row = calloc((size_t)(B * Hq * L) + 1, 1);
    int64_t n_empty = 0;
    for (int64_t r = 0; r < B * Hq * L; r++)
        if (lse[r] == -INFINITY) empty_row[r] = 1, n_empty++;

    /* the forward as the op calls it (with the split-KV workspace of a
     * decode shape), then, for a decode shape, without a workspace: one
     * block over all keys */
    const int64_t wsb = ng_attention_fwd_cuda_workspace_bytes(&ad);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;
    const int decode = L >= 1 && L <= 16 && S >= 32;
    const size_t case_len = strlen(g_case);
    for (int form = 0; form < (decode ? 2 : 1); form++) {
        if (form == 1) snprintf(g_case + strlen(g_case), sizeof g_case - strlen(g_case), " [no workspace]");
        dpoison(o.d, at_bytes(&o));
        dpoison(lse_d, L ? lse_bytes : 0);
        if (ws_d) dpoison(ws_d, (size_t)wsb);
        if (st == NG_OK && LAUNCHED(form ? ng_attention_fwd_cuda(&ad, g_stream)
                                         : ng_attention_fwd_cuda_ws(&ad, ws_d, wsb, g_stream))) {
            void *og = at_compare("out", &o, t, attn_tol(t, 0, c->mag, 0));
            float *lg = ddownload(lse_d, L ? lse_bytes : 0);
            double *lr = to_f64(lse, NG_F32, B * Hq * L), *lc = to_f64(lg, NG_F32, B * Hq * L);
            close_rows("lse", lc, lr, B * Hq * L, 1, attn_tol(t, 1, c->mag, 0), NULL);
            const int64_t nonzero = empty_row_nonzeros(og, t, &o, empty_row);
            CHECK(nonzero == 0, "%lld output values of fully masked rows are not 0",
                  (long long)nonzero);
            free(og), free(lg), free(lr), free(lc);
        }
        g_case[case_len] = 0;
    }
    dfree(ws_d);

    if (st == NG_OK && do_bwd) {
        /* the CPU forward's out and lse feed both backward passes */
        if (o.span) dcopy_to(o.d, o.h, at_bytes(&o));
        if (L) dcopy_to(lse_d, lse, lse_bytes);
        dpoison(dq.d, at_bytes(&dq));
        dpoison(dk.d, at_bytes(&dk));
        dpoison(dv.d, at_bytes(&dv));
        if (LAUNCHED(ng_attention_bwd_cuda(&ad, g_stream))) {
            void *g = at_compare("dq", &dq, t, attn_tol(t, 2, c->mag, S));
            const int64_t nonzero = empty_row_nonzeros(g, t, &dq, empty_row);
            CHECK(nonzero == 0, "%lld dq values of fully masked rows are not 0",
                  (long long)nonzero);
            free(g);
            const int64_t leak = c->causal && (c->special == SP_NAN || c->special == SP_NAN_DOUT) && L > 0
                                     ? NG_MIN(2, L - 1)
                                     : -1;
            free(at_compare_leak("dk", &dk, t, attn_tol(t, 2, c->mag, L * (Hq / Hkv)), leak));
            free(at_compare_leak("dv", &dv, t, attn_tol(t, 2, c->mag, L * (Hq / Hkv)), leak));
            /* the backward only reads out and lse */
            void *og = ddownload(o.d, at_bytes(&o));
            void *lg = ddownload(lse_d, L ? lse_bytes : 0);
            CHECK((!o.span || memcmp(og, o.h, at_bytes(&o)) == 0) &&
                      (!L || memcmp(lg, lse, lse_bytes) == 0),
                  "the backward wrote to out or lse");
            free(og), free(lg);
        }
    }
    if (n_empty)
        snprintf(g_case + strlen(g_case), sizeof g_case - strlen(g_case), " [%lld empty rows]",
                 (long long)n_empty);

    at_free(&q), at_free(&k), at_free(&v), at_free(&dout), at_free(&o), at_free(&dq), at_free(&dk),
        at_free(&dv);
    dfree(mask_d), dfree(lse_d);
    free(mask), free(lse), free(empty_row);
    case_end();
}

static void attn_rejects_fp64(void) {
    if (!case_begin("attention  %-34s %s", "rejects", "float64")) return;
    double *buf = dmalloc(64 * sizeof(double));
    float *lse = dmalloc(4 * sizeof(float));
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F64;
    a.B = 1, a.Hq = 1, a.Hkv = 1, a.L = 2, a.S = 2, a.E = 8, a.Ev = 8;
    const int64_t st[3] = {16, 16, 8};
    a.q = a.k = a.v = a.dout = buf;
    a.out = a.dq = a.dk = a.dv = buf;
    memcpy(a.q_stride, st, sizeof st), memcpy(a.k_stride, st, sizeof st),
        memcpy(a.v_stride, st, sizeof st);
    memcpy(a.out_stride, st, sizeof st), memcpy(a.dout_stride, st, sizeof st),
        memcpy(a.dq_stride, st, sizeof st);
    memcpy(a.dk_stride, st, sizeof st), memcpy(a.dv_stride, st, sizeof st);
    a.lse = lse;
    a.scale = 0.35;
    ng_status s1 = ng_attention_fwd_cuda(&a, g_stream), s2 = ng_attention_bwd_cuda(&a, g_stream);
    CHECK(s1 == NG_ERR_DTYPE && s2 == NG_ERR_DTYPE, "fp64: fwd %s, bwd %s (want %s)",
          ng_status_str(s1), ng_status_str(s2), ng_status_str(NG_ERR_DTYPE));
    a.dtype = NG_F16;
    a.Hq = 3, a.Hkv = 2;
    s1 = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s1 == NG_ERR_INVALID_ARG, "Hq %% Hkv != 0: %s (want %s)", ng_status_str(s1),
          ng_status_str(NG_ERR_INVALID_ARG));
    CU(cudaStreamSynchronize(g_stream));
    dfree(buf), dfree(lse);
    case_end();
}

/* The split-KV workspace: asked for by long decode shapes only, and a
 * smaller or misaligned one refused before anything is launched. */
static void attn_workspace_contract(void) {
    if (!case_begin("attention  %-34s %s", "decode_workspace", "float32")) return;
    const int64_t L = 1, S = 1024, E = 64;
    float *buf = dmalloc(sizeof(float) * (size_t)(2 * S * E));
    float *lse = dmalloc(4 * sizeof(float));
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F32;
    a.B = 1, a.Hq = 2, a.Hkv = 1, a.L = L, a.S = S, a.E = E, a.Ev = E;
    const int64_t qst[3] = {2 * L * E, L * E, E}, kst[3] = {S * E, S * E, E};
    a.q = a.out = buf;
    a.k = a.v = buf;
    memcpy(a.q_stride, qst, sizeof qst), memcpy(a.out_stride, qst, sizeof qst);
    memcpy(a.k_stride, kst, sizeof kst), memcpy(a.v_stride, kst, sizeof kst);
    a.lse = lse;
    a.scale = 0.125;
    const int64_t need = ng_attention_fwd_cuda_workspace_bytes(&a);
    /* 1024 keys over 2 rows: 8 splits of 128 keys, each (m, l) + 64 outputs per row */
    CHECK(need == (int64_t)sizeof(float) * 8 * 2 * (E + 2), "workspace of L 1, S 1024: %lld bytes",
          (long long)need);
    ng_attention_args t = a;
    t.L = 17;
    CHECK(ng_attention_fwd_cuda_workspace_bytes(&t) == 0, "L 17 (not a decode shape) asks for a workspace");
    t = a;
    t.S = 255;
    CHECK(ng_attention_fwd_cuda_workspace_bytes(&t) == 0, "S 255 (one split) asks for a workspace");
    char *ws = dmalloc((size_t)need + 4);
    ng_status s = ng_attention_fwd_cuda_ws(&a, ws, need - 4, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a workspace 4 bytes short: %s", ng_status_str(s));
    s = ng_attention_fwd_cuda_ws(&a, ws + 2, need, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a misaligned workspace: %s", ng_status_str(s));
    CU(cudaStreamSynchronize(g_stream));
    dfree(ws), dfree(buf), dfree(lse);
    case_end();
}

static void test_attention(void) {
    static const int64_t sizes[5] = {1, 7, 64, 129, 300};
    static const int64_t dims[2] = {64, 128};
    /* the tensor-core head dims over every (L, S), plain and causal */
    for (int ei = 0; ei < 2; ei++)
        for (int causal = 0; causal < 2; causal++)
            for (int li = 0; li < 5; li++)
                for (int si = 0; si < 5; si++) {
                    char name[64];
                    snprintf(name, sizeof name, "E%lld_L%lld_S%lld%s", (long long)dims[ei],
                             (long long)sizes[li], (long long)sizes[si], causal ? "_causal" : "");
                    acase c = {name,     2,        2,        2,        sizes[li], sizes[si],
                               dims[ei], dims[ei], LAY_BHSD, LAY_BHSD, AM_NONE,   MS_FULL,
                               0,        causal,   0,        0,        0,         1,
                               0,        SP_NONE,  42};
                    /* sample: the tensor-core types at every size up to 129 and a
                     * third of the rest; fp32 (SIMT) a third of those up to 129 */
                    const int third = (li + si + ei + causal) % 3 == 0, big = li == 4 || si == 4;
                    for (int di = 0; di < 3; di++)
                        if (!g_sample || (di ? (!big || third) : (!big && third)))
                            attn_case(&c, FLOAT_TYPES[di]);
                }
    for (size_t ci = 0; ci < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; ci++) {
        /* sample: not the 65537-head grid (65537 blocks of 256 threads take
         * minutes on the emulator; the mutation test cuda_emu_mutant_grid
         * shows the launch it guards against being refused) */
        const acase *c = &ATTN_CASES[ci];
        if (g_sample && c->B * c->Hq > 65535) continue;
        /* sample: cases of over 30K scores, whose SIMT runs take the
         * emulator seconds, in the tensor-core types only (head dims 64 and
         * 128) or in bf16 only (the others, SIMT in every type) */
        const int big = c->B * c->Hq * c->L * c->S > 30000, tc = c->E == c->Ev && (c->E == 64 || c->E == 128);
        for (int di = 0; di < 3; di++)
            if (!g_sample || !big || (tc ? di > 0 : di == 2)) attn_case(c, FLOAT_TYPES[di]);
    }
    for (size_t ci = 0; ci < sizeof ATTN_CASES_16 / sizeof ATTN_CASES_16[0]; ci++)
        for (int di = 1; di < 3; di++)
            attn_case(&ATTN_CASES_16[ci], FLOAT_TYPES[di]);
    attn_rejects_fp64();
    attn_workspace_contract();
}

/* ---- runtime errors inside a launcher (emulator only) ---------------------------
 * A runtime call that fails inside a launcher: the launcher returns
 * NG_ERR_CUDA with the runtime's error name and message recorded for the op's
 * message (ng_cuda_error_string), or takes its fallback, and in both cases
 * leaves no error behind for the next, unrelated launch. The emulator injects
 * the failures (ng_emu_inject); a GPU cannot be made to fail on demand. */
#ifdef NG_CUDA_EMU
static ng_attention_args err_attn_args(void *buf, void *lse, int64_t E) {
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F32;
    a.B = 1, a.Hq = 1, a.Hkv = 1, a.L = 1, a.S = 1, a.E = E, a.Ev = E;
    const int64_t st[3] = {E, E, E};
    a.q = a.k = a.v = a.dout = buf;
    a.out = a.dq = a.dk = a.dv = (char *)buf + E * 4;
    memcpy(a.q_stride, st, sizeof st), memcpy(a.k_stride, st, sizeof st), memcpy(a.v_stride, st, sizeof st);
    memcpy(a.out_stride, st, sizeof st), memcpy(a.dout_stride, st, sizeof st), memcpy(a.dq_stride, st, sizeof st);
    memcpy(a.dk_stride, st, sizeof st), memcpy(a.dv_stride, st, sizeof st);
    a.lse = lse;
    a.scale = 0.0625;
    return a;
}

static void test_cuda_errors(void) {
    float *buf = dmalloc(2 * 256 * sizeof(float)), *lse = dmalloc(sizeof(float)), *ln = dmalloc(64 * sizeof(float));
    dpoison(buf, 512 * sizeof(float));
    CU(cudaMemsetAsync(buf, 0, 256 * sizeof(float), g_stream));
    ng_layernorm_args l;
    memset(&l, 0, sizeof l);
    l.dtype = NG_F32, l.rows = 2, l.cols = 8, l.eps = 1e-5;
    l.x = ln, l.y = ln + 16, l.mean = ln + 32, l.rstd = ln + 40;
    CU(cudaMemsetAsync(ln, 0, 16 * sizeof(float), g_stream));

    if (case_begin("errors     %-34s %s", "failed_smem_attribute", "float32")) {
        /* head dim 256 needs 64 KiB of dynamic shared memory: an attribute call */
        ng_attention_args a = err_attn_args(buf, lse, 256);
        ng_emu_inject("cudaFuncSetAttribute", cudaErrorInvalidValue);
        ng_status s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_ERR_CUDA, "a failed cudaFuncSetAttribute: launcher returned %s", ng_status_str(s));
        CHECK(strstr(ng_cuda_error_string(), "cudaErrorInvalidValue: invalid argument") != NULL,
              "the recorded error is \"%s\"", ng_cuda_error_string());
        s = ng_layernorm_fwd_cuda(&l, g_stream);
        CHECK(s == NG_OK, "the next, unrelated launch returned %s", ng_status_str(s));
        s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_OK, "the same call again returned %s", ng_status_str(s));
        CU(cudaStreamSynchronize(g_stream));
        case_end();
    }
    if (case_begin("errors     %-34s %s", "failed_smem_attribute_decode", "float32")) {
        /* the decode kernel at head dim 256 asks for 49 KiB: the failure is
         * returned, and the same call then succeeds */
        const int64_t S = 64, E = 256;
        float *kv = dmalloc(sizeof(float) * (size_t)(S * E));
        CU(cudaMemsetAsync(kv, 0, sizeof(float) * (size_t)(S * E), g_stream));
        ng_attention_args a = err_attn_args(buf, lse, E);
        a.S = S;
        a.k = a.v = kv;
        a.k_stride[0] = a.k_stride[1] = a.v_stride[0] = a.v_stride[1] = S * E;
        ng_emu_inject("cudaFuncSetAttribute", cudaErrorInvalidValue);
        ng_status s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_ERR_CUDA, "a failed cudaFuncSetAttribute: launcher returned %s", ng_status_str(s));
        s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_OK, "the same call again returned %s", ng_status_str(s));
        CU(cudaStreamSynchronize(g_stream));
        dfree(kv);
        case_end();
    }
    if (case_begin("errors     %-34s %s", "failed_device_query", "float16")) {
        /* the compute-capability query fails: the SIMT kernels run instead */
        ng_attention_args a = err_attn_args(buf, lse, 64);
        a.dtype = NG_F16;
        ng_emu_inject("cudaGetDevice", cudaErrorInvalidDevice);
        ng_status s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_OK, "a failed device query: launcher returned %s (%s)", ng_status_str(s),
              ng_cuda_error_string());
        s = ng_layernorm_fwd_cuda(&l, g_stream);
        CHECK(s == NG_OK, "the next, unrelated launch returned %s", ng_status_str(s));
        CU(cudaStreamSynchronize(g_stream));
        case_end();
    }
    if (case_begin("errors     %-34s %s", "attributes_cached_per_device", "float32")) {
        /* the second launch queries nothing: capability and granted shared
         * memory are cached per device */
        ng_attention_args a = err_attn_args(buf, lse, 256);
        ng_status s = ng_attention_fwd_cuda(&a, g_stream);
        const long long set0 = ng_emu_calls("cudaFuncSetAttribute");
        const long long get0 = ng_emu_calls("cudaDeviceGetAttribute");
        s = s == NG_OK ? ng_attention_fwd_cuda(&a, g_stream) : s;
        a.dtype = NG_F16, a.E = a.Ev = 64;
        for (int k = 0; k < 2 && s == NG_OK; k++) s = ng_attention_fwd_cuda(&a, g_stream);
        CHECK(s == NG_OK, "launch: %s", ng_status_str(s));
        CHECK(ng_emu_calls("cudaFuncSetAttribute") == set0, "cudaFuncSetAttribute called again (%lld times)",
              ng_emu_calls("cudaFuncSetAttribute") - set0);
        CHECK(ng_emu_calls("cudaDeviceGetAttribute") <= get0 + 1, "cudaDeviceGetAttribute called %lld times",
              ng_emu_calls("cudaDeviceGetAttribute") - get0);
        CU(cudaStreamSynchronize(g_stream));
        case_end();
    }
    if (case_begin("errors     %-34s %s", "driver_older_than_runtime", "")) {
        /* what libnanguard_cuda says at load when the driver is too old */
        char msg[512] = "";
        ng_emu_set_driver_version(12040);
        const int bad = ng_cuda_driver_check(msg, sizeof msg);
        ng_emu_set_driver_version(CUDART_VERSION);
        CHECK(bad && strstr(msg, "runtime 13.0") && strstr(msg, "CUDA 12.4"),
              "an older driver: check %d, message \"%s\"", bad, msg);
        CHECK(ng_cuda_driver_check(msg, sizeof msg) == 0, "a matching driver is refused: %s", msg);
        case_end();
    }
    dfree(buf), dfree(lse), dfree(ln);
}
#endif

/* ---- main ------------------------------------------------------------------- */

int main(int argc, char **argv) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        return 77;
    }
    g_filters = argv + 1;
    g_nfilters = argc - 1;
#ifdef NG_CUDA_EMU
    g_sample = !(getenv("NG_EMU_FULL") && atoi(getenv("NG_EMU_FULL")));
#endif
    g_verbose = getenv("NG_TEST_VERBOSE") != NULL;
    struct cudaDeviceProp prop;
    CU(cudaSetDevice(0));
    CU(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    CU(cudaRuntimeGetVersion(&rt));
    CU(cudaDriverGetVersion(&drv));
    printf("test_cuda: device 0 of %d: %s, sm_%d%d; runtime %d, driver %d%s%s%s\n", ndev, prop.name,
           prop.major, prop.minor, rt, drv, g_nfilters ? "; filter: " : "", g_nfilters ? g_filters[0] : "",
           g_nfilters > 1 ? " ..." : "");
    if (g_sample) printf("test_cuda: a sample of the cases (NG_EMU_FULL=1 runs them all)\n");
    CU(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));

#ifdef NG_CUDA_EMU
    test_cuda_errors();
#endif
    test_layernorm();
    test_layernorm_fp32_params();
    test_grad_guard();
    test_tensor_stats();
    test_attention();

    CU(cudaStreamDestroy(g_stream));
    printf("test_cuda: %d cases, %d failed\n", g_cases, g_cases_failed);
#ifdef NG_CUDA_EMU
    printf("test_cuda: %lld kernel launches on the emulator (sm_%d), each under %d schedules\n", ng_emu_launches(),
           ng_emu_sm(), ng_emu_schedules());
#endif
    return ng_test_finish("test_cuda");
}
