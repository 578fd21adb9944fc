/*
 * tests/c/test_tensor_stats.c - CPU tensor_stats vs a plain loop over the
 * converted values (isnan / isinf / fabs in fp64): every dtype, odd sizes
 * (1, 7, 1023, 70001, sizes that span several parallel blocks), empty and
 * scalar tensors, transposed / sliced / expanded (stride 0) views of up to 8
 * dimensions, NaN / +Inf / -Inf / zeros / subnormals at random places, all
 * values non-finite, split-independence (serial, reversed blocks, one block
 * per call), bad arguments; every CPU path the machine has.
 *
 * Counts and both magnitudes must match exactly (no tolerance): the kernel's
 * integer arithmetic on bit patterns is exact and fp64 holds every value.
 */
#include <string.h>

#include "kernels/tensor_stats.h"
#include "tests/c/ng_test.h"

static void reverse_chunks(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    if (grain < 1) grain = 1;
    for (int64_t c = NG_CEIL_DIV(n, grain) - 1; c >= 0; c--)
        fn(c * grain, NG_MIN(n, (c + 1) * grain), ctx);
}

static void one_by_one(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    (void)grain;
    for (int64_t i = 0; i < n; i++) fn(i, i + 1, ctx);
}

typedef struct ref_stats {
    int64_t nan, pinf, ninf;
    double max_abs, min_abs;
} ref_stats;

/* The oracle: a plain loop over every index of the view, on fp64 values. */
static ref_stats reference(const ng_tensor_stats_args *a) {
    ref_stats r = {0, 0, 0, 0.0, INFINITY};
    int64_t numel = 1;
    for (int64_t d = 0; d < a->ndim; d++) numel *= a->sizes[d];
    int64_t idx[NG_TS_MAX_DIMS] = {0};
    for (int64_t k = 0; k < numel; k++) {
        int64_t off = 0;
        for (int64_t d = 0; d < a->ndim; d++) off += idx[d] * a->strides[d];
        double v = ng_load_f64(a->x, a->dtype, off);
        if (isnan(v))
            r.nan++;
        else if (v == INFINITY)
            r.pinf++;
        else if (v == -INFINITY)
            r.ninf++;
        else {
            double m = fabs(v);
            if (m > r.max_abs) r.max_abs = m;
            if (m != 0.0 && m < r.min_abs) r.min_abs = m;
        }
        for (int64_t d = a->ndim - 1; d >= 0; d--) {
            if (++idx[d] < a->sizes[d]) break;
            idx[d] = 0;
        }
    }
    return r;
}

static int check_one(const char *what, const ng_tensor_stats_args *a0, ng_parallel_fn par) {
    int64_t counts[NG_TS_NCOUNTS] = {-1, -1, -1};
    double values[NG_TS_NVALUES] = {-1.0, -1.0};
    ng_tensor_stats_args a = *a0;
    a.counts = counts;
    a.values = values;
    ng_status s = ng_tensor_stats(&a, par);
    ref_stats r = reference(&a);
    int ok = s == NG_OK && counts[NG_TS_NAN] == r.nan && counts[NG_TS_POSINF] == r.pinf &&
             counts[NG_TS_NEGINF] == r.ninf && values[NG_TS_MAX_ABS] == r.max_abs &&
             values[NG_TS_MIN_ABS] == r.min_abs;
    ng_test_checks++;
    if (!ok) {
        ng_test_failures++;
        fprintf(stderr,
                "FAIL %s (%s, isa %s): status %d got nan %lld +inf %lld -inf %lld max %.17g min "
                "%.17g; want %lld %lld %lld %.17g %.17g\n",
                what, ng_dtype_name(a.dtype), ng_cpu_isa_name(ng_cpu_isa_active()), (int)s,
                (long long)counts[0], (long long)counts[1], (long long)counts[2], values[0],
                values[1], (long long)r.nan, (long long)r.pinf, (long long)r.ninf, r.max_abs,
                r.min_abs);
    }
    return ok;
}

/* Check with every runner: serial, reversed blocks, one block per call. */
static void check_all_runners(const char *what, const ng_tensor_stats_args *a) {
    check_one(what, a, NULL);
    check_one(what, a, reverse_chunks);
    check_one(what, a, one_by_one);
}

static const ng_dtype DTYPES[] = {NG_F32, NG_F64, NG_F16, NG_BF16};

/* Fill n elements with values of magnitude ~mag; with probability `bad`
 * (per mille) a NaN, +Inf or -Inf, and some zeros and tiny values. */
