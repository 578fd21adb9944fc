/*
 * kernels/attention_simt_bwd.cu - safe_sdpa's SIMT backward on CUDA: the
 * shapes of the SIMT forward (attention_cuda.cuh). Two kernels (key blocks,
 * query blocks), no atomics; the dq one computes the scores again
 * (docs/cuda.md says why). D comes from the pre-kernel's workspace
 * (attention_bwd_pre.cu) or is computed in-kernel (WsD).
 *   dkdv: nblk = ceil(S/16) per (b, kv head), 8 warps x 2 keys; loops over
 *         the query heads of the group and all query tiles (16 rows staged
 *         with their lse and D).
 *   dq:   nblk = ceil(L/16) per (b, h), 8 warps x 2 query rows; loops over
 *         key tiles.
 */
#include "kernels/attention_bwd.cuh"

namespace ng_attn_cu {
namespace {

/* The SIMT kernels' D of row i (0 where !valid): the workspace's (WsD), or
 * row_dot. */
template <ng_dtype T, bool WsD>
__device__ __forceinline__ float simt_row_d(const float *dsum, const ng_attention_args &a,
                                            int64_t b, int64_t h, const void *gb, const void *ob,
                                            int64_t i, bool valid) {
    if constexpr (WsD)
        return valid ? ws_d(dsum, a, b, h, i) : 0.0f;
    else
        return row_dot<T>(a, gb, ob, i, valid);
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int NT, bool WsD>
static __global__ void __launch_bounds__(kThreads, NT > 4 ? 1 : kSimtMinBlocks)
    attention_bwd_dkdv_kernel(ng_attention_args a, const float *dsum, const int *live) {
    NG_DYNAMIC_SMEM(float, smem);
    float *qs = smem, *gs = qs + kBwdBQ * a.E, *lses = gs + kBwdBQ * a.Ev, *Ds = lses + kBwdBQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.S, (int64_t)kBwdBlock), a.Hkv);
    const int64_t b = bc.b, hk = bc.h, grp = a.Hq / a.Hkv;
    const int64_t jblk = bc.blk * kBwdBlock, j0 = jblk + warp * kBwdPer;
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);

    float kr[kBwdPer][NT], vr[kBwdPer][NT], dk[kBwdPer][NT], dv[kBwdPer][NT];
    for (int c = 0; c < kBwdPer; c++)
        for (int t = 0; t < NT; t++) {
            int64_t j = j0 + c, e = lane + 32 * t;
            kr[c][t] = (j < a.S && e < a.E) ? ld<T>(kb, j * a.k_stride[2] + e) : 0.0f;
            vr[c][t] = (j < a.S && e < a.Ev) ? ld<T>(vb, j * a.v_stride[2] + e) : 0.0f;
            dk[c][t] = 0.0f;
            dv[c][t] = 0.0f;
        }

    /* causal: query tiles that end before this block's first key see none
     * of it; live: a padding mask hides the 64 keys around this block from
     * every query of the group (dk = dv = 0) */
    const int64_t istart = a.is_causal ? (jblk / kBwdBQ) * kBwdBQ : 0;
    const bool dead =
        WsD && live &&
        !live[(b * a.Hkv + hk) * NG_CEIL_DIV(a.S, (int64_t)kLiveKeys) + jblk / kLiveKeys];
    for (int64_t h = dead ? (hk + 1) * grp : hk * grp; h < (hk + 1) * grp; h++) {
        const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
        const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
        const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
        const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;
        for (int64_t i0 = istart; i0 < a.L; i0 += kBwdBQ) {
            const int64_t nq = NG_MIN((int64_t)kBwdBQ, a.L - i0);
            __syncthreads();
            stage<T>(qs, a.E, kBwdBQ, qb, a.q_stride[2], i0, nq, a.E);
            stage<T>(gs, a.Ev, kBwdBQ, gb, a.dout_stride[2], i0, nq, a.Ev);
            for (int r = warp; r < kBwdBQ; r += kWarps) { /* D, one warp per row */
                const float d = simt_row_d<T, WsD>(dsum, a, b, h, gb, ob, i0 + r, r < nq);
                if (lane == 0) {
                    Ds[r] = d;
                    lses[r] = r < nq ? lse[i0 + r] : -INFINITY;
                }
            }
            __syncthreads();
            for (int r = 0; r < nq; r++) {
                const int64_t i = i0 + r;
                for (int c = 0; c < kBwdPer; c++) {
                    const int64_t j = j0 + c;
                    float pq = 0.0f, pg = 0.0f;
                    for (int t = 0; t < NT; t++) {
                        int e = lane + 32 * t;
                        if (e < a.E) pq += qs[r * a.E + e] * kr[c][t];
                        if (e < a.Ev) pg += gs[r * a.Ev + e] * vr[c][t];
                    }
                    const float qk = warp_sum(pq), dp = warp_sum(pg);
                    if (j >= a.S) continue;
                    bwd_terms w = bwd_score(a, qk, dp, lses[r], Ds[r], b, h, i, j);
                    for (int t = 0; t < NT; t++) {
                        int e = lane + 32 * t;
                        if (e < a.E) dk[c][t] += w.ds * qs[r * a.E + e];
                        if (e < a.Ev) dv[c][t] += w.pd * gs[r * a.Ev + e];
                    }
                }
            }
        }
    }

