/*
 * kernels/cuda_status.cu - the runtime's error behind an NG_ERR_CUDA, and the
 * driver check made when the CUDA library loads (see cuda_status.h).
 *
 * ng_cuda_record takes the runtime's last error with cudaGetLastError, which
 * also clears it (an error that is not sticky would otherwise be reported
 * again by the next, unrelated check). Sticky errors (a kernel fault) stay in
 * the context whatever we do; the runtime reports them on every later call.
 */
#include <cuda_runtime.h>
#include <stdio.h>

#include "kernels/cuda_launch.h"
#include "kernels/cuda_status.h"

static thread_local char ng_cuda_err[160];

ng_status ng_cuda_record(cudaError_t e) {
    if (e == cudaSuccess)
        e = cudaGetLastError(); /* the launch's own error, if any */
    else
        (void)cudaGetLastError(); /* clear what the failed call left */
    if (e == cudaSuccess) return NG_OK;
    snprintf(ng_cuda_err, sizeof ng_cuda_err, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    return NG_ERR_CUDA;
}

extern "C" const char *ng_cuda_error_string(void) { return ng_cuda_err; }

extern "C" int ng_cuda_driver_check(char *msg, size_t n) {
    int drv = 0;
    const cudaError_t e = cudaDriverGetVersion(&drv);
    (void)cudaGetLastError();
    if (e == cudaSuccess && drv >= CUDART_VERSION) return 0;
    if (e != cudaSuccess || drv == 0)
        snprintf(
            msg, n,
            "libnanguard_cuda was built with CUDA runtime %d.%d, and no CUDA driver was found (%s)",
            CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, cudaGetErrorString(e));
    else
        snprintf(
            msg, n,
            "libnanguard_cuda was built with CUDA runtime %d.%d, but the installed driver supports "
            "CUDA %d.%d only: update the NVIDIA driver, or build nanguard with a CUDA toolkit "
            "no newer than %d.%d",
            CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, drv / 1000, drv % 1000 / 10,
            drv / 1000, drv % 1000 / 10);
    return 1;
}
