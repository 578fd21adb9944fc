/*
 * kernels/attention_simt_fwd.cu - safe_sdpa's SIMT forward on CUDA: every
 * dtype (fp32, fp16, bf16) and head dim up to 256, E != Ev included; the
 * shapes the tensor-core forward does not take (attention_cuda.cuh).
 *
 * nblk = ceil(L/32) blocks per (b, h), 8 warps x 4 query rows. Per tile of
 * 32 keys, lane j owns key j's score: guarded, masked, folded into (m, l)
 * with one warp max and one warp sum, then p_j is broadcast lane by lane
 * into the [Ev] accumulator.
 */
#include "kernels/attention_cuda.cuh"

namespace ng_attn_cu {
namespace {

template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kThreads, NT > 4 ? 4 : 0)
    attention_fwd_kernel(ng_attention_args a) {
    NG_DYNAMIC_SMEM(float, smem);
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kFwdBQ), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = bc.blk * kFwdBQ, row0 = blk0 + warp * kFwdRows;
    const float scale = (float)a.scale;
    const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);

    float q[kFwdRows][NT], acc[kFwdRows][NT], m[kFwdRows], l[kFwdRows];
    for (int r = 0; r < kFwdRows; r++) {
        for (int t = 0; t < NT; t++) {
            int64_t e = lane + 32 * t, i = row0 + r;
            q[r][t] = (e < a.E && i < a.L) ? ld<T>(qb, i * a.q_stride[2] + e) : 0.0f;
            acc[r][t] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }

    const int64_t kend = a.is_causal ? NG_MIN(a.S, blk0 + kFwdBQ) : a.S;
    for (int64_t j0 = 0; j0 < kend; j0 += kBK) {
        const int64_t nk = NG_MIN((int64_t)kBK, kend - j0);
        stage_kv<T>(ks, vs, kb, vb, a, j0, nk);
        for (int r = 0; r < kFwdRows; r++) {
            const int64_t i = row0 + r, j = j0 + lane;
            float mine = 0.0f;
            for (int jj = 0; jj < nk; jj++) {
                float part = 0.0f;
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) part += q[r][t] * ks[jj * a.E + e];
                }
                float dot = warp_sum(part);
                if (lane == jj) mine = dot;
            }
            float s =
                (i < a.L && lane < nk) ? guarded_score(a, mine * scale, b, h, i, j) : -INFINITY;
            float m_new = ng_attn_max_nan_f32(m[r], warp_max_nan(s));
            float alpha = ng_attn_rescale_f32(m[r], m_new);
            float p = ng_attn_exp_shift_f32(s, m_new);
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = m_new;
            if (i < a.L && lane < nk) p *= dropout_scale(a, b, h, i, j);
            for (int t = 0; t < NT; t++) acc[r][t] *= alpha;
            for (int jj = 0; jj < nk; jj++) {
                float pj = __shfl_sync(kFull, p, jj);
                for (int t = 0; t < NT; t++) {
                    int d = lane + 32 * t;
                    if (d < a.Ev) acc[r][t] += pj * vs[jj * a.Ev + d];
                }
            }
        }
    }

    for (int r = 0; r < kFwdRows; r++) {
        if (row0 + r >= a.L) break;
        store_row<T, NT>(a, b, h, row0 + r, acc[r], m[r], l[r]);
    }
}

template <ng_dtype T, int NT>
ng_status launch_fwd(const ng_attention_args *a, cudaStream_t st) {
    static std::atomic<int> allowed[kMaxDevices];
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kFwdBQ), a->Hq, a->B, &grid));
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_fwd_kernel<T, NT>, sm, allowed));
    NG_LAUNCH((attention_fwd_kernel<T, NT>), grid, kThreads, sm, st, *a);
    return cuda_check();
}

} // namespace

/* NT = ceil(max(E, Ev) / 32) rounded up to 1, 2, 4, 8. */
template <ng_dtype T>
ng_status simt_fwd(const ng_attention_args *a, cudaStream_t st) {
    const int64_t dmax = NG_MAX(a->E, a->Ev);
    if (dmax <= 32) return launch_fwd<T, 1>(a, st);
    if (dmax <= 64) return launch_fwd<T, 2>(a, st);
    if (dmax <= 128) return launch_fwd<T, 4>(a, st);
    return launch_fwd<T, 8>(a, st);
}

template ng_status simt_fwd<NG_F32>(const ng_attention_args *, cudaStream_t);
template ng_status simt_fwd<NG_F16>(const ng_attention_args *, cudaStream_t);
template ng_status simt_fwd<NG_BF16>(const ng_attention_args *, cudaStream_t);

} // namespace ng_attn_cu
