/*
 * ops/layernorm.c - torch.ops.nanguard.stable_layernorm and its backward.
 *
 * Schemas (ops/ops.h, NG_LAYERNORM_SCHEMAS; no `Tensor?`: optional weight /
 * bias are overloads):
 *   stable_layernorm(Tensor input, float eps, bool rms) -> (Tensor out, Tensor mean, Tensor rstd)
 *   stable_layernorm.weight(input, weight, eps, rms)
 *   stable_layernorm.bias(input, bias, eps, rms)            LayerNorm only
 *   stable_layernorm.weight_bias(input, weight, bias, eps, rms)
 *   stable_layernorm_backward(grad_out, input, mean, rstd, rms, with_bias)
 *       -> (Tensor grad_input, Tensor grad_bias)
 *   stable_layernorm_backward.weight(grad_out, input, weight, mean, rstd, rms, with_bias)
 *       -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)
 *
 * Normalization is over the last dimension; mean / rstd have the leading
 * shape and are fp32 (fp64 for fp64 input). For RMSNorm mean is all zeros.
 * grad_bias is [cols] when with_bias is true and [0] otherwise.
 * weight / bias have the input's dtype or, for fp16 / bf16 input, fp32 (both
 * the same): fp32 parameters are applied in fp32, the output keeps the
 * input's dtype (as torch.nn.functional.layer_norm), and grad_weight /
 * grad_bias have weight's dtype (the input's in the overload without weight).
 * Non-contiguous inputs are copied to contiguous ones; outputs are contiguous.
 */
#include <math.h>

#include "kernels/layernorm.h"
#include "ops/ops.h"

#define LN_OP "nanguard::stable_layernorm"
#define LN_BWD_OP "nanguard::stable_layernorm_backward"

/* The parameters of a 16-bit input may be fp32 (applied in fp32, gradients
 * in fp32: a model that keeps its norms in fp32); otherwise, and for fp32 /
 * fp64 input, they have the input's dtype. */
static int param_dtype_ok(ng_dtype x, ng_dtype p) {
    return p == x || (p == NG_F32 && (x == NG_F16 || x == NG_BF16));
}

/* Check the input and an optional [cols] parameter on its device, in its
 * dtype or (16-bit input) fp32. */
static void check_param(ng_frame *f, const ng_tensor *x, const ng_tensor *p, const char *name) {
    ng_check_same_device(f, x, "input", p, name);
    if (!param_dtype_ok(x->dtype, p->dtype))
        ng_fail(f, "%s must have the dtype of input (%s)%s, got %s", name, ng_dtype_name(x->dtype),
                x->dtype == NG_F16 || x->dtype == NG_BF16 ? " or float32" : "",
                ng_dtype_name(p->dtype));
    if (p->ndim != 1 || p->sizes[0] != x->sizes[x->ndim - 1])
        ng_fail(f, "%s must have shape [%lld] (the last dimension of input), got %s%lld%s", name,
                (long long)x->sizes[x->ndim - 1], p->ndim == 1 ? "[" : "",
                (long long)(p->ndim == 1 ? p->sizes[0] : p->ndim), p->ndim == 1 ? "]" : " dims");
}

static void check_input(ng_frame *f, ng_tensor *x, double eps) {
    ng_check_device_dtype(f, x, "input");
    if (x->ndim < 1) ng_fail(f, "input must have at least one dimension");
    if (!(eps >= 0.0) || eps == (double)INFINITY)
        ng_fail(f, "eps must be a finite number >= 0, got %g", eps);
}

static ng_dtype stat_dtype(ng_dtype t) { return t == NG_F64 ? NG_F64 : NG_F32; }

/* Number of rows: the product of the leading dimensions (even when cols == 0). */
static int64_t leading_rows(const ng_tensor *x) {
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < x->ndim; d++) rows *= x->sizes[d];
    return rows;
}

/* Shared body of the four forward overloads; `name` is the overload's
 * schema name, whose arguments say whether there is a weight and a bias. */
