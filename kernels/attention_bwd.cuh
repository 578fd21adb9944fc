/*
 * kernels/attention_bwd.cuh - the backward's per-score terms (p, dS) and
 * its D = rowsum(dout . out), shared by the SIMT and tensor-core backward
 * kernels and the D pre-kernel (attention_cuda.cuh lists the files).
 */
#ifndef NG_KERNELS_ATTENTION_BWD_CUH
#define NG_KERNELS_ATTENTION_BWD_CUH

#include "kernels/attention_cuda.cuh"

namespace ng_attn_cu {
namespace {

/* For one (query i, key j), from its raw dot products: p, pd = p times the
 * dropout factor, and dS (already times scale and the guard's derivative). */
struct bwd_terms {
    float p, pd, ds;
};

/* keep: the dropout factor of (i, j), 0 or 1 / (1 - dropout_p); 1 without
 * dropout. A pair whose probability is zero (a fully masked row or a row
 * past L, checked before the mask is read; a masked pair; a probability
 * that underflows) contributes exactly nothing, whatever NaN dout, out or v
 * hold: the rule the CPU kernel follows too (attention_cpu.inc). */
__device__ __forceinline__ bwd_terms bwd_score_keep(const ng_attention_args &a, float qk, float dp,
                                                    float lse, float D, int64_t b, int64_t h,
                                                    int64_t i, int64_t j, float keep) {
    bwd_terms o = {0.0f, 0.0f, 0.0f};
    if (lse == -INFINITY) return o;
    const float scale = (float)a.scale;
    const float raw = qk * scale;
    const float s = guarded_score(a, raw, b, h, i, j);
    if (s == -INFINITY) return o;
    const float p = expf(s - lse); /* NaN for every unmasked pair of a NaN row */
    if (p == 0.0f) return o;
    o.p = p;
    o.pd = p * keep;
    o.ds = p * (dp * keep - D) * scale *
           ng_attn_transform_grad_f32(raw, (float)a.max_score, (float)a.softcap);
    return o;
}

__device__ __forceinline__ bwd_terms bwd_score(const ng_attention_args &a, float qk, float dp,
                                               float lse, float D, int64_t b, int64_t h, int64_t i,
                                               int64_t j) {
    return bwd_score_keep(a, qk, dp, lse, D, b, h, i, j, dropout_scale(a, b, h, i, j));
}

/* D = dout . out of query row i of the (b, h) slice whose dout / out rows
 * start at gb / ob, over n columns (N when N > 0, a compile-time head dim),
 * in fp32: lane l adds columns l, l + 32, ... in order, then the warp's
 * butterfly sum; every lane gets the total (0 where !valid: a row past L).
 * The one computation of D, by the pre-kernel and by the kernels' in-kernel
 * path alike. Called by a whole warp. */
template <ng_dtype T, int N = 0>
__device__ __forceinline__ float row_dot(const ng_attention_args &a, const void *gb, const void *ob,
                                         int64_t i, bool valid) {
    const int n = N > 0 ? N : (int)a.Ev;
    float part = 0.0f;
    if (valid)
        for (int d = threadIdx.x & 31; d < n; d += 32)
            part += ld<T>(gb, i * a.dout_stride[2] + d) * ld<T>(ob, i * a.out_stride[2] + d);
    return warp_sum(part);
}

/* Row (b, h, i)'s D in the pre-kernel's workspace ([B, Hq, L], as lse). */
__device__ __forceinline__ float ws_d(const float *dsum, const ng_attention_args &a, int64_t b,
                                      int64_t h, int64_t i) {
    return dsum[(b * a.Hq + h) * a.L + i];
}

} // namespace
} // namespace ng_attn_cu

#endif
