/*
 * ops/attention.c - torch.ops.nanguard.safe_sdpa and its backward
 * (kernels/attention.h).
 *
 * Schemas (ops/ops.h, NG_ATTENTION_SCHEMAS; no `Tensor?`: the mask is an overload):
 *   safe_sdpa(Tensor query, Tensor key, Tensor value, float dropout_p, bool is_causal,
 *             float scale, float max_score, float softcap, Tensor rng)
 *       -> (Tensor out, Tensor lse)
 *   safe_sdpa.masked(query, key, value, Tensor attn_mask, dropout_p, ...) -> (out, lse)
 *   safe_sdpa_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
 *                      Tensor lse, float dropout_p, bool is_causal, float scale,
 *                      float max_score, float softcap, Tensor rng)
 *       -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
 *   safe_sdpa_backward.masked(grad_out, query, key, value, attn_mask, out, lse, ...)
 *
 * query [B, Hq, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev] with
 * Hq % Hkv == 0 (grouped-query attention when they differ), one float dtype,
 * one device. attn_mask is 4-d, bool (True = attend) or float (additive, any
 * float dtype), each dim equal to [B, Hq, L, S]'s or 1 (broadcast, read with
 * stride 0; no copy). out is contiguous [B, Hq, L, Ev]; lse [B, Hq, L] is fp32
 * (fp64 for fp64 inputs), -inf for fully masked rows. max_score / softcap
 * <= 0 turn the guards off; softcap must be finite (at +inf the soft-cap
 * would be inf * 0). The Python layer (python/nanguard/attention.py)
 * maps F.scaled_dot_product_attention's shapes onto these.
 *
 * rng is dropout's Philox [seed, offset]: a contiguous CPU int64 tensor of 2
 * elements, on the CPU even when query is a CUDA tensor (its two values are
 * read on the host before the launch). A tensor rather than two ints, so that
 * under torch.compile the draw is an op in the graph, not a value the tracer
 * must know. The backward takes the forward's rng and regenerates its mask.
 *
 * Only the last dim of query/key/value/grad_out must be contiguous; other
 * strides (e.g. a [B, L, H, E] tensor transposed to [B, H, L, E]) are passed
 * to the kernel as they are.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels/attention.h"
#include "ops/ops.h"

#define SDPA_OP "nanguard::safe_sdpa"
#define SDPA_BWD_OP "nanguard::safe_sdpa_backward"

typedef struct sdpa_params {
    double dropout_p, scale, max_score, softcap;
    int is_causal;
    int64_t seed, offset;
} sdpa_params;

/* The scalars and the rng tensor, common to the four schemas. */
static sdpa_params read_params(ng_frame *f) {
    sdpa_params p;
    int64_t rng[2];
    p.dropout_p = ng_arg_float(f, "dropout_p");
    p.is_causal = ng_arg_bool(f, "is_causal");
    p.scale = ng_arg_float(f, "scale");
    p.max_score = ng_arg_float(f, "max_score");
    p.softcap = ng_arg_float(f, "softcap");
    ng_host_int64s(f, ng_arg_tensor(f, "rng"), "rng", 2, rng);
    p.seed = rng[0];
    p.offset = rng[1];
    return p;
}

/* For inputs scored in fp32 (all but fp64), the scalars as fp32 sees them:
 * a scale or soft-cap past FLT_MAX is inf there (inf * 0 = NaN in the
 * scores), a clamp or soft-cap below its smallest positive value is 0,
 * which turns it off. Refused, naming the argument (ng_attention_check's
 * rule). */
static void check_fp32_params(ng_frame *f, const sdpa_params *p, ng_dtype dt) {
    if (dt == NG_F64) return;
    const char *dn = ng_dtype_name(dt);
    if (fabs(p->scale) > (double)FLT_MAX)
        ng_fail(
            f,
            "scale must be at most %g in magnitude for %s inputs (their scores are float32), got %g",
            (double)FLT_MAX, dn, p->scale);
    if (p->softcap > (double)FLT_MAX)
        ng_fail(f, "softcap must be at most %g for %s inputs (their scores are float32), got %g",
                (double)FLT_MAX, dn, p->softcap);
    if (p->max_score > 0.0 && (float)p->max_score == 0.0f)
        ng_fail(
            f,
            "max_score %g is 0 in float32 (the scores of %s inputs), which turns the clamp off; use 0 for off",
            p->max_score, dn);
    if (p->softcap > 0.0 && (float)p->softcap == 0.0f)
        ng_fail(
            f,
            "softcap %g is 0 in float32 (the scores of %s inputs), which turns the soft-cap off; use 0 for off",
            p->softcap, dn);
}