static void fill(void *buf, ng_dtype t, int64_t n, double mag, int bad, ng_rng *rng) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t k = ng_rng_u64(rng) % 1000;
        double v = ng_rng_unif(rng) * mag;
        if ((int)k < bad) {
            int w = (int)(ng_rng_u64(rng) % 3);
            v = w == 0 ? NAN : w == 1 ? INFINITY : -INFINITY;
        } else if (k < 20) {
            v = 0.0;
        } else if (k < 30) {
            v = (k & 1 ? -1.0 : 1.0) * 1e-6; /* subnormal in fp16, normal elsewhere */
        }
        ng_store_f64(buf, t, i, v);
    }
    if (n > 0 && t != NG_F64) { /* a NaN with a payload, and a negative NaN */
        if (bad) {
            if (t == NG_F32)
                ((uint32_t *)buf)[n / 2] = 0xffc00001u;
            else
                ((uint16_t *)buf)[n / 2] = 0xfe01u;
        }
    }
}

static ng_tensor_stats_args contig_args(ng_dtype t, const void *x, int64_t n) {
    ng_tensor_stats_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.x = x;
    a.ndim = 1;
    a.sizes[0] = n;
    a.strides[0] = 1;
    return a;
}

static void test_contiguous(void) {
    static const int64_t sizes[] = {
        1, 2, 7, 31, 1023, 4097, 70001, (1 << 18) + 3, 3 * (1 << 18) + 11};
    static const int bads[] = {0, 1, 50};
    ng_rng rng = {42};
    for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
        ng_dtype t = DTYPES[di];
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int64_t n = sizes[si];
            void *buf = malloc((size_t)n * ng_dtype_size(t));
            for (size_t bi = 0; bi < sizeof bads / sizeof bads[0]; bi++) {
                fill(buf, t, n, si % 2 ? 3e3 : 0.5, bads[bi], &rng);
                ng_tensor_stats_args a = contig_args(t, buf, n);
                check_all_runners("contiguous", &a);
            }
            free(buf);
        }
    }
}

static void test_special(void) {
    for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
        ng_dtype t = DTYPES[di];
        double buf8[64];
        void *buf = buf8;
        /* empty */
        ng_tensor_stats_args a = contig_args(t, NULL, 0);
        check_one("empty", &a, NULL);
        int64_t counts[3];
        double values[2];
        a.counts = counts;
        a.values = values;
        NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_OK && counts[0] == 0 && counts[1] == 0 &&
                  counts[2] == 0 && values[0] == 0.0 && values[1] == INFINITY);
        /* empty in one of several dims, with a NULL pointer */
        a.ndim = 3;
        a.sizes[0] = 4, a.sizes[1] = 0, a.sizes[2] = 5;
        a.strides[0] = 0, a.strides[1] = 5, a.strides[2] = 1;
        check_one("empty 3d", &a, NULL);
        /* scalar (0 dims) */
        ng_store_f64(buf, t, 0, -2.5);
        a = contig_args(t, buf, 1);
        a.ndim = 0;
        check_one("scalar", &a, NULL);
        /* all zeros: max 0, min none */
        for (int i = 0; i < 37; i++) ng_store_f64(buf, t, i, i % 2 ? 0.0 : -0.0);
        a = contig_args(t, buf, 37);
        check_one("zeros", &a, NULL);
        /* all non-finite */
        for (int i = 0; i < 37; i++)
            ng_store_f64(buf, t, i, i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY);
        check_one("all non-finite", &a, NULL);
        /* largest finite and smallest subnormal of the dtype */
        if (t == NG_F16) {
            ((uint16_t *)buf)[0] = 0x7bffu, ((uint16_t *)buf)[1] = 0x8001u;
        } else if (t == NG_BF16) {
            ((uint16_t *)buf)[0] = 0xff7fu, ((uint16_t *)buf)[1] = 0x0001u;
        } else if (t == NG_F32) {
            ((uint32_t *)buf)[0] = 0x7f7fffffu, ((uint32_t *)buf)[1] = 0x80000001u;
        } else {
            ((uint64_t *)buf)[0] = 0xffefffffffffffffull, ((uint64_t *)buf)[1] = 1u;
        }
        a = contig_args(t, buf, 2);
        check_one("extremes", &a, NULL);
    }
}

/* Strided views of a larger buffer: transposes, slices, stride 0, 8 dims. */
/* One non-finite value at each edge of the contiguous loop's 4096-element
 * chunks (all-finite chunks take a two-reduction pass; a chunk with a NaN or
 * Inf is read again by the counting loop), between finite chunks. */
