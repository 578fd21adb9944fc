/*
 * tests/c/test_cuda_grad_guard.c - the gradient guard's reduce and apply
 * launchers against the CPU kernels (the fixture's rules: cuda_fixture.h).
 *
 * Cases: reduce + apply, fp32 / fp16 / bf16 / fp64, norm 2 and inf: one
 * tensor, mixed sizes with empty tensors and multi-block tensors, 1100
 * tensors (more blocks than one launch's table), a base one element off 16
 * bytes, an empty list; no clip, clip, a multiplier of exactly 1, NaN + Inf
 * (step skipped, gradients untouched), a multiplier below FLT_MIN.
 *
 * Tolerances: stats exact except the sum of squares (rtol 1e-12: exact fp64
 * squares summed in another order); found_inf exact. Apply: same stats, same
 * coefficient arithmetic, so the gradients should match bit for bit; one
 * unit in the last place is allowed (fp32 3e-7, fp16 1e-3, bf16 8e-3, fp64
 * 1e-12 relative, plus one subnormal step).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/grad_guard.h"
#include "tests/c/cuda_fixture.h"

enum { GL_ONE, GL_MIXED, GL_MANY, GL_MISALIGNED, GL_EMPTY, GL_COUNT };
static const char *const GL_NAMES[GL_COUNT] = {"1_tensor", "mixed_sizes", "1100_tensors",
                                               "misaligned", "empty_list"};
/* overflow: an inv_scale above 1 that takes one finite value past what its
 * dtype holds (counted as Inf, step skipped); bad_scale: an inv_scale that
 * cannot unscale, NaN or (odd lists) negative (step skipped, total norm
 * NaN). */
enum { GS_NOCLIP, GS_CLIP, GS_ONE, GS_NONFINITE, GS_WIDE, GS_OVERFLOW, GS_BAD_SCALE, GS_COUNT };
static const char *const GS_NAMES[GS_COUNT] = {"no_clip",   "clip",     "coef_1",   "nan_inf",
                                               "tiny_coef", "overflow", "bad_scale"};

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
        for (int64_t i = 0; i < 1100; i++) numels[i] = 1 + (i * 37) % 50;
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
    case NG_F64: return (tol){1e-12, 0, 5e-324, "one ulp"};
    case NG_F32: return (tol){3e-7, 0, 1.5e-45, "one ulp"};
    case NG_F16: return (tol){1e-3, 0, 6e-8, "one ulp"};
    case NG_BF16: return (tol){8e-3, 0, 1e-40, "one ulp"};
    }
    return (tol){0, 0, 0, ""};
}

/* A case: its gradient list (host copies, untouched originals, device
 * tensors), the CPU's results, and the device-side arguments. */
typedef struct gg_io {
    ng_dtype t;
    ng_gg_norm norm;
    int list, scen;
    int planted; /* GS_OVERFLOW: the value that overflows is in the list */
    int64_t n, numels[1100];
    void *host[1100], *orig[1100], *dbase[1100], *dptr[1100];
    float inv_scale, found;
    ng_dtype ndt; /* the total norm's dtype */
    double stats[NG_GG_NSTATS], max_norm;
    union {
        double d;
        float f;
    } tn;
} gg_io;

/* The gradients: random, with a NaN in the first non-empty tensor after #1
 * and Infs in the last for the non-finite scenario; device copies at the
 * list's alignment. */
static void gg_inputs(gg_io *g) {
    int misalign;
    g->n = gg_list(g->list, g->numels, &misalign);
    const size_t es = ng_dtype_size(g->t);
    ng_rng rng = {0x6e6700u + (uint64_t)(g->list * 64 + g->scen * 8 + (int)g->norm * 4) +
                  (uint64_t)g->t};
    const double mag = g->t == NG_F16 ? 8.0 : 4.0;
    for (int64_t i = 0; i < g->n; i++) {
        g->host[i] = malloc((size_t)g->numels[i] * es + 1);
        for (int64_t e = 0; e < g->numels[i]; e++)
            ng_store_f64(g->host[i], g->t, e, mag * ng_rng_unif(&rng));
    }
    if (g->scen == GS_NONFINITE) {
        int64_t first = -1, last = -1;
        for (int64_t i = 0; i < g->n; i++)
            if (g->numels[i] > 0) {
                if (first < 0 && i >= 1) first = i;
                last = i;
            }
        if (first >= 0) ng_store_f64(g->host[first], g->t, g->numels[first] / 2, NAN);
        if (last >= 0) {
            ng_store_f64(g->host[last], g->t, 0, INFINITY);
            ng_store_f64(g->host[last], g->t, g->numels[last] - 1, -INFINITY);
        }
    }
    if (g->scen == GS_OVERFLOW) {
        /* times GS_OVERFLOW_SCALE, past the dtype's largest value: fp16 and
         * bf16 below fp32's (the bf16 one between its overflow limit and
         * FLT_MAX), fp32 and fp64 to Inf */
        const double big = g->t == NG_F16    ? 16.0
                           : g->t == NG_BF16 ? 8.29e34
                           : g->t == NG_F32  ? 1e35
                                             : 1e308;
        for (int64_t i = g->n - 1; i >= 0; i--)
            if (g->numels[i] > 0) {
                ng_store_f64(g->host[i], g->t, g->numels[i] / 3, -big);
                g->planted = 1;
                break;
            }
    }
    for (int64_t i = 0; i < g->n; i++) {
        size_t bytes = (size_t)g->numels[i] * es;
        g->orig[i] = malloc(bytes + 1);
        memcpy(g->orig[i], g->host[i], bytes);
        g->dbase[i] = dmalloc(bytes + (size_t)misalign * es);
        g->dptr[i] = (char *)g->dbase[i] + (size_t)misalign * es;
        dcopy_to(g->dptr[i], g->host[i], bytes);
    }
}

