/*
 * kernels/cpu_info.h - which CPU code path each kernel runs on this machine,
 * as text, for `python -m nanguard info` and the benchmarks.
 */
#ifndef NG_KERNELS_CPU_INFO_H
#define NG_KERNELS_CPU_INFO_H

#include "kernels/common.h"

/*
 * "key=value" lines, each ending in '\n', in a static buffer (valid until the
 * next call; not thread-safe):
 *   supported=<isa>   widest path this CPU supports (cpu_isa.h)
 *   active=<isa>      the path in use
 *   requested=<text>  NANGUARD_CPU_ISA as set now ("" when unset)
 *   <op>.<dtype>=<path>  per kernel family (attention, layernorm, grad_guard,
 *                     tensor_stats) and dtype (f32, f64, bf16, f16): the
 *                     instruction set of the loop that runs, and for
 *                     half-precision inputs how they are computed.
 */
const char *ng_cpu_info(void);

#endif /* NG_KERNELS_CPU_INFO_H */