    for (int c = 0; c < kBwdPer; c++) {
        const int64_t j = j0 + c;
        if (j >= a.S) break;
        const int64_t kofs = b * a.dk_stride[0] + hk * a.dk_stride[1] + j * a.dk_stride[2];
        const int64_t vofs = b * a.dv_stride[0] + hk * a.dv_stride[1] + j * a.dv_stride[2];
        for (int t = 0; t < NT; t++) {
            int e = lane + 32 * t;
            if (e < a.E) ng_store_f32(a.dk, T, kofs + e, dk[c][t]);
            if (e < a.Ev) ng_store_f32(a.dv, T, vofs + e, dv[c][t]);
        }
    }
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int NT, bool WsD>
static __global__ void __launch_bounds__(kThreads, kSimtMinBlocks)
    attention_bwd_dq_kernel(ng_attention_args a, const float *dsum) {
    NG_DYNAMIC_SMEM(float, smem);
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kBwdBlock), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = bc.blk * kBwdBlock, row0 = blk0 + warp * kBwdPer;
    const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
    const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);
    const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;

    float q[kBwdPer][NT], g[kBwdPer][NT], dq[kBwdPer][NT], D[kBwdPer], L[kBwdPer];
    for (int r = 0; r < kBwdPer; r++) {
        const int64_t i = row0 + r;
        for (int t = 0; t < NT; t++) {
            int64_t e = lane + 32 * t;
            q[r][t] = (i < a.L && e < a.E) ? ld<T>(qb, i * a.q_stride[2] + e) : 0.0f;
            g[r][t] = (i < a.L && e < a.Ev) ? ld<T>(gb, i * a.dout_stride[2] + e) : 0.0f;
            dq[r][t] = 0.0f;
        }
        D[r] = simt_row_d<T, WsD>(dsum, a, b, h, gb, ob, i, i < a.L);
        L[r] = i < a.L ? lse[i] : -INFINITY;
    }

    const int64_t kend = a.is_causal ? NG_MIN(a.S, blk0 + kBwdBlock) : a.S;
    for (int64_t j0 = 0; j0 < kend; j0 += kBK) {
        const int64_t nk = NG_MIN((int64_t)kBK, kend - j0);
        stage_kv<T>(ks, vs, kb, vb, a, j0, nk);
        for (int r = 0; r < kBwdPer; r++) {
            const int64_t i = row0 + r;
            for (int jj = 0; jj < nk; jj++) {
                float pq = 0.0f, pg = 0.0f;
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) pq += q[r][t] * ks[jj * a.E + e];
                    if (e < a.Ev) pg += g[r][t] * vs[jj * a.Ev + e];
                }
                const float qk = warp_sum(pq), dp = warp_sum(pg);
                if (i >= a.L) continue;
                bwd_terms w = bwd_score(a, qk, dp, L[r], D[r], b, h, i, j0 + jj);
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) dq[r][t] += w.ds * ks[jj * a.E + e];
                }
            }
        }
    }

    for (int r = 0; r < kBwdPer; r++) {
        const int64_t i = row0 + r;
        if (i >= a.L) break;
        const int64_t ofs = b * a.dq_stride[0] + h * a.dq_stride[1] + i * a.dq_stride[2];
        for (int t = 0; t < NT; t++) {
            int e = lane + 32 * t;
            if (e < a.E) ng_store_f32(a.dq, T, ofs + e, dq[r][t]);
        }
    }
}

template <ng_dtype T, int NT, bool WsD>
ng_status launch_bwd_d(const ng_attention_args *a, cudaStream_t st, const float *dsum) {
    static std::atomic<int> allowed_dkdv[kMaxDevices], allowed_dq[kMaxDevices];
    if (a->S > 0) {
        dim3 grid;
        NG_TRY(fold_grid(NG_CEIL_DIV(a->S, (int64_t)kBwdBlock), a->Hkv, a->B, &grid));
        size_t sm = sizeof(float) * (size_t)(kBwdBQ * (a->E + a->Ev) + 2 * kBwdBQ);
        NG_TRY(allow_smem(attention_bwd_dkdv_kernel<T, NT, WsD>, sm, allowed_dkdv));
        NG_LAUNCH((attention_bwd_dkdv_kernel<T, NT, WsD>), grid, kThreads, sm, st, *a, dsum,
                  bwd_live(a, dsum));
        NG_TRY(cuda_check());
    }
    if (a->L == 0) return NG_OK;
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kBwdBlock), a->Hq, a->B, &grid));
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_bwd_dq_kernel<T, NT, WsD>, sm, allowed_dq));
    NG_LAUNCH((attention_bwd_dq_kernel<T, NT, WsD>), grid, kThreads, sm, st, *a, dsum);
    return cuda_check();
}

/* dsum: the pre-kernel's D (the WsD instantiations) or NULL (D in-kernel). */
template <ng_dtype T, int NT>
ng_status launch_bwd(const ng_attention_args *a, cudaStream_t st, const float *dsum) {
    if (dsum) return launch_bwd_d<T, NT, true>(a, st, dsum);
    return launch_bwd_d<T, NT, false>(a, st, nullptr);
}

} // namespace

/* NT = ceil(max(E, Ev) / 32) rounded up to 1, 2, 4, 8. */
template <ng_dtype T>
ng_status simt_bwd(const ng_attention_args *a, cudaStream_t st, const float *dsum) {
    const int64_t dmax = NG_MAX(a->E, a->Ev);
    if (dmax <= 32) return launch_bwd<T, 1>(a, st, dsum);
    if (dmax <= 64) return launch_bwd<T, 2>(a, st, dsum);
    if (dmax <= 128) return launch_bwd<T, 4>(a, st, dsum);
    return launch_bwd<T, 8>(a, st, dsum);
}

template ng_status simt_bwd<NG_F32>(const ng_attention_args *, cudaStream_t, const float *);
template ng_status simt_bwd<NG_F16>(const ng_attention_args *, cudaStream_t, const float *);
template ng_status simt_bwd<NG_BF16>(const ng_attention_args *, cudaStream_t, const float *);

} // namespace ng_attn_cu
