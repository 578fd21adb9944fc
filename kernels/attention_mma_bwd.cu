/*
 * kernels/attention_mma_bwd.cu - safe_sdpa's tensor-core backward on CUDA:
 * the shapes of the tensor-core forward (attention_mma_fwd.cu); the tile
 * layout and the shared steps are attention_mma_tile.cuh's, D and the live
 * flags come from attention_bwd_pre.cu (or D from the kernels, WsD).
 *
 *   dkdv: ceil(S/64) blocks per (b, kv head). Warp rows are keys; per query tile of
 *         every head of the group: S^T = K Q^T and dP^T = V dO^T, then
 *         dV += P^T dO and dK += dS^T Q (at D = 128 the tile's queries in
 *         two parts of 32: registers, see the kernel).
 *   dq:   ceil(L/64) blocks per (b, h). Warp rows are queries; per key tile:
 *         S = Q K^T, dP = dO V^T, dQ += dS K.
 *         Both read every fragment through ldmatrix: the A operands (the
 *         warp's own K / V or Q / dO rows) with ldmatrix.x4, the streamed
 *         tile's rows as B of X Y^T with ldmatrix.x4 and as B of W Y (P^T dO,
 *         dS^T Q, dS K, as P V in the forward: one helper, mma_wy) with
 *         ldmatrix.x4.trans. The streamed tiles (Q, dO and the rows'
 *         dout . out and lse for dkdv; K, V for dq) are double-buffered as in
 *         the forward: the next tile issued as cp.async.cg right after the
 *         barrier that opens the current one, one wait_group 0 and one
 *         __syncthreads per tile; the fixed tiles travel in the first group.
 *         At D = 128 two stages take 103 KiB of shared memory, more than
 *         sm_86 / sm_89 have (99 KiB): there the kernels run one stage, the
 *         next tile issued after a second barrier. Unaligned rows and rows
 *         past the end are staged by ordinary stores, as in the forward.
 *
 * fp16 has a 65504 ceiling that dS (unlike p in [0, 1/(1-p)]) can exceed
 * while dq and dk stay in range, so the fp16 kernels scale each dS row by a
 * power of two before rounding (ng_mma_ds_exponent) and undo it, exactly, on
 * the fp32 accumulator. bf16 has fp32's range and needs none of it.
 */
#include "kernels/attention_bwd.cuh"
#include "kernels/attention_mma_tile.cuh"

namespace ng_attn_cu {
namespace {

/* c[16 x 8 NT] += X Y^T for the backward: the 16 rows of tile x from row
 * xr0 (A fragments through ldmatrix.x4, one per k-step) against the 8 NT
 * rows of tile y, over the D columns. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_xyt(float c[NT][4], const uint16_t *x, int xr0,
                                        const uint16_t *y, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        ng_mma_ldm_a(a, x, D + 8, xr0, kk * 16, lane);
        mma_xyt_step<T, D, NT>(c, a, y, kk * 16, lane);
    }
}

/* fp16 dS rows: pick each row's exponent (max over the 4 lanes holding it),
 * move the accumulator to a larger one when needed, scale the row down. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_scale_ds(float ds[NT][4], float acc[D / 8][4], int ex[2]) {
    if constexpr (T != NG_F16) return;
    float mx[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            mx[c >> 1] = fmaxf(mx[c >> 1], fabsf(ds[nt][c])); /* fmaxf skips NaN */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 2));
        const int need = ng_mma_ds_exponent(mx[r]);
        if (need > ex[r]) {
            const float f = ldexpf(1.0f, ex[r] - need);
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                acc[dt][2 * r] *= f;
                acc[dt][2 * r + 1] *= f;
            }
            ex[r] = need;
        }
    }
    if (ex[0] == 0 && ex[1] == 0) return;
    const float f0 = ldexpf(1.0f, -ex[0]), f1 = ldexpf(1.0f, -ex[1]);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        ds[nt][0] *= f0;
        ds[nt][1] *= f0;
        ds[nt][2] *= f1;
        ds[nt][3] *= f1;
    }
}

