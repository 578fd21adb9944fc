/*
 * kernels/attention_bwd_pre.cu - the pre-kernels of safe_sdpa's CUDA
 * backward, launched before either backward path (SIMT or tensor-core)
 * when the caller gives a workspace (ng_attention_bwd_cuda_ws):
 *   dot:  D = rowsum(dout . out) of every query row, once, into the
 *         workspace: fp32 [B, Hq, L] contiguous, row (b, h, i) at
 *         (b Hq + h) L + i (the layout of lse), 4 B Hq L bytes; one warp per
 *         row, row_dot. Without a workspace (ng_attention_bwd_cuda, which
 *         allocates nothing) it is not launched and the backward kernels
 *         compute D themselves with the same row_dot, per staged query tile
 *         (dk / dv) or per block (dq). Every backward kernel takes the
 *         source of D as a template flag (WsD), so that neither
 *         instantiation carries the other's registers.
 *   live: with a padding mask, one int per 64-key block of each kv head
 *         after D: whether any query head of the group sees a key of it;
 *         both dk / dv kernels write dk = dv = 0 for a block that none
 *         does, computing nothing.
 */
#include "kernels/attention_bwd.cuh"

namespace ng_attn_cu {
namespace {

/* The pre-kernel: one warp per query row of B Hq L (row = (b Hq + h) L + i),
 * kWarps rows a block, D into dsum[row]. Reads dout and out through their
 * strides, as the backward kernels do. */
template <ng_dtype T>
static __global__ void __launch_bounds__(kThreads)
    attention_bwd_dot_kernel(ng_attention_args a, float *dsum) {
    const int64_t rows = a.B * a.Hq * a.L, row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (row >= rows) return; /* the last block's spare warps */
    const int64_t i = row % a.L, bh = row / a.L, h = bh % a.Hq, b = bh / a.Hq;
    const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    const float d = row_dot<T>(a, gb, ob, i, true);
    if ((threadIdx.x & 31) == 0) dsum[row] = d;
}

/* The second pre-kernel, with a padding mask (one that does not depend on
 * the query: mask_stride[2] == 0): live[(b Hkv + hk) nkb + kb], nkb =
 * ceil(S / 64), says whether any of the keys [64 kb, 64 kb + 64) is
 * unmasked for any query head of kv head hk's group. A key that no query
 * sees has p = 0 and dS = 0 for every query, so the dk / dv kernels (SIMT
 * and tensor-core) give a block of such keys dk = dv = 0 without staging a
 * query tile. These are the 64-key blocks the CPU backward skips for every
 * query tile (rows_masked), so a NaN in dout reaches neither side's dk / dv
 * at those keys. One warp per entry, kWarps entries a block. */
static __global__ void __launch_bounds__(kThreads)
    attention_bwd_live_kernel(ng_attention_args a, int *live) {
    const int64_t nkb = NG_CEIL_DIV(a.S, (int64_t)kLiveKeys);
    const int64_t e = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (e >= a.B * a.Hkv * nkb) return; /* the last block's spare warps */
    const int64_t kb = e % nkb, bh = e / nkb, hk = bh % a.Hkv, b = bh / a.Hkv;
    const int64_t grp = a.Hq / a.Hkv;
    const int64_t heads = a.mask_stride[1] == 0 ? 1 : grp; /* [B, 1, 1, S]: one row for all */
    const int lane = threadIdx.x & 31;
    int any = 0;
    for (int64_t g = 0; g < heads && !any; g++) { /* any is the warp's: a uniform loop */
        const int64_t row = b * a.mask_stride[0] + (hk * grp + g) * a.mask_stride[1];
        /* unrolled: as a loop over j (to min(S, 64 kb + 64)) it spilled 8 B on sm_90 */
#pragma unroll
        for (int x = 0; x < kLiveKeys; x += 32) {
            const int64_t j = kb * kLiveKeys + x + lane;
            if (j < a.S)
                any |= ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype,
                                          row + j * a.mask_stride[3]) != -INFINITY;
        }
        any = __any_sync(kFull, any);
    }
    if (lane == 0) live[e] = any;
}

} // namespace

/* D of every query row into dsum (B Hq L floats), then with a padding mask
 * the key blocks' live flags after it. */
template <ng_dtype T>
ng_status bwd_pre(const ng_attention_args *a, cudaStream_t st, float *dsum) {
    int64_t nb = NG_CEIL_DIV(a->B * a->Hq * a->L, (int64_t)kWarps);
    if (nb > 2147483647LL) return NG_ERR_UNSUPPORTED; /* gridDim.x */
    NG_LAUNCH((attention_bwd_dot_kernel<T>), dim3((unsigned)nb), kThreads, 0, st, *a, dsum);
    NG_TRY(cuda_check());
    int *live = (int *)bwd_live(a, dsum); /* the caller's workspace, written here */
    if (!live) return NG_OK;
    nb = NG_CEIL_DIV(bwd_live_count(a), (int64_t)kWarps);
    if (nb > 2147483647LL) return NG_ERR_UNSUPPORTED;
    NG_LAUNCH((attention_bwd_live_kernel), dim3((unsigned)nb), kThreads, 0, st, *a, live);
    return cuda_check();
}

template ng_status bwd_pre<NG_F32>(const ng_attention_args *, cudaStream_t, float *);
template ng_status bwd_pre<NG_F16>(const ng_attention_args *, cudaStream_t, float *);
template ng_status bwd_pre<NG_BF16>(const ng_attention_args *, cudaStream_t, float *);

} // namespace ng_attn_cu
