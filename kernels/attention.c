/*
 * kernels/attention.c - safe_sdpa on the CPU: flash-style tiled attention
 * with an online softmax (Milakov & Gimelshein 2018; Dao et al.,
 * FlashAttention 1 and 2), never materializing the [L, S] score matrix.
 *
 * Forward, per (batch, head, block of BQ queries), in parallel:
 *   Q^T packed as NG_R once; for each block of BK keys (K and V read in
 *   place when they are NG_R, else converted): the scores held transposed,
 *   S^T = K Q^T (micro-kernel), per key row: clamp / soft-cap, mask, causal
 *   where asked, then the online-softmax update down each query's column
 *   (ng_cols_softmax: a query is a register lane, nothing is reduced across
 *   lanes), P V accumulated into [BQ, Ev] with P^T as the micro-kernel's
 *   strided A operand. out = acc / l, lse = m + log l (-inf and 0 output
 *   for a fully masked row).
 * Backward, FlashAttention-2 style with the saved lse:
 *   D_i = dout_i . out_i (a first pass over rows), then tasks over
 *   (batch, kv head, chunk of key blocks): per key block, for each query head
 *   of the group and each query block, recompute S and P = exp(s - lse),
 *   dP = dout V^T, dS = P (dP - D) * guard'(s) * scale, and accumulate
 *   dV += P^T dout, dK += dS^T Q (complete per task: no races, GQA heads
 *   summed in the tile), dQ += dS K into a per-chunk fp32 (fp64) buffer.
 *   Chunks split the key blocks of one (batch, kv head) only when there are
 *   too few such pairs to keep the threads busy; a last pass sums the chunks
 *   and writes dq.
 * With dropout p, P is multiplied by keep / (1 - p) from the Philox stream of
 *   attention_math.h, in the forward and again in the backward.
 * Decode (forward, L <= NG_ATTN_CPU_DEC_MAX_L against any S >= 1 keys): a
 *   64-row query block would be mostly padding and every query head would
 *   re-read (and transpose) its kv head. (With few keys that padding is
 *   most of the flash path's cost: one row against 16 keys took 30x the
 *   decode path's time, 4-8 us a head.) Instead a task takes a kv head with
 *   all the query heads of its group and all their rows, reads each K / V row
 *   once (in place when it is fp32 / fp64), scores by row dots and adds P V
 *   row by row. When there are few (batch, kv head) pairs the keys are split
 *   across tasks (split-KV, "flash-decoding"): each split keeps its own
 *   running max, sum and unnormalised output, and a last pass merges them in
 *   split order. Split sizes depend on the shape only, never on the thread
 *   count, so neither does the result.
 *
 * The tile type NG_R is fp32 for fp32/fp16/bf16 inputs and fp64 for fp64
 * (gradcheck). Each is compiled for baseline x86-64 and for AVX2+FMA, fp32
 * also for AVX-512, and on aarch64 fp32 for NEON (attention_cpu.inc, chosen
 * at run time through cpu_isa.h from a table indexed by the CPU path); only the micro-kernel, the decode
 * path's dots and P V (attention_dec_f32.inc, over simd_f32.h), the
 * forward's column softmax (attention_f32.inc, over simd_f32.h) and
 * the row exp differ between them.
 *
 * The tiled forward and backward loops are written once
 * (attention_tile_loop.inc) over the operand functions of a tile path, one
 * file each, picked per task by attention_cpu.inc's tile_pick:
 *   simd     every variant, every dtype: all products by the micro-kernel
 *            over NG_R tiles (attention_tile_simd.inc);
 *   bdot     fp32 AVX-512 variant, bf16 inputs, where ng_cpu_bf16_dot()
 *            (AVX-512 BF16; by default on AMD only) and the head dims are
 *            even: the products of two bf16 inputs (forward S^T, backward S
 *            and dP) by vdpbf16ps, the rest as simd
 *            (attention_tile_bf16dot.inc, with its kernel);
 *   amx      fp32 AVX-512 variant, built where the compiler has the AMX
 *            intrinsics (NG_AMX), bf16 inputs where ng_cpu_amx(): every
 *            product on AMX tiles, P and dS rounded to bf16
 *            (attention_tile_amx.inc, with its ng_amx_* kernels).
 * The decode path takes none of them: its bf16 / fp16 K and V rows are read
 * in place by attention_dec_f32.inc's loops (NG_DEC_16).
 */
#include "kernels/attention.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu_isa.h"
#include "kernels/simd_f32.h"

#define BQ 64
#define BK 64
#define NG_FWD_SUB 8 /* most query blocks one forward task keeps (4 but on AMX) */

/* Decode path (short query blocks, attention_cpu.inc's dec_*): keys per
 * tile, most query rows one task keeps, and the split-KV sizing. 128 keys
 * a tile rather than 64 halve the per-tile work (each row's softmax step
 * and accumulator rescale, the kernels' setup): the bf16 GQA decode step
 * took 0.91-0.94x the time on an AVX2 core (AMD Zen 3), fp32 0.96-0.97x. */
