/*
 * kernels/cuda_launch.h - what every .cu file of kernels/ shares: the launch
 * and dynamic-shared-memory macros, and the status of a launch.
 *
 * The kernels launch through NG_LAUNCH and declare shared memory through
 * NG_DYNAMIC_SMEM and NG_SHARED instead of writing `<<<...>>>`,
 * `extern __shared__` and `__shared__` themselves, so that the same sources also compile as
 * host C++ under the CPU emulator of the CUDA execution model
 * (tests/cuda_emu), whose cuda_runtime.h defines both macros first. Under
 * nvcc they expand to exactly the CUDA syntax:
 *
 *   NG_LAUNCH((kernel<T, N>), grid, block, smem, stream, args...)
 *     -> kernel<T, N><<<grid, block, smem, stream>>>(args...)
 *   NG_SHARED(float, red, [32]) -> __shared__ float red[32]
 *
 * (the kernel in parentheses, so a template argument list's commas survive
 * the preprocessor).
 */
#ifndef NG_KERNELS_CUDA_LAUNCH_H
#define NG_KERNELS_CUDA_LAUNCH_H

#include <cuda_runtime.h>

#include "kernels/common.h"

#ifndef NG_LAUNCH
#define NG_UNPAREN(...) __VA_ARGS__
#define NG_LAUNCH(kernel, grid, block, smem, stream, ...)                                          \
    NG_UNPAREN kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define NG_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#define NG_SHARED(type, name, ...) __shared__ type name __VA_ARGS__
#endif

/* NG_OK, or NG_ERR_CUDA after recording the runtime's error for the op
 * layer's message (cuda_status.h). Pass the result of a runtime call, or
 * cudaSuccess to check the launch just made. */
ng_status ng_cuda_record(cudaError_t e);

#endif /* NG_KERNELS_CUDA_LAUNCH_H */
