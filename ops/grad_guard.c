/*
 * ops/grad_guard.c - torch.ops.nanguard gradient guard: fused unscale,
 * NaN/Inf check, global norm and clip (kernels/grad_guard.h).
 *
 * Schemas (ops/ops.h, NG_GRAD_GUARD_SCHEMAS):
 *   grad_guard_reduce(Tensor[] grads, Tensor inv_scale, float norm_type) -> Tensor stats
 *   grad_guard_apply_(Tensor(a!)[] grads, Tensor inv_scale, Tensor stats,
 *                     Tensor(b!) found_inf, float max_norm, float norm_type) -> Tensor total_norm
 *   fused_unscale_clip_(Tensor(a!)[] grads, Tensor inv_scale, Tensor(b!) found_inf,
 *                       float max_norm, float norm_type) -> (Tensor total_norm, Tensor stats)
 *
 * stats is a float64 [4] tensor on the gradients' device, laid out as
 * kernels/grad_guard_math.h documents (sum of squares or max |g|, NaN count,
 * Inf count, index of the first offending tensor or -1). The two-pass ops let
 * the caller combine stats across calls, dtype groups and ranks in between;
 * fused_unscale_clip_ is both passes on one list. total_norm is a 0-dim
 * float32 tensor (float64 for float64 gradients).
 *
 * One call takes one dtype on one device; every gradient must be contiguous
 * (they are written in place). inv_scale and found_inf are float32 tensors of
 * one element on the same device. norm_type is 2.0 or inf. The Python layer
 * (python/nanguard/grad_guard.py) groups lists by device and dtype.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/grad_guard.h"
#include "ops/ops.h"

#define GG_OP "nanguard::fused_unscale_clip_"
#define GG_REDUCE_OP "nanguard::grad_guard_reduce"
#define GG_APPLY_OP "nanguard::grad_guard_apply_"

/* The Tensor[] argument and what the kernels need of it. Every array lives
 * in the frame (handles owned by it, the rest frame scratch), so lists of any
 * length are released on every path, errors included. */
typedef struct gg_list {
    size_t n;
    AtenTensorHandle *h;
    ng_tensor *t;
    const void **cptrs; /* every gradient, for pass 1 */
    void **ptrs;        /* the same, writable: NULL for the read-only op */
    int64_t *numels;
    ng_dtype dtype;
    ng_tensor scale; /* inv_scale: the list's device, also for an empty list */
} gg_list;

static ng_gg_norm gg_norm_arg(ng_frame *f, double norm_type) {
    if (norm_type == 2.0) return NG_GG_NORM_2;
    if (norm_type == (double)INFINITY) return NG_GG_NORM_INF;
    ng_fail(f, "norm_type must be 2.0 or inf, got %g", norm_type);
}

/* A float32 one-element tensor on the device of inv_scale; torch_dtype is
 * the dtype code ng_view_raw returned for it. */
static void gg_check_scalar(ng_frame *f, const ng_tensor *ref, const ng_tensor *t,
                            int32_t torch_dtype, const char *name) {
    if (torch_dtype != aoti_torch_dtype_float32() || t->numel != 1)
        ng_fail(f, "%s must be a float32 tensor with one element (got %s, %lld elements)", name,
                ng_torch_dtype_name(torch_dtype), (long long)t->numel);
    ng_check_device_dtype(f, t, name);
    if (ref) ng_check_same_device(f, ref, "inv_scale", t, name);
}

/* The Tensor[] argument `grads` into l, validated against `inv_scale`.
 * `mut`: the op writes the gradients. */