#define BKD 128
#define NG_DEC_ROWS 64
#define NG_DEC_TASKS 64      /* split long key ranges until there are this many tasks */
#define NG_DEC_MIN_SPLIT 256 /* but never into splits shorter than this (keys) */

typedef struct ng_attn_ctx {
    const ng_attention_args *a;
    void *D;      /* backward: [B*Hq*L] rowsum(dout * out) */
    void *dq_acc; /* backward: [nchunk][B*Hq][Lp][Ep] partial dq */
    int64_t Lp, nchunk;
    int64_t nsub; /* forward: query blocks per task */
    /* decode: query heads per task, key splits and keys per split (a
     * multiple of BKD); with nsplit > 1 each split leaves its (m, l) in
     * part_ml [nsplit][B*Hq*L][2] and its unnormalised output in part_acc
     * [nsplit][B*Hq*L][Evp], combined in split order by dec_combine_range */
    int64_t dgrp, nsplit, split_len;
    void *part_ml, *part_acc;
    atomic_int failed;
} ng_attn_ctx;

static void *ng_attn_alloc(size_t bytes) {
    size_t n = NG_CEIL_DIV(bytes, (size_t)64) * 64;
    return aligned_alloc(64, n ? n : 64);
}

static void ng_attn_fail(ng_attn_ctx *c) { atomic_store(&c->failed, 1); }

/* Rows to bring into the cache while a decode kernel computes. The decode
 * path reads each K and V row once, from memory, with little arithmetic per
 * row to hide the misses behind. A kernel that reads rows [j0, j1) of its
 * tile fetches the rows `ahead` further on in the sequence it and the next
 * phase read: the scores' K rows of the tile, then the same tile's V rows;
 * P V's V rows, then the next tile's K rows. The hint is L1's (locality 3)
 * and the distance a few KiB (NG_DEC_PF_BYTES), so that the lines arrive
 * just before their loads on any core, whatever the size of its L1.
 *
 * Why not the hardware's prefetchers alone, nor a whole tile ahead: the
 * kernels read four rows side by side (a vector of each in turn, so that
 * one vector of Q or one broadcast of P serves the four), a pattern some
 * cores' stream prefetchers do not follow; a whole tile ahead into L1 is as
 * large as the L1 of some cores, where the K rows being scored evict it.
 * How far ahead: far enough to cover the miss latency, near enough that
 * the prefetches do not wait for line fill buffers themselves, which on
 * Intel cores (16 buffers) happens at a shorter distance than on AMD ones:
 * there 2 KiB for 16-bit K / V rows and 1 KiB for wider ones, 8 KiB
 * elsewhere. docs/design/attention-cpu.md has the measurements per core. */
#define NG_DEC_PF_BYTES 8192
#define NG_DEC_PF_BYTES_INTEL_16 2048
#define NG_DEC_PF_BYTES_INTEL 1024

/* The distance for K / V elements of es bytes. */
static int64_t ng_dec_pf_bytes(size_t es) {
    if (!ng_cpu_is_intel()) return NG_DEC_PF_BYTES;
    return es == 2 ? NG_DEC_PF_BYTES_INTEL_16 : NG_DEC_PF_BYTES_INTEL;
}

typedef struct ng_pf {
    const char *p[2];       /* rows of the phase, then of the next (NULL: none) */
    size_t ld[2], width[2]; /* bytes between rows, bytes of a row */
    int64_t n[2];           /* rows */
    int64_t ahead;          /* rows between a row read and the row fetched */
} ng_pf;

/* The helpers are always inlined: a call to one, a function with no side
 * effect GCC can see (a prefetch is none), is deleted as dead code before
 * it is inlined, prefetches and all. */
#define NG_PF_INLINE __attribute__((always_inline)) static inline

NG_PF_INLINE void ng_pf_line_run(const char *row, size_t width) {
    for (size_t x = 0; x < width; x += 64) __builtin_prefetch(row + x, 0, 3);
}

/* Row j + ahead of the sequence, if there is one. */
NG_PF_INLINE void ng_pf_row(const ng_pf *pf, int64_t j) {
    j += pf->ahead;
    if (j < pf->n[0]) {
        if (pf->p[0]) ng_pf_line_run(pf->p[0] + (size_t)j * pf->ld[0], pf->width[0]);
    } else if (j - pf->n[0] < pf->n[1] && pf->p[1]) {
        ng_pf_line_run(pf->p[1] + (size_t)(j - pf->n[0]) * pf->ld[1], pf->width[1]);
    }
}

/* Rows [j0, j1) are about to be read. */
NG_PF_INLINE void ng_pf_rows(const ng_pf *pf, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) ng_pf_row(pf, j);
}