static void check_params(ng_frame *f, const sdpa_params *p) {
    if (!(p->dropout_p >= 0.0 && p->dropout_p < 1.0))
        ng_fail(f, "dropout_p must be in [0, 1), got %g", p->dropout_p);
    if (!isfinite(p->scale)) ng_fail(f, "scale must be finite, got %g", p->scale);
    if (isnan(p->max_score)) ng_fail(f, "max_score must not be NaN (<= 0 turns the clamp off)");
    /* softcap * tanh(s / softcap) is inf * 0 = NaN at +inf: refused, like NaN */
    if (isnan(p->softcap) || p->softcap == (double)INFINITY)
        ng_fail(f, "softcap must be finite, got %g (<= 0 turns the soft-cap off)", p->softcap);
}

/* A 4-d float tensor with a contiguous last dim on this library's device. */
static void check_qkv(ng_frame *f, ng_tensor *t, const char *name, const ng_tensor *q) {
    ng_check_device_dtype(f, t, name);
    if (t->ndim != 4)
        ng_fail(f, "%s must be 4-d [batch, heads, seq, head_dim], got %lld dims", name,
                (long long)t->ndim);
    if (q) {
        ng_check_same_device(f, q, "query", t, name);
        ng_check_same_dtype(f, q, "query", t, name);
    }
    if (t->sizes[3] > 1 && t->strides[3] != 1) ng_make_contiguous(f, t);
}

/* The mask is bool (True = attend) or an additive float of any of the four
 * floating dtypes. */
static void view_mask(ng_frame *f, AtenTensorHandle h, ng_tensor *m, ng_mask_kind *kind) {
    int32_t dt = ng_view_raw(f, h, "attn_mask", m);
    if (dt == aoti_torch_dtype_bool()) {
        *kind = NG_MASK_BOOL;
        return;
    }
    if (ng_dtype_from_torch(dt) < 0)
        ng_fail(f, "attn_mask must be bool or float16, bfloat16, float32 or float64 (got %s)",
                ng_torch_dtype_name(dt));
    *kind = NG_MASK_ADD;
}

/* Shapes of q, k, v (and the mask) into the kernel args. */
static void fill_args(ng_frame *f, ng_attention_args *a, const ng_tensor *q, const ng_tensor *k,
                      const ng_tensor *v, const ng_tensor *mask, ng_mask_kind kind,
                      const sdpa_params *p) {
    memset(a, 0, sizeof *a);
    a->dtype = q->dtype;
    a->B = q->sizes[0];
    a->Hq = q->sizes[1];
    a->L = q->sizes[2];
    a->E = q->sizes[3];
    a->Hkv = k->sizes[1];
    a->S = k->sizes[2];
    a->Ev = v->sizes[3];
    if (k->sizes[0] != a->B || v->sizes[0] != a->B)
        ng_fail(f, "key and value must have the batch size of query (%lld), got %lld and %lld",
                (long long)a->B, (long long)k->sizes[0], (long long)v->sizes[0]);
    if (k->sizes[3] != a->E)
        ng_fail(f, "key's head dim (%lld) must equal query's (%lld)", (long long)k->sizes[3],
                (long long)a->E);
    if (v->sizes[1] != a->Hkv || v->sizes[2] != a->S)
        ng_fail(f,
                "value must have key's heads and sequence length ([%lld, %lld]), got [%lld, %lld]",
                (long long)a->Hkv, (long long)a->S, (long long)v->sizes[1], (long long)v->sizes[2]);
    if (a->Hq < 1) ng_fail(f, "query must have at least one head, got %lld", (long long)a->Hq);
    if (a->Hkv < 1 || a->Hq % a->Hkv != 0)
        ng_fail(f, "query heads (%lld) must be a multiple of key/value heads (%lld)",
                (long long)a->Hq, (long long)a->Hkv);
    if (a->E < 1 || a->E > NG_ATTN_MAX_HEAD_DIM || a->Ev < 1 || a->Ev > NG_ATTN_MAX_HEAD_DIM)
        ng_fail(f, "head dims must be in [1, %d], got query/key %lld and value %lld",
                NG_ATTN_MAX_HEAD_DIM, (long long)a->E, (long long)a->Ev);
    a->q = q->data;
    a->k = k->data;
    a->v = v->data;
    for (int d = 0; d < 3; d++) {
        a->q_stride[d] = q->strides[d];
        a->k_stride[d] = k->strides[d];
        a->v_stride[d] = v->strides[d];
    }
    if (mask) {
        const int64_t want[4] = {a->B, a->Hq, a->L, a->S};
        const char *dims[4] = {"batch", "heads", "query length", "key length"};
        if (mask->ndim != 4)
            ng_fail(f, "attn_mask must be 4-d (broadcastable to [B, H, L, S]), got %lld dims",
                    (long long)mask->ndim);
        ng_check_same_device(f, q, "query", mask, "attn_mask");
        for (int d = 0; d < 4; d++) {
            if (mask->sizes[d] != want[d] && mask->sizes[d] != 1)
                ng_fail(f, "attn_mask's %s dim is %lld; it must be %lld or 1", dims[d],
                        (long long)mask->sizes[d], (long long)want[d]);
            a->mask_stride[d] = mask->sizes[d] == 1 ? 0 : mask->strides[d];
        }
        a->mask = mask->data;
        a->mask_kind = kind;
        a->mask_dtype = mask->dtype;
#ifdef NG_BUILD_CUDA
        if (kind == NG_MASK_ADD && mask->dtype == NG_F64)
            ng_fail(f, "attn_mask: float64 is supported on the CPU only");
#endif
    }
    a->is_causal = p->is_causal;
    a->scale = p->scale;
    a->max_score = p->max_score;
    a->softcap = p->softcap;
    a->dropout_p = p->dropout_p;
    a->seed = (uint64_t)p->seed;
    a->offset = (uint64_t)p->offset;
}

