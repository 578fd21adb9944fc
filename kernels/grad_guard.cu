/*
 * kernels/grad_guard.cu - CUDA gradient guard (see grad_guard.h for the two
 * passes and grad_guard_math.h for the arithmetic and the stats layout).
 *
 * Multi-tensor launches in the spirit of PyTorch's foreach kernels: the list
 * of gradients is cut into blocks of NG_GG_CHUNK elements (never crossing a
 * tensor), and a table of (pointer, numel, tensor index) descriptors travels
 * as a kernel argument, GG_BATCH descriptors per launch (16 KiB of
 * parameters: CUDA >= 12.1 allows 32 KiB on sm_70+). One thread block per
 * descriptor. 124M values (GPT-2 small) are 1900 blocks: 2 launches per pass.
 *
 * Pass 1: each block folds its elements (unscale in registers, fp64 sum of
 * exact squares or max |u|, NaN / Inf counts), reduces over the block with
 * warp shuffles in a fixed pattern and writes one 24-byte partial to the
 * workspace. A single block then reduces the partials, each thread striding
 * in a fixed order, into the stats vector. No float atomics: the stats are
 * bitwise reproducible for a given list of sizes.
 *
 * Pass 2: a 1-thread kernel writes the total norm and found_inf; the apply
 * kernels read the stats and inv_scale from device memory, compute the
 * coefficient per block (ng_gg_coef, the same function the CPU uses) and
 * return at once when the step must be skipped or the multiplier is 1.
 * Nothing is copied to the host.
 *
 * Loads are 16-byte vectors when a block's base pointer is 16-byte aligned
 * (block offsets are multiples of NG_GG_CHUNK, so that is the tensor's own
 * alignment), scalar otherwise.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <limits.h>

#include "kernels/grad_guard.h"
#include "kernels/cuda_launch.h"

#define GG_THREADS 512
#define GG_BATCH 1024

struct gg_desc {
    const void *ptr;
    int32_t n;      /* elements in this block, <= NG_GG_CHUNK */
    int32_t tensor; /* index in the call's list */
};

struct gg_batch {
    gg_desc d[GG_BATCH];
};

struct gg_part {
    double norm;
    int32_t nan_count;
    int32_t inf_count;
    int32_t tensor; /* tensor index of the block */
    int32_t pad;
};
static_assert(sizeof(gg_part) == NG_GG_CUDA_PARTIAL_BYTES, "partial layout");
static_assert(sizeof(gg_desc) == 16, "descriptor layout");

/* ---- element types --------------------------------------------------------- */

/* lim: the smallest |u| the type rounds to +-Inf (grad_guard_math.h). */
struct gg_f32 {
    typedef float S;
    static __device__ __forceinline__ float lim() { return INFINITY; }
    static __device__ __forceinline__ float ld(S v) { return v; }
    static __device__ __forceinline__ S st(float v) { return v; }
};
struct gg_f16 {
    typedef __half S;
    static __device__ __forceinline__ float lim() { return NG_GG_F16_OVERFLOW; }
    static __device__ __forceinline__ float ld(S v) { return __half2float(v); }
    static __device__ __forceinline__ S st(float v) { return __float2half_rn(v); }
};
struct gg_bf16 {
    typedef __nv_bfloat16 S;
    static __device__ __forceinline__ float lim() { return NG_GG_BF16_OVERFLOW; }
    static __device__ __forceinline__ float ld(S v) { return __bfloat162float(v); }
    static __device__ __forceinline__ S st(float v) { return __float2bfloat16_rn(v); }
};
struct gg_f64 {
    typedef double S;
    static __device__ __forceinline__ float lim() { return INFINITY; }
};

/* One element: an unscaled value at or past lim counts as Inf (an infinite
 * x too: its u is +-Inf, or NaN for s = 0; counted once either way). */
