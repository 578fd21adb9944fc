/*
 * tests/c/cuda_fixture.c - main of the CUDA test binary, its case
 * bookkeeping, tolerance check and device plumbing (see cuda_fixture.h).
 *
 * Usage: build/test_cuda [--set=NAME] [--shard=I/N] [filter ...]. One line per case on
 * stdout, "ok" or "FAIL" with the worst error seen as a fraction of its
 * limit; mismatches in detail on stderr. With filters only the cases whose
 * line contains one of them run ("attention", "bfloat16", "gqa", ...);
 * --set=NAME adds a named list of filters (SETS below); --shard=I/N runs
 * only the I-th (0-based) of every N cases that pass the filters, so N
 * processes together run each case once. With NG_TEST_VERBOSE
 * set in the environment every comparison's worst error goes to stderr.
 * Without a usable CUDA device (cudaGetDeviceCount fails or finds none) it
 * prints "SKIP: no CUDA device" and exits 77, which ctest reports as skipped.
 * A failing CUDA runtime call ends the run (the context may be unusable after
 * it); a launcher returning anything but NG_OK fails its case with
 * ng_status_str.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/c/cuda_fixture.h"

const ng_dtype FLOAT_TYPES[3] = {NG_F32, NG_F16, NG_BF16};

/* ---- cases and checks ---------------------------------------------------- */

static const char **g_filters;             /* run only the cases whose line contains one of these */
static int g_shard, g_nshards = 1, g_seen; /* --shard=I/N; cases that passed the filters */
static int g_nfilters;
int g_sample;
static int g_verbose; /* NG_TEST_VERBOSE set: the worst error of every comparison on stderr */
char g_case[192];
static int g_case_bad; /* failed checks in the current case */
double g_case_worst;
static int g_cases, g_cases_failed;

/* sm75 (--set=sm75): what a GPU before sm_80 must run. fp16 / bf16
 * attention on the SIMT kernels, every mask kind, dropout, GQA, ragged
 * tails, NaN rows and empty sizes; the decode kernel at head dim 256 in
 * sm_75's 64 KiB of shared memory. */
static const char *const SET_SM75[] = {"E64_L64_S129",
                                       "E128_L129_S7_causal",
                                       "E64_L1_S1",
                                       "E128_L7_S64",
                                       "bool_full_rows_E64",
                                       "neginf_full_rows_E64_gqa",
                                       "lowest_LS_causal_E128",
                                       "f32_mask_E64",
                                       "clamp_softcap_E64_gqa",
                                       "dropout_E64",
                                       "dropout_bool_E40",
                                       "shifted_base_E64",
                                       "nan_in_q_causal_mask_E64",
                                       "nan_in_dout_pad_mask_E128",
                                       "empty_S",
                                       "empty_L",
                                       "rejects",
                                       "decode_L1_gqa_bool_pad",
                                       "decode_L2_E256_gqa",
                                       NULL};

/* sm86 (--set=sm86): a GPU of compute capability 8.6 / 8.9, whose 99 KiB of
 * shared memory per block take one stage of the tensor-core backward's
 * streamed tiles at head dim 128 (two at 64): ragged tails, GQA, causal,
 * masks, dropout, unaligned rows, NaN and large scores. */
static const char *const SET_SM86[] = {"E128_L129_S129",
                                       "E128_L300_S300",
                                       "E128_L7_S300",
                                       "E128_L300_S1",
                                       "E64_L129_S129",
                                       "gqa_E128_causal",
                                       "dropout_E128_causal_gqa",
                                       "large_scores_E128",
                                       "nan_in_dout_pad_mask_E128",
                                       "pad_rows_E128_causal",
                                       "shifted_base_E128_gqa_mask",
                                       NULL};

/* Named filter lists, for --set=NAME. */
static const struct {
    const char *name;
    const char *const *filters;
} SETS[] = {{"sm75", SET_SM75}, {"sm86", SET_SM86}};

/* argv[1..] as the filter list, each --set=NAME replaced by its filters;
 * returns 0 for an unknown set. */
static int parse_filters(int argc, char **argv) {
    int cap = argc;
    for (size_t k = 0; k < sizeof SETS / sizeof SETS[0]; k++)
        for (const char *const *f = SETS[k].filters; *f; f++) cap++;
    g_filters = calloc((size_t)cap, sizeof *g_filters);
    g_nfilters = 0;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--shard=", 8) == 0) {
            if (sscanf(argv[i] + 8, "%d/%d", &g_shard, &g_nshards) != 2 || g_nshards < 1 ||
                g_shard < 0 || g_shard >= g_nshards) {
                fprintf(stderr, "test_cuda: --shard=I/N needs 0 <= I < N, not \"%s\"\n",
                        argv[i] + 8);
                return 0;
            }
            continue;
        }
        if (strncmp(argv[i], "--set=", 6) != 0) {
            g_filters[g_nfilters++] = argv[i];
            continue;
        }
        size_t k = 0;
        while (k < sizeof SETS / sizeof SETS[0] && strcmp(SETS[k].name, argv[i] + 6) != 0) k++;
        if (k == sizeof SETS / sizeof SETS[0]) {
            fprintf(stderr, "test_cuda: unknown filter set \"%s\"\n", argv[i] + 6);
            return 0;
        }
        for (const char *const *f = SETS[k].filters; *f; f++) g_filters[g_nfilters++] = *f;
    }
    return 1;
}