#define GS_OVERFLOW_SCALE 4108.0f

/* The CPU reduce and apply (in place on host[]); the scenario's max_norm. */
static ng_status gg_cpu(gg_io *g) {
    const int scen = g->scen;
    g->inv_scale = scen == GS_NOCLIP      ? 1.0f / 1024.0f
                   : scen == GS_ONE       ? 1.0f
                   : scen == GS_OVERFLOW  ? GS_OVERFLOW_SCALE
                   : scen == GS_BAD_SCALE ? (g->list % 2 ? -0.5f : NAN)
                                          : 0.37f;
    g->ndt = (g->list + scen) % 2 ? NG_F64 : NG_F32;
    ng_status st = ng_grad_guard_reduce((const void *const *)g->host, g->numels, g->n, g->t,
                                        &g->inv_scale, g->norm, g->stats, NULL);
    CHECK(st == NG_OK, "CPU reduce: %s", ng_status_str(st));
    double total = ng_gg_total_norm(g->stats, g->norm);
    g->max_norm = scen == GS_CLIP ? 0.25 * total : scen == GS_WIDE ? 1e-40 : 1e30;
    if (!(g->max_norm >= 0.0)) g->max_norm = 1.0; /* non-finite total: any max_norm */
    g->found = 0.0f;
    g->tn.d = 0.0;
    if (st == NG_OK) {
        st = ng_grad_guard_apply(g->host, g->numels, g->n, g->t, &g->inv_scale, g->stats,
                                 g->max_norm, g->norm, &g->found, &g->tn, g->ndt, NULL);
        CHECK(st == NG_OK, "CPU apply: %s", ng_status_str(st));
    }
    if (g->planted)
        CHECK(g->stats[NG_GG_INF] == 1.0 && g->found == 1.0f,
              "overflow: CPU inf count %g, found_inf %g", g->stats[NG_GG_INF], (double)g->found);
    if (scen == GS_BAD_SCALE) {
        double tn = g->ndt == NG_F64 ? g->tn.d : (double)g->tn.f;
        CHECK(g->found == 1.0f && isnan(tn), "inv_scale %g: CPU found_inf %g, total norm %g",
              (double)g->inv_scale, (double)g->found, tn);
    }
    return st;
}

/* The reduce launch's stats against the CPU's. */
static void gg_check_stats(const gg_io *g, const double *stats_d) {
    const int n2 = g->norm == NG_GG_NORM_2;
    const double *stats = g->stats;
    double *sg = ddownload(stats_d, sizeof g->stats);
    /* NaN / Inf in the gradients make the sum of squares NaN / Inf on both sides */
    const double ng = sg[NG_GG_NORM], nc = stats[NG_GG_NORM], nd = fabs(ng - nc);
    const double lim = n2 ? 1e-12 * fabs(nc) : 0.0;
    CHECK((isnan(ng) && isnan(nc)) || ng == nc || nd <= lim, "%s: cuda %.17g cpu %.17g",
          n2 ? "sum of squares" : "max |u|", ng, nc);
    if (isfinite(nd) && nd > 0.0 && lim > 0.0 && nd / lim > g_case_worst) g_case_worst = nd / lim;
    CHECK(sg[NG_GG_NAN] == stats[NG_GG_NAN] && sg[NG_GG_INF] == stats[NG_GG_INF] &&
              sg[NG_GG_FIRST_BAD] == stats[NG_GG_FIRST_BAD],
          "counts: cuda nan %g inf %g first %g, cpu nan %g inf %g first %g", sg[NG_GG_NAN],
          sg[NG_GG_INF], sg[NG_GG_FIRST_BAD], stats[NG_GG_NAN], stats[NG_GG_INF],
          stats[NG_GG_FIRST_BAD]);
    free(sg);
}