/* ---- exp ----------------------------------------------------------------
 * Branch-free expf (Cephes polynomial, ~1 ulp) so that the softmax row loop
 * vectorizes; exact for the cases the softmax relies on: exp(-inf) = 0,
 * exp(NaN) = NaN. Arguments are <= 0 there (s - running max). */
static inline float ng_expf_poly(float x) {
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    n = n == n ? n : 0.0f;
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float sc;
    memcpy(&sc, &e, sizeof sc);
    y *= sc;
    y = x < -87.0f ? 0.0f : y;
    return x != x ? x : y;
}

/* ---- micro-kernels: C[M][N] (+)= A[M][K] B[K][N], M % 4 == 0, N % 16 == 0.
 * A's element (i, k) is A[i * sai + k * sak], so A may be read transposed
 * (P^T dout, dS^T Q in the backward) without a copy. */

#define NG_GEMM_PLAIN(NAME, T)                                                                     \
    static void NAME(int64_t M, int64_t N, int64_t K, const T *A, int64_t sai, int64_t sak,        \
                     const T *B, int64_t ldb, T *C, int64_t ldc, int acc) {                        \
        for (int64_t i = 0; i < M; i += 4)                                                         \
            for (int64_t n = 0; n < N; n += 8) {                                                   \
                T c0[8], c1[8], c2[8], c3[8];                                                      \
                for (int x = 0; x < 8; x++) {                                                      \
                    c0[x] = acc ? C[i * ldc + n + x] : 0;                                          \
                    c1[x] = acc ? C[(i + 1) * ldc + n + x] : 0;                                    \
                    c2[x] = acc ? C[(i + 2) * ldc + n + x] : 0;                                    \
                    c3[x] = acc ? C[(i + 3) * ldc + n + x] : 0;                                    \
                }                                                                                  \
                for (int64_t k = 0; k < K; k++) {                                                  \
                    const T *b = B + k * ldb + n;                                                  \
                    T a0 = A[i * sai + k * sak], a1 = A[(i + 1) * sai + k * sak];                  \
                    T a2 = A[(i + 2) * sai + k * sak], a3 = A[(i + 3) * sai + k * sak];            \
                    _Pragma("omp simd") for (int x = 0; x < 8; x++) {                              \
                        c0[x] += a0 * b[x];                                                        \
                        c1[x] += a1 * b[x];                                                        \
                        c2[x] += a2 * b[x];                                                        \
                        c3[x] += a3 * b[x];                                                        \
                    }                                                                              \
                }                                                                                  \
                for (int x = 0; x < 8; x++) {                                                      \
                    C[i * ldc + n + x] = c0[x];                                                    \
                    C[(i + 1) * ldc + n + x] = c1[x];                                              \
                    C[(i + 2) * ldc + n + x] = c2[x];                                              \
                    C[(i + 3) * ldc + n + x] = c3[x];                                              \
                }                                                                                  \
            }                                                                                      \
    }

NG_GEMM_PLAIN(ng_gemm_f32_base, float)
NG_GEMM_PLAIN(ng_gemm_f64_base, double)

#if NG_X86
/* 4 rows x 8 doubles. */
NG_TARGET_AVX2 static void ng_gemm_f64_avx2(int64_t M, int64_t N, int64_t K, const double *A,
                                            int64_t sai, int64_t sak, const double *B, int64_t ldb,
                                            double *C, int64_t ldc, int acc) {
    for (int64_t i = 0; i < M; i += 4) {
        const double *a0 = A + i * sai, *a1 = a0 + sai, *a2 = a1 + sai, *a3 = a2 + sai;
        double *r0 = C + i * ldc, *r1 = r0 + ldc, *r2 = r1 + ldc, *r3 = r2 + ldc;
        for (int64_t n = 0; n < N; n += 8) {
            __m256d c00, c01, c10, c11, c20, c21, c30, c31;
            if (acc) {
                c00 = _mm256_loadu_pd(r0 + n);
                c01 = _mm256_loadu_pd(r0 + n + 4);
                c10 = _mm256_loadu_pd(r1 + n);
                c11 = _mm256_loadu_pd(r1 + n + 4);
                c20 = _mm256_loadu_pd(r2 + n);
                c21 = _mm256_loadu_pd(r2 + n + 4);
                c30 = _mm256_loadu_pd(r3 + n);
                c31 = _mm256_loadu_pd(r3 + n + 4);
            } else {
                c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = _mm256_setzero_pd();
            }
            const double *b = B + n;
            for (int64_t k = 0; k < K; k++, b += ldb) {
                __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
                __m256d x = _mm256_broadcast_sd(a0 + k * sak);
                c00 = _mm256_fmadd_pd(x, b0, c00);
                c01 = _mm256_fmadd_pd(x, b1, c01);
                x = _mm256_broadcast_sd(a1 + k * sak);
                c10 = _mm256_fmadd_pd(x, b0, c10);
                c11 = _mm256_fmadd_pd(x, b1, c11);
                x = _mm256_broadcast_sd(a2 + k * sak);
                c20 = _mm256_fmadd_pd(x, b0, c20);
                c21 = _mm256_fmadd_pd(x, b1, c21);
                x = _mm256_broadcast_sd(a3 + k * sak);
                c30 = _mm256_fmadd_pd(x, b0, c30);
                c31 = _mm256_fmadd_pd(x, b1, c31);
            }
            _mm256_storeu_pd(r0 + n, c00);
            _mm256_storeu_pd(r0 + n + 4, c01);
            _mm256_storeu_pd(r1 + n, c10);
            _mm256_storeu_pd(r1 + n + 4, c11);
            _mm256_storeu_pd(r2 + n, c20);
            _mm256_storeu_pd(r2 + n + 4, c21);
            _mm256_storeu_pd(r3 + n, c30);
            _mm256_storeu_pd(r3 + n + 4, c31);
        }
    }
}
#endif