static void ln_forward(StableIValue *stack, uint64_t na, uint64_t no, const char *name) {
    ng_frame f;
    ng_frame_init(&f, LN_OP);
    ng_take_args(&f, name, stack, na, no);
    const int has_w = ng_has_arg(&f, "weight"), has_b = ng_has_arg(&f, "bias");
    ng_tensor x, w = {0}, b = {0};
    ng_view(&f, ng_arg_tensor(&f, "input"), "input", &x);
    if (has_w) ng_view(&f, ng_arg_tensor(&f, "weight"), "weight", &w);
    if (has_b) ng_view(&f, ng_arg_tensor(&f, "bias"), "bias", &b);
    double eps = ng_arg_float(&f, "eps");
    int rms = ng_arg_bool(&f, "rms");
    check_input(&f, &x, eps);
    if (has_w) check_param(&f, &x, &w, "weight");
    if (has_b) {
        if (rms) ng_fail(&f, "bias is not supported with rms=True (RMSNorm has no bias)");
        check_param(&f, &x, &b, "bias");
        if (has_w && b.dtype != w.dtype)
            ng_fail(&f, "bias must have the dtype of weight (%s), got %s", ng_dtype_name(w.dtype),
                    ng_dtype_name(b.dtype));
    }
    ng_make_contiguous(&f, &x);
    if (has_w) ng_make_contiguous(&f, &w);
    if (has_b) ng_make_contiguous(&f, &b);
    ng_device_guard(&f, &x);

    const int64_t cols = x.sizes[x.ndim - 1];
    const int64_t rows = leading_rows(&x);
    AtenTensorHandle y = ng_empty_like(&f, &x);
    AtenTensorHandle mean =
        ng_empty(&f, x.ndim - 1, x.sizes, stat_dtype(x.dtype), x.device_type, x.device_index);
    AtenTensorHandle rstd =
        ng_empty(&f, x.ndim - 1, x.sizes, stat_dtype(x.dtype), x.device_type, x.device_index);
    ng_tensor yv, mv, rv;
    ng_view_mut(&f, y, "out", &yv);
    ng_view_mut(&f, mean, "mean", &mv);
    ng_view_mut(&f, rstd, "rstd", &rv);
    if (rms) NG_SHIM_CHECK(&f, aoti_torch_zero_(mean));

    ng_layernorm_args a = {
        .dtype = x.dtype,
        .rows = rows,
        .cols = cols,
        .rms = rms,
        .eps = eps,
        .x = x.data,
        .weight = has_w ? w.data : NULL,
        .bias = has_b ? b.data : NULL,
        .mean = mv.mut,
        .rstd = rv.mut,
        .y = yv.mut,
        .params_f32 = (has_w   ? w.dtype
                       : has_b ? b.dtype
                               : x.dtype) != x.dtype,
    };
#ifdef NG_BUILD_CUDA
    NG_KERNEL_CHECK(&f, ng_layernorm_fwd_cuda(&a, ng_cuda_current_stream(&f, x.device_index)));
#else
    NG_KERNEL_CHECK(&f, ng_layernorm_fwd(&a, ng_torch_parallel));
#endif
    ng_ret_tensor(&f, stack, 0, y);
    ng_ret_tensor(&f, stack, 1, mean);
    ng_ret_tensor(&f, stack, 2, rstd);
    ng_frame_release(&f);
}

static void ln_fwd_plain(StableIValue *s, uint64_t na, uint64_t no) {
    ln_forward(s, na, no, "stable_layernorm");
}
static void ln_fwd_w(StableIValue *s, uint64_t na, uint64_t no) {
    ln_forward(s, na, no, "stable_layernorm.weight");
}
static void ln_fwd_b(StableIValue *s, uint64_t na, uint64_t no) {
    ln_forward(s, na, no, "stable_layernorm.bias");
}
static void ln_fwd_wb(StableIValue *s, uint64_t na, uint64_t no) {
    ln_forward(s, na, no, "stable_layernorm.weight_bias");
}

