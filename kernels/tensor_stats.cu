/*
 * kernels/tensor_stats.cu - CUDA tensor_stats (see tensor_stats.h for the
 * interface and tensor_stats_math.h for the arithmetic, which is shared with
 * the CPU kernel: ng_ts_fold on the bit patterns).
 *
 * Launch math: TS_THREADS threads per block, grid-stride over the flat index
 * of the (coalesced) view, at most TS_MAX_GRID blocks and about
 * TS_ELEMS_PER_THREAD elements per thread before the grid is capped. A
 * strided element's offset is rebuilt from its flat index by div/mod over at
 * most NG_TS_MAX_DIMS sizes; the coalesced contiguous case (one dimension,
 * stride 1) skips that.
 *
 * Combine: warp shuffles, then one value per warp in shared memory, reduced
 * by warp 0 in a fixed order. A grid of one block (every tensor up to
 * TS_THREADS * TS_ELEMS_PER_THREAD elements) writes the slot directly: one
 * launch. A larger grid first clears the slot (a one-thread kernel), then
 * each block adds its counts with 64-bit integer atomics and folds its
 * magnitudes with atomicMax / atomicMin on the fp64 bit pattern, which for
 * non-negative doubles orders exactly as the values do (+inf, the "none" of
 * the minimum, is above every finite value). Integer atomics are exact and
 * max / min are order-independent, so the result is bitwise deterministic.
 * No host synchronisation and no allocation.
 */
#include <cuda_runtime.h>

#include "kernels/tensor_stats.h"
#include "kernels/cuda_launch.h"

#define TS_THREADS 256
#define TS_ELEMS_PER_THREAD 8
#define TS_MAX_GRID 1024

typedef unsigned long long ts_u64;

static __device__ __forceinline__ ts_u64 ts_double_bits(double d) {
    return (ts_u64)__double_as_longlong(d);
}

/* Element offset of flat index i in the view. */
static __device__ __forceinline__ int64_t ts_offset(const ng_tensor_stats_args &a, int64_t i) {
    int64_t off = 0;
    for (int64_t d = a.ndim - 1; d >= 0; d--) {
        const int64_t s = a.sizes[d];
        off += (i % s) * a.strides[d];
        i /= s;
    }
    return off;
}

/* Fold the counts and extreme bit patterns of a warp into lane 0. */
static __device__ __forceinline__ void ts_warp_reduce(long long &c0, long long &c1, long long &c2,
                                                      ts_u64 &mx, ts_u64 &mn) {
    const unsigned full = 0xffffffffu;
    for (int o = 16; o > 0; o >>= 1) {
        c0 += __shfl_down_sync(full, c0, o);
        c1 += __shfl_down_sync(full, c1, o);
        c2 += __shfl_down_sync(full, c2, o);
        const ts_u64 omx = __shfl_down_sync(full, mx, o), omn = __shfl_down_sync(full, mn, o);
        mx = omx > mx ? omx : mx;
        mn = omn < mn ? omn : mn;
    }
}

/* Reduce a partial over the block; the result is valid in thread 0. */
static __device__ void ts_block_reduce(ng_ts_part &p) {
    NG_SHARED(long long, s_cnt, [3][32]);
    NG_SHARED(ts_u64, s_max, [32]);
    NG_SHARED(ts_u64, s_min, [32]);
    long long c0 = p.nan, c1 = p.pinf, c2 = p.ninf;
    ts_u64 mx = p.max_bits, mn = p.min_bits;
    ts_warp_reduce(c0, c1, c2, mx, mn);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) {
        s_cnt[0][warp] = c0, s_cnt[1][warp] = c1, s_cnt[2][warp] = c2;
        s_max[warp] = mx, s_min[warp] = mn;
    }
    __syncthreads();
    if (warp == 0) {
        c0 = lane < nwarps ? s_cnt[0][lane] : 0;
        c1 = lane < nwarps ? s_cnt[1][lane] : 0;
        c2 = lane < nwarps ? s_cnt[2][lane] : 0;
        mx = lane < nwarps ? s_max[lane] : 0;
        mn = lane < nwarps ? s_min[lane] : NG_TS_NONE;
        ts_warp_reduce(c0, c1, c2, mx, mn);
        p.nan = c0, p.pinf = c1, p.ninf = c2;
        p.max_bits = mx, p.min_bits = mn;
    }
}

