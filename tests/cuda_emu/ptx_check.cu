/*
 * tests/cuda_emu/ptx_check.cu - every wrapper of kernels/cuda_ptx.h in one
 * kernel, compiled by nvcc with the CUDA library's flags (-Werror) for its
 * architectures, so the inline PTX is instantiated and assembled before any
 * kernel of kernels/ calls it. Never linked or installed: ctest
 * cuda_ptx_check (check_ptx.sh) compiles it to PTX for sm_80 and sm_90 and
 * looks for each instruction.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda_ptx.h"

__global__ void ng_ptx_check_kernel(const uint4 *src, uint32_t *out) {
    __shared__ __align__(16) uint16_t tile[2][16 * 24];
    const int t = threadIdx.x;
    for (int s = 0; s < 2; s++) {
        ng_cp_async_cg16(&tile[s][8 * t], src + 2 * t + s * 64);
        ng_cp_async_ca<16>(&tile[s][8 * t + 128], src + 2 * t + 1 + s * 64);
        ng_cp_async_ca<8>(&tile[s][8 * t + 256], src + 2 * t + s * 64);
        ng_cp_async_ca<4>(&tile[s][8 * t + 260], src + 2 * t + s * 64);
        ng_cp_async_commit();
    }
    ng_cp_async_wait_group<1>();
    ng_cp_async_wait_group<0>();
    ng_cp_async_wait_all();
    __syncthreads();
    const uint16_t *row = &tile[t >> 4 & 1][((t & 15) * 24) % (16 * 24 - 8)];
    uint32_t r[4], acc = 0;
    ng_ldmatrix<1>(r, row), acc ^= r[0];
    ng_ldmatrix<2>(r, row), acc ^= r[0] ^ r[1];
    ng_ldmatrix<4>(r, row), acc ^= r[0] ^ r[1] ^ r[2] ^ r[3];
    ng_ldmatrix<1, true>(r, row), acc ^= r[0];
    ng_ldmatrix<2, true>(r, row), acc ^= r[0] ^ r[1];
    ng_ldmatrix<4, true>(r, row), acc ^= r[0] ^ r[1] ^ r[2] ^ r[3];
    out[blockIdx.x * blockDim.x + t] = acc;
}
