/* ops/ops.h - each op file's registration entry point, called once by
 * ops/nanguard.c when the library loads. */
#ifndef NG_OPS_H
#define NG_OPS_H

#include "shim/shim.h"

void ng_register_layernorm(ng_registrar *r);
void ng_register_grad_guard(ng_registrar *r);
void ng_register_attention(ng_registrar *r);
void ng_register_tensor_stats(ng_registrar *r);

#endif /* NG_OPS_H */
