/*
 * kernels/layernorm.c - CPU LayerNorm / RMSNorm, forward and backward.
 *
 * Formulas and the no-0/0 guarantees: layernorm_math.h. Rows are independent
 * in the forward and are split across PyTorch's thread pool. The backward
 * also reduces dweight / dbias over rows: rows are cut into a fixed number
 * of blocks (NG_LN_BLOCKS, independent of the thread count, so results are
 * bitwise reproducible whatever torch.set_num_threads says), each block
 * accumulates its own fp32 partial row, and the partials are summed in block
 * order afterwards.
 *
 * fp16 / bf16 rows are widened to fp32 scratch, processed by the fp32 loops
 * and narrowed on the way out; their weight / bias (16-bit, or fp32 with
 * params_f32) are used as fp32, so fp32 parameters are applied unrounded. fp64 has its own plain loops (it exists for
 * gradcheck and references, not speed). The fp32 loops are compiled for
 * baseline x86-64 and again for AVX2+FMA (+F16C), chosen at run time; on
 * aarch64 for the baseline and for NEON (NANGUARD_CPU_ISA=baseline picks the
 * former).
 */
#include "kernels/layernorm.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/cpu_isa.h"
#include "kernels/layernorm_math.h"
#include "kernels/simd_f32.h"

#define NG_LN_BLOCKS 64

/* ---- the fp32 row loops, once per CPU path ------------------------------ */
#define NG_SFX _base
#define NG_ATTR
#define NG_USE_SIMD 0
#define NG_USE_F16C 0
#define NG_USE_AVX2 0
#define NG_USE_NEON 0
#include "kernels/layernorm_rows.inc"
#undef NG_SFX
#undef NG_ATTR
#undef NG_USE_SIMD
#undef NG_USE_F16C
#undef NG_USE_AVX2
#undef NG_USE_NEON

#if NG_X86
#define NG_SFX _avx2
#define NG_ATTR NG_TARGET_AVX2
#define NG_F32_W 8
#define NG_USE_SIMD 1
#define NG_USE_F16C 1
#define NG_USE_AVX2 1
#define NG_USE_NEON 0
#include "kernels/layernorm_rows.inc"
#undef NG_SFX
#undef NG_ATTR
#undef NG_F32_W
#undef NG_USE_SIMD
#undef NG_USE_F16C
#undef NG_USE_AVX2
#undef NG_USE_NEON
#endif

#if NG_NEON
#define NG_SFX _neon
#define NG_ATTR NG_TARGET_NEON
#define NG_F32_W 4
#define NG_USE_SIMD 1
#define NG_USE_F16C 0
#define NG_USE_AVX2 0
#define NG_USE_NEON 1
#include "kernels/layernorm_rows.inc"
#undef NG_SFX
#undef NG_ATTR
#undef NG_F32_W
#undef NG_USE_SIMD
#undef NG_USE_F16C
#undef NG_USE_AVX2
#undef NG_USE_NEON
#endif

typedef struct ln_path {
    void (*fwd)(const float *, float *, const float *, const float *, int64_t, float, int, float *,
                float *);
    void (*bwd)(const float *, const float *, const float *, float *, float *, float *, int64_t,
                float, float, int);
    void (*to_f32)(const uint16_t *, float *, int64_t, ng_dtype);
    void (*from_f32)(const float *, uint16_t *, int64_t, ng_dtype);
    void (*sum_blocks)(const float *, int64_t, int64_t, int64_t, int64_t, float *);
} ln_path;

static ln_path pick_path(void) {
#if NG_X86
    if (ng_cpu_isa_active() >= NG_ISA_AVX2)
        return (ln_path){ln_row_fwd__avx2, ln_row_bwd__avx2, row_to_f32__avx2, row_from_f32__avx2,
                         sum_blocks__avx2};
#endif
#if NG_NEON
    if (ng_cpu_isa_active() == NG_ISA_NEON)
        return (ln_path){ln_row_fwd__neon, ln_row_bwd__neon, row_to_f32__neon, row_from_f32__neon,
                         sum_blocks__neon};
#endif
    return (ln_path){ln_row_fwd__base, ln_row_bwd__base, row_to_f32__base, row_from_f32__base,
                     sum_blocks__base};
}

/* ---- fp64 reference-grade loops ---------------------------------------- */