/* ---- row dots for the decode path: S[r][j] = Q_r . K_j for r < M, j < nk.
 * Q rows at Q + r * ldq, K rows at K + j * ldk (read straight from the
 * key cache when its dtype is R's), n columns each. Short query blocks have
 * too few rows for the micro-kernel above, and K is read in its own row
 * layout, so nothing is transposed. */

#define NG_DOTS_PLAIN(NAME, T)                                                                     \
    static void NAME(int64_t M, int64_t nk, int64_t n, const T *Q, int64_t ldq, const T *K,        \
                     int64_t ldk, T *S, int64_t lds, const ng_pf *pf) {                            \
        for (int64_t j = 0; j < nk; j++) {                                                         \
            ng_pf_rows(pf, j, j + 1);                                                              \
            for (int64_t r = 0; r < M; r++) {                                                      \
                const T *q = Q + r * ldq, *k = K + j * ldk;                                        \
                T d = 0;                                                                           \
                _Pragma("omp simd reduction(+ : d)") for (int64_t e = 0; e < n; e++) d +=          \
                    q[e] * k[e];                                                                   \
                S[r * lds + j] = d;                                                                \
            }                                                                                      \
        }                                                                                          \
    }

NG_DOTS_PLAIN(ng_dots_f32_base, float)
NG_DOTS_PLAIN(ng_dots_f64_base, double)

/* ---- P V for the decode path: C[r][d] += sum_j P[r][j] V[j][d] for r < M,
 * j < nk, d < n. V is read row after row (straight from the value cache
 * when its dtype is R's): the micro-kernel's 16-column strips would walk
 * every V row of the tile once per strip. */

#define NG_PV_PLAIN(NAME, T)                                                                       \
    static void NAME(int64_t M, int64_t nk, int64_t n, const T *P, int64_t lds, const T *V,        \
                     int64_t ldv, T *C, int64_t ldc, const ng_pf *pf) {                            \
        for (int64_t j = 0; j < nk; j++) {                                                         \
            ng_pf_rows(pf, j, j + 1);                                                              \
            for (int64_t r = 0; r < M; r++) {                                                      \
                const T p = P[r * lds + j], *v = V + j * ldv;                                      \
                T *c = C + r * ldc;                                                                \
                _Pragma("omp simd") for (int64_t d = 0; d < n; d++) c[d] += p * v[d];              \
            }                                                                                      \
        }                                                                                          \
    }

NG_PV_PLAIN(ng_pv_f32_base, float)
NG_PV_PLAIN(ng_pv_f64_base, double)

#if NG_X86
/* The SIMD forms of both, one body at 8 (AVX2) and at 16 lanes (AVX-512):
 * the decode step of grouped-query attention does 2 x heads x E
 * multiply-adds per key it reads, enough to make it bound by arithmetic,
 * not memory, on AVX2. */
#define NG_F32_W 8
#define NG_DEC_KV f32
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 16
#define NG_DEC_KV f32
#include "kernels/attention_dec_f32.inc"
/* the same loops over a bf16 / fp16 KV cache read in place */
#define NG_F32_W 8
#define NG_DEC_KV bf16
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 16
#define NG_DEC_KV bf16
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 8
#define NG_DEC_KV f16
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 16
#define NG_DEC_KV f16
#include "kernels/attention_dec_f32.inc"
#endif

#if NG_NEON
/* The same loops at NEON's 4 lanes, over fp32, bf16 and fp16 K / V. */
#define NG_F32_W 4
#define NG_DEC_KV f32
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 4
#define NG_DEC_KV bf16
#include "kernels/attention_dec_f32.inc"
#define NG_F32_W 4
#define NG_DEC_KV f16
#include "kernels/attention_dec_f32.inc"
#endif

/* p[j] = exp(x[j] - m) in place, returns the sum (m finite or NaN). Kept
 * out of line: inlined into the tile loop, GCC 12 leaves it scalar. */