static void test_chunk_edges(void) {
    static const int64_t at[] = {0, 4095, 4096, 8191, 8192, 12292};
    const int64_t n = 12293;
    ng_rng rng = {7};
    for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
        ng_dtype t = DTYPES[di];
        void *buf = malloc((size_t)n * ng_dtype_size(t));
        for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
            for (int w = 0; w < 3; w++) {
                fill(buf, t, n, 2.0, 0, &rng);
                ng_store_f64(buf, t, at[k], w == 0 ? NAN : w == 1 ? INFINITY : -INFINITY);
                ng_tensor_stats_args a = contig_args(t, buf, n);
                check_one("chunk edge", &a, NULL);
            }
        }
        free(buf);
    }
}

static void test_strided(void) {
    ng_rng rng = {7};
    for (size_t di = 0; di < sizeof DTYPES / sizeof DTYPES[0]; di++) {
        ng_dtype t = DTYPES[di];
        const int64_t N = 1 << 20;
        void *buf = malloc((size_t)N * ng_dtype_size(t));
        fill(buf, t, N, 10.0, 5, &rng);
        ng_tensor_stats_args a;
        /* transpose of [37, 53] */
        memset(&a, 0, sizeof a);
        a.dtype = t, a.x = buf, a.ndim = 2;
        a.sizes[0] = 53, a.sizes[1] = 37, a.strides[0] = 1, a.strides[1] = 53;
        check_all_runners("transpose", &a);
        /* every other column of [611, 1000], starting at column 3 */
        a.x = (const char *)buf + 3 * ng_dtype_size(t);
        a.sizes[0] = 611, a.sizes[1] = 499, a.strides[0] = 1000, a.strides[1] = 2;
        check_all_runners("column slice", &a);
        /* rows slice [700, 300] of [700, 1000]: contiguous rows, gaps between */
        a.x = buf;
        a.sizes[0] = 700, a.sizes[1] = 300, a.strides[0] = 1000, a.strides[1] = 1;
        check_all_runners("row slice", &a);
        /* expanded: [5, 1000] with stride 0 in dim 0 */
        a.sizes[0] = 5, a.sizes[1] = 1000, a.strides[0] = 0, a.strides[1] = 1;
        check_all_runners("expand", &a);
        /* 8 dims, permuted, size-1 dims included */
        a.ndim = 8;
        {
            const int64_t sz[8] = {3, 1, 5, 2, 7, 1, 4, 3};
            const int64_t st[8] = {1, 999, 3, 15, 30, 7, 210, 840};
            for (int d = 0; d < 8; d++) a.sizes[d] = sz[d], a.strides[d] = st[d];
        }
        check_all_runners("8 dims", &a);
        /* large strided (several parallel blocks): [1024, 512] of every other element */
        a.ndim = 2;
        a.sizes[0] = 1024, a.sizes[1] = 512, a.strides[0] = 1024, a.strides[1] = 2;
        check_all_runners("large strided", &a);
        free(buf);
    }
}

static void test_coalesce(void) {
    int64_t s[4] = {2, 3, 1, 4}, st[4] = {12, 4, 99, 1};
    NG_EXPECT(ng_ts_coalesce(4, s, st) == 1 && s[0] == 24 && st[0] == 1);
    int64_t s2[3] = {2, 3, 4}, st2[3] = {1, 2, 6}; /* a permuted view: nothing merges */
    NG_EXPECT(ng_ts_coalesce(3, s2, st2) == 3);
    int64_t s3[2] = {5, 0}, st3[2] = {0, 1};
    NG_EXPECT(ng_ts_coalesce(2, s3, st3) == 1 && s3[0] == 0);
}

static void test_bad_args(void) {
    float x = 1.0f;
    int64_t counts[3];
    double values[2];
    ng_tensor_stats_args a = contig_args(NG_F32, &x, 1);
    NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_ERR_INVALID_ARG); /* no outputs */
    a.counts = counts, a.values = values;
    a.dtype = (ng_dtype)9;
    NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_ERR_DTYPE);
    a.dtype = NG_F32;
    a.ndim = NG_TS_MAX_DIMS + 1;
    NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_ERR_INVALID_ARG);
    a.ndim = 1;
    a.sizes[0] = -1;
    NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_ERR_INVALID_ARG);
    a.sizes[0] = 1;
    a.x = NULL;
    NG_EXPECT(ng_tensor_stats(&a, NULL) == NG_ERR_INVALID_ARG);
}

int main(void) {
    NG_FOR_EACH_ISA(isa) {
        printf("tensor_stats: CPU path %s\n", ng_cpu_isa_name((ng_cpu_isa)isa));
        test_contiguous();
        test_special();
        test_chunk_edges();
        test_strided();
    }
    test_coalesce();
    test_bad_args();
    return ng_test_finish("test_tensor_stats");
}