static ng_dtype lse_dtype(ng_dtype t) { return t == NG_F64 ? NG_F64 : NG_F32; }

/* `name`: the overload's schema name; the masked ones have attn_mask. */
static void sdpa_forward(StableIValue *stack, uint64_t na, uint64_t no, const char *name) {
    ng_frame f;
    ng_frame_init(&f, SDPA_OP);
    ng_take_args(&f, name, stack, na, no);
    const bool has_mask = ng_has_arg(&f, "attn_mask");
    ng_tensor q, k, v, m = {0};
    ng_mask_kind kind = NG_MASK_NONE;
    ng_view(&f, ng_arg_tensor(&f, "query"), "query", &q);
    ng_view(&f, ng_arg_tensor(&f, "key"), "key", &k);
    ng_view(&f, ng_arg_tensor(&f, "value"), "value", &v);
    if (has_mask) view_mask(&f, ng_arg_tensor(&f, "attn_mask"), &m, &kind);
    sdpa_params p = read_params(&f);
    check_params(&f, &p);
    check_qkv(&f, &q, "query", NULL);
    check_qkv(&f, &k, "key", &q);
    check_qkv(&f, &v, "value", &q);
    check_fp32_params(&f, &p, q.dtype);
    ng_device_guard(&f, &q);

    ng_attention_args a;
    fill_args(&f, &a, &q, &k, &v, has_mask ? &m : NULL, kind, &p);
    const int64_t osz[4] = {a.B, a.Hq, a.L, a.Ev};
    AtenTensorHandle out = ng_empty(&f, 4, osz, q.dtype, q.device_type, q.device_index);
    AtenTensorHandle lse = ng_empty(&f, 3, osz, lse_dtype(q.dtype), q.device_type, q.device_index);
    ng_tensor ov, lv;
    ng_view_mut(&f, out, "out", &ov);
    ng_view_mut(&f, lse, "lse", &lv);
    a.out = ov.mut;
    for (int d = 0; d < 3; d++) a.out_stride[d] = ov.strides[d];
    a.lse = lv.mut;
#ifdef NG_BUILD_CUDA
    /* a decode shape's split-KV partials */
    const int64_t wsb = ng_attention_fwd_cuda_workspace_bytes(&a);
    NG_KERNEL_CHECK(&f, ng_attention_fwd_cuda_ws(&a, ng_scratch(&f, wsb, &q), wsb,
                                                 ng_cuda_current_stream(&f, q.device_index)));
#else
    NG_KERNEL_CHECK(&f, ng_attention_fwd(&a, ng_torch_parallel));
#endif
    ng_ret_tensor(&f, stack, 0, out);
    ng_ret_tensor(&f, stack, 1, lse);
    ng_frame_release(&f);
}

static void sdpa_fwd_plain(StableIValue *s, uint64_t na, uint64_t no) {
    sdpa_forward(s, na, no, "safe_sdpa");
}
static void sdpa_fwd_masked(StableIValue *s, uint64_t na, uint64_t no) {
    sdpa_forward(s, na, no, "safe_sdpa.masked");
}

