/*
 * kernels/attention.cu - safe_sdpa on CUDA: tiled attention with an online
 * softmax, fp32 accumulation, the per-score math of attention_math.h.
 *
 * A clean SIMT version (no tensor cores yet): one warp per query row (fwd,
 * dq) or per key (dk/dv); each lane holds head-dim elements lane, lane+32,
 * ... (NT = ceil(E/32) of them, E <= 256), dot products are warp reductions,
 * K/V (or Q/dout) tiles are staged in shared memory as fp32.
 *
 *   fwd:  grid (ceil(L/32), Hq, B), 8 warps x 4 query rows. Per tile of 32
 *         keys, lane j owns key j's score: guarded, masked, folded into
 *         (m, l) with one warp max and one warp sum, then p_j is broadcast
 *         lane by lane into the [Ev] accumulator.
 *   bwd:  two kernels, no atomics and no workspace (FlashAttention-2's split):
 *         dkdv: grid (ceil(S/16), Hkv, B), 8 warps x 2 keys; loops over the
 *               query heads of the group and all query tiles (16 rows staged
 *               with their lse and D = dout . out).
 *         dq:   grid (ceil(L/16), Hq, B), 8 warps x 2 query rows; loops over
 *               key tiles.
 * fp64 has no CUDA path (it exists for gradcheck on the CPU): NG_ERR_DTYPE.
 */
#include <cuda_runtime.h>

#include "kernels/attention.h"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kFwdRows = 4;                   /* query rows per warp, forward */
constexpr int kFwdBQ = kWarps * kFwdRows;     /* 32 query rows per block */
constexpr int kBK = 32;                       /* keys per shared tile, one per lane */
constexpr int kBwdPer = 2;                    /* keys (dkdv) or rows (dq) per warp */
constexpr int kBwdBlock = kWarps * kBwdPer;   /* 16 keys or rows per block */
constexpr int kBwdBQ = 16;                    /* query rows per shared tile in dkdv */
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
    return x;
}

__device__ __forceinline__ float warp_max_nan(float x) {
    for (int o = 16; o > 0; o >>= 1) x = ng_attn_max_nan_f32(x, __shfl_xor_sync(kFull, x, o));
    return x;
}

template <ng_dtype T>
__device__ __forceinline__ float ld(const void *p, int64_t i) {
    return ng_load_f32(p, T, i);
}

/* Scaled raw score -> guarded, masked score (-inf where masked). */
__device__ __forceinline__ float guarded_score(const ng_attention_args &a, float raw, int64_t b, int64_t h,
                                               int64_t i, int64_t j) {
    float s = ng_attn_transform_f32(raw, (float)a.max_score, (float)a.softcap);
    if (a.is_causal && ng_attn_causal_masked(i, j)) return -INFINITY;
    if (a.mask_kind != NG_MASK_NONE) {
        int64_t off = b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2] + j * a.mask_stride[3];
        double mv = ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype, off);
        if (mv == -INFINITY) return -INFINITY;
        s += (float)mv;
    }
    return s;
}

__device__ __forceinline__ float dropout_scale(const ng_attention_args &a, int64_t b, int64_t h, int64_t i,
                                               int64_t j) {
    if (!(a.dropout_p > 0.0)) return 1.0f;
    uint64_t e = (uint64_t)(((b * a.Hq + h) * a.L + i) * a.S + j);
    return ng_attn_dropout_keep(a.seed, a.offset, e, (float)a.dropout_p) ? (float)(1.0 / (1.0 - a.dropout_p))
                                                                          : 0.0f;
}

/* Stage rows [r0, r0+n) of a [seq, dim] slice into tile[rows][dim] as fp32 (zeros past n). */
template <ng_dtype T>
__device__ __forceinline__ void stage(float *tile, int rows, const void *base, int64_t rs, int64_t r0, int64_t n,
                                      int64_t dim) {
    for (int x = threadIdx.x; x < rows * dim; x += kThreads) {
        int r = x / (int)dim, d = x % (int)dim;
        tile[x] = r < n ? ld<T>(base, (r0 + r) * rs + d) : 0.0f;
    }
}

template <ng_dtype T>
__device__ __forceinline__ const void *slice(const void *p, int64_t off) {
    return (const char *)p + off * (int64_t)(T == NG_F32 ? 4 : 2);
}

/* ---- forward ------------------------------------------------------------ */