#define NG_EXP_ROW_F32(NAME, ATTRS)                                                                \
    ATTRS __attribute__((noinline)) static float NAME(float *x, int64_t n, float m) {              \
        float sum = 0.0f;                                                                          \
        _Pragma("omp simd reduction(+ : sum)") for (int64_t j = 0; j < n; j++) {                   \
            float p = ng_expf_poly(x[j] - m);                                                      \
            x[j] = p;                                                                              \
            sum += p;                                                                              \
        }                                                                                          \
        return sum;                                                                                \
    }

NG_EXP_ROW_F32(ng_exp_row_f32_base, )

static double ng_exp_row_f64_base(double *x, int64_t n, double m) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        x[j] = exp(x[j] - m);
        sum += x[j];
    }
    return sum;
}

/* ---- column softmax: the forward's online-softmax step over a transposed
 * score tile, s[j * ld + i] the raw score of query i against key j (j < nk,
 * i < ncols), scale > 0. Per query column: the running max m[i] (of scaled
 * scores) moves to ng_attn_max_nan(m[i], scale * the column's max), NaN when
 * a score is NaN; alpha[i] = ng_attn_rescale(old, new max); P = exp(s *
 * scale - m[i]) (0 while m[i] = -inf) goes to p[j * ld + i] (a tile of its
 * own: the SIMD forms read the scores again after writing P) and l[i] =
 * l[i] * alpha[i] + their sum. A key row is a vector of queries, so maxima
 * and sums run down the lanes: nothing is reduced across a register.
 *
 * The SIMD forms (attention_f32.inc, and the AMX path's) move the running
 * max lazily: only where the tile's passes it by more than NG_ATTN_LAZY_MAX
 * (or is NaN, or the running max is -inf). Every tile where none of a
 * vector's lanes moves then takes one pass instead of two, and leaves alpha
 * at 1 and the accumulator alone; P stays below e^8. */
#define NG_ATTN_LAZY_MAX 8.0f
#define NG_COLS_SOFTMAX_PLAIN(NAME, T, EXP, MAXNAN, RESCALE)                                       \
    static void NAME(const T *s, T *p, int64_t ld, int64_t nk, int64_t ncols, T scale, T *m, T *l, \
                     T *alpha) {                                                                   \
        T mx[BQ], sum[BQ];                                                                         \
        unsigned char nan[BQ];                                                                     \
        for (int64_t i = 0; i < ncols; i++) mx[i] = (T) - INFINITY, sum[i] = 0, nan[i] = 0;        \
        for (int64_t j = 0; j < nk; j++) {                                                         \
            const T *row = s + j * ld;                                                             \
            for (int64_t i = 0; i < ncols; i++) {                                                  \
                nan[i] |= row[i] != row[i];                                                        \
                mx[i] = row[i] > mx[i] ? row[i] : mx[i];                                           \
            }                                                                                      \
        }                                                                                          \
        for (int64_t i = 0; i < ncols; i++) {                                                      \
            const T mn = MAXNAN(m[i], nan[i] ? (T)NAN : mx[i] * scale);                            \
            alpha[i] = RESCALE(m[i], mn);                                                          \
            m[i] = mn;                                                                             \
        }                                                                                          \
        for (int64_t j = 0; j < nk; j++) {                                                         \
            const T *row = s + j * ld;                                                             \
            T *prow = p + j * ld;                                                                  \
            for (int64_t i = 0; i < ncols; i++) {                                                  \
                const T pi = m[i] == (T) - INFINITY ? (T)0 : EXP(row[i] * scale - m[i]);           \
                prow[i] = pi;                                                                      \
                sum[i] += pi;                                                                      \
            }                                                                                      \
        }                                                                                          \
        for (int64_t i = 0; i < ncols; i++) l[i] = l[i] * alpha[i] + sum[i];                       \
    }

NG_COLS_SOFTMAX_PLAIN(ng_cols_softmax_f32_base, float, ng_expf_poly, ng_attn_max_nan_f32,
                      ng_attn_rescale_f32)
NG_COLS_SOFTMAX_PLAIN(ng_cols_softmax_f64_base, double, exp, ng_attn_max_nan_f64,
                      ng_attn_rescale_f64)

#if NG_X86
#define NG_F32_W 8
#include "kernels/attention_f32.inc"
#define NG_F32_W 16
#include "kernels/attention_f32.inc"

#endif

#if NG_NEON
#define NG_F32_W 4
#include "kernels/attention_f32.inc"
#endif

/* ---- the tile kernels, once per variant --------------------------------- */

typedef float ng_attn_real_f32;
typedef double ng_attn_real_f64;

/* Row (b, h, i) of a [batch, head, seq, dim] tensor with element strides st
 * and elements of es bytes (writable for the outputs; inputs take it as
 * const char *). */
static inline char *ng_attn_row(const void *base, const int64_t st[3], size_t es, int64_t b,
                                int64_t h, int64_t i) {
    return (char *)base + (size_t)(b * st[0] + h * st[1] + i * st[2]) * es;
}

