/*
 * tests/c/cuda_fixture.h - what the files of the CUDA test binary share:
 * case bookkeeping (one output line per case, filtered by name), the
 * tolerance check, and the device plumbing.
 *
 * The binary (test_cuda on a GPU, test_cuda_emu on the CPU emulator of
 * tests/cuda_emu) runs every CUDA launcher (the .cu files of kernels/)
 * against the CPU kernel of the same op, on the same inputs; one file per op:
 *   test_cuda_layernorm.c     LayerNorm and RMSNorm, forward and backward
 *   test_cuda_grad_guard.c    the gradient guard's reduce and apply
 *   test_cuda_tensor_stats.c  tensor_stats over strided views
 *   test_cuda_attention.c     attention forward, backward and decode
 *   test_cuda_errors.c        failed runtime calls inside launchers (emulator)
 * each with its cases and tolerances in its header comment, and
 * cuda_fixture.c with main (usage there).
 *
 * The CPU kernels are the oracle (the other ctest binaries check them against
 * plain fp64 loops). A case fills one argument struct with host pointers,
 * runs the CPU kernel serially (par = NULL), then hands the CUDA launcher the
 * same struct with device pointers swapped in and compares. Launches go to a
 * non-blocking stream of the test's own (g_stream), which is also the only
 * stream the copies use: work a launcher put on the legacy default stream
 * instead would race with the copies rather than be ordered by accident.
 * Device outputs are filled with 0xff bytes (NaN in every float type) before
 * each launch (dpoison), so an element the launcher never writes cannot pass,
 * and padding between rows and neighbouring stats slots must keep those
 * bytes. A backward pass gets the CPU forward's results (attention out / lse,
 * LayerNorm mean / rstd) on both sides, so it is judged on its own; the
 * grad-guard apply pass likewise gets the CPU's stats.
 *
 * The counters of ng_test.h are per file: every file here counts and fails
 * through the functions below, and only cuda_fixture.c's counters are read.
 */
#ifndef NG_CUDA_FIXTURE_H
#define NG_CUDA_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "kernels/common.h"
#include "tests/c/tolerance.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-variable" /* its counters: see above */
#include "tests/c/ng_test.h"
#pragma GCC diagnostic pop

/* ---- cases --------------------------------------------------------------- */

extern const ng_dtype FLOAT_TYPES[3]; /* fp32, fp16, bf16 */
/* Run a sample of the cases. On the CPU emulator of the CUDA execution model
 * (tests/cuda_emu) a warp intrinsic costs about a microsecond per warp, so
 * the SIMT attention kernels, the 65539-row LayerNorms and the 1100-tensor
 * gradient lists take minutes: there a sample runs, chosen so that every
 * kernel and every template instantiation still runs (each dtype, both
 * tensor-core head dims and the SIMT ones, every mask kind, dropout, GQA,
 * ragged tails, zero sizes, multi-table gradient lists, 16/32/64-bit
 * tensor_stats). NG_EMU_FULL=1 runs every case there too; a GPU always does. */
extern int g_sample;
extern char g_case[192];    /* the current case's line */
extern double g_case_worst; /* worst |d| / limit among the values that passed */

/* Start a case named by the format; 0 (skip it) when a filter excludes it. */
__attribute__((format(printf, 1, 2))) int case_begin(const char *fmt, ...);
/* Print the case's line: "ok" or "FAIL", with its worst error. */
void case_end(void);
/* Fail the current case with a message on stderr. */
__attribute__((format(printf, 1, 2))) void fail(const char *fmt, ...);
void count_check(void);

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        count_check();                                                                             \
        if (!(cond)) fail(__VA_ARGS__);                                                            \
    } while (0)

/* Compare rows x cols values: |cuda - cpu| <= tol_limit(t, cpu, rowmax),
 * rowmax being the largest finite |cpu| of the row, or rowscale[row] when
 * rowscale is given. A NaN must be a NaN and an infinity the same infinity. */
void close_rows(const char *what, const double *got, const double *ref, int64_t rows, int64_t cols,
                tol t, const double *rowscale);
/* n values of type t as a malloc'd fp64 array. */
double *to_f64(const void *src, ng_dtype t, int64_t n);
/* uniform in [0, 1) */
static inline double urand(ng_rng *r) { return 0.5 * (ng_rng_unif(r) + 1.0); }

/* ---- device plumbing ------------------------------------------------------ */

extern cudaStream_t g_stream;

/* Ends the run: the context may be unusable after a failed runtime call. */
__attribute__((noreturn)) void cuda_fatal(cudaError_t e, const char *stmt, const char *file,
                                          int line);
/* Every CUDA runtime call goes through this. */
#define CU(stmt)                                                                                   \
    do {                                                                                           \
        cudaError_t cu_e_ = (stmt);                                                                \
        if (cu_e_ != cudaSuccess) cuda_fatal(cu_e_, #stmt, __FILE__, __LINE__);                    \
    } while (0)

/* A launcher's status: anything but NG_OK fails the case. On success the
 * stream is synchronized, so a fault inside the kernels surfaces here. */
#define LAUNCHED(stmt) launched((stmt), #stmt, __LINE__)
int launched(ng_status s, const char *stmt, int line);

void *dmalloc(size_t bytes);
void dfree(void *p);
void *dupload(const void *h, size_t bytes);
void dcopy_to(void *d, const void *h, size_t bytes);
void dpoison(void *d, size_t bytes); /* 0xff bytes */
/* Copy back and wait; returns a malloc'd host buffer. */
void *ddownload(const void *d, size_t bytes);
int all_ff(const void *p, size_t bytes);

/* ---- the suites, in the order main runs them ------------------------------- */

#ifdef NG_CUDA_EMU
void test_cuda_errors(void);
#endif
void test_cuda_layernorm(void);
void test_cuda_grad_guard(void);
void test_cuda_tensor_stats(void);
void test_cuda_attention(void);

#endif /* NG_CUDA_FIXTURE_H */
