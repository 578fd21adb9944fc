/*
 * tests/c/test_cuda_tensor_stats.c - the tensor_stats launcher against the
 * CPU kernel (the fixture's rules: cuda_fixture.h).
 *
 * Cases: fp32 / fp16 / bf16 / fp64: scalar, empty, 1 .. 6.3M elements (one
 * block, many, the capped grid), transposed, sliced, expanded (stride 0) and
 * 8-d permuted views, all zeros, all non-finite, extremes; written into the
 * middle slot of three.
 *
 * Tolerance: none. Both sides reduce the same bit patterns with exact
 * integer counts and max / min.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/tensor_stats.h"
#include "tests/c/cuda_fixture.h"

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

void test_cuda_tensor_stats(void) {
    const ng_dtype types[4] = {NG_F32, NG_F16, NG_BF16, NG_F64};
    for (size_t vi = 0; vi < sizeof TS_VIEWS / sizeof TS_VIEWS[0]; vi++)
        for (int di = 0; di < 4; di++) ts_case(&TS_VIEWS[vi], types[di]);
}
