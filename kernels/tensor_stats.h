/*
 * kernels/tensor_stats.h - non-finite census of one tensor in one pass:
 * NaN / +Inf / -Inf counts, max |x| and min non-zero |x| over the finite
 * values (definitions and exactness: tensor_stats_math.h), written into one
 * slot of a caller-owned stats buffer.
 *
 * The tensor is given by its data pointer, sizes and element strides, up to
 * NG_TS_MAX_DIMS dimensions, so a transposed or sliced view is read in place.
 * Strides may be 0 (expanded views: an element is counted once per position).
 * ng_ts_coalesce merges dimensions that are contiguous with each other and
 * drops size-1 ones first; the op layer calls it and makes a tensor
 * contiguous only when more than NG_TS_MAX_DIMS dimensions remain.
 *
 * Output: counts points at the slot's NG_TS_NCOUNTS int64 values and values
 * at its NG_TS_NVALUES fp64 values; both are overwritten (an empty tensor
 * gives 0, 0, 0 / 0, +inf).
 */
#ifndef NG_KERNELS_TENSOR_STATS_H
#define NG_KERNELS_TENSOR_STATS_H

#include "kernels/common.h"
#include "kernels/tensor_stats_math.h"

#define NG_TS_MAX_DIMS 8

typedef struct ng_tensor_stats_args {
    ng_dtype dtype;
    const void *x;                   /* element (0, ..., 0) */
    int64_t ndim;                    /* 0 .. NG_TS_MAX_DIMS (0: a scalar) */
    int64_t sizes[NG_TS_MAX_DIMS];   /* >= 0 */
    int64_t strides[NG_TS_MAX_DIMS]; /* in elements, >= 0 */
    int64_t *counts;                 /* [NG_TS_NCOUNTS] */
    double *values;                  /* [NG_TS_NVALUES] */
} ng_tensor_stats_args;

/* Merge adjacent dimensions that are contiguous with each other and drop
 * dimensions of size 1, in place, for any ndim (up to 64). A tensor with a
 * zero size becomes one dimension of size 0. Returns the new ndim. */
static inline int64_t ng_ts_coalesce(int64_t ndim, int64_t *sizes, int64_t *strides) {
    int64_t out = 0;
    for (int64_t d = 0; d < ndim; d++) {
        if (sizes[d] == 0) {
            sizes[0] = 0;
            strides[0] = 1;
            return 1;
        }
    }
    for (int64_t d = 0; d < ndim; d++) {
        if (sizes[d] == 1) continue;
        if (out > 0 && strides[out - 1] == strides[d] * sizes[d]) {
            sizes[out - 1] *= sizes[d];
            strides[out - 1] = strides[d];
        } else {
            sizes[out] = sizes[d];
            strides[out] = strides[d];
            out++;
        }
    }
    return out;
}

/* CPU. par may be NULL (serial); the result does not depend on it. */
NG_EXTERN_C ng_status ng_tensor_stats(const ng_tensor_stats_args *a, ng_parallel_fn par);

/* CUDA (kernels/tensor_stats.cu): x, counts and values are device pointers;
 * stream is a cudaStream_t. No host synchronisation, no allocation. fp64 is
 * supported. */
NG_EXTERN_C ng_status ng_tensor_stats_cuda(const ng_tensor_stats_args *a, void *stream);

#endif /* NG_KERNELS_TENSOR_STATS_H */
