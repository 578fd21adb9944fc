/*
 * kernels/attention_mma_tile.cuh - the tensor-core tile helpers of
 * safe_sdpa's fp16 / bf16 CUDA kernels (attention_mma_fwd.cu,
 * attention_mma_bwd.cu and the tensor-core decode of attention_decode.cu):
 * staging, fragment products (kernels/attention_mma.h has the fragments
 * themselves), the online softmax step, dropout bits and the score variants.
 *
 * The same three kernels on mma.sync m16n8k16 (fp32 accumulators) for the
 * common case E == Ev in {64, 128} on sm_80+. 4 warps; every warp owns 16
 * rows of a 64-row block and walks 64-row tiles of the other operand, staged
 * in shared memory as raw 16-bit elements (rows padded to D + 8, see
 * attention_mma.h). Scores and dp live in C fragments; the per-score math is
 * the SIMT kernels' (guarded_score, bwd_score); p and dS are rounded to the
 * input dtype and fed back as A fragments, as FlashAttention-2 does.
 */
#ifndef NG_KERNELS_ATTENTION_MMA_TILE_CUH
#define NG_KERNELS_ATTENTION_MMA_TILE_CUH

#include "kernels/attention_cuda.cuh"
#include "kernels/attention_mma.h"

namespace ng_attn_cu {
namespace {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaRows = 64;         /* rows per block and per staged tile */
constexpr int kMmaNT = kMmaRows / 8; /* n-tiles of 8 across a staged tile */
static_assert(kMmaRows == kLiveKeys, "a tensor-core dk / dv block is one flag's keys");

template <ng_dtype T>
__device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
    uint32_t u;
    if constexpr (T == NG_F16) {
        __half2 h = __floats2half2_rn(lo, hi);
        memcpy(&u, &h, sizeof u);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        memcpy(&u, &h, sizeof u);
    }
    return u;
}

/* Rows [r0, r0 + n) of a [seq, D] slice (row stride rs) into a 64-row tile,
 * zeros past n. vec: every row start is 16-byte aligned (one 128-bit load per
 * 8 elements); otherwise element loads. */
template <int D>
__device__ __forceinline__ void mma_stage(uint16_t *tile, const uint16_t *base, int64_t rs,
                                          int64_t r0, int64_t n, int vec) {
    constexpr int kLd = D + 8, kChunks = D / 8;
    for (int x = threadIdx.x; x < kMmaRows * kChunks; x += kMmaThreads) {
        const int r = x / kChunks, c = (x % kChunks) * 8;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < n) {
            const uint16_t *src = base + (r0 + r) * rs + c;
            if (vec) {
                w = *(const uint4 *)src;
            } else {
                w.x = ng_mma_pack(src[0], src[1]);
                w.y = ng_mma_pack(src[2], src[3]);
                w.z = ng_mma_pack(src[4], src[5]);
                w.w = ng_mma_pack(src[6], src[7]);
            }
        }
        *(uint4 *)(tile + r * kLd + c) = w;
    }
}

/* mma_stage, with the 16-byte chunks of valid rows issued as cp.async.cg
 * (landing at the caller's wait_group) when vec; rows >= n (zeros) and
 * unaligned rows (element loads) are stored at once, as mma_stage does.
 * The caller commits the group, waits for it and then __syncthreads before
 * any thread reads the tile. */
template <int D>
__device__ __forceinline__ void mma_stage_async(uint16_t *tile, const uint16_t *base, int64_t rs,
                                                int64_t r0, int64_t n, int vec) {
    constexpr int kLd = D + 8, kChunks = D / 8;
    if constexpr (kAsyncCopy) {
        if (vec) {
#pragma unroll 1
            for (int x = threadIdx.x; x < kMmaRows * kChunks; x += kMmaThreads) {
                const int r = x / kChunks, c = (x % kChunks) * 8;
                uint16_t *dst = tile + r * kLd + c;
                if (r < n)
                    ng_cp_async_cg16(dst, base + (r0 + r) * rs + c);
                else
                    *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
            }
            return;
        }
    }
    mma_stage<D>(tile, base, rs, r0, n, vec);
}