/* Shared body of the two backward overloads. */
static void ln_backward(StableIValue *stack, uint64_t na, uint64_t no, const char *name) {
    ng_frame f;
    ng_frame_init(&f, LN_BWD_OP);
    ng_take_args(&f, name, stack, na, no);
    const int has_w = ng_has_arg(&f, "weight");
    ng_tensor dy, x, w = {0}, mean, rstd;
    ng_view(&f, ng_arg_tensor(&f, "grad_out"), "grad_out", &dy);
    ng_view(&f, ng_arg_tensor(&f, "input"), "input", &x);
    if (has_w) ng_view(&f, ng_arg_tensor(&f, "weight"), "weight", &w);
    ng_view(&f, ng_arg_tensor(&f, "mean"), "mean", &mean);
    ng_view(&f, ng_arg_tensor(&f, "rstd"), "rstd", &rstd);
    int rms = ng_arg_bool(&f, "rms");
    int with_bias = ng_arg_bool(&f, "with_bias");
    check_input(&f, &x, 0.0);
    ng_check_same_device(&f, &x, "input", &dy, "grad_out");
    ng_check_same_dtype(&f, &x, "input", &dy, "grad_out");
    if (dy.ndim != x.ndim || dy.numel != x.numel)
        ng_fail(&f, "grad_out must have the shape of input");
    for (int64_t d = 0; d < x.ndim; d++)
        if (dy.sizes[d] != x.sizes[d]) ng_fail(&f, "grad_out must have the shape of input");
    if (has_w) check_param(&f, &x, &w, "weight");
    const int64_t cols = x.sizes[x.ndim - 1];
    const int64_t rows = leading_rows(&x);
    const ng_tensor *stats[2] = {&mean, &rstd};
    const char *stat_names[2] = {"mean", "rstd"};
    for (int k = 0; k < 2; k++) {
        ng_check_same_device(&f, &x, "input", stats[k], stat_names[k]);
        if (stats[k]->dtype != stat_dtype(x.dtype) || stats[k]->numel != rows)
            ng_fail(&f, "%s must be the %s statistics of input (%s, one per row)", stat_names[k],
                    ng_dtype_name(stat_dtype(x.dtype)), stat_names[k]);
    }
    ng_make_contiguous(&f, &dy);
    ng_make_contiguous(&f, &x);
    if (has_w) ng_make_contiguous(&f, &w);
    ng_make_contiguous(&f, &mean);
    ng_make_contiguous(&f, &rstd);
    ng_device_guard(&f, &x);

    AtenTensorHandle dx = ng_empty_like(&f, &x);
    AtenTensorHandle dw = NULL;
    int64_t bias_len = with_bias ? cols : 0;
    /* the parameter gradients have the parameters' dtype: weight's (grad_bias
     * too, forward requires bias to match it), the input's without weight */
    const ng_dtype pdt = has_w ? w.dtype : x.dtype;
    AtenTensorHandle db = ng_empty(&f, 1, &bias_len, pdt, x.device_type, x.device_index);
    ng_tensor dxv, dwv = {0}, dbv;
    ng_view_mut(&f, dx, "grad_input", &dxv);
    ng_view_mut(&f, db, "grad_bias", &dbv);
    if (has_w) {
        dw = ng_empty(&f, 1, &cols, pdt, x.device_type, x.device_index);
        ng_view_mut(&f, dw, "grad_weight", &dwv);
    }
    if (with_bias && rms) ng_fail(&f, "with_bias is not supported with rms=True");
    /* mean and rstd are only read; the kernel's struct has one mutable field
     * for both directions. */
    ng_layernorm_args a = {
        .dtype = x.dtype,
        .rows = rows,
        .cols = cols,
        .rms = rms,
        .x = x.data,
        .weight = has_w ? w.data : NULL,
        .mean = (void *)(uintptr_t)mean.data,
        .rstd = (void *)(uintptr_t)rstd.data,
        .dy = dy.data,
        .dx = dxv.mut,
        .dweight = has_w ? dwv.mut : NULL,
        .dbias = with_bias ? dbv.mut : NULL,
        .params_f32 = pdt != x.dtype,
    };
#ifdef NG_BUILD_CUDA
    /* the dweight / dbias partial sums over chunks of rows */
    const int64_t wsb = ng_layernorm_bwd_cuda_workspace_bytes(&a);
    NG_KERNEL_CHECK(&f, ng_layernorm_bwd_cuda_ws(&a, ng_scratch(&f, wsb, &x), wsb,
                                                 ng_cuda_current_stream(&f, x.device_index)));
#else
    NG_KERNEL_CHECK(&f, ng_layernorm_bwd(&a, ng_torch_parallel));
#endif
    uint64_t o = 0;
    ng_ret_tensor(&f, stack, o++, dx);
    if (has_w) ng_ret_tensor(&f, stack, o++, dw);
    ng_ret_tensor(&f, stack, o++, db);
    ng_frame_release(&f);
}

static void ln_bwd_plain(StableIValue *s, uint64_t na, uint64_t no) {
    ln_backward(s, na, no, "stable_layernorm_backward");
}
static void ln_bwd_w(StableIValue *s, uint64_t na, uint64_t no) {
    ln_backward(s, na, no, "stable_layernorm_backward.weight");
}

void ng_register_layernorm(ng_registrar *r) {
    NG_LAYERNORM_SCHEMAS(NG_DEF_EACH)
    ng_impl(r, "stable_layernorm", ln_fwd_plain);
    ng_impl(r, "stable_layernorm.weight", ln_fwd_w);
    ng_impl(r, "stable_layernorm.bias", ln_fwd_b);
    ng_impl(r, "stable_layernorm.weight_bias", ln_fwd_wb);
    ng_impl(r, "stable_layernorm_backward", ln_bwd_plain);
    ng_impl(r, "stable_layernorm_backward.weight", ln_bwd_w);
}
