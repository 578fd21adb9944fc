/*
 * kernels/grad_guard.h - fused gradient guard for mixed-precision steps:
 * unscale, NaN/Inf check, global norm and clip in two memory passes.
 *
 *   pass 1  ng_grad_guard_reduce*: reads every gradient once and writes the
 *           stats vector (layout in grad_guard_math.h: sum of squares or max
 *           |g|, NaN count, Inf count, first offending tensor index).
 *   (the caller combines stats across dtype groups and ranks here)
 *   pass 2  ng_grad_guard_apply*: reads the combined stats; when every value
 *           was finite multiplies every gradient in place by
 *           inv_scale * min(1, max_norm / (norm + 1e-6)); otherwise leaves the
 *           gradients untouched and sets *found_inf = 1. Always writes the
 *           total norm of the unscaled gradients (NaN / Inf when non-finite).
 *
 * One dtype per call. Gradients are contiguous buffers given as a list of
 * (pointer, numel); numel may be 0 (the pointer is then ignored).
 *
 * CPU: fp32, fp16, bf16, fp64; inv_scale, stats, found_inf are host pointers.
 * CUDA: fp32, fp16, bf16 (and fp64, which the op layer does not expose);
 * inv_scale, stats, found_inf, the norm output and the workspace are device
 * pointers and nothing is synchronised with the host: the apply pass reads
 * its coefficient from device memory. The pointer and numel arrays
 * themselves are host arrays (they travel as kernel arguments).
 */
#ifndef NG_KERNELS_GRAD_GUARD_H
#define NG_KERNELS_GRAD_GUARD_H

#include "kernels/common.h"
#include "kernels/grad_guard_math.h"

/* ---- CPU ------------------------------------------------------------------ */

/* Pass 1. stats: NG_GG_NSTATS doubles, overwritten. par: NULL for serial.
 * The result does not depend on the number of threads par uses. */
NG_EXTERN_C ng_status ng_grad_guard_reduce(const void *const *grads, const int64_t *numels,
                                           int64_t n_tensors, ng_dtype dtype,
                                           const float *inv_scale, ng_gg_norm norm, double *stats,
                                           ng_parallel_fn par);

/* Pass 2. found_inf may be NULL; total_norm (one element of norm_dtype,
 * NG_F32 or NG_F64) may be NULL. */
NG_EXTERN_C ng_status ng_grad_guard_apply(void *const *grads, const int64_t *numels,
                                          int64_t n_tensors, ng_dtype dtype, const float *inv_scale,
                                          const double *stats, double max_norm, ng_gg_norm norm,
                                          float *found_inf, void *total_norm, ng_dtype norm_dtype,
                                          ng_parallel_fn par);

/* ---- CUDA (libnanguard_cuda; kernels/grad_guard.cu) ------------------------ */

/* Bytes of device workspace the CUDA reduce needs for these sizes: one
 * partial per NG_GG_CHUNK-element block. */
#define NG_GG_CUDA_PARTIAL_BYTES ((int64_t)24)

static inline int64_t ng_grad_guard_num_chunks(const int64_t *numels, int64_t n_tensors) {
    int64_t m = 0;
    for (int64_t t = 0; t < n_tensors; t++) m += NG_CEIL_DIV(numels[t], NG_GG_CHUNK);
    return m;
}

static inline int64_t ng_grad_guard_cuda_workspace_bytes(const int64_t *numels, int64_t n_tensors) {
    return ng_grad_guard_num_chunks(numels, n_tensors) * NG_GG_CUDA_PARTIAL_BYTES;
}

/* Pass 1 on the GPU: chunked multi-tensor launches writing one partial per
 * block into workspace (at least ng_grad_guard_cuda_workspace_bytes bytes,
 * 8-byte aligned), then one block that reduces the partials in a fixed order
 * into stats. stream is a cudaStream_t. */
NG_EXTERN_C ng_status ng_grad_guard_reduce_cuda(const void *const *grads, const int64_t *numels,
                                                int64_t n_tensors, ng_dtype dtype,
                                                const float *inv_scale, ng_gg_norm norm,
                                                double *stats, void *workspace,
                                                int64_t workspace_bytes, void *stream);

/* Pass 2 on the GPU. found_inf and total_norm may be NULL. */
NG_EXTERN_C ng_status ng_grad_guard_apply_cuda(void *const *grads, const int64_t *numels,
                                               int64_t n_tensors, ng_dtype dtype,
                                               const float *inv_scale, const double *stats,
                                               double max_norm, ng_gg_norm norm, float *found_inf,
                                               void *total_norm, ng_dtype norm_dtype, void *stream);

#endif /* NG_KERNELS_GRAD_GUARD_H */