/* The apply launch's found_inf, total norm and gradients against the CPU's. */
static void gg_check_apply(const gg_io *g, const float *found_d, const double *tn_d) {
    const size_t es = ng_dtype_size(g->t);
    float *fg = ddownload(found_d, sizeof(float));
    void *tg = ddownload(tn_d, sizeof(double));
    CHECK(*fg == g->found, "found_inf: cuda %g cpu %g", (double)*fg, (double)g->found);
    double tgv;
    if (g->ndt == NG_F64) {
        memcpy(&tgv, tg, sizeof tgv);
    } else {
        float f;
        memcpy(&f, tg, sizeof f);
        tgv = f;
    }
    double tcv = g->ndt == NG_F64 ? g->tn.d : (double)g->tn.f;
    CHECK((isnan(tcv) && isnan(tgv)) || tgv == tcv || fabs(tgv - tcv) <= 1e-12 * fabs(tcv),
          "total norm (%s): cuda %.17g cpu %.17g", ng_dtype_name(g->ndt), tgv, tcv);
    for (int64_t i = 0; i < g->n; i++) {
        size_t bytes = (size_t)g->numels[i] * es;
        void *gd = ddownload(g->dptr[i], bytes);
        char what[48];
        snprintf(what, sizeof what, "grad %lld", (long long)i);
        if (g->found != 0.0f || g->scen == GS_ONE) { /* untouched, bit for bit */
            CHECK(memcmp(gd, g->orig[i], bytes) == 0, "%s: changed although the step is %s", what,
                  g->found != 0.0f ? "skipped" : "a multiply by 1");
        } else {
            double *r = to_f64(g->host[i], g->t, g->numels[i]), *d = to_f64(gd, g->t, g->numels[i]);
            close_rows(what, d, r, 1, g->numels[i], gg_tol(g->t), NULL);
            free(r), free(d);
        }
        free(gd);
    }
    free(fg);
    free(tg);
}

/* The reduce launch, then the apply launch given the CPU's stats. */
static void gg_device(gg_io *g) {
    const int64_t ws_bytes = ng_grad_guard_cuda_workspace_bytes(g->numels, g->n);
    void *ws = ws_bytes ? dmalloc((size_t)ws_bytes) : NULL;
    float *inv_d = dupload(&g->inv_scale, sizeof g->inv_scale);
    double *stats_d = dmalloc(sizeof g->stats);
    float zero = 0.0f, *found_d = dupload(&zero, sizeof zero);
    double *tn_d = dmalloc(sizeof(double));
    dpoison(stats_d, sizeof g->stats);
    if (LAUNCHED(ng_grad_guard_reduce_cuda((const void *const *)g->dptr, g->numels, g->n, g->t,
                                           inv_d, g->norm, stats_d, ws, ws_bytes, g_stream))) {
        gg_check_stats(g, stats_d);
        /* apply with the CPU's stats on both sides */
        dcopy_to(stats_d, g->stats, sizeof g->stats);
        dpoison(tn_d, sizeof(double));
        if (LAUNCHED(ng_grad_guard_apply_cuda(g->dptr, g->numels, g->n, g->t, inv_d, stats_d,
                                              g->max_norm, g->norm, found_d, tn_d, g->ndt,
                                              g_stream)))
            gg_check_apply(g, found_d, tn_d);
    }
    dfree(ws), dfree(inv_d), dfree(stats_d), dfree(found_d), dfree(tn_d);
}

static void gg_case(ng_dtype t, ng_gg_norm norm, int list, int scen) {
    if (!case_begin("grad_guard %s %s %s %s", norm == NG_GG_NORM_2 ? "norm2" : "norm_inf",
                    GL_NAMES[list], GS_NAMES[scen], ng_dtype_name(t)))
        return;
    static gg_io g;
    memset(&g, 0, sizeof g);
    g.t = t, g.norm = norm, g.list = list, g.scen = scen;
    gg_inputs(&g);
    if (gg_cpu(&g) == NG_OK) gg_device(&g);
    for (int64_t i = 0; i < g.n; i++) {
        dfree(g.dbase[i]);
        free(g.host[i]);
        free(g.orig[i]);
    }
    case_end();
}

void test_cuda_grad_guard(void) {
    const ng_dtype types[4] = {NG_F32, NG_F16, NG_BF16, NG_F64};
    for (int di = 0; di < 4; di++)
        for (int list = 0; list < GL_COUNT; list++) {
            /* sample: the lists that need two launches (1100 tensors) once
             * per dtype: norm 2 clipping (fp32, fp64) or norm inf skipping a
             * non-finite step (fp16, bf16) */
            const int many = g_sample && list == GL_MANY;
            for (int scen = 0; scen < GS_COUNT; scen++)
                if (!many || (di % 3 == 0 && scen == GS_CLIP))
                    gg_case(types[di], NG_GG_NORM_2, list, scen);
            if (!many) gg_case(types[di], NG_GG_NORM_INF, list, GS_CLIP);
            if (!many || di % 3 != 0) gg_case(types[di], NG_GG_NORM_INF, list, GS_NONFINITE);
            if (!many) {
                gg_case(types[di], NG_GG_NORM_INF, list, GS_OVERFLOW);
                gg_case(types[di], NG_GG_NORM_INF, list, GS_BAD_SCALE);
            }
        }
}
