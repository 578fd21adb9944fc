/*
 * kernels/layernorm.h - LayerNorm / RMSNorm over the last dimension.
 *
 * The input is viewed as rows x cols with contiguous rows (the op layer makes
 * it so). weight and bias are [cols] in the input dtype, or NULL; with
 * params_f32 set they are fp32 for fp16 / bf16 input (a model that keeps its
 * norms in fp32 while the rest runs in 16 bits), applied in fp32 and never
 * rounded to 16 bits, and dweight / dbias are fp32 too. Statistics (mean,
 * rstd; [rows]) are fp32, or fp64 for fp64 input. Math and the guarantees it
 * gives are in layernorm_math.h.
 */
#ifndef NG_KERNELS_LAYERNORM_H
#define NG_KERNELS_LAYERNORM_H

#include "kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ng_layernorm_args {
    ng_dtype dtype; /* of x, y, dy, dx; and of weight, bias, dweight, dbias unless params_f32 */
    int64_t rows, cols;
    int rms;            /* 1: RMSNorm (no mean, no bias) */
    double eps;         /* >= 0 */
    const void *x;      /* [rows, cols] */
    const void *weight; /* [cols] or NULL */
    const void *bias;   /* [cols] or NULL; ignored for RMSNorm */
    void *mean;         /* [rows], fp32 (fp64 for fp64); unused (may be NULL) for RMSNorm */
    void *rstd;         /* [rows], fp32 (fp64 for fp64) */
    /* forward */
    void *y; /* [rows, cols] */
    /* backward */
    const void *dy; /* [rows, cols] */
    void *dx;       /* [rows, cols] or NULL */
    void *dweight;  /* [cols] or NULL */
    void *dbias;    /* [cols] or NULL */
    /* 1: weight, bias, dweight and dbias are fp32 (allowed for fp16, bf16 and
     * fp32 input; fp64 input gives NG_ERR_DTYPE). 0: they have dtype. Last,
     * so that an initializer that omits it means 0. */
    int params_f32;
} ng_layernorm_args;

/* The dtype of weight, bias, dweight and dbias. */
NG_HD ng_dtype ng_layernorm_param_dtype(const ng_layernorm_args *a) {
    return a->params_f32 ? NG_F32 : a->dtype;
}

/* Size, dtype and flag checks shared by the CPU kernels and the CUDA
 * launchers; backward adds the backward-only rules (RMSNorm has no bias). */
ng_status ng_layernorm_check(const ng_layernorm_args *a, int backward);

/* CPU. par may be NULL (serial). */
ng_status ng_layernorm_fwd(const ng_layernorm_args *a, ng_parallel_fn par);
ng_status ng_layernorm_bwd(const ng_layernorm_args *a, ng_parallel_fn par);

/* CUDA launchers (kernels/layernorm.cu); stream is a cudaStream_t. fp64 is
 * not supported on CUDA (NG_ERR_DTYPE). */
ng_status ng_layernorm_fwd_cuda(const ng_layernorm_args *a, void *stream);
ng_status ng_layernorm_bwd_cuda(const ng_layernorm_args *a, void *stream);
/* The backward with a device workspace (4-byte aligned) of at least
 * ng_layernorm_bwd_cuda_workspace_bytes(a) bytes, which lets the dweight /
 * dbias sums run in parallel over chunks of rows (fp32 partials combined in
 * a fixed order). Without one (NULL, as ng_layernorm_bwd_cuda passes) they
 * run in parallel over columns only. The result is deterministic either way,
 * and the two differ only in fp32 summation order. */
ng_status ng_layernorm_bwd_cuda_ws(const ng_layernorm_args *a, void *workspace,
                                   int64_t workspace_bytes, void *stream);
/* 0 when no dweight / dbias is asked for, or the rows fit one chunk. */
int64_t ng_layernorm_bwd_cuda_workspace_bytes(const ng_layernorm_args *a);

#ifdef __cplusplus
}
#endif

#endif /* NG_KERNELS_LAYERNORM_H */