/* D (dout . out) of rows [i0, i0 + 64) of head h into dl[64] and their
 * logsumexp times log2(e) into ls[64] (-inf past L, so those rows get
 * p = 0). WsD: D from
 * the pre-kernel's workspace dsum, one thread per row; otherwise row_dot,
 * one warp per row. */
template <ng_dtype T, int D, bool WsD>
__device__ __forceinline__ void mma_row_terms(float *dl, float *ls, const ng_attention_args &a,
                                              int64_t b, int64_t h, const void *gb, const void *ob,
                                              const float *dsum, int64_t i0) {
    const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;
    if constexpr (WsD) {
        for (int r = threadIdx.x; r < kMmaRows; r += kMmaThreads) {
            const int64_t i = i0 + r;
            dl[r] = i < a.L ? ws_d(dsum, a, b, h, i) : 0.0f;
            ls[r] = i < a.L ? lse[i] * kLog2e : -INFINITY;
        }
    } else {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 1
        for (int r = warp; r < kMmaRows; r += kMmaWarps) {
            const int64_t i = i0 + r;
            const float d = row_dot<T, D>(a, gb, ob, i, i < a.L);
            if (lane == 0) {
                dl[r] = d;
                ls[r] = i < a.L ? lse[i] * kLog2e : -INFINITY;
            }
        }
    }
}

/* The elementwise part of mma_bwd_scores for a tile of variant V, from the
 * raw dot products st (q . k) and dpt (dout . v). */
template <score_variant V, bool KeyRows, int NT>
__device__ __forceinline__ void
mma_bwd_elems(float pd[NT][4], float ds[NT][4], const float st[NT][4], const float dpt[NT][4],
              const ng_attention_args &a, uint32_t keep, const float *ls, const float *dl,
              int64_t b, int64_t h, int64_t row0, int64_t col0, int rl0, int64_t kend, int lane) {
    const bool drop = a.dropout_p > 0.0;
    const float inv_keep = drop ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const float scale = (float)a.scale, scale2 = scale * kLog2e;
    const int64_t mrow = mask_row(a, b, h);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int rl = frag_row(lane, c), cl = frag_col(lane, nt, c);
            const int ql = KeyRows ? cl : rl0 + rl; /* the query's place in its block */
            const int64_t i = KeyRows ? col0 + cl : row0 + rl, j = KeyRows ? row0 + rl : col0 + cl;
            const float kf = drop ? keep_factor(keep, nt, c, inv_keep) : 1.0f;
            /* bwd_score_keep's steps in base 2; rows past L (the last
             * tile's) never reach the mask */
            float p = 0.0f, dsc = 0.0f;
            if ((V != kScoreGeneral || (j < kend && i < a.L)) && ls[ql] != -INFINITY) {
                if constexpr (V == kScorePlain) {
                    p = exp2f(fmaf(st[nt][c], scale2, -ls[ql]));
                } else {
                    const float sc = tile_score<V>(a, st[nt][c] * scale, b, h, i, j, true, mrow);
                    p = sc == -INFINITY ? 0.0f : exp2f(fmaf(sc, kLog2e, -ls[ql]));
                }
                if (p != 0.0f) {
                    dsc = p * (dpt[nt][c] * kf - dl[ql]) * scale;
                    if constexpr (V == kScoreGeneral)
                        dsc *= ng_attn_transform_grad_f32(st[nt][c] * scale, (float)a.max_score,
                                                          (float)a.softcap);
                }
            }
            pd[nt][c] = kf != 0.0f ? p : 0.0f;
            ds[nt][c] = dsc;
        }
}

/* One warp's backward scores against 8 NT rows of a staged tile, in C fragments:
 * pd = p times the dropout keep bit (0 or 1: the factor 1/(1-p_drop) is
 * applied to the fp32 dv accumulator by the caller, so no rounding to fp16
 * can overflow) and ds = dS (bwd_score_keep) of the 16 x 8 NT block whose raw
 * dot products are x . y^T (q . k) and x2 . y2^T (dout . v). KeyRows: the
 * warp's rows are keys and the tile's rows queries (dk/dv kernel), else the
 * reverse (dq kernel). row0 / col0: first global row / column index; rl0:
 * the warp's first row inside its block (the lse / D arrays ls, dl are
 * indexed by the query's position in its 64-row block); keys >= kend are
 * out of range; var: the tile's score variant (tile_variant). */