/* A head dim or key count padded to the tiles' multiple of 16 columns. */
static inline int64_t ng_pad16(int64_t n) { return NG_CEIL_DIV(n, 16) * 16; }

/* The same to AMX's tiles: 32 bf16 elements (keys or head dims) per row. */
static inline int64_t ng_pad32(int64_t n) { return NG_CEIL_DIV(n, 32) * 32; }

#define NG_T f32
#define NG_ISA base
#define NG_ATTR
#define NG_DOTS_ALIGN 1
#include "kernels/attention_cpu.inc"

#define NG_T f64
#define NG_ISA base
#define NG_ATTR
#define NG_DOTS_ALIGN 1
#include "kernels/attention_cpu.inc"

#if NG_X86
#define NG_T f32
#define NG_ISA avx2
#define NG_ATTR NG_TARGET_AVX2
#define NG_DOTS_ALIGN 8
#define NG_DEC_16 1
#include "kernels/attention_cpu.inc"

/* AVX-512: the micro-kernel, the decode path's dots and P V and the row exp
 * at 16 lanes; the bf16 tile paths (by vdpbf16ps, and on AMX tiles where the
 * compiler has them) */
#define NG_T f32
#define NG_ISA avx512
#define NG_ATTR NG_TARGET_AVX512
#define NG_DOTS_ALIGN 16
#define NG_DEC_16 1
#define NG_BF16_DOT 1
#define NG_AMX_FWD NG_AMX
#include "kernels/attention_cpu.inc"

/* fp64 on AVX2: the micro-kernel only; dots, P V and the row exp are the
 * baseline's */
#define ng_dots_f64_avx2 ng_dots_f64_base
#define ng_pv_f64_avx2 ng_pv_f64_base
#define ng_exp_row_f64_avx2 ng_exp_row_f64_base
#define ng_cols_softmax_f64_avx2 ng_cols_softmax_f64_base
#define NG_T f64
#define NG_ISA avx2
#define NG_ATTR NG_TARGET_AVX2
#define NG_DOTS_ALIGN 1
#include "kernels/attention_cpu.inc"
#endif

#if NG_NEON
/* NEON: the fp32 micro-kernel, the decode path's dots and P V (over fp32,
 * bf16 and fp16 K / V) and the row exp at 4 lanes; fp64 takes the
 * baseline variant */
#define NG_T f32
#define NG_ISA neon
#define NG_ATTR NG_TARGET_NEON
#define NG_DOTS_ALIGN 4
#define NG_DEC_16 1
#include "kernels/attention_cpu.inc"
#endif

/* ---- dispatch ------------------------------------------------------------ */

typedef struct ng_attn_variant {
    ng_range_fn fwd, bwd_prep, bwd, dq_store, dec, dec_combine;
} ng_attn_variant;