/* c[16 x 8 NT] += X Y^T over the 16 columns k0 .. k0 + 15, X's A fragment
 * given: the 8 NT rows of tile y (n-tile nt = rows 8 nt .. 8 nt + 7) as B
 * fragments through ldmatrix.x4, two n-tiles each. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_xyt_step(float c[NT][4], const uint32_t a[4], const uint16_t *y,
                                             int k0, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b0[2], b1[2];
        ng_mma_ldm_b_rows2(b0, b1, y, D + 8, nt * 8, k0, lane);
        ng_mma_16816<T>(c[nt], a, b0);
        ng_mma_16816<T>(c[nt + 1], a, b1);
    }
}

/* Key step kt (16 keys) of W[16 x 64], given as C fragments (w[nt][4],
 * fp32), rounded to T as an A fragment. */
template <ng_dtype T, int NT>
__device__ __forceinline__ void mma_w_to_a(uint32_t a[4], const float w[NT][4], int kt) {
    const uint32_t lo[2] = {pack_f32x2<T>(w[2 * kt][0], w[2 * kt][1]),
                            pack_f32x2<T>(w[2 * kt][2], w[2 * kt][3])};
    const uint32_t hi[2] = {pack_f32x2<T>(w[2 * kt + 1][0], w[2 * kt + 1][1]),
                            pack_f32x2<T>(w[2 * kt + 1][2], w[2 * kt + 1][3])};
    ng_mma_c_to_a(a, lo, hi);
}

/* acc[16 x D] += W[16 x 64] Y, W given as C fragments (w[nt][4], fp32) that
 * are rounded to T here, Y a 64-row tile read as B[k][n] = Y[k][n] through
 * ldmatrix.x4.trans (two d-tiles each): P V in the forward; P^T dO, dS^T Q
 * and dS K in the backward. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_wy(float acc[D / 8][4], const float w[NT][4], const uint16_t *y,
                                       int lane) {
    constexpr int kLd = D + 8;
#pragma unroll
    for (int kt = 0; kt < NT / 2; kt++) {
        uint32_t a[4];
        mma_w_to_a<T, NT>(a, w, kt);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
            uint32_t b0[2], b1[2];
            ng_mma_ldm_b_cols2(b0, b1, y, kLd, kt * 16, dt * 8, lane);
            ng_mma_16816<T>(acc[dt], a, b0);
            ng_mma_16816<T>(acc[dt + 1], a, b1);
        }
    }
}

/* Row r (0: g, 1: g + 8) and column of C-fragment element c of n-tile nt. */
__device__ __forceinline__ int frag_row(int lane, int c) { return (lane >> 2) + 8 * (c >> 1); }
__device__ __forceinline__ int frag_col(int lane, int nt, int c) {
    return nt * 8 + 2 * (lane & 3) + (c & 1);
}

/* Dropout keep bits of a lane's 4 nts C-fragment elements of nts n-tiles
 * (bit 4 * nt + c), rows from row0 and columns from col0; rows are keys and
 * columns queries when keys_are_rows. A loop that is not unrolled, so each
 * kernel carries one Philox body rather than one per fragment element. */
__device__ __forceinline__ uint32_t mma_keep_bits(const ng_attention_args &a, int64_t b, int64_t h,
                                                  int64_t row0, int64_t col0, int keys_are_rows,
                                                  int nts, int lane) {
    uint32_t bits = 0;
#pragma unroll 1
    for (int x = 0; x < 4 * nts; x++) {
        const int64_t r = row0 + frag_row(lane, x & 3), c = col0 + frag_col(lane, x >> 2, x & 3);
        const int64_t i = keys_are_rows ? c : r, j = keys_are_rows ? r : c;
        if (i < a.L && j < a.S) {
            const uint64_t e = (uint64_t)(((b * a.Hq + h) * a.L + i) * a.S + j);
            bits |= (uint32_t)ng_attn_dropout_keep(a.seed, a.offset, e, (float)a.dropout_p) << x;
        }
    }
    return bits;
}

/* The factor bit 4 * nt + c of keep-bits stands for: 0 or 1 / (1 - p). */
__device__ __forceinline__ float keep_factor(uint32_t bits, int nt, int c, float inv_keep) {
    return (bits >> (4 * nt + c)) & 1u ? inv_keep : 0.0f;
}