/* Clear the slot before a multi-block launch folds into it. */
static __global__ void ts_clear_kernel(int64_t *counts, double *values) {
    counts[NG_TS_NAN] = 0;
    counts[NG_TS_POSINF] = 0;
    counts[NG_TS_NEGINF] = 0;
    values[NG_TS_MAX_ABS] = 0.0;
    values[NG_TS_MIN_ABS] = __longlong_as_double((long long)0x7ff0000000000000ll); /* +inf */
}

template <int T>
static __global__ void __launch_bounds__(TS_THREADS)
    ts_kernel(const ng_tensor_stats_args a, int64_t numel, int contiguous) {
    const ng_dtype t = (ng_dtype)T;
    const uint64_t e = ng_ts_exp_mask(t), sign = ng_ts_sign_bit(t);
    ng_ts_part p = ng_ts_part_init();
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += step) {
        const int64_t off = contiguous ? i : ts_offset(a, i);
        ng_ts_fold(&p, ng_ts_bits_at(a.x, t, off), e, sign);
    }
    ts_block_reduce(p);
    if (threadIdx.x != 0) return;
    const double mx = ng_ts_max_abs(&p, t), mn = ng_ts_min_abs(&p, t);
    if (gridDim.x == 1) {
        a.counts[NG_TS_NAN] = p.nan;
        a.counts[NG_TS_POSINF] = p.pinf;
        a.counts[NG_TS_NEGINF] = p.ninf;
        a.values[NG_TS_MAX_ABS] = mx;
        a.values[NG_TS_MIN_ABS] = mn;
        return;
    }
    if (p.nan) atomicAdd((ts_u64 *)&a.counts[NG_TS_NAN], (ts_u64)p.nan);
    if (p.pinf) atomicAdd((ts_u64 *)&a.counts[NG_TS_POSINF], (ts_u64)p.pinf);
    if (p.ninf) atomicAdd((ts_u64 *)&a.counts[NG_TS_NEGINF], (ts_u64)p.ninf);
    atomicMax((ts_u64 *)&a.values[NG_TS_MAX_ABS], ts_double_bits(mx));
    atomicMin((ts_u64 *)&a.values[NG_TS_MIN_ABS], ts_double_bits(mn));
}

static ng_status launch_status(void) { return ng_cuda_record(cudaSuccess); }

extern "C" ng_status ng_tensor_stats_cuda(const ng_tensor_stats_args *a0, void *stream) {
    if (!a0 || !a0->counts || !a0->values) return NG_ERR_INVALID_ARG;
    if ((unsigned)a0->dtype > NG_BF16) return NG_ERR_DTYPE;
    if (a0->ndim < 0 || a0->ndim > NG_TS_MAX_DIMS) return NG_ERR_INVALID_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    ng_tensor_stats_args a = *a0;
    int64_t numel = 1;
    for (int64_t d = 0; d < a.ndim; d++) {
        if (a.sizes[d] < 0) return NG_ERR_INVALID_ARG;
        numel *= a.sizes[d];
    }
    if (numel > 0 && !a.x) return NG_ERR_INVALID_ARG;
    a.ndim = ng_ts_coalesce(a.ndim, a.sizes, a.strides);
    if (a.ndim == 0) {
        a.ndim = 1;
        a.sizes[0] = 1;
        a.strides[0] = 1;
    }
    const int contiguous = a.ndim == 1 && a.strides[0] == 1;
    const int64_t per_block = (int64_t)TS_THREADS * TS_ELEMS_PER_THREAD;
    const unsigned grid =
        (unsigned)NG_MAX((int64_t)1, NG_MIN((int64_t)TS_MAX_GRID, NG_CEIL_DIV(numel, per_block)));
    if (grid > 1) {
        NG_LAUNCH((ts_clear_kernel), 1, 1, 0, s, a.counts, a.values);
        NG_TRY(launch_status());
    }
    switch (a.dtype) {
    case NG_F32:
        NG_LAUNCH((ts_kernel<NG_F32>), grid, TS_THREADS, 0, s, a, numel, contiguous);
        break;
    case NG_F64:
        NG_LAUNCH((ts_kernel<NG_F64>), grid, TS_THREADS, 0, s, a, numel, contiguous);
        break;
    case NG_F16:
        NG_LAUNCH((ts_kernel<NG_F16>), grid, TS_THREADS, 0, s, a, numel, contiguous);
        break;
    case NG_BF16:
        NG_LAUNCH((ts_kernel<NG_BF16>), grid, TS_THREADS, 0, s, a, numel, contiguous);
        break;
    }
    return launch_status();
}
