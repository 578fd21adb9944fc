/*
 * kernels/attention.cu - safe_sdpa on CUDA: the C launchers of
 * kernels/attention.h. Tiled attention with an online softmax, fp32
 * accumulation and the per-score math of attention_math.h, in two
 * implementations of the same three kernels (forward, dk/dv, dq) and of
 * the decode forward (L <= 16 rows against S >= 1 keys, with its split-KV
 * combine):
 * - tensor cores (mma.sync m16n8k16) for fp16 / bf16 with E == Ev in
 *   {64, 128} on sm_80+;
 * - SIMT for everything else (fp32, other head dims up to 256, E != Ev).
 * Each algorithm has a file of its own (attention_cuda.cuh lists them);
 * this one checks the arguments and the workspace, picks the kernel
 * (dispatch) and holds the host helpers every launcher uses.
 */
#include "kernels/attention_cuda.cuh"

namespace ng_attn_cu {

ng_status cuda_check() { return ng_cuda_record(cudaSuccess); }

int current_device() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError(); /* leave no error behind for an unrelated check */
        return -1;
    }
    return dev;
}

namespace {

/* An attribute of the current device, cached per device in `cache` (0: not
 * read yet); 0 when it cannot be read (the error is cleared). */
int device_attr(cudaDeviceAttr attr, std::atomic<int> (&cache)[kMaxDevices]) {
    const int dev = current_device();
    if (dev < 0) return 0;
    if (dev < kMaxDevices) {
        const int c = cache[dev].load(std::memory_order_relaxed);
        if (c) return c;
    }
    int v = 0;
    if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (dev < kMaxDevices) cache[dev].store(v, std::memory_order_relaxed);
    return v;
}

} // namespace

int device_major() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrComputeCapabilityMajor, cache);
}

int device_optin_smem() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, cache);
}

ng_status fold_grid(int64_t nblk, int64_t heads, int64_t batch, dim3 *grid) {
    const int64_t n = nblk * heads * batch;
    if (nblk <= 0 || heads <= 0 || batch <= 0) return NG_ERR_INVALID_ARG;
    if (n / batch / heads != nblk || n > 2147483647LL) return NG_ERR_UNSUPPORTED; /* gridDim.x */
    *grid = dim3((unsigned)n);
    return NG_OK;
}

int64_t bwd_live_count(const ng_attention_args *a) {
    if (a->mask_kind == NG_MASK_NONE || a->mask_stride[2] != 0 || a->Hkv <= 0 || a->S <= 0)
        return 0;
    return a->B * a->Hkv * NG_CEIL_DIV(a->S, (int64_t)kLiveKeys);
}

const int *bwd_live(const ng_attention_args *a, const float *ws) {
    return ws && bwd_live_count(a) > 0 ? (const int *)(ws + a->B * a->Hq * a->L) : nullptr;
}

int device_sms() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrMultiProcessorCount, cache);
}

int rows_aligned(const void *p, const int64_t stride[3], int64_t el) {
    const int64_t w = 16 / el;
    return (uintptr_t)p % 16 == 0 && stride[0] % w == 0 && stride[1] % w == 0 && stride[2] % w == 0;
}

int rows_aligned16(const void *p, const int64_t stride[3]) { return rows_aligned(p, stride, 2); }

int mma_eligible(const ng_attention_args *a) {
    if ((a->dtype != NG_F16 && a->dtype != NG_BF16) || a->E != a->Ev || (a->E != 64 && a->E != 128))
        return 0;
    return device_major() >= 8;
}

namespace {

/* The decode kernels for a forward of the decode shape, then the tensor
 * cores where they apply, else SIMT. ws: the forward's split-KV workspace,
 * or the backward's D (the pre-kernels run first); NULL without one. */
template <ng_dtype T>
ng_status dispatch_t(const ng_attention_args *a, cudaStream_t st, int backward, float *ws) {
    if (backward && ws) NG_TRY(bwd_pre<T>(a, st, ws));
    if (!backward && decode_shape(a)) return decode<T>(a, st, ws);
    if constexpr (T != NG_F32) {
        if (mma_eligible(a)) {
            const int vec = rows_aligned16(a->q, a->q_stride) &&
                            rows_aligned16(a->k, a->k_stride) &&
                            rows_aligned16(a->v, a->v_stride) &&
                            (!backward || rows_aligned16(a->dout, a->dout_stride));
            return backward ? mma_bwd<T>(a, st, vec, ws) : mma_fwd<T>(a, st, vec);
        }
    }
    return backward ? simt_bwd<T>(a, st, ws) : simt_fwd<T>(a, st);
}

/* The backward's D: one fp32 per query row, [B, Hq, L], then with a
 * padding mask one int per 64-key block of each kv head, [B, Hkv,
 * ceil(S / 64)] (bwd_live_count); 0 where there is no row (or fp64, which has no
 * CUDA path). Shape and mask only: the args need not be checked yet. */
int64_t bwd_workspace_bytes(const ng_attention_args *a) {
    if (a->dtype == NG_F64 || a->B <= 0 || a->Hq <= 0 || a->L <= 0) return 0;
    return (int64_t)sizeof(float) * a->B * a->Hq * a->L + (int64_t)sizeof(int) * bwd_live_count(a);
}

ng_status dispatch(const ng_attention_args *a, void *stream, int backward, void *ws,
                   int64_t ws_bytes) {
    NG_TRY(ng_attention_check(a, backward));
    const int64_t need = backward ? bwd_workspace_bytes(a) : decode_workspace_bytes(a);
    if (ws && (ws_bytes < need || (uintptr_t)ws % alignof(float))) return NG_ERR_INVALID_ARG;
    if (a->B == 0 || (a->L == 0 && !backward) || (a->L == 0 && a->S == 0)) return NG_OK;
    ng_attention_args n = *a;
    if (n.mask_kind == NG_MASK_NONE) n.mask = nullptr;
    cudaStream_t st = (cudaStream_t)stream;
    float *w = need > 0 ? (float *)ws : nullptr;
    switch (a->dtype) {
    case NG_F32: return dispatch_t<NG_F32>(&n, st, backward, w);
    case NG_F16: return dispatch_t<NG_F16>(&n, st, backward, w);
    case NG_BF16: return dispatch_t<NG_BF16>(&n, st, backward, w);
    case NG_F64: return NG_ERR_DTYPE;
    }
    return NG_ERR_DTYPE;
}

} // namespace
} // namespace ng_attn_cu

using ng_attn_cu::bwd_workspace_bytes;
using ng_attn_cu::dispatch;

extern "C" ng_status ng_attention_fwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 0, nullptr, 0);
}

extern "C" ng_status ng_attention_fwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                              int64_t workspace_bytes, void *stream) {
    return dispatch(a, stream, 0, workspace, workspace_bytes);
}

extern "C" int64_t ng_attention_fwd_cuda_workspace_bytes(const ng_attention_args *a) {
    return a ? ng_attn_cu::decode_workspace_bytes(a) : 0;
}

extern "C" ng_status ng_attention_bwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 1, nullptr, 0);
}

extern "C" ng_status ng_attention_bwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                              int64_t workspace_bytes, void *stream) {
    return dispatch(a, stream, 1, workspace, workspace_bytes);
}

extern "C" int64_t ng_attention_bwd_cuda_workspace_bytes(const ng_attention_args *a) {
    return a ? bwd_workspace_bytes(a) : 0;
}
