/*
 * kernels/attention_mma_fwd.cu - safe_sdpa's tensor-core forward on CUDA:
 * fp16 / bf16 with E == Ev in {64, 128} on sm_80+ (mma_eligible); the tile
 * layout and the shared steps are attention_mma_tile.cuh's.
 *
 *   fwd:  ceil(L/64) blocks per (b, h). Warp rows are queries; per key tile:
 *         S = Q K^T, online softmax (row max over the 4 lanes of a group),
 *         O = O * alpha + P V. Q's A fragments are read once (ldmatrix.x4)
 *         and stay in registers; K's B fragments come through ldmatrix.x4,
 *         V's through ldmatrix.x4.trans. K / V tiles are double-buffered:
 *         two stages of (K, V), the next tile's rows issued as 16-byte
 *         cp.async.cg right after the barrier that opens the current one, so
 *         they are in flight during its math; one wait_group 0 and one
 *         __syncthreads per tile. Rows past the end are zero-filled by
 *         ordinary stores, and when any row of q / k / v is not 16-byte
 *         aligned (vec == 0) every row is staged by ordinary loads.
 */
#include "kernels/attention_mma_tile.cuh"

namespace ng_attn_cu {
namespace {

/* c[16 x 64] += Q K^T for the forward: Q's A fragments held in registers
 * (qf[k-step]). */
template <ng_dtype T, int D>
__device__ __forceinline__ void mma_qkt(float c[kMmaNT][4], const uint32_t qf[D / 16][4],
                                        const uint16_t *k, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) mma_xyt_step<T, D, kMmaNT>(c, qf[kk], k, kk * 16, lane);
}

/* The forward's scores of a key tile, variant V: s[nt][c] (raw dot
 * products of the warp's rows from i0 against keys from j0) becomes each
 * element's score times log2(e), bm[r] the max over the lane's part of
 * row r. */
template <score_variant V>
__device__ __forceinline__ void
fwd_scores(float s[kMmaNT][4], float bm[2], const ng_attention_args &a, int64_t b, int64_t h,
           int64_t i0, int64_t j0, int64_t kend, float scale, int lane) {
    const int64_t mrow = mask_row(a, b, h);
    const float scale2 = scale * kLog2e;
#pragma unroll
    for (int nt = 0; nt < kMmaNT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int64_t i = i0 + frag_row(lane, c), j = j0 + frag_col(lane, nt, c);
            if constexpr (V == kScorePlain)
                s[nt][c] *= scale2;
            else
                s[nt][c] =
                    tile_score<V>(a, s[nt][c] * scale, b, h, i, j, i < a.L && j < kend, mrow) *
                    kLog2e;
            bm[c >> 1] = ng_attn_max_nan_f32(bm[c >> 1], s[nt][c]);
        }
}

template <ng_dtype T, int D>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_fwd_mma_kernel(ng_attention_args a, int vec) {
#if NG_MMA_DEVICE
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* two stages of (K, V) tiles, stage st at smem + 2 st kTile; Q is staged
     * in stage 1's K tile and read into registers before tile 1 lands there */
    uint16_t *const smem = (uint16_t *)mma_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kMmaRows), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t q0 = bc.blk * kMmaRows;
    const float scale = (float)a.scale;
    const bool drop = a.dropout_p > 0.0;
    const float inv_keep = drop ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];
    const int64_t kend = a.is_causal ? NG_MIN(a.S, q0 + kMmaRows) : a.S;
    /* group 0: Q; group 1: key tile 0 (empty when there are no keys) */
    mma_stage_async<D>(smem + 2 * kTile, qb, a.q_stride[2], q0, a.L - q0, vec);
    if constexpr (kAsyncCopy) ng_cp_async_commit();
    if (kend > 0) {
        mma_stage_async<D>(smem, kb, a.k_stride[2], 0, kend, vec);
        mma_stage_async<D>(smem + kTile, vb, a.v_stride[2], 0, kend, vec);
    }
    if constexpr (kAsyncCopy) {
        ng_cp_async_commit();
        ng_cp_async_wait_group<1>(); /* Q landed; tile 0 may still be in flight */
    }
    /* live: whether the tile about to be computed has a live key (tile 0's
     * copies are issued before its vote, the others' after) */
    bool live = __syncthreads_or(key_vote(a, b, h, 0, kend));
    uint32_t qf[D / 16][4]; /* the warp's 16 query rows as A fragments, for every key tile */
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ng_mma_ldm_a(qf[kk], smem + 2 * kTile, D + 8, warp * 16, kk * 16, lane);

    /* m: each row's running max times log2(e) (fwd_scores) */
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int st = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += kMmaRows, st ^= 1) {
        /* tile j0 complete and visible to all; every warp done with the
         * other stage (tile j0 - 64, or Q on the first pass) */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>();
        /* the block's vote on the next tile: copied only when it has a
         * live key */
        const int64_t jn = j0 + kMmaRows;
        const bool live_next = __syncthreads_or(jn < kend && key_vote(a, b, h, jn, kend));
        const uint16_t *ks = smem + 2 * st * kTile, *vs = ks + kTile;
        if (live_next) { /* tile jn into the other stage, behind this one's math */
            mma_issue_kv<D>(smem + 2 * (st ^ 1) * kTile, kb, vb, a, jn, kend, vec);
        }
        const bool dead = !live;
        live = live_next;
        if (dead) continue; /* every key of the tile masked: p = 0 for every row */
        float s[kMmaNT][4] = {};
        mma_qkt<T, D>(s, qf, ks, lane);

        float bm[2] = {-INFINITY, -INFINITY};
        with_variant(tile_variant(a, q0, j0, kend), [&](auto v) {
            fwd_scores<decltype(v)::value>(s, bm, a, b, h, q0 + warp * 16, j0, kend, scale, lane);
        });
        const uint32_t keep =
            drop ? mma_keep_bits(a, b, h, q0 + warp * 16, j0, 0, kMmaNT, lane) : 0u;
        mma_softmax_step<D, kMmaNT>(s, bm, m, l, o, drop, keep);
        mma_wy<T, D, kMmaNT>(o, s, vs, lane);
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) { /* the 4 lanes of a group hold disjoint parts of the row sum */
        l[r] += __shfl_xor_sync(kFull, l[r], 1);
        l[r] += __shfl_xor_sync(kFull, l[r], 2);
        inv[r] = ng_attn_inv_sum_f32(l[r]) * inv_keep;
        const int64_t i = q0 + warp * 16 + frag_row(lane, 2 * r);
        if ((lane & 3) == 0 && i < a.L)
            ((float *)a.lse)[(b * a.Hq + h) * a.L + i] = ng_attn_lse_f32(m[r] * kLn2, l[r]);
    }
    mma_store_rows<T, D>(a.out, b * a.out_stride[0] + h * a.out_stride[1], a.out_stride[2],
                         q0 + warp * 16, a.L, o, inv, lane);
#else
    NG_MMA_UNREACHABLE();
#endif
}

template <ng_dtype T, int D>
ng_status launch_mma_fwd(const ng_attention_args *a, cudaStream_t st, int vec) {
    static std::atomic<int> allowed[kMaxDevices];
    const size_t tile = sizeof(uint16_t) * (size_t)(kMmaRows * (D + 8));
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kMmaRows), a->Hq, a->B, &grid));
    NG_TRY(allow_smem(attention_fwd_mma_kernel<T, D>, 4 * tile, allowed));
    NG_LAUNCH((attention_fwd_mma_kernel<T, D>), grid, kMmaThreads, 4 * tile, st, *a, vec);
    return cuda_check();
}

} // namespace

template <ng_dtype T>
ng_status mma_fwd(const ng_attention_args *a, cudaStream_t st, int vec) {
    return a->E == 64 ? launch_mma_fwd<T, 64>(a, st, vec) : launch_mma_fwd<T, 128>(a, st, vec);
}

template ng_status mma_fwd<NG_F16>(const ng_attention_args *, cudaStream_t, int);
template ng_status mma_fwd<NG_BF16>(const ng_attention_args *, cudaStream_t, int);

} // namespace ng_attn_cu
