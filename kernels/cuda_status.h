/*
 * kernels/cuda_status.h - what the CUDA runtime said when a nanguard
 * launcher failed, and the load-time check of the driver against the
 * runtime the library was built with. Plain C: the op layer (ops/, shim/)
 * includes it without CUDA headers.
 *
 * Every launcher that returns NG_ERR_CUDA first records the runtime's error
 * (ng_cuda_record, per host thread) and clears it from the runtime, so a
 * failed attribute call or launch is reported once, with its name and
 * cudaGetErrorString, and never blamed on a later, unrelated call.
 */
#ifndef NG_KERNELS_CUDA_STATUS_H
#define NG_KERNELS_CUDA_STATUS_H

#include <stddef.h>

#include "kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "cudaErrorX: <cudaGetErrorString>" of the last failure this thread's
 * launchers recorded, or "" when there was none. */
const char *ng_cuda_error_string(void);

/* 0 when the installed driver supports the CUDA runtime this library was
 * built with; otherwise non-zero and msg holds a sentence naming both
 * versions. */
int ng_cuda_driver_check(char *msg, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* NG_KERNELS_CUDA_STATUS_H */