/* ---- score variants of a tile ----------------------------------------------
 * The general per-score path (guarded_score: bounds, causality, clamp /
 * soft-cap, a mask element read through 64-bit index math) is what a tile
 * at an edge needs; most tiles of a long sequence need much less. The
 * tensor-core kernels pick one of these per 64 x 64 tile at run time (one
 * branch, uniform over the block), each compiled with only its own steps:
 *   kScorePlain    an interior tile (every query row < L, every key < kend,
 *                  none above the causal diagonal) of a call without mask,
 *                  clamp or soft-cap: s = raw * scale;
 *   kScoreKeyMask  an interior tile without clamp or soft-cap whose mask
 *                  does not depend on the query (mask_stride[2] == 0: a
 *                  padding mask [B, 1, 1, S] or [B, H, 1, S]): the mask
 *                  element at the key alone, s = raw * scale + mask;
 *   kScoreGeneral  everything else: guarded_score per element, bounds too.
 * Where a variant applies it computes what guarded_score does: with both
 * guards off the transform is the identity and its derivative exactly 1,
 * and the mask adds the same float (or masks the same keys). */
enum score_variant { kScorePlain, kScoreKeyMask, kScoreGeneral };

/* Whether a score clamp or soft-cap is on ("on" as in attention_math.h):
 * otherwise a score is raw * scale, guarded_score's identity. */
__device__ __forceinline__ bool score_guards_on(const ng_attention_args &a) {
    return (float)a.max_score > 0.0f || (float)a.softcap > 0.0f;
}

/* The variant of the tile of query rows [i0, i0 + 64) and keys [j0, j0 + 64),
 * keys valid below kend. */
__device__ __forceinline__ score_variant tile_variant(const ng_attention_args &a, int64_t i0,
                                                      int64_t j0, int64_t kend) {
    const bool interior =
        i0 + kMmaRows <= a.L && j0 + kMmaRows <= kend && (!a.is_causal || j0 + kMmaRows - 1 <= i0);
    if (!interior || score_guards_on(a)) return kScoreGeneral;
    if (a.mask_kind == NG_MASK_NONE) return kScorePlain;
    return a.mask_stride[2] == 0 ? kScoreKeyMask : kScoreGeneral;
}

/* f(variant_tag<V>{}) for the variant var, V a compile-time constant: the
 * one run-time branch by which a tile picks its compiled score step. */
template <score_variant V>
struct variant_tag {
    static constexpr score_variant value = V;
};
template <typename F>
__device__ __forceinline__ void with_variant(score_variant var, F &&f) {
    switch (var) {
    case kScorePlain: f(variant_tag<kScorePlain>{}); break;
    case kScoreKeyMask: f(variant_tag<kScoreKeyMask>{}); break;
    default: f(variant_tag<kScoreGeneral>{});
    }
}

/* Score of element (i, j) of a tile of variant V (the masked ones: the
 * plain variant's score is the scaled dot product itself, which its
 * callers fold into their own step) from its scaled raw dot product x:
 * mrow, the offset of (b, h)'s mask row (kScoreKeyMask: the element's is
 * mrow + j mask_stride[3]), ok that i < L and j < kend (kScoreGeneral). */
template <score_variant V>
__device__ __forceinline__ float tile_score(const ng_attention_args &a, float x, int64_t b,
                                            int64_t h, int64_t i, int64_t j, bool ok,
                                            int64_t mrow) {
    static_assert(V != kScorePlain, "the plain variant has no tile_score");
    if constexpr (V == kScoreKeyMask) {
        const double mv =
            ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype, mrow + j * a.mask_stride[3]);
        return mv == -INFINITY ? -INFINITY : x + (float)mv;
    }
    return ok ? guarded_score(a, x, b, h, i, j) : -INFINITY;
}

/* The tensor-core kernels take exp in base 2: a score x is carried as
 * x log2(e), so that exp(x - m) is one FMA and one ex2 (exp2f) where expf
 * needs a range reduction of its own, and the plain variant folds the
 * scale in (raw * scale log2(e)). Their p is rounded to fp16 / bf16 right
 * after, far coarser than the few ulp by which this differs from expf. */
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* The offset of (b, h)'s row of a mask (what tile_score takes). */
__device__ __forceinline__ int64_t mask_row(const ng_attention_args &a, int64_t b, int64_t h) {
    return b * a.mask_stride[0] + h * a.mask_stride[1];
}

