/* ops/ops.h - each op file's registration entry point, called once by
 * ops/nanguard.c when the library loads, and each op file's schemas.
 *
 * A schema is the one description of an op's arguments: ng_def parses it
 * (shim/schema.h) for the boxed kernel, which reads its arguments by name,
 * and the Python layer reads the same schema back from
 * torch.ops.nanguard.<op>.<overload>._schema. Each list is defined, in
 * order, by its op file's ng_register_* (the order is part of the build id),
 * and tests/c/test_schema.c parses every one. */
#ifndef NG_OPS_H
#define NG_OPS_H

#include "shim/shim.h"

/* ops/layernorm.c (no `Tensor?`: optional weight / bias are overloads) */
#define NG_LAYERNORM_SCHEMAS(X)                                                                    \
    X("stable_layernorm(Tensor input, float eps, bool rms) -> (Tensor, Tensor, Tensor)")           \
    X("stable_layernorm.weight(Tensor input, Tensor weight, float eps, bool rms) "                 \
      "-> (Tensor, Tensor, Tensor)")                                                               \
    X("stable_layernorm.bias(Tensor input, Tensor bias, float eps, bool rms) "                     \
      "-> (Tensor, Tensor, Tensor)")                                                               \
    X("stable_layernorm.weight_bias(Tensor input, Tensor weight, Tensor bias, float eps, "         \
      "bool rms) -> (Tensor, Tensor, Tensor)")                                                     \
    X("stable_layernorm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, "        \
      "bool rms, bool with_bias) -> (Tensor, Tensor)")                                             \
    X("stable_layernorm_backward.weight(Tensor grad_out, Tensor input, Tensor weight, "            \
      "Tensor mean, Tensor rstd, bool rms, bool with_bias) -> (Tensor, Tensor, Tensor)")

/* ops/grad_guard.c */
#define NG_GRAD_GUARD_SCHEMAS(X)                                                                   \
    X("grad_guard_reduce(Tensor[] grads, Tensor inv_scale, float norm_type) -> Tensor")            \
    X("grad_guard_apply_(Tensor(a!)[] grads, Tensor inv_scale, Tensor stats, "                     \
      "Tensor(b!) found_inf, float max_norm, float norm_type) -> Tensor")                          \
    X("fused_unscale_clip_(Tensor(a!)[] grads, Tensor inv_scale, Tensor(b!) found_inf, "           \
      "float max_norm, float norm_type) -> (Tensor, Tensor)")

/* ops/attention.c (no `Tensor?`: the mask is an overload); the scalars and
 * rng are common to the four */
#define NG_SDPA_PARAMS                                                                             \
    "float dropout_p, bool is_causal, float scale, float max_score, float softcap, Tensor rng"
#define NG_ATTENTION_SCHEMAS(X)                                                                    \
    X("safe_sdpa(Tensor query, Tensor key, Tensor value, " NG_SDPA_PARAMS ") -> (Tensor, Tensor)") \
    X("safe_sdpa.masked(Tensor query, Tensor key, Tensor value, Tensor attn_mask, " NG_SDPA_PARAMS \
      ") -> (Tensor, Tensor)")                                                                     \
    X("safe_sdpa_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "               \
      "Tensor out, Tensor lse, " NG_SDPA_PARAMS ") -> (Tensor, Tensor, Tensor)")                   \
    X("safe_sdpa_backward.masked(Tensor grad_out, Tensor query, Tensor key, Tensor value, "        \
      "Tensor attn_mask, Tensor out, Tensor lse, " NG_SDPA_PARAMS ") -> (Tensor, Tensor, Tensor)")

/* ops/tensor_stats.c */
#define NG_TENSOR_STATS_SCHEMAS(X)                                                                 \
    X("tensor_stats_(Tensor x, Tensor(a!) counts, Tensor(b!) values, int slot) -> ()")

/* Every schema, in the order the libraries define them. */
#define NG_ALL_SCHEMAS(X)                                                                          \
    NG_LAYERNORM_SCHEMAS(X)                                                                        \
    NG_GRAD_GUARD_SCHEMAS(X) NG_ATTENTION_SCHEMAS(X) NG_TENSOR_STATS_SCHEMAS(X)

/* In an ng_register_*: define each schema of a list, `NG_XXX_SCHEMAS(NG_DEF_EACH)`. */
#define NG_DEF_EACH(schema) ng_def(r, schema);

void ng_register_layernorm(ng_registrar *r);
void ng_register_grad_guard(ng_registrar *r);
void ng_register_attention(ng_registrar *r);
void ng_register_tensor_stats(ng_registrar *r);

#endif /* NG_OPS_H */