template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kThreads) attention_fwd_kernel(ng_attention_args a) {
    extern __shared__ float smem[];
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = (int64_t)blockIdx.x * kFwdBQ, row0 = blk0 + warp * kFwdRows;
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
        __syncthreads();
        stage<T>(ks, kBK, kb, a.k_stride[2], j0, nk, a.E);
        stage<T>(vs, kBK, vb, a.v_stride[2], j0, nk, a.Ev);
        __syncthreads();
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
            float s = (i < a.L && lane < nk) ? guarded_score(a, mine * scale, b, h, i, j) : -INFINITY;
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
        const int64_t i = row0 + r;
        if (i >= a.L) break;
        const float inv = ng_attn_inv_sum_f32(l[r]);
        const int64_t ob = b * a.out_stride[0] + h * a.out_stride[1] + i * a.out_stride[2];
        for (int t = 0; t < NT; t++) {
            int d = lane + 32 * t;
            if (d < a.Ev) ng_store_f32(a.out, T, ob + d, acc[r][t] * inv);
        }
        if (lane == 0) ((float *)a.lse)[(b * a.Hq + h) * a.L + i] = ng_attn_lse_f32(m[r], l[r]);
    }
}

/* ---- backward ----------------------------------------------------------- */

/* P, dS (already times scale and the guard's derivative) and the dropout
 * factor for one (query i, key j) from its raw dot products. */
struct bwd_terms {
    float pd, ds;
};

__device__ __forceinline__ bwd_terms bwd_score(const ng_attention_args &a, float qk, float dp, float lse,
                                               float D, int64_t b, int64_t h, int64_t i, int64_t j) {
    const float scale = (float)a.scale;
    const float raw = qk * scale;
    const float s = guarded_score(a, raw, b, h, i, j);
    bwd_terms o = {0.0f, 0.0f};
    if (s == -INFINITY || lse == -INFINITY) return o; /* masked or fully masked row */
    const float p = expf(s - lse);
    const float keep = dropout_scale(a, b, h, i, j);
    o.pd = p * keep;
    o.ds = p * (dp * keep - D) * scale * ng_attn_transform_grad_f32(raw, (float)a.max_score, (float)a.softcap);
    return o;
}