static void sdpa_backward(StableIValue *stack, uint64_t na, uint64_t no, const char *name) {
    ng_frame f;
    ng_frame_init(&f, SDPA_BWD_OP);
    ng_take_args(&f, name, stack, na, no);
    const bool has_mask = ng_has_arg(&f, "attn_mask");
    ng_tensor g, q, k, v, m = {0}, o, lse;
    ng_mask_kind kind = NG_MASK_NONE;
    ng_view(&f, ng_arg_tensor(&f, "grad_out"), "grad_out", &g);
    ng_view(&f, ng_arg_tensor(&f, "query"), "query", &q);
    ng_view(&f, ng_arg_tensor(&f, "key"), "key", &k);
    ng_view(&f, ng_arg_tensor(&f, "value"), "value", &v);
    if (has_mask) view_mask(&f, ng_arg_tensor(&f, "attn_mask"), &m, &kind);
    ng_view(&f, ng_arg_tensor(&f, "out"), "out", &o);
    ng_view(&f, ng_arg_tensor(&f, "lse"), "lse", &lse);
    sdpa_params p = read_params(&f);
    check_params(&f, &p);
    check_qkv(&f, &q, "query", NULL);
    check_qkv(&f, &k, "key", &q);
    check_qkv(&f, &v, "value", &q);
    check_qkv(&f, &g, "grad_out", &q);
    check_fp32_params(&f, &p, q.dtype);
    check_qkv(&f, &o, "out", &q);
    ng_device_guard(&f, &q);

    ng_attention_args a;
    fill_args(&f, &a, &q, &k, &v, has_mask ? &m : NULL, kind, &p);
    const int64_t osz[4] = {a.B, a.Hq, a.L, a.Ev};
    for (int d = 0; d < 4; d++) {
        if (g.sizes[d] != osz[d]) ng_fail(&f, "grad_out must have the shape of out [B, Hq, L, Ev]");
        if (o.sizes[d] != osz[d])
            ng_fail(&f, "out must have shape [B, Hq, L, Ev] (the forward's output)");
    }
    ng_check_same_device(&f, &q, "query", &lse, "lse");
    if (lse.dtype != lse_dtype(q.dtype) || lse.ndim != 3 || lse.sizes[0] != a.B ||
        lse.sizes[1] != a.Hq || lse.sizes[2] != a.L)
        ng_fail(&f, "lse must be the forward's %s logsumexp of shape [B, Hq, L]",
                ng_dtype_name(lse_dtype(q.dtype)));
    ng_make_contiguous(&f, &lse);

    AtenTensorHandle dq = ng_empty(&f, 4, q.sizes, q.dtype, q.device_type, q.device_index);
    AtenTensorHandle dk = ng_empty(&f, 4, k.sizes, q.dtype, q.device_type, q.device_index);
    AtenTensorHandle dv = ng_empty(&f, 4, v.sizes, q.dtype, q.device_type, q.device_index);
    ng_tensor dqv, dkv, dvv;
    ng_view_mut(&f, dq, "grad_query", &dqv);
    ng_view_mut(&f, dk, "grad_key", &dkv);
    ng_view_mut(&f, dv, "grad_value", &dvv);
    /* out and lse are only read by the backward; the kernel's struct has one
     * mutable field for both directions. */
    a.out = (void *)(uintptr_t)o.data;
    a.dout = g.data;
    a.dq = dqv.mut;
    a.dk = dkv.mut;
    a.dv = dvv.mut;
    for (int d = 0; d < 3; d++) {
        a.out_stride[d] = o.strides[d];
        a.dout_stride[d] = g.strides[d];
        a.dq_stride[d] = dqv.strides[d];
        a.dk_stride[d] = dkv.strides[d];
        a.dv_stride[d] = dvv.strides[d];
    }
    a.lse = (void *)(uintptr_t)lse.data;
#ifdef NG_BUILD_CUDA
    /* D = rowsum(dout . out) per query row, computed once by a pre-kernel,
     * and with a padding mask the key blocks it hides from every query (the
     * dk / dv kernels skip them) */
    const int64_t wsb = ng_attention_bwd_cuda_workspace_bytes(&a);
    NG_KERNEL_CHECK(&f, ng_attention_bwd_cuda_ws(&a, ng_scratch(&f, wsb, &q), wsb,
                                                 ng_cuda_current_stream(&f, q.device_index)));
#else
    NG_KERNEL_CHECK(&f, ng_attention_bwd(&a, ng_torch_parallel));
#endif
    ng_ret_tensor(&f, stack, 0, dq);
    ng_ret_tensor(&f, stack, 1, dk);
    ng_ret_tensor(&f, stack, 2, dv);
    ng_frame_release(&f);
}

static void sdpa_bwd_plain(StableIValue *s, uint64_t na, uint64_t no) {
    sdpa_backward(s, na, no, "safe_sdpa_backward");
}
static void sdpa_bwd_masked(StableIValue *s, uint64_t na, uint64_t no) {
    sdpa_backward(s, na, no, "safe_sdpa_backward.masked");
}

void ng_register_attention(ng_registrar *r) {
    NG_ATTENTION_SCHEMAS(NG_DEF_EACH)
    ng_impl(r, "safe_sdpa", sdpa_fwd_plain);
    ng_impl(r, "safe_sdpa.masked", sdpa_fwd_masked);
    ng_impl(r, "safe_sdpa_backward", sdpa_bwd_plain);
    ng_impl(r, "safe_sdpa_backward.masked", sdpa_bwd_masked);
}