#define NG_ATTN_VARIANT(T, ISA)                                                                    \
    {fwd_range_##T##_##ISA,      bwd_prep_range_##T##_##ISA, bwd_range_##T##_##ISA,                \
     dq_store_range_##T##_##ISA, dec_range_##T##_##ISA,      dec_combine_range_##T##_##ISA}
#if NG_X86
#define NG_ATTN_X86_VARIANT(T, ISA) NG_ATTN_VARIANT(T, ISA)
#else
#define NG_ATTN_X86_VARIANT(T, ISA) NG_ATTN_VARIANT(T, base) /* never picked */
#endif
#if NG_NEON
#define NG_ATTN_NEON_VARIANT(T, ISA) NG_ATTN_VARIANT(T, ISA)
#else
#define NG_ATTN_NEON_VARIANT(T, ISA) NG_ATTN_VARIANT(T, base) /* never picked */
#endif

/* [fp64?][cpu path]; fp64 has no AVX-512 variant of its own, and no NEON
 * one (the baseline's). */
static const ng_attn_variant ng_attn_variants[2][NG_ISA_COUNT] = {
    {NG_ATTN_VARIANT(f32, base), NG_ATTN_X86_VARIANT(f32, avx2), NG_ATTN_X86_VARIANT(f32, avx512),
     NG_ATTN_NEON_VARIANT(f32, neon)},
    {NG_ATTN_VARIANT(f64, base), NG_ATTN_X86_VARIANT(f64, avx2), NG_ATTN_X86_VARIANT(f64, avx2),
     NG_ATTN_VARIANT(f64, base)},
};

static ng_attn_variant ng_attn_pick(ng_dtype t) {
    return ng_attn_variants[t == NG_F64][ng_cpu_isa_active()];
}

static int ng_attn_strides_ok(const void *p, const int64_t st[3]) {
    return p != NULL && st[0] >= 0 && st[1] >= 0 && st[2] >= 0;
}

ng_status ng_attention_check(const ng_attention_args *a, int backward) {
    if (!a) return NG_ERR_INVALID_ARG;
    if (a->dtype != NG_F32 && a->dtype != NG_F64 && a->dtype != NG_F16 && a->dtype != NG_BF16)
        return NG_ERR_DTYPE;
    if (a->B < 0 || a->L < 0 || a->S < 0 || a->Hq < 1 || a->Hkv < 1 || a->Hq % a->Hkv != 0)
        return NG_ERR_INVALID_ARG;
    if (a->E < 1 || a->Ev < 1 || a->E > NG_ATTN_MAX_HEAD_DIM || a->Ev > NG_ATTN_MAX_HEAD_DIM)
        return NG_ERR_INVALID_ARG;
    if (!(a->dropout_p >= 0.0 && a->dropout_p < 1.0) || !isfinite(a->scale) ||
        a->max_score != a->max_score || a->softcap != a->softcap)
        return NG_ERR_INVALID_ARG;
    /* scored in fp32 (all but fp64): no scale or soft-cap past FLT_MAX (inf
     * there), no clamp or soft-cap that fp32 rounds to 0 (off) */
    if (a->dtype != NG_F64 && (fabs(a->scale) > (double)FLT_MAX || a->softcap > (double)FLT_MAX ||
                               (a->max_score > 0.0 && (float)a->max_score == 0.0f) ||
                               (a->softcap > 0.0 && (float)a->softcap == 0.0f)))
        return NG_ERR_INVALID_ARG;
    if (a->mask_kind != NG_MASK_NONE && a->mask_kind != NG_MASK_BOOL && a->mask_kind != NG_MASK_ADD)
        return NG_ERR_INVALID_ARG;
    if (a->B == 0) return NG_OK; /* nothing to read or write */
    /* empty tensors may carry NULL data: pointers are required only when read */
    const int has_q = a->L > 0, has_k = a->S > 0;
    if (has_q && (!ng_attn_strides_ok(a->q, a->q_stride) ||
                  !ng_attn_strides_ok(a->out, a->out_stride) || !a->lse))
        return NG_ERR_INVALID_ARG;
    if (has_k && (!ng_attn_strides_ok(a->k, a->k_stride) || !ng_attn_strides_ok(a->v, a->v_stride)))
        return NG_ERR_INVALID_ARG;
    if (a->mask_kind != NG_MASK_NONE && has_q && has_k) {
        if (!a->mask) return NG_ERR_INVALID_ARG;
        for (int d = 0; d < 4; d++)
            if (a->mask_stride[d] < 0) return NG_ERR_INVALID_ARG;
        if (a->mask_kind == NG_MASK_ADD && a->mask_dtype != NG_F32 && a->mask_dtype != NG_F64 &&
            a->mask_dtype != NG_F16 && a->mask_dtype != NG_BF16)
            return NG_ERR_DTYPE;
    }
    if (backward) {
        if (has_q && (!ng_attn_strides_ok(a->dout, a->dout_stride) ||
                      !ng_attn_strides_ok(a->dq, a->dq_stride)))
            return NG_ERR_INVALID_ARG;
        if (has_k &&
            (!ng_attn_strides_ok(a->dk, a->dk_stride) || !ng_attn_strides_ok(a->dv, a->dv_stride)))
            return NG_ERR_INVALID_ARG;
    }
    return NG_OK;
}

/* A copy of the args with the mask pointer cleared when there is none, so
 * the tile code tests one field. */
static ng_attention_args ng_attn_normalize(const ng_attention_args *a) {
    ng_attention_args n = *a;
    if (n.mask_kind == NG_MASK_NONE || n.L == 0 || n.S == 0) n.mask = NULL;
    return n;
}

/* The decode path on normalized args: tasks over (batch, kv head, group of
 * its query heads, split of the keys), then the combine pass when the keys
 * were split. Split sizes are a function of the shape alone. */
static ng_status ng_attn_decode(const ng_attention_args *a, ng_parallel_fn par) {
    ng_attn_variant v = ng_attn_pick(a->dtype);
    ng_attn_ctx c = {.a = a};
    atomic_init(&c.failed, 0);
    const int64_t grp = a->Hq / a->Hkv;
    c.dgrp = NG_MAX(1, NG_MIN(grp, NG_DEC_ROWS / a->L));
    const int64_t groups = a->B * a->Hkv * NG_CEIL_DIV(grp, c.dgrp);
    const int64_t klen = a->is_causal ? NG_MIN(a->S, a->L) : a->S;
    /* split while there are fewer than NG_DEC_TASKS tasks and every split
     * keeps at least NG_DEC_MIN_SPLIT keys */
    int64_t nsplit = 1;
    while (groups * nsplit < NG_DEC_TASKS && klen / (nsplit * 2) >= NG_DEC_MIN_SPLIT) nsplit *= 2;
    c.split_len = NG_MAX(BKD, NG_CEIL_DIV(NG_CEIL_DIV(klen, nsplit), BKD) * BKD);
    c.nsplit = NG_MAX(1, NG_CEIL_DIV(klen, c.split_len));
    if (c.nsplit > 1) {
        const size_t rs = a->dtype == NG_F64 ? sizeof(double) : sizeof(float);
        const int64_t rows = a->B * a->Hq * a->L, Evp = ng_pad16(a->Ev);
        c.part_ml = ng_attn_alloc(rs * (size_t)(c.nsplit * rows * 2));
        c.part_acc = ng_attn_alloc(rs * (size_t)(c.nsplit * rows * Evp));
        if (!c.part_ml || !c.part_acc) {
            free(c.part_ml);
            free(c.part_acc);
            return NG_ERR_ALLOC;
        }
    }
    ng_parallel_run(par, groups * c.nsplit, 1, v.dec, &c);
    if (c.nsplit > 1 && !atomic_load(&c.failed))
        ng_parallel_run(par, a->B * a->Hq * a->L, 16, v.dec_combine, &c);
    free(c.part_ml);
    free(c.part_acc);
    return atomic_load(&c.failed) ? NG_ERR_ALLOC : NG_OK;
}

ng_status ng_attention_fwd_decode(const ng_attention_args *args, ng_parallel_fn par) {
    NG_TRY(ng_attention_check(args, 0));
    if (args->B == 0 || args->L == 0) return NG_OK;
    ng_attention_args a = ng_attn_normalize(args);
    return ng_attn_decode(&a, par);
}

ng_status ng_attention_fwd(const ng_attention_args *args, ng_parallel_fn par) {
    NG_TRY(ng_attention_check(args, 0));
    if (args->B == 0 || args->L == 0) return NG_OK;
    ng_attention_args a = ng_attn_normalize(args);
    if (a.L <= NG_ATTN_CPU_DEC_MAX_L && a.S >= 1) return ng_attn_decode(&a, par);
    ng_attn_variant v = ng_attn_pick(a.dtype);
    ng_attn_ctx c = {.a = &a};
    atomic_init(&c.failed, 0);
    /* Several query blocks per task share each converted K / V tile; keep
     * at least ~64 tasks so the thread pool stays busy. */
    const int64_t nqb = NG_CEIL_DIV(a.L, BQ), heads = a.B * a.Hq;
    c.nsub = 1;
    /* AMX: up to 8, as each key tile's V^T costs more to pack than the
     * widened tiles do to convert (the bf16 forward at 1.02-1.08x the
     * speed of 4 blocks, head dims 64 and 128) */
    const int64_t max_sub = a.dtype == NG_BF16 && ng_cpu_amx() ? NG_FWD_SUB : 4;
    while (c.nsub < max_sub && heads * NG_CEIL_DIV(nqb, c.nsub * 2) >= 64) c.nsub *= 2;
    ng_parallel_run(par, heads * NG_CEIL_DIV(nqb, c.nsub), 1, v.fwd, &c);
    return atomic_load(&c.failed) ? NG_ERR_ALLOC : NG_OK;
}

ng_status ng_attention_bwd(const ng_attention_args *args, ng_parallel_fn par) {
    NG_TRY(ng_attention_check(args, 1));
    if (args->B == 0) return NG_OK;
    ng_attention_args a = ng_attn_normalize(args);
    const size_t rs = a.dtype == NG_F64 ? sizeof(double) : sizeof(float);
    const int64_t Ep = ng_pad16(a.E);
    const int64_t nkb = NG_CEIL_DIV(a.S, BK);
    const int64_t pairs = a.B * a.Hkv;
    ng_attn_variant v = ng_attn_pick(a.dtype);
    ng_attn_ctx c = {.a = &a};
    atomic_init(&c.failed, 0);
    c.Lp = NG_CEIL_DIV(a.L, BQ) * BQ;
    /* Split key blocks across tasks only when there are few (batch, kv head)
     * pairs; each extra chunk costs one more [B, Hq, L, E] dq buffer. */
    c.nchunk = pairs >= 8 ? 1 : NG_MIN(NG_MAX(nkb, 1), NG_MIN(4, NG_CEIL_DIV(8, NG_MAX(pairs, 1))));
    size_t dq_elems = (size_t)(c.nchunk * a.B * a.Hq * c.Lp * Ep);
    c.D = ng_attn_alloc(rs * (size_t)(a.B * a.Hq * a.L));
    c.dq_acc = ng_attn_alloc(rs * dq_elems);
    if (!c.D || !c.dq_acc) {
        free(c.D);
        free(c.dq_acc);
        return NG_ERR_ALLOC;
    }
    memset(c.dq_acc, 0, rs * dq_elems);
    ng_parallel_run(par, a.B * a.Hq * a.L, 64, v.bwd_prep, &c);
    if (!atomic_load(&c.failed)) ng_parallel_run(par, pairs * c.nchunk, 1, v.bwd, &c);
    if (!atomic_load(&c.failed)) ng_parallel_run(par, a.B * a.Hq * a.L, 64, v.dq_store, &c);
    free(c.D);
    free(c.dq_acc);
    return atomic_load(&c.failed) ? NG_ERR_ALLOC : NG_OK;
}