template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(ng_attention_args a) {
    extern __shared__ float smem[];
    float *qs = smem, *gs = qs + kBwdBQ * a.E, *lses = gs + kBwdBQ * a.Ev, *Ds = lses + kBwdBQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t b = blockIdx.z, hk = blockIdx.y, grp = a.Hq / a.Hkv;
    const int64_t jblk = (int64_t)blockIdx.x * kBwdBlock, j0 = jblk + warp * kBwdPer;
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

    /* causal: query tiles that end before this block's first key see none of it */
    const int64_t istart = a.is_causal ? (jblk / kBwdBQ) * kBwdBQ : 0;
    for (int64_t h = hk * grp; h < (hk + 1) * grp; h++) {
        const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
        const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
        const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
        const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;
        for (int64_t i0 = istart; i0 < a.L; i0 += kBwdBQ) {
            const int64_t nq = NG_MIN((int64_t)kBwdBQ, a.L - i0);
            __syncthreads();
            stage<T>(qs, kBwdBQ, qb, a.q_stride[2], i0, nq, a.E);
            stage<T>(gs, kBwdBQ, gb, a.dout_stride[2], i0, nq, a.Ev);
            for (int r = warp; r < kBwdBQ; r += kWarps) { /* D = dout . out, one warp per row */
                float part = 0.0f;
                if (r < nq)
                    for (int64_t d = lane; d < a.Ev; d += 32)
                        part += ld<T>(gb, (i0 + r) * a.dout_stride[2] + d) * ld<T>(ob, (i0 + r) * a.out_stride[2] + d);
                part = warp_sum(part);
                if (lane == 0) {
                    Ds[r] = part;
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

template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(ng_attention_args a) {
    extern __shared__ float smem[];
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = (int64_t)blockIdx.x * kBwdBlock, row0 = blk0 + warp * kBwdPer;
    const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
    const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);
    const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;

    float q[kBwdPer][NT], g[kBwdPer][NT], dq[kBwdPer][NT], D[kBwdPer], L[kBwdPer];
    for (int r = 0; r < kBwdPer; r++) {
        const int64_t i = row0 + r;
        float part = 0.0f;
        for (int t = 0; t < NT; t++) {
            int64_t e = lane + 32 * t;
            q[r][t] = (i < a.L && e < a.E) ? ld<T>(qb, i * a.q_stride[2] + e) : 0.0f;
            g[r][t] = (i < a.L && e < a.Ev) ? ld<T>(gb, i * a.dout_stride[2] + e) : 0.0f;
            if (i < a.L && e < a.Ev) part += g[r][t] * ld<T>(ob, i * a.out_stride[2] + e);
            dq[r][t] = 0.0f;
        }
        D[r] = warp_sum(part);
        L[r] = i < a.L ? lse[i] : -INFINITY;
    }

    const int64_t kend = a.is_causal ? NG_MIN(a.S, blk0 + kBwdBlock) : a.S;
    for (int64_t j0 = 0; j0 < kend; j0 += kBK) {
        const int64_t nk = NG_MIN((int64_t)kBK, kend - j0);
        __syncthreads();
        stage<T>(ks, kBK, kb, a.k_stride[2], j0, nk, a.E);
        stage<T>(vs, kBK, vb, a.v_stride[2], j0, nk, a.Ev);
        __syncthreads();
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

/* ---- launch helpers ------------------------------------------------------ */

ng_status cuda_check() { return cudaGetLastError() == cudaSuccess ? NG_OK : NG_ERR_CUDA; }

/* Dynamic shared memory above 48 KiB (K and V tiles of head dims > 192) must
 * be opted into per kernel; sm_80 and sm_90 allow far more than we use. */
template <typename Kernel>
ng_status allow_smem(Kernel kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return NG_OK;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) == cudaSuccess
               ? NG_OK
               : NG_ERR_CUDA;
}

/* Grid limits: y and z are at most 65535. */
ng_status grid_ok(const ng_attention_args *a, int64_t heads) {
    return (a->B <= 65535 && heads <= 65535) ? NG_OK : NG_ERR_UNSUPPORTED;
}

template <ng_dtype T, int NT>
ng_status launch_fwd(const ng_attention_args *a, cudaStream_t st) {
    dim3 grid((unsigned)NG_CEIL_DIV(a->L, (int64_t)kFwdBQ), (unsigned)a->Hq, (unsigned)a->B);
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_fwd_kernel<T, NT>, sm));
    attention_fwd_kernel<T, NT><<<grid, kThreads, sm, st>>>(*a);
    return cuda_check();
}

template <ng_dtype T, int NT>
ng_status launch_bwd(const ng_attention_args *a, cudaStream_t st) {
    if (a->S > 0) {
        dim3 grid((unsigned)NG_CEIL_DIV(a->S, (int64_t)kBwdBlock), (unsigned)a->Hkv, (unsigned)a->B);
        size_t sm = sizeof(float) * (size_t)(kBwdBQ * (a->E + a->Ev) + 2 * kBwdBQ);
        NG_TRY(allow_smem(attention_bwd_dkdv_kernel<T, NT>, sm));
        attention_bwd_dkdv_kernel<T, NT><<<grid, kThreads, sm, st>>>(*a);
        NG_TRY(cuda_check());
    }
    if (a->L == 0) return NG_OK;
    dim3 grid((unsigned)NG_CEIL_DIV(a->L, (int64_t)kBwdBlock), (unsigned)a->Hq, (unsigned)a->B);
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_bwd_dq_kernel<T, NT>, sm));
    attention_bwd_dq_kernel<T, NT><<<grid, kThreads, sm, st>>>(*a);
    return cuda_check();
}

/* Dispatch on NT = ceil(max(E, Ev) / 32) rounded up to 1, 2, 4, 8. */
template <ng_dtype T>
ng_status dispatch_nt(const ng_attention_args *a, cudaStream_t st, int backward) {
    const int64_t dmax = NG_MAX(a->E, a->Ev);
    if (dmax <= 32) return backward ? launch_bwd<T, 1>(a, st) : launch_fwd<T, 1>(a, st);
    if (dmax <= 64) return backward ? launch_bwd<T, 2>(a, st) : launch_fwd<T, 2>(a, st);
    if (dmax <= 128) return backward ? launch_bwd<T, 4>(a, st) : launch_fwd<T, 4>(a, st);
    return backward ? launch_bwd<T, 8>(a, st) : launch_fwd<T, 8>(a, st);
}

ng_status dispatch(const ng_attention_args *a, void *stream, int backward) {
    NG_TRY(ng_attention_check(a, backward));
    NG_TRY(grid_ok(a, NG_MAX(a->Hq, a->Hkv)));
    if (a->B == 0 || (a->L == 0 && !backward) || (a->L == 0 && a->S == 0)) return NG_OK;
    ng_attention_args n = *a;
    if (n.mask_kind == NG_MASK_NONE) n.mask = nullptr;
    cudaStream_t st = (cudaStream_t)stream;
    switch (a->dtype) {
    case NG_F32: return dispatch_nt<NG_F32>(&n, st, backward);
    case NG_F16: return dispatch_nt<NG_F16>(&n, st, backward);
    case NG_BF16: return dispatch_nt<NG_BF16>(&n, st, backward);
    case NG_F64: return NG_ERR_DTYPE;
    }
    return NG_ERR_DTYPE;
}

} // namespace

extern "C" ng_status ng_attention_fwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 0);
}

extern "C" ng_status ng_attention_bwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 1);
}