template <int P>
static __device__ __forceinline__ void gg_fold(float x, float s, float lim, double &acc, int &nan,
                                               int &inf) {
    const float u = ng_gg_unscale(x, s);
    acc = ng_gg_acc_f(acc, u, (ng_gg_norm)P);
    nan += ng_gg_isnan_f(x);
    inf += ng_gg_isinf_f(x) | (ng_gg_absf(u) >= lim);
}

template <int P>
static __device__ __forceinline__ void gg_fold(double x, float s, float, double &acc, int &nan,
                                               int &inf) {
    const double u = x * (double)s;
    acc = ng_gg_acc_d(acc, u, (ng_gg_norm)P);
    nan += ng_gg_isnan_d(x);
    inf += ng_gg_isinf_d(x) | ng_gg_isinf_d(u);
}

template <typename T>
struct gg_load {
    static __device__ __forceinline__ float f(typename T::S v) { return T::ld(v); }
};
template <>
struct gg_load<gg_f64> {
    static __device__ __forceinline__ double f(double v) { return v; }
};

/* x * coef rounded to the storage type; `wide` when coef is below FLT_MIN. */
template <typename T>
struct gg_scale {
    static __device__ __forceinline__ typename T::S f(typename T::S v, float cf, double cd,
                                                      bool wide) {
        float x = T::ld(v);
        return T::st(wide ? (float)((double)x * cd) : x * cf);
    }
};
template <>
struct gg_scale<gg_f64> {
    static __device__ __forceinline__ double f(double v, float, double cd, bool) { return v * cd; }
};

template <typename S>
struct __align__(16) gg_pack {
    S v[16 / sizeof(S)];
};

/* ---- block reduction ---------------------------------------------------------- */

template <int P>
static __device__ __forceinline__ void gg_block_reduce(double &acc, long long &nan, long long &inf,
                                                       int &bad) {
    NG_SHARED(double, s_acc, [32]);
    NG_SHARED(long long, s_nan, [32]);
    NG_SHARED(long long, s_inf, [32]);
    NG_SHARED(int, s_bad, [32]);
    const unsigned full = 0xffffffffu;
    for (int o = 16; o > 0; o >>= 1) {
        acc = ng_gg_combine(acc, __shfl_down_sync(full, acc, o), (ng_gg_norm)P);
        nan += __shfl_down_sync(full, nan, o);
        inf += __shfl_down_sync(full, inf, o);
        bad = min(bad, __shfl_down_sync(full, bad, o));
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) {
        s_acc[warp] = acc;
        s_nan[warp] = nan;
        s_inf[warp] = inf;
        s_bad[warp] = bad;
    }
    __syncthreads();
    if (warp == 0) {
        acc = lane < nwarps ? s_acc[lane] : 0.0;
        nan = lane < nwarps ? s_nan[lane] : 0;
        inf = lane < nwarps ? s_inf[lane] : 0;
        bad = lane < nwarps ? s_bad[lane] : INT_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            acc = ng_gg_combine(acc, __shfl_down_sync(full, acc, o), (ng_gg_norm)P);
            nan += __shfl_down_sync(full, nan, o);
            inf += __shfl_down_sync(full, inf, o);
            bad = min(bad, __shfl_down_sync(full, bad, o));
        }
    }
}

/* ---- kernels ------------------------------------------------------------------ */