static void ln_row_fwd_f64(const double *x, double *y, const double *w, const double *b, int64_t n,
                           double eps, int rms, double *mean_out, double *rstd_out) {
    double shift = rms ? 0.0 : x[0], s = 0.0, v = 0.0;
    if (!rms) {
        for (int64_t i = 0; i < n; i++) s += x[i] - shift;
    }
    double md = s / (double)n, c = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = (x[i] - shift) - md;
        c += e;
        v += e * e;
    }
    /* the corrected two-pass of layernorm_rows.inc (c == 0 for RMSNorm) */
    const double cm = rms ? 0.0 : c / (double)n;
    md += cm;
    double var = v == INFINITY ? INFINITY : v / (double)n - cm * cm;
    if (var < 0.0) var = 0.0;
    double rstd = ng_ln_rstd_f64(var, eps);
    if (mean_out) *mean_out = shift + md;
    *rstd_out = rstd;
    for (int64_t i = 0; i < n; i++) {
        double o = ((x[i] - shift) - md) * rstd;
        if (w) o *= w[i];
        if (b && !rms) o += b[i];
        y[i] = o;
    }
}

static void ln_row_bwd_f64(const double *x, const double *dy, const double *w, double *dx,
                           double *dw_acc, double *db_acc, int64_t n, double mean, double rstd,
                           int rms) {
    if (dx) {
        double sg = 0.0, sgx = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double g = w ? dy[i] * w[i] : dy[i];
            sg += g;
            sgx += g * (x[i] - mean) * rstd;
        }
        double a = rms ? 0.0 : sg / (double)n, bb = sgx / (double)n;
        for (int64_t i = 0; i < n; i++)
            dx[i] = ng_ln_dx_f64(w ? dy[i] * w[i] : dy[i], (x[i] - mean) * rstd, rstd, a, bb);
    }
    for (int64_t i = 0; dw_acc && i < n; i++) dw_acc[i] += dy[i] * (x[i] - mean) * rstd;
    for (int64_t i = 0; db_acc && i < n; i++) db_acc[i] += dy[i];
}

/* ---- forward ------------------------------------------------------------- */

typedef struct fwd_ctx {
    const ng_layernorm_args *a;
    ln_path path;
    const float *w32, *b32; /* fp32 weight / bias (converted once for 16-bit) */
    int failed;             /* scratch allocation failed in some range */
} fwd_ctx;

static void fwd_range(int64_t r0, int64_t r1, void *vctx) {
    fwd_ctx *c = (fwd_ctx *)vctx;
    const ng_layernorm_args *a = c->a;
    const int64_t n = a->cols;
    const int rms = a->rms;
    if (a->dtype == NG_F64) {
        const double *w = (const double *)a->weight, *b = rms ? NULL : (const double *)a->bias;
        for (int64_t r = r0; r < r1; r++)
            ln_row_fwd_f64((const double *)a->x + r * n, (double *)a->y + r * n, w, b, n, a->eps,
                           rms, rms ? NULL : (double *)a->mean + r, (double *)a->rstd + r);
        return;
    }
    const float eps = (float)a->eps;
    float *mean = (float *)a->mean, *rstd = (float *)a->rstd;
    float dummy_mean = 0.0f;
    if (a->dtype == NG_F32) {
        for (int64_t r = r0; r < r1; r++)
            c->path.fwd((const float *)a->x + r * n, (float *)a->y + r * n, c->w32, c->b32, n, eps,
                        rms, rms ? &dummy_mean : mean + r, rstd + r);
        return;
    }
    float *buf = (float *)malloc(2 * (size_t)n * sizeof(float));
    if (!buf) {
        c->failed = 1;
        return;
    }
    float *xr = buf, *yr = buf + n;
    for (int64_t r = r0; r < r1; r++) {
        c->path.to_f32((const uint16_t *)a->x + r * n, xr, n, a->dtype);
        c->path.fwd(xr, yr, c->w32, c->b32, n, eps, rms, rms ? &dummy_mean : mean + r, rstd + r);
        c->path.from_f32(yr, (uint16_t *)a->y + r * n, n, a->dtype);
    }
    free(buf);
}

/* Widen 16-bit weight / bias to fp32 once; fp32 (and fp64) pass through. */
static ng_status params_f32(const ng_layernorm_args *a, const ln_path *p, const float **w32,
                            const float **b32, float **owned) {
    *owned = NULL;
    const void *bias = a->rms ? NULL : a->bias;
    if (ng_layernorm_param_dtype(a) == NG_F32 || a->dtype == NG_F64) {
        *w32 = (const float *)a->weight;
        *b32 = (const float *)bias;
        return NG_OK;
    }
    *w32 = *b32 = NULL;
    if (!a->weight && !bias) return NG_OK;
    float *buf = (float *)malloc(2 * (size_t)a->cols * sizeof(float));
    if (!buf) return NG_ERR_ALLOC;
    if (a->weight) {
        p->to_f32((const uint16_t *)a->weight, buf, a->cols, a->dtype);
        *w32 = buf;
    }
    if (bias) {
        p->to_f32((const uint16_t *)bias, buf + a->cols, a->cols, a->dtype);
        *b32 = buf + a->cols;
    }
    *owned = buf;
    return NG_OK;
}