/* This thread's vote on whether the 64 keys [j0, j0 + 64) are live for
 * head h: with a mask that does not depend on the query (a padding mask),
 * thread t < 64 says whether key j0 + t is below kend and not masked (the
 * others say no); with any other mask, or none, every thread says yes.
 * Through __syncthreads_or the block learns whether any key is live: a tile
 * none of whose keys is gives every row p = 0 (and dS = 0), and its math is
 * skipped (a NaN that K or V hold at those keys does not reach the rows,
 * the "may" of the numerics contract, as on the CPU). */
__device__ __forceinline__ int key_vote(const ng_attention_args &a, int64_t b, int64_t h,
                                        int64_t j0, int64_t kend) {
    if (a.mask_kind == NG_MASK_NONE || a.mask_stride[2] != 0) return 1;
    const int64_t j = j0 + threadIdx.x;
    return threadIdx.x < kMmaRows && j < kend &&
           ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype,
                              mask_row(a, b, h) + j * a.mask_stride[3]) != -INFINITY;
}

/* Store a warp's 16 x D accumulator rows, row r times mul[r], to rows
 * row0 + frag_row of a [seq, D] slice; rows >= n are skipped. */
template <ng_dtype T, int D>
__device__ __forceinline__ void mma_store_rows(void *dst, int64_t base, int64_t rs, int64_t row0,
                                               int64_t n, const float acc[D / 8][4],
                                               const float mul[2], int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = row0 + frag_row(lane, 2 * r);
        if (i >= n) continue;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; c++)
                ng_store_f32(dst, T, base + i * rs + frag_col(lane, dt, c), acc[dt][c] * mul[r]);
    }
}

/* Keys [j0, j0 + 64) of K and V (those below end; zeros past it) into a
 * stage's K tile and the V tile after it, issued as one committed cp.async
 * group (mma_stage_async). */
template <int D>
__device__ __forceinline__ void mma_issue_kv(uint16_t *stage, const uint16_t *kb,
                                             const uint16_t *vb, const ng_attention_args &a,
                                             int64_t j0, int64_t end, int vec) {
    mma_stage_async<D>(stage, kb, a.k_stride[2], j0, end - j0, vec);
    mma_stage_async<D>(stage + kMmaRows * (D + 8), vb, a.v_stride[2], j0, end - j0, vec);
    if constexpr (kAsyncCopy) ng_cp_async_commit();
}

/* One step of the online softmax of a warp's 16 rows in base 2 over a
 * tile's NT n-tiles: s holds the scores times log2(e) and bm[r] the max of
 * the lane's part of row r (0: g, 1: g + 8). The row max is taken over the
 * 4 lanes of the group; m, l and the accumulator o move to it, and s
 * becomes p times its dropout keep bit (keep, bit 4 nt + c; unused without
 * drop). Only the bit: p / (1 - p_drop) can exceed fp16's range once
 * rounded for the tensor cores, so the factor is the caller's, on the fp32
 * output. */
template <int D, int NT>
__device__ __forceinline__ void mma_softmax_step(float s[NT][4], float bm[2], float m[2],
                                                 float l[2], float o[D / 8][4], bool drop,
                                                 uint32_t keep) {
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        bm[r] = ng_attn_max_nan_f32(bm[r], __shfl_xor_sync(kFull, bm[r], 1));
        bm[r] = ng_attn_max_nan_f32(bm[r], __shfl_xor_sync(kFull, bm[r], 2));
        const float m_new = ng_attn_max_nan_f32(m[r], bm[r]);
        alpha[r] = ng_attn_rescale2_f32(m[r], m_new);
        m[r] = m_new;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int r = c >> 1;
            const float p = ng_attn_exp2_shift_f32(s[nt][c], m[r]);
            l[r] += p;
            s[nt][c] = drop ? p * keep_factor(keep, nt, c, 1.0f) : p;
        }
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dt][c] *= alpha[c >> 1];
}

} // namespace
} // namespace ng_attn_cu

#endif