/* Pass 1: one block per descriptor, one partial per block. */
template <typename T, int P>
static __global__ void __launch_bounds__(GG_THREADS)
    gg_reduce_kernel(const gg_batch b, const float *__restrict__ inv_scale,
                     gg_part *__restrict__ parts) {
    typedef typename T::S S;
    const gg_desc d = b.d[blockIdx.x];
    const S *x = (const S *)d.ptr;
    const float s = *inv_scale;
    const float lim = T::lim();
    double acc = 0.0;
    int nan = 0, inf = 0;
    const int V = 16 / (int)sizeof(S);
    int i0 = 0;
    if (((uintptr_t)x & 15u) == 0) {
        const gg_pack<S> *xv = (const gg_pack<S> *)x;
        int nv = d.n / V;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            gg_pack<S> pk = xv[i];
#pragma unroll
            for (int k = 0; k < V; k++) gg_fold<P>(gg_load<T>::f(pk.v[k]), s, lim, acc, nan, inf);
        }
        i0 = nv * V;
    }
    for (int i = i0 + threadIdx.x; i < d.n; i += blockDim.x)
        gg_fold<P>(gg_load<T>::f(x[i]), s, lim, acc, nan, inf);

    long long ln = nan, li = inf;
    int bad = INT_MAX;
    gg_block_reduce<P>(acc, ln, li, bad);
    if (threadIdx.x == 0) {
        gg_part out;
        out.norm = acc;
        out.nan_count = (int32_t)ln;
        out.inf_count = (int32_t)li;
        out.tensor = d.tensor;
        out.pad = 0;
        parts[blockIdx.x] = out;
    }
}

/* Pass 1, final: one block reduces every partial in a fixed order. It is
 * launched as a single block, and says so (min blocks 1): ptxas for sm_100
 * otherwise caps it at 32 registers for an occupancy it never has, and spills. */
template <int P>
static __global__ void __launch_bounds__(GG_THREADS, 1)
    gg_final_kernel(const gg_part *__restrict__ parts, int64_t m, double *__restrict__ stats) {
    double acc = 0.0;
    long long nan = 0, inf = 0;
    int bad = INT_MAX;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
        gg_part q = parts[i];
        acc = ng_gg_combine(acc, q.norm, (ng_gg_norm)P);
        nan += q.nan_count;
        inf += q.inf_count;
        if (q.nan_count + q.inf_count > 0) bad = min(bad, q.tensor);
    }
    gg_block_reduce<P>(acc, nan, inf, bad);
    if (threadIdx.x == 0) {
        stats[NG_GG_NORM] = acc;
        stats[NG_GG_NAN] = (double)nan;
        stats[NG_GG_INF] = (double)inf;
        stats[NG_GG_FIRST_BAD] = bad == INT_MAX ? -1.0 : (double)bad;
    }
}

/* Pass 2, first: the norm and found_inf, whatever the list holds. */
static __global__ void gg_finish_kernel(const float *__restrict__ inv_scale,
                                        const double *__restrict__ stats, double max_norm, int p,
                                        float *__restrict__ found_inf, void *total_norm,
                                        int norm_f64) {
    double coef;
    int ok = ng_gg_coef(stats, *inv_scale, max_norm, (ng_gg_norm)p, &coef);
    double tn = ng_gg_step_norm(stats, *inv_scale, (ng_gg_norm)p);
    if (total_norm) {
        if (norm_f64)
            *(double *)total_norm = tn;
        else
            *(float *)total_norm = (float)tn;
    }
    if (!ok && found_inf) *found_inf = 1.0f;
}

/* Pass 2: multiply in place when every value was finite. */
template <typename T>
static __global__ void __launch_bounds__(GG_THREADS)
    gg_apply_kernel(const gg_batch b, const float *__restrict__ inv_scale,
                    const double *__restrict__ stats, double max_norm, int p) {
    typedef typename T::S S;
    NG_SHARED(double, s_coef);
    NG_SHARED(int, s_ok);
    if (threadIdx.x == 0) {
        double c;
        s_ok = ng_gg_coef(stats, *inv_scale, max_norm, (ng_gg_norm)p, &c);
        s_coef = c;
    }
    __syncthreads();
    const double cd = s_coef;
    const float cf = (float)cd;
    const bool is64 = sizeof(S) == 8;
    if (!s_ok || (is64 ? cd == 1.0 : cf == 1.0f)) return; /* skipped step, or nothing to do */
    const bool wide = !is64 && cd != 0.0 && fabs(cd) < (double)FLT_MIN;

    const gg_desc d = b.d[blockIdx.x];
    S *x = (S *)d.ptr;
    const int V = 16 / (int)sizeof(S);
    int i0 = 0;
    if (((uintptr_t)x & 15u) == 0) {
        gg_pack<S> *xv = (gg_pack<S> *)x;
        int nv = d.n / V;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            gg_pack<S> pk = xv[i];
#pragma unroll
            for (int k = 0; k < V; k++) pk.v[k] = gg_scale<T>::f(pk.v[k], cf, cd, wide);
            xv[i] = pk;
        }
        i0 = nv * V;
    }
    for (int i = i0 + threadIdx.x; i < d.n; i += blockDim.x)
        x[i] = gg_scale<T>::f(x[i], cf, cd, wide);
}