ng_status ng_layernorm_check(const ng_layernorm_args *a, int backward) {
    if (!a || a->rows < 0 || a->cols < 0) return NG_ERR_INVALID_ARG;
    if ((unsigned)a->dtype > NG_BF16) return NG_ERR_DTYPE;
    if (!(a->eps >= 0.0)) return NG_ERR_INVALID_ARG;
    if (a->params_f32 && a->dtype == NG_F64) return NG_ERR_DTYPE;
    if (backward && a->rms && a->dbias) return NG_ERR_INVALID_ARG;
    return NG_OK;
}

/* Rows per task: about 16K elements of work, at least one row. */
static int64_t row_grain(int64_t cols) {
    return NG_MAX((int64_t)1, (int64_t)16384 / NG_MAX(cols, (int64_t)1));
}

ng_status ng_layernorm_fwd(const ng_layernorm_args *a, ng_parallel_fn par) {
    NG_TRY(ng_layernorm_check(a, 0));
    if (a->rows == 0) return NG_OK;
    if (a->cols == 0) {
        /* Empty rows: statistics of nothing. mean 0, rstd of eps, no output. */
        for (int64_t r = 0; r < a->rows; r++) {
            if (a->dtype == NG_F64) {
                if (!a->rms && a->mean) ((double *)a->mean)[r] = 0.0;
                ((double *)a->rstd)[r] = ng_ln_rstd_f64(0.0, a->eps);
            } else {
                if (!a->rms && a->mean) ((float *)a->mean)[r] = 0.0f;
                ((float *)a->rstd)[r] = ng_ln_rstd_f32(0.0f, (float)a->eps);
            }
        }
        return NG_OK;
    }
    fwd_ctx c = {a, pick_path(), NULL, NULL, 0};
    float *owned = NULL;
    NG_TRY(params_f32(a, &c.path, &c.w32, &c.b32, &owned));
    ng_parallel_run(par, a->rows, row_grain(a->cols), fwd_range, &c);
    free(owned);
    return c.failed ? NG_ERR_ALLOC : NG_OK;
}

/* ---- backward ------------------------------------------------------------ */

typedef struct bwd_ctx {
    const ng_layernorm_args *a;
    ln_path path;
    const float *w32;
    int64_t nblk, rows_per_blk;
    void *dw_part, *db_part; /* [nblk, cols], fp32 (fp64 for fp64) */
    int failed;
} bwd_ctx;

static void bwd_blocks(int64_t k0, int64_t k1, void *vctx) {
    bwd_ctx *c = (bwd_ctx *)vctx;
    const ng_layernorm_args *a = c->a;
    const int64_t n = a->cols;
    float *buf = NULL;
    if (a->dtype == NG_F16 || a->dtype == NG_BF16) {
        buf = (float *)malloc(3 * (size_t)n * sizeof(float));
        if (!buf) {
            c->failed = 1;
            return;
        }
    }
    for (int64_t k = k0; k < k1; k++) {
        const int64_t r0 = k * c->rows_per_blk, r1 = NG_MIN(a->rows, r0 + c->rows_per_blk);
        if (a->dtype == NG_F64) {
            double *dw = c->dw_part ? (double *)c->dw_part + k * n : NULL;
            double *db = c->db_part ? (double *)c->db_part + k * n : NULL;
            if (dw) memset(dw, 0, (size_t)n * sizeof(double));
            if (db) memset(db, 0, (size_t)n * sizeof(double));
            for (int64_t r = r0; r < r1; r++) {
                double mean = a->rms ? 0.0 : ((const double *)a->mean)[r];
                ln_row_bwd_f64((const double *)a->x + r * n, (const double *)a->dy + r * n,
                               (const double *)a->weight, a->dx ? (double *)a->dx + r * n : NULL,
                               dw, db, n, mean, ((const double *)a->rstd)[r], a->rms);
            }
            continue;
        }
        float *dw = c->dw_part ? (float *)c->dw_part + k * n : NULL;
        float *db = c->db_part ? (float *)c->db_part + k * n : NULL;
        if (dw) memset(dw, 0, (size_t)n * sizeof(float));
        if (db) memset(db, 0, (size_t)n * sizeof(float));
        for (int64_t r = r0; r < r1; r++) {
            float mean = a->rms ? 0.0f : ((const float *)a->mean)[r];
            float rstd = ((const float *)a->rstd)[r];
            if (a->dtype == NG_F32) {
                c->path.bwd((const float *)a->x + r * n, (const float *)a->dy + r * n, c->w32,
                            a->dx ? (float *)a->dx + r * n : NULL, dw, db, n, mean, rstd, a->rms);
                continue;
            }
            float *xr = buf, *dyr = buf + n, *dxr = buf + 2 * n;
            c->path.to_f32((const uint16_t *)a->x + r * n, xr, n, a->dtype);
            c->path.to_f32((const uint16_t *)a->dy + r * n, dyr, n, a->dtype);
            c->path.bwd(xr, dyr, c->w32, a->dx ? dxr : NULL, dw, db, n, mean, rstd, a->rms);
            if (a->dx) c->path.from_f32(dxr, (uint16_t *)a->dx + r * n, n, a->dtype);
        }
    }
    free(buf);
}