static void gg_read_list(ng_frame *f, gg_list *l, bool mut) {
    size_t len = ng_arg_list(f, &l->h);
    l->t = (ng_tensor *)ng_frame_calloc(f, len, sizeof *l->t);
    l->cptrs = (const void **)ng_frame_calloc(f, len, sizeof *l->cptrs);
    l->ptrs = mut ? (void **)ng_frame_calloc(f, len, sizeof *l->ptrs) : NULL;
    l->numels = (int64_t *)ng_frame_calloc(f, len, sizeof *l->numels);
    l->n = len;

    const int32_t sdt = ng_view_raw(f, ng_arg_tensor(f, "inv_scale"), "inv_scale", &l->scale);
    gg_check_scalar(f, NULL, &l->scale, sdt, "inv_scale");
    l->dtype = NG_F32;
    for (size_t k = 0; k < len; k++) {
        ng_tensor *t = &l->t[k];
        if (mut)
            ng_view_mut(f, l->h[k], "grads", t);
        else
            ng_view(f, l->h[k], "grads", t);
        ng_check_device_dtype(f, t, "grads");
        ng_check_same_device(f, &l->scale, "inv_scale", t, "grads");
        if (k == 0) l->dtype = t->dtype;
        if (t->dtype != l->dtype)
            ng_fail(f,
                    "grads must all have one dtype (tensor 0 is %s, tensor %zu is %s); group "
                    "them by dtype",
                    ng_dtype_name(l->dtype), k, ng_dtype_name(t->dtype));
        if (!ng_is_contiguous(t))
            ng_fail(f, "grads[%zu] must be contiguous%s", k,
                    mut ? " (it is updated in place)" : "");
        l->cptrs[k] = t->data;
        if (mut) l->ptrs[k] = t->mut;
        l->numels[k] = t->numel;
    }
    ng_device_guard(f, &l->scale);
}

static void gg_check_stats(ng_frame *f, const gg_list *l, const ng_tensor *st) {
    ng_check_same_device(f, &l->scale, "inv_scale", st, "stats");
    if (st->dtype != NG_F64 || st->numel != NG_GG_NSTATS || !ng_is_contiguous(st))
        ng_fail(f,
                "stats must be a contiguous float64 tensor of %d elements, as "
                "grad_guard_reduce returns",
                (int)NG_GG_NSTATS);
}

static ng_dtype gg_norm_dtype(const gg_list *l) { return l->dtype == NG_F64 ? NG_F64 : NG_F32; }

/* Pass 1 into a new float64 [4] tensor. */
static AtenTensorHandle gg_reduce(ng_frame *f, gg_list *l, ng_gg_norm norm) {
    int64_t four = NG_GG_NSTATS;
    AtenTensorHandle st =
        ng_empty(f, 1, &four, NG_F64, l->scale.device_type, l->scale.device_index);
    ng_tensor sv;
    ng_view_mut(f, st, "stats", &sv);
    const float *s = (const float *)l->scale.data;
#ifdef NG_BUILD_CUDA
    int64_t bytes = ng_grad_guard_cuda_workspace_bytes(l->numels, (int64_t)l->n);
    int64_t words = NG_MAX(NG_CEIL_DIV(bytes, 8), 1);
    AtenTensorHandle ws =
        ng_empty(f, 1, &words, NG_F64, l->scale.device_type, l->scale.device_index);
    ng_tensor wv;
    ng_view_mut(f, ws, "workspace", &wv);
    NG_KERNEL_CHECK(f, ng_grad_guard_reduce_cuda((const void *const *)l->cptrs, l->numels,
                                                 (int64_t)l->n, l->dtype, s, norm, (double *)sv.mut,
                                                 wv.mut, words * 8,
                                                 ng_cuda_current_stream(f, l->scale.device_index)));
#else
    NG_KERNEL_CHECK(f,
                    ng_grad_guard_reduce((const void *const *)l->cptrs, l->numels, (int64_t)l->n,
                                         l->dtype, s, norm, (double *)sv.mut, ng_torch_parallel));
#endif
    return st;
}

/* Pass 2; returns the 0-dim total norm. */
static AtenTensorHandle gg_apply(ng_frame *f, gg_list *l, const ng_tensor *stats,
                                 const ng_tensor *found_inf, double max_norm, ng_gg_norm norm) {
    AtenTensorHandle tn =
        ng_empty(f, 0, NULL, gg_norm_dtype(l), l->scale.device_type, l->scale.device_index);
    ng_tensor tv;
    ng_view_mut(f, tn, "total_norm", &tv);
    const float *s = (const float *)l->scale.data;
#ifdef NG_BUILD_CUDA
    NG_KERNEL_CHECK(f, ng_grad_guard_apply_cuda(l->ptrs, l->numels, (int64_t)l->n, l->dtype, s,
                                                (const double *)stats->data, max_norm, norm,
                                                (float *)found_inf->mut, tv.mut, gg_norm_dtype(l),
                                                ng_cuda_current_stream(f, l->scale.device_index)));
#else
    NG_KERNEL_CHECK(f, ng_grad_guard_apply(l->ptrs, l->numels, (int64_t)l->n, l->dtype, s,
                                           (const double *)stats->data, max_norm, norm,
                                           (float *)found_inf->mut, tv.mut, gg_norm_dtype(l),
                                           ng_torch_parallel));
#endif
    return tn;
}