/* ---- launchers ---------------------------------------------------------------- */

/* A launch's status, with the runtime's error recorded for the op's message
 * (ng_cuda_record clears it, so it is not reported again by a later call). */
static ng_status gg_check(cudaError_t e) { return ng_cuda_record(e); }

static ng_status gg_check_list(const void *const *grads, const int64_t *numels, int64_t n) {
    if (n < 0 || n > (int64_t)INT_MAX || (n > 0 && (!grads || !numels))) return NG_ERR_INVALID_ARG;
    for (int64_t t = 0; t < n; t++)
        if (numels[t] < 0 || (numels[t] > 0 && !grads[t])) return NG_ERR_INVALID_ARG;
    return NG_OK;
}

/* Walk the list in blocks of NG_GG_CHUNK, launching `launch(batch, count,
 * first_block)` for every GG_BATCH descriptors. */
template <typename Launch>
static ng_status gg_for_batches(const void *const *grads, const int64_t *numels, int64_t n,
                                size_t esize, Launch launch) {
    gg_batch b;
    int cnt = 0;
    int64_t first = 0;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t off = 0; off < numels[t]; off += NG_GG_CHUNK) {
            b.d[cnt].ptr = (const char *)grads[t] + (size_t)off * esize;
            b.d[cnt].n = (int32_t)NG_MIN(NG_GG_CHUNK, numels[t] - off);
            b.d[cnt].tensor = (int32_t)t;
            if (++cnt == GG_BATCH) {
                NG_TRY(launch(b, cnt, first));
                first += cnt;
                cnt = 0;
            }
        }
    }
    if (cnt > 0) NG_TRY(launch(b, cnt, first));
    return NG_OK;
}

template <typename T, int P>
static ng_status gg_reduce_typed(const void *const *grads, const int64_t *numels, int64_t n,
                                 const float *inv_scale, double *stats, gg_part *parts, int64_t m,
                                 cudaStream_t st) {
    NG_TRY(gg_for_batches(grads, numels, n, sizeof(typename T::S),
                          [&](const gg_batch &b, int cnt, int64_t first) -> ng_status {
                              NG_LAUNCH((gg_reduce_kernel<T, P>), cnt, GG_THREADS, 0, st, b,
                                        inv_scale, parts + first);
                              return gg_check(cudaGetLastError());
                          }));
    NG_LAUNCH((gg_final_kernel<P>), 1, GG_THREADS, 0, st, parts, m, stats);
    return gg_check(cudaGetLastError());
}

template <int P>
static ng_status gg_reduce_p(const void *const *grads, const int64_t *numels, int64_t n,
                             ng_dtype dtype, const float *inv_scale, double *stats, gg_part *parts,
                             int64_t m, cudaStream_t st) {
    switch (dtype) {
    case NG_F32:
        return gg_reduce_typed<gg_f32, P>(grads, numels, n, inv_scale, stats, parts, m, st);
    case NG_F16:
        return gg_reduce_typed<gg_f16, P>(grads, numels, n, inv_scale, stats, parts, m, st);
    case NG_BF16:
        return gg_reduce_typed<gg_bf16, P>(grads, numels, n, inv_scale, stats, parts, m, st);
    case NG_F64:
        return gg_reduce_typed<gg_f64, P>(grads, numels, n, inv_scale, stats, parts, m, st);
    }
    return NG_ERR_DTYPE;
}