typedef struct reduce_ctx {
    const bwd_ctx *b;
    float *tmp; /* [cols] fp32 sums before narrowing (16-bit dtypes) */
    int which;  /* 0: dweight, 1: dbias */
} reduce_ctx;

static void reduce_cols(int64_t c0, int64_t c1, void *vctx) {
    reduce_ctx *rc = (reduce_ctx *)vctx;
    const bwd_ctx *c = rc->b;
    const ng_layernorm_args *a = c->a;
    const int64_t n = a->cols;
    const void *part = rc->which ? c->db_part : c->dw_part;
    void *out = rc->which ? a->dbias : a->dweight;
    if (a->dtype == NG_F64) {
        for (int64_t j = c0; j < c1; j++) {
            double s = 0.0;
            for (int64_t k = 0; k < c->nblk; k++) s += ((const double *)part)[k * n + j];
            ((double *)out)[j] = s;
        }
        return;
    }
    /* fp32 sums, narrowed once at the end for 16-bit parameters */
    const ng_dtype pt = ng_layernorm_param_dtype(a);
    float *dst = pt == NG_F32 ? (float *)out : rc->tmp;
    c->path.sum_blocks((const float *)part, c->nblk, n, c0, c1, dst);
    if (pt != NG_F32) c->path.from_f32(dst + c0, (uint16_t *)out + c0, c1 - c0, pt);
}

ng_status ng_layernorm_bwd(const ng_layernorm_args *a, ng_parallel_fn par) {
    NG_TRY(ng_layernorm_check(a, 1));
    const int64_t n = a->cols;
    const size_t es = a->dtype == NG_F64 ? sizeof(double) : sizeof(float);
    if (a->rows == 0 || n == 0) {
        /* No rows: parameter gradients are sums over nothing. */
        for (int64_t j = 0; j < n; j++) {
            if (a->dweight) ng_store_f64(a->dweight, ng_layernorm_param_dtype(a), j, 0.0);
            if (a->dbias) ng_store_f64(a->dbias, ng_layernorm_param_dtype(a), j, 0.0);
        }
        return NG_OK;
    }
    bwd_ctx c = {a, pick_path(), NULL, 0, 0, NULL, NULL, 0};
    float *owned = NULL;
    ng_layernorm_args wa = *a;
    wa.bias = NULL;
    NG_TRY(params_f32(&wa, &c.path, &c.w32, &(const float *){NULL}, &owned));
    c.nblk = NG_MIN(a->rows, (int64_t)NG_LN_BLOCKS);
    c.rows_per_blk = NG_CEIL_DIV(a->rows, c.nblk);
    c.nblk = NG_CEIL_DIV(a->rows, c.rows_per_blk);
    void *part = NULL;
    float *tmp = NULL;
    int nparts = (a->dweight != NULL) + (a->dbias != NULL);
    if (nparts) {
        part = malloc((size_t)nparts * (size_t)c.nblk * (size_t)n * es);
        tmp = (float *)malloc((size_t)n * sizeof(float));
        if (!part || !tmp) {
            free(part);
            free(tmp);
            free(owned);
            return NG_ERR_ALLOC;
        }
        char *p = (char *)part;
        if (a->dweight) {
            c.dw_part = p;
            p += (size_t)c.nblk * (size_t)n * es;
        }
        if (a->dbias) c.db_part = p;
    }
    ng_parallel_run(par, c.nblk, 1, bwd_blocks, &c);
    if (!c.failed) {
        for (int which = 0; which < 2; which++) {
            if (!(which ? a->dbias : a->dweight)) continue;
            reduce_ctx rc = {&c, tmp, which};
            ng_parallel_run(par, n, NG_MAX((int64_t)1, (int64_t)65536 / c.nblk), reduce_cols, &rc);
        }
    }
    free(part);
    free(tmp);
    free(owned);
    return c.failed ? NG_ERR_ALLOC : NG_OK;
}