template <ng_dtype T, int D, bool KeyRows, int NT>
__device__ __forceinline__ void
mma_bwd_scores(float pd[NT][4], float ds[NT][4], const ng_attention_args &a, const uint16_t *x,
               const uint16_t *y, const uint16_t *x2, const uint16_t *y2, const float *ls,
               const float *dl, int64_t b, int64_t h, int64_t row0, int64_t col0, int rl0,
               int64_t kend, score_variant var, int lane) {
    float st[NT][4] = {}, dpt[NT][4] = {};
    mma_xyt<T, D, NT>(st, x, rl0, y, lane);
    mma_xyt<T, D, NT>(dpt, x2, rl0, y2, lane);
    const uint32_t keep =
        a.dropout_p > 0.0 ? mma_keep_bits(a, b, h, row0, col0, KeyRows, NT, lane) : 0u;
    with_variant(var, [&](auto v) {
        mma_bwd_elems<decltype(v)::value, KeyRows, NT>(pd, ds, st, dpt, a, keep, ls, dl, b, h, row0,
                                                       col0, rl0, kend, lane);
    });
}

/* Query tile (h, i0) of the dk / dv kernel into a stage: its Q and dO rows
 * issued as cp.async (mma_stage_async; the caller commits), its rows'
 * D and lse (mma_row_terms) stored at once. */
template <ng_dtype T, int D, bool WsD>
__device__ __forceinline__ void mma_dkdv_issue(uint16_t *qs, uint16_t *gs, float *dl, float *ls,
                                               const ng_attention_args &a, const float *dsum,
                                               int64_t b, int64_t h, int64_t i0, int vec) {
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *gb = (const uint16_t *)a.dout + b * a.dout_stride[0] + h * a.dout_stride[1];
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    mma_stage_async<D>(qs, qb, a.q_stride[2], i0, a.L - i0, vec);
    mma_stage_async<D>(gs, gb, a.dout_stride[2], i0, a.L - i0, vec);
    mma_row_terms<T, D, WsD>(dl, ls, a, b, h, gb, ob, dsum, i0);
}

/* NStage (1 or 2) stages of the streamed tiles (mma_bwd picks 2 where the
 * device's shared memory allows). With 2 the next tile is issued right after
 * the barrier that opens the current one; with 1 it is issued after a second
 * barrier, once every warp is done with the current one. WsD: D from the
 * pre-kernel's dsum; otherwise computed per query tile (dsum unused). */