extern "C" ng_status ng_grad_guard_reduce_cuda(const void *const *grads, const int64_t *numels,
                                               int64_t n_tensors, ng_dtype dtype,
                                               const float *inv_scale, ng_gg_norm norm,
                                               double *stats, void *workspace,
                                               int64_t workspace_bytes, void *stream) {
    if (!inv_scale || !stats || (norm != NG_GG_NORM_2 && norm != NG_GG_NORM_INF))
        return NG_ERR_INVALID_ARG;
    if (dtype != NG_F32 && dtype != NG_F16 && dtype != NG_BF16 && dtype != NG_F64)
        return NG_ERR_DTYPE;
    NG_TRY(gg_check_list(grads, numels, n_tensors));
    int64_t m = ng_grad_guard_num_chunks(numels, n_tensors);
    if (m > 0 && (!workspace || workspace_bytes < m * NG_GG_CUDA_PARTIAL_BYTES ||
                  ((uintptr_t)workspace & 7u) != 0))
        return NG_ERR_INVALID_ARG;
    cudaStream_t st = (cudaStream_t)stream;
    gg_part *parts = (gg_part *)workspace;
    if (norm == NG_GG_NORM_2)
        return gg_reduce_p<NG_GG_NORM_2>(grads, numels, n_tensors, dtype, inv_scale, stats, parts,
                                         m, st);
    return gg_reduce_p<NG_GG_NORM_INF>(grads, numels, n_tensors, dtype, inv_scale, stats, parts, m,
                                       st);
}

template <typename T>
static ng_status gg_apply_typed(void *const *grads, const int64_t *numels, int64_t n,
                                const float *inv_scale, const double *stats, double max_norm, int p,
                                cudaStream_t st) {
    return gg_for_batches((const void *const *)grads, numels, n, sizeof(typename T::S),
                          [&](const gg_batch &b, int cnt, int64_t) -> ng_status {
                              NG_LAUNCH((gg_apply_kernel<T>), cnt, GG_THREADS, 0, st, b, inv_scale,
                                        stats, max_norm, p);
                              return gg_check(cudaGetLastError());
                          });
}

extern "C" ng_status ng_grad_guard_apply_cuda(void *const *grads, const int64_t *numels,
                                              int64_t n_tensors, ng_dtype dtype,
                                              const float *inv_scale, const double *stats,
                                              double max_norm, ng_gg_norm norm, float *found_inf,
                                              void *total_norm, ng_dtype norm_dtype, void *stream) {
    if (!inv_scale || !stats || (norm != NG_GG_NORM_2 && norm != NG_GG_NORM_INF) ||
        !(max_norm >= 0.0) || (norm_dtype != NG_F32 && norm_dtype != NG_F64))
        return NG_ERR_INVALID_ARG;
    NG_TRY(gg_check_list((const void *const *)grads, numels, n_tensors));
    cudaStream_t st = (cudaStream_t)stream;
    NG_LAUNCH((gg_finish_kernel), 1, 1, 0, st, inv_scale, stats, max_norm, (int)norm, found_inf,
              total_norm, norm_dtype == NG_F64);
    NG_TRY(gg_check(cudaGetLastError()));
    switch (dtype) {
    case NG_F32:
        return gg_apply_typed<gg_f32>(grads, numels, n_tensors, inv_scale, stats, max_norm,
                                      (int)norm, st);
    case NG_F16:
        return gg_apply_typed<gg_f16>(grads, numels, n_tensors, inv_scale, stats, max_norm,
                                      (int)norm, st);
    case NG_BF16:
        return gg_apply_typed<gg_bf16>(grads, numels, n_tensors, inv_scale, stats, max_norm,
                                       (int)norm, st);
    case NG_F64:
        return gg_apply_typed<gg_f64>(grads, numels, n_tensors, inv_scale, stats, max_norm,
                                      (int)norm, st);
    }
    return NG_ERR_DTYPE;
}