static void gg_check_max_norm(ng_frame *f, double max_norm) {
    if (!(max_norm >= 0.0))
        ng_fail(f, "max_norm must be >= 0 (inf for no clipping), got %g", max_norm);
}

/* grad_guard_reduce(Tensor[] grads, Tensor inv_scale, float norm_type) -> Tensor */
static void gg_reduce_boxed(StableIValue *stack, uint64_t na, uint64_t no) {
    ng_frame f;
    ng_frame_init(&f, GG_REDUCE_OP);
    ng_take_args(&f, "grad_guard_reduce", stack, na, no);
    gg_list l = {0};
    gg_read_list(&f, &l, false);
    ng_gg_norm norm = gg_norm_arg(&f, ng_arg_float(&f, "norm_type"));
    AtenTensorHandle st = gg_reduce(&f, &l, norm);
    ng_ret_tensor(&f, stack, 0, st);
    ng_frame_release(&f);
}

/* grad_guard_apply_(grads, inv_scale, stats, found_inf, max_norm, norm_type) -> Tensor */
static void gg_apply_boxed(StableIValue *stack, uint64_t na, uint64_t no) {
    ng_frame f;
    ng_frame_init(&f, GG_APPLY_OP);
    ng_take_args(&f, "grad_guard_apply_", stack, na, no);
    gg_list l = {0};
    gg_read_list(&f, &l, true);
    ng_tensor st, fi;
    ng_view(&f, ng_arg_tensor(&f, "stats"), "stats", &st);
    const int32_t fdt = ng_view_raw_mut(&f, ng_arg_tensor(&f, "found_inf"), "found_inf", &fi);
    double max_norm = ng_arg_float(&f, "max_norm");
    ng_gg_norm norm = gg_norm_arg(&f, ng_arg_float(&f, "norm_type"));
    gg_check_stats(&f, &l, &st);
    gg_check_scalar(&f, &l.scale, &fi, fdt, "found_inf");
    gg_check_max_norm(&f, max_norm);
    AtenTensorHandle tn = gg_apply(&f, &l, &st, &fi, max_norm, norm);
    ng_ret_tensor(&f, stack, 0, tn);
    ng_frame_release(&f);
}

/* fused_unscale_clip_(grads, inv_scale, found_inf, max_norm, norm_type) -> (Tensor, Tensor) */
static void gg_fused_boxed(StableIValue *stack, uint64_t na, uint64_t no) {
    ng_frame f;
    ng_frame_init(&f, GG_OP);
    ng_take_args(&f, "fused_unscale_clip_", stack, na, no);
    gg_list l = {0};
    gg_read_list(&f, &l, true);
    ng_tensor fi;
    const int32_t fdt = ng_view_raw_mut(&f, ng_arg_tensor(&f, "found_inf"), "found_inf", &fi);
    double max_norm = ng_arg_float(&f, "max_norm");
    ng_gg_norm norm = gg_norm_arg(&f, ng_arg_float(&f, "norm_type"));
    gg_check_scalar(&f, &l.scale, &fi, fdt, "found_inf");
    gg_check_max_norm(&f, max_norm);
    AtenTensorHandle st = gg_reduce(&f, &l, norm);
    ng_tensor sv;
    ng_view(&f, st, "stats", &sv);
    AtenTensorHandle tn = gg_apply(&f, &l, &sv, &fi, max_norm, norm);
    ng_ret_tensor(&f, stack, 0, tn);
    ng_ret_tensor(&f, stack, 1, st);
    ng_frame_release(&f);
}

void ng_register_grad_guard(ng_registrar *r) {
    NG_GRAD_GUARD_SCHEMAS(NG_DEF_EACH)
    ng_impl(r, "grad_guard_reduce", gg_reduce_boxed);
    ng_impl(r, "grad_guard_apply_", gg_apply_boxed);
    ng_impl(r, "fused_unscale_clip_", gg_fused_boxed);
}