int case_begin(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_case, sizeof g_case, fmt, ap);
    va_end(ap);
    if (g_nfilters) {
        int hit = 0;
        for (int f = 0; f < g_nfilters && !hit; f++) hit = strstr(g_case, g_filters[f]) != NULL;
        if (!hit) return 0;
    }
    if (g_seen++ % g_nshards != g_shard) return 0;
    g_case_bad = 0;
    g_case_worst = 0.0;
    g_cases++;
    return 1;
}

void case_end(void) {
    if (g_case_bad) g_cases_failed++;
    printf("%-64s %s (worst %.3f of tol)\n", g_case, g_case_bad ? "FAIL" : "ok", g_case_worst);
    fflush(stdout);
}

void fail(const char *fmt, ...) {
    va_list ap;
    ng_test_failures++;
    g_case_bad++;
    fprintf(stderr, "FAIL %s: ", g_case);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
}

void count_check(void) { ng_test_checks++; }

/* Compare rows x cols values (see the header for the rule). rowscale, when
 * given, replaces each row's own largest |ref| in the afrac term. */
void close_rows(const char *what, const double *got, const double *ref, int64_t rows, int64_t cols,
                tol t, const double *rowscale) {
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
            double d = fabs(g[c] - w[c]), lim = tol_limit(t, w[c], rowmax);
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

double *to_f64(const void *src, ng_dtype t, int64_t n) {
    double *d = calloc((size_t)(n + 1), sizeof(double));
    for (int64_t i = 0; i < n; i++) d[i] = ng_load_f64(src, t, i);
    return d;
}

/* ---- device plumbing ------------------------------------------------------ */

cudaStream_t g_stream;

void cuda_fatal(cudaError_t e, const char *stmt, const char *file, int line) {
    ng_test_failures++;
    fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", file, line, stmt, cudaGetErrorName(e),
            cudaGetErrorString(e));
    printf("test_cuda: stopped at a CUDA error in %s: %s\n", g_case[0] ? g_case : "setup",
           cudaGetErrorName(e));
    exit(ng_test_finish("test_cuda"));
}

int launched(ng_status s, const char *stmt, int line) {
    ng_test_checks++;
    if (s != NG_OK) {
        fail("line %d: %s returned %s", line, stmt, ng_status_str(s));
        return 0;
    }
    CU(cudaStreamSynchronize(g_stream));
    return 1;
}

void *dmalloc(size_t bytes) {
    void *p = NULL;
    CU(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

void dfree(void *p) {
    if (p) CU(cudaFree(p));
}

void *dupload(const void *h, size_t bytes) {
    void *d = dmalloc(bytes);
    if (bytes) CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, g_stream));
    return d;
}

void dcopy_to(void *d, const void *h, size_t bytes) {
    if (bytes) CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, g_stream));
}

void dpoison(void *d, size_t bytes) {
    if (bytes) CU(cudaMemsetAsync(d, 0xff, bytes, g_stream));
}

void *ddownload(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    if (bytes) CU(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, g_stream));
    CU(cudaStreamSynchronize(g_stream));
    return h;
}

int all_ff(const void *p, size_t bytes) {
    const uint8_t *b = p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i] != 0xff) return 0;
    return 1;
}

/* ---- main ------------------------------------------------------------------- */

int main(int argc, char **argv) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        return 77;
    }
    if (!parse_filters(argc, argv)) return 2;
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
    if (g_nshards > 1)
        printf("test_cuda: shard %d of %d (every %d-th case)\n", g_shard, g_nshards, g_nshards);
    printf("test_cuda: device 0 of %d: %s, sm_%d%d; runtime %d, driver %d%s%s%s\n", ndev, prop.name,
           prop.major, prop.minor, rt, drv, argc > 1 ? "; filter: " : "", argc > 1 ? argv[1] : "",
           argc > 2 ? " ..." : "");
    if (g_sample) printf("test_cuda: a sample of the cases (NG_EMU_FULL=1 runs them all)\n");
    CU(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));

#ifdef NG_CUDA_EMU
    test_cuda_errors();
#endif
    test_cuda_layernorm();
    test_cuda_grad_guard();
    test_cuda_tensor_stats();
    test_cuda_attention();

    CU(cudaStreamDestroy(g_stream));
    printf("test_cuda: %d cases, %d failed\n", g_cases, g_cases_failed);
#ifdef NG_CUDA_EMU
    printf("test_cuda: %lld kernel launches on the emulator (sm_%d), each under %d schedules\n",
           ng_emu_launches(), ng_emu_sm(), ng_emu_schedules());
#endif
    free(g_filters);
    return ng_test_finish("test_cuda");
}
