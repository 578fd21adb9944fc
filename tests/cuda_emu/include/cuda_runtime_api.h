/*
 * tests/cuda_emu/include/cuda_runtime_api.h - the part of the CUDA runtime
 * API that nanguard's kernels and tests/c/test_cuda.c call, served by the
 * CPU emulator (tests/cuda_emu/cuda_emu.cpp). Plain C, as the real header
 * is, so the C11 test program compiles against it unchanged.
 */
#ifndef NG_CUDA_EMU_RUNTIME_API_H
#define NG_CUDA_EMU_RUNTIME_API_H

#include <stddef.h>

#ifndef NG_CUDA_EMU
#define NG_CUDA_EMU 1
#endif

/* The runtime version the emulator answers with (CUDA 13.0). */
#define CUDART_VERSION 13000

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorIllegalInstruction = 715,
    cudaErrorLaunchFailure = 719,
} cudaError_t;

typedef struct ng_emu_stream *cudaStream_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxGridDimY = 6,
    cudaDevAttrMaxGridDimZ = 7,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int warpSize;
    int maxThreadsPerBlock;
    int maxGridSize[3];
    int major;
    int minor;
    int multiProcessorCount;
};

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error);

cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void *ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

/* ---- the emulator's own controls (not CUDA) ------------------------------
 * The device the emulator imitates: compute capability sm (75, 80, 86, 89
 * or 90; default 90, or $NG_EMU_SM). It sets the capability the kernels
 * query and the opt-in shared-memory limit. Returns 0, or -1 for an sm the
 * emulator does not know. */
int ng_emu_set_sm(int sm);
int ng_emu_sm(void);
/* The next call to the runtime function named `call` ("cudaFuncSetAttribute",
 * "cudaDeviceGetAttribute" or "cudaGetDevice") fails with `error`, leaving it
 * as the last error as the real runtime does: for testing how callers handle
 * a failed call. */
void ng_emu_inject(const char *call, cudaError_t error);
/* The driver version cudaDriverGetVersion reports (default: CUDART_VERSION). */
void ng_emu_set_driver_version(int version);
/* Calls made so far to the runtime function named `call` (any of the
 * device-query and attribute functions above). */
long long ng_emu_calls(const char *call);
/* Launches emulated so far, and the schedules each ran under. */
long long ng_emu_launches(void);
int ng_emu_schedules(void);
/* Inside a kernel: the byte shared memory held at the block's start in the
 * schedule now running (0xff in the first, 0x00 in the second), and whether
 * [p, p + n) lies in the block's shared memory (an NG_SHARED variable or the
 * launch's dynamic shared memory). For the emulator's own tests. */
int ng_emu_shared_poison(void);
int ng_emu_is_shared(const void *p, size_t n);
/* Whether the shared-memory race detector has seen an access (the kernels
 * were compiled for it: NG_EMU_RACECHECK), and how many it has checked. */
int ng_emu_racecheck(void);
long long ng_emu_racecheck_accesses(void);

#ifdef __cplusplus
}
#endif

#endif /* NG_CUDA_EMU_RUNTIME_API_H */