template <ng_dtype T, int D, int NStage, bool WsD>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_bwd_dkdv_mma_kernel(ng_attention_args a, const float *dsum, const int *live,
                                  int vec) {
#if NG_MMA_DEVICE
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* K, V, then stage st's (Q, dO) tiles at (2 + 2 st) kTile; after the
     * tiles, stage st's dl, ls (dout . out and lse of its 64 rows) */
    uint16_t *const ks = (uint16_t *)mma_smem, *const vs = ks + kTile;
    float *const rows = (float *)(ks + (2 + 2 * NStage) * kTile);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.S, (int64_t)kMmaRows), a.Hkv);
    const int64_t b = bc.b, hk = bc.h, grp = a.Hq / a.Hkv;
    const int64_t j0 = bc.blk * kMmaRows;
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];

    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    int ex[2] = {0, 0};
    /* The query tiles, head by head of the group. causal: query tiles that
     * end before this block's first key see none of it; live: a padding
     * mask hides its keys from every query of the group. */
    const int64_t istart = a.is_causal ? j0 : 0, hend = (hk + 1) * grp;
    int64_t h = hk * grp, i0 = istart;
    /* (the flags' blocks are this grid's: flag blockIdx.x is this block's) */
    if (istart >= a.L || (WsD && live && !live[blockIdx.x])) {
        h = hend; /* no query sees these keys: dk = dv = 0 */
    } else {      /* group: K, V and query tile 0 */
        mma_stage_async<D>(ks, kb, a.k_stride[2], j0, a.S - j0, vec);
        mma_stage_async<D>(vs, vb, a.v_stride[2], j0, a.S - j0, vec);
        mma_dkdv_issue<T, D, WsD>(ks + 2 * kTile, ks + 3 * kTile, rows, rows + kMmaRows, a, dsum, b,
                                  h, i0, vec);
        if constexpr (kAsyncCopy) ng_cp_async_commit();
    }
    for (int st = 0; h < hend; st ^= NStage - 1) {
        /* query tile (h, i0) complete and visible to all; with two stages,
         * every warp done with the other one (the previous tile) */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>(); /* this thread's Q / dO rows */
        __syncthreads();
        const uint16_t *qs = ks + (2 + 2 * st) * kTile, *gs = qs + kTile;
        const float *dl = rows + 2 * st * kMmaRows, *ls = dl + kMmaRows;
        if (NStage == 2) { /* the next tile into the other stage, behind this math */
            const bool more = i0 + kMmaRows < a.L;
            const int64_t hn = more ? h : h + 1, in = more ? i0 + kMmaRows : istart;
            const int sn = 2 + 2 * (st ^ 1);
            if (hn < hend) {
                mma_dkdv_issue<T, D, WsD>(
                    ks + sn * kTile, ks + (sn + 1) * kTile, rows + 2 * (st ^ 1) * kMmaRows,
                    rows + (2 * (st ^ 1) + 1) * kMmaRows, a, dsum, b, hn, in, vec);
                if constexpr (kAsyncCopy) ng_cp_async_commit();
            }
        }
        /* D = 128: the tile's queries in two parts of 32, so that p and dS
         * take 32 registers beside the 128 of the dk / dv accumulators
         * instead of 64 (with 64 the kernel spills) */
        constexpr int kParts = D == 128 ? 2 : 1, kPartNT = kMmaNT / kParts;
        /* the variants in the hot kernel only: the in-kernel D's registers
         * leave no room for them (it would spill) */
        const score_variant var = WsD ? tile_variant(a, i0, j0, a.S) : kScoreGeneral;
#pragma unroll 1
        for (int q = 0; q < kMmaRows; q += kMmaRows / kParts) {
            const uint16_t *qp = qs + q * (D + 8), *gp = gs + q * (D + 8);
            float pd[kPartNT][4], ds[kPartNT][4];
            mma_bwd_scores<T, D, true, kPartNT>(pd, ds, a, ks, qp, vs, gp, ls + q, dl + q, b, h,
                                                j0 + warp * 16, i0 + q, warp * 16, a.S, var, lane);
            mma_scale_ds<T, D, kPartNT>(ds, dk, ex);
            mma_wy<T, D, kPartNT>(dv, pd, gp, lane);
            mma_wy<T, D, kPartNT>(dk, ds, qp, lane);
        }
        if (i0 + kMmaRows < a.L) {
            i0 += kMmaRows;
        } else {
            h++;
            i0 = istart;
        }
        if (NStage == 1 && h < hend) { /* every warp done with the one stage */
            __syncthreads();
            mma_dkdv_issue<T, D, WsD>(ks + 2 * kTile, ks + 3 * kTile, rows, rows + kMmaRows, a,
                                      dsum, b, h, i0, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
    }

    const float inv_keep = a.dropout_p > 0.0 ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const float vmul[2] = {inv_keep, inv_keep},
                kmul[2] = {ldexpf(1.0f, ex[0]), ldexpf(1.0f, ex[1])};
    mma_store_rows<T, D>(a.dk, b * a.dk_stride[0] + hk * a.dk_stride[1], a.dk_stride[2],
                         j0 + warp * 16, a.S, dk, kmul, lane);
    mma_store_rows<T, D>(a.dv, b * a.dv_stride[0] + hk * a.dv_stride[1], a.dv_stride[2],
                         j0 + warp * 16, a.S, dv, vmul, lane);
#else
    NG_MMA_UNREACHABLE();
#endif
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int D, int NStage, bool WsD>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_bwd_dq_mma_kernel(ng_attention_args a, const float *dsum, int vec) {
#if NG_MMA_DEVICE
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* Q, dO, then stage st's (K, V) tiles at (2 + 2 st) kTile; after the
     * tiles, dl, ls (dout . out and lse of the block's 64 rows) */
    uint16_t *const qs = (uint16_t *)mma_smem, *const gs = qs + kTile;
    float *const dl = (float *)(qs + (2 + 2 * NStage) * kTile), *const ls = dl + kMmaRows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kMmaRows), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t q0 = bc.blk * kMmaRows;
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *gb = (const uint16_t *)a.dout + b * a.dout_stride[0] + h * a.dout_stride[1];
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);

    float dq[D / 8][4] = {};
    int ex[2] = {0, 0};
    const int64_t kend = a.is_causal ? NG_MIN(a.S, q0 + kMmaRows) : a.S;
    if (kend > 0) { /* group: Q, dO and key tile 0 (without keys dq = 0) */
        mma_stage_async<D>(qs, qb, a.q_stride[2], q0, a.L - q0, vec);
        mma_stage_async<D>(gs, gb, a.dout_stride[2], q0, a.L - q0, vec);
        mma_stage_async<D>(qs + 2 * kTile, kb, a.k_stride[2], 0, kend, vec);
        mma_stage_async<D>(qs + 3 * kTile, vb, a.v_stride[2], 0, kend, vec);
        if constexpr (kAsyncCopy) ng_cp_async_commit();
        mma_row_terms<T, D, WsD>(dl, ls, a, b, h, gb, ob, dsum, q0);
    }
    int st = 0;
    /* live: whether key tile j0 has a live key, from the vote at the
     * previous tile's barrier (tile 0, copied with Q and dO, is computed) */
    bool live = true;
    for (int64_t j0 = 0; j0 < kend; j0 += kMmaRows, st ^= NStage - 1) {
        /* key tile j0 complete and visible to all; with two stages, every
         * warp done with the other one (the previous tile). The block's
         * vote on the next tile: copied only when it has a live key. */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>(); /* this thread's K / V rows */
        const int64_t jn = j0 + kMmaRows;
        const bool live_next = __syncthreads_or(jn < kend && key_vote(a, b, h, jn, kend));
        const uint16_t *ks = qs + (2 + 2 * st) * kTile, *vs = ks + kTile;
        if (NStage == 2 && live_next) { /* the next tile into the other stage, behind this math */
            uint16_t *kn = qs + (2 + 2 * (st ^ 1)) * kTile;
            mma_stage_async<D>(kn, kb, a.k_stride[2], jn, kend - jn, vec);
            mma_stage_async<D>(kn + kTile, vb, a.v_stride[2], jn, kend - jn, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
        if (live) { /* else every key of the tile masked: dS = 0 */
            float pd[kMmaNT][4], ds[kMmaNT][4];
            mma_bwd_scores<T, D, false, kMmaNT>(pd, ds, a, qs, ks, gs, vs, ls, dl, b, h,
                                                q0 + warp * 16, j0, warp * 16, kend,
                                                tile_variant(a, q0, j0, kend), lane);
            mma_scale_ds<T, D, kMmaNT>(ds, dq, ex);
            mma_wy<T, D, kMmaNT>(dq, ds, ks, lane);
        }
        if (NStage == 1 && live_next) { /* every warp done with the one stage */
            __syncthreads();
            mma_stage_async<D>(qs + 2 * kTile, kb, a.k_stride[2], jn, kend - jn, vec);
            mma_stage_async<D>(qs + 3 * kTile, vb, a.v_stride[2], jn, kend - jn, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
        live = live_next;
    }

    const float qmul[2] = {ldexpf(1.0f, ex[0]), ldexpf(1.0f, ex[1])};
    mma_store_rows<T, D>(a.dq, b * a.dq_stride[0] + h * a.dq_stride[1], a.dq_stride[2],
                         q0 + warp * 16, a.L, dq, qmul, lane);
#else
    NG_MMA_UNREACHABLE();
#endif
}

/* The backward's dynamic shared memory: two fixed tiles (dkdv: K, V; dq: Q,
 * dO), NStage stages of the two streamed ones, and `rows` pairs of 64 floats
 * (the rows' dout . out and lse; dkdv: one per stage, dq: one). */
constexpr size_t mma_bwd_smem(int D, int nstage, int rows) {
    return sizeof(uint16_t) * (size_t)((2 + 2 * nstage) * kMmaRows * (D + 8)) +
           (size_t)rows * 2 * kMmaRows * sizeof(float);
}

template <ng_dtype T, int D, int NStage, bool WsD>
ng_status launch_mma_bwd_d(const ng_attention_args *a, cudaStream_t st, int vec,
                           const float *dsum) {
    static std::atomic<int> allowed_dkdv[kMaxDevices], allowed_dq[kMaxDevices];
    dim3 grid;
    if (a->S > 0) {
        constexpr size_t sm = mma_bwd_smem(D, NStage, NStage);
        NG_TRY(fold_grid(NG_CEIL_DIV(a->S, (int64_t)kMmaRows), a->Hkv, a->B, &grid));
        NG_TRY(allow_smem(attention_bwd_dkdv_mma_kernel<T, D, NStage, WsD>, sm, allowed_dkdv));
        NG_LAUNCH((attention_bwd_dkdv_mma_kernel<T, D, NStage, WsD>), grid, kMmaThreads, sm, st, *a,
                  dsum, bwd_live(a, dsum), vec);
        NG_TRY(cuda_check());
    }
    if (a->L == 0) return NG_OK;
    constexpr size_t sm = mma_bwd_smem(D, NStage, 1);
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kMmaRows), a->Hq, a->B, &grid));
    NG_TRY(allow_smem(attention_bwd_dq_mma_kernel<T, D, NStage, WsD>, sm, allowed_dq));
    NG_LAUNCH((attention_bwd_dq_mma_kernel<T, D, NStage, WsD>), grid, kMmaThreads, sm, st, *a, dsum,
              vec);
    return cuda_check();
}

/* dsum: the pre-kernel's D (the WsD instantiations) or NULL (D in-kernel). */
template <ng_dtype T, int D, int NStage>
ng_status launch_mma_bwd(const ng_attention_args *a, cudaStream_t st, int vec, const float *dsum) {
    if (dsum) return launch_mma_bwd_d<T, D, NStage, true>(a, st, vec, dsum);
    return launch_mma_bwd_d<T, D, NStage, false>(a, st, vec, nullptr);
}

/* Two stages of the streamed tiles where the device's shared memory per
 * block allows them (always at D = 64; at D = 128 they need 103 KiB: sm_80
 * and sm_90 have it, sm_86 / sm_89 have 99 KiB and take one). */
template <ng_dtype T, int D>
ng_status launch_mma(const ng_attention_args *a, cudaStream_t st, int vec, const float *dsum) {
    if (D == 64 || (size_t)device_optin_smem() >= mma_bwd_smem(D, 2, 2))
        return launch_mma_bwd<T, D, 2>(a, st, vec, dsum);
    return launch_mma_bwd<T, 128, 1>(a, st, vec, dsum);
}

} // namespace

template <ng_dtype T>
ng_status mma_bwd(const ng_attention_args *a, cudaStream_t st, int vec, const float *dsum) {
    return a->E == 64 ? launch_mma<T, 64>(a, st, vec, dsum) : launch_mma<T, 128>(a, st, vec, dsum);
}

template ng_status mma_bwd<NG_F16>(const ng_attention_args *, cudaStream_t, int, const float *);
template ng_status mma_bwd<NG_BF16>(const ng_attention_args *, cudaStream_t, int, const float *);

} // namespace ng_attn_cu
