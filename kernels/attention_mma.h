/*
 * kernels/attention_mma.h - register fragments of the tensor-core instruction
 * mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D[16x8] += A[16x16] B[16x8]
 * with fp32 accumulators, the building block of the fp16/bf16 safe_sdpa CUDA
 * kernels (kernels/attention_mma_*.cu, attention_decode.cu).
 *
 * Everything here but the ldmatrix loaders and ng_mma_16816 (device code,
 * at the end) only computes addresses and moves bits, so it is host+device:
 * the ctest suite runs the scalar fragment loaders on the CPU and checks
 * them against the fragment tables of the PTX ISA ("Matrix Fragments for
 * mma.m16n8k16 with floating point type"). The kernels load their fragments
 * with the ldmatrix forms, which cuda_emu_self checks lane for lane against
 * the scalar ones.
 *
 * Lane l of the warp has group g = l / 4 and thread-in-group t = l % 4. A
 * 32-bit register holds two 16-bit elements, the lower-indexed one in the low
 * half. The PTX layouts, element by element:
 *
 *   A (4 regs, a0..a7):  row g + 8 * (i in {2,3,6,7}),  col 2t + (i & 1) + 8 * (i >= 4)
 *   B (2 regs, b0..b3):  row (k) 2t + (i & 1) + 8 * (i >= 2),  col (n) g
 *   C/D (4 fp32, c0..c3): row g + 8 * (i >= 2),  col 2t + (i & 1)
 *
 * Tiles live in shared memory as rows of `ld` 16-bit elements (row-major).
 * With ld = head_dim + 8 (a 16-byte pad), ld / 2 = 4 (mod 32) words, so the 32
 * lanes of every load below hit 32 different banks.
 *
 * Two facts the kernels rely on:
 * - The C fragment of a 16x16 block (two n-tiles of 8 columns) has exactly the
 *   elements of the A fragment of the same block, so probabilities computed in
 *   accumulators feed the next product without a trip through shared memory
 *   (ng_mma_c_to_a).
 * - A product X * Y^T with Y row-major in shared memory reads B[k][n] = Y[n][k]
 *   (ng_mma_frag_b_rows, two adjacent elements per register); a product
 *   X * Y reads B[k][n] = Y[k][n] (ng_mma_frag_b_cols, elements of two rows).
 */
#ifndef NG_KERNELS_ATTENTION_MMA_H
#define NG_KERNELS_ATTENTION_MMA_H

#include <math.h>

#include "kernels/common.h"
#include "kernels/cuda_ptx.h"

/* Two 16-bit elements as one register, `lo` in the low half. */
NG_HD uint32_t ng_mma_pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* Two adjacent 16-bit elements p[0], p[1] (p 4-byte aligned) as one register. */
NG_HD uint32_t ng_mma_ld2(const uint16_t *p) { return ng_mma_pack(p[0], p[1]); }

/* A fragment of the 16x16 block at (r0, k0) of a row-major tile. */
NG_HD void ng_mma_frag_a(uint32_t a[4], const uint16_t *tile, int ld, int r0, int k0, int lane) {
    const uint16_t *p = tile + (r0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
    a[0] = ng_mma_ld2(p);              /* row g,     cols 2t, 2t+1 */
    a[1] = ng_mma_ld2(p + 8 * ld);     /* row g + 8, cols 2t, 2t+1 */
    a[2] = ng_mma_ld2(p + 8);          /* row g,     cols 2t+8, 2t+9 */
    a[3] = ng_mma_ld2(p + 8 * ld + 8); /* row g + 8, cols 2t+8, 2t+9 */
}

/* B fragment with B[k][n] = tile[n0 + n][k0 + k]: the 16x8 block of Y^T for
 * a product X * Y^T (scores q . k, dp = dout . v). */
NG_HD void ng_mma_frag_b_rows(uint32_t b[2], const uint16_t *tile, int ld, int n0, int k0,
                              int lane) {
    const uint16_t *p = tile + (n0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
    b[0] = ng_mma_ld2(p);     /* k = 2t, 2t+1 */
    b[1] = ng_mma_ld2(p + 8); /* k = 2t+8, 2t+9 */
}

/* B fragment with B[k][n] = tile[k0 + k][n0 + n]: the 16x8 block of Y for a
 * product X * Y (p . v, ds . k, ds^T . q, p^T . dout). */
NG_HD void ng_mma_frag_b_cols(uint32_t b[2], const uint16_t *tile, int ld, int k0, int n0,
                              int lane) {
    const uint16_t *p = tile + (k0 + 2 * (lane & 3)) * ld + n0 + (lane >> 2);
    b[0] = ng_mma_pack(p[0], p[ld]);          /* k = 2t, 2t+1 */
    b[1] = ng_mma_pack(p[8 * ld], p[9 * ld]); /* k = 2t+8, 2t+9 */
}

/* A fragment of a 16x16 block from the C fragments of its two 8-column
 * halves, already packed to 16 bits in pairs: lo[0] = (c0, c1) and
 * lo[1] = (c2, c3) of columns 0..7, hi[] the same of columns 8..15. */
NG_HD void ng_mma_c_to_a(uint32_t a[4], const uint32_t lo[2], const uint32_t hi[2]) {
    a[0] = lo[0]; /* row g,     cols 2t, 2t+1 */
    a[1] = lo[1]; /* row g + 8, cols 2t, 2t+1 */
    a[2] = hi[0]; /* row g,     cols 2t+8, 2t+9 */
    a[3] = hi[1]; /* row g + 8, cols 2t+8, 2t+9 */
}

/* Power-of-two exponent e >= 0 that brings a row's largest |dS| (the
 * gradient of the scores, rounded to fp16 for the tensor cores) under 2^15,
 * so the rounding cannot overflow fp16's 65504: the fp16 kernels multiply
 * that row by 2^-e before rounding and its fp32 accumulator by 2^e at the
 * end. 0 for values that fit, for inf and for NaN (they propagate as they are). */
NG_HD int ng_mma_ds_exponent(float max_abs) {
    if (!(max_abs >= 32768.0f) || max_abs > 3.4028234663852886e38f) return 0;
    int e;
    frexpf(max_abs, &e); /* 2^(e-1) <= max_abs < 2^e, e >= 16 */
    return e - 15;
}

#if defined(__CUDACC__) || defined(NG_CUDA_EMU)
/* The same fragments through ldmatrix (kernels/cuda_ptx.h), one warp-wide
 * instruction instead of scalar 16-bit loads: lane l gives the address of
 * row l % 8 of 8x8 matrix l / 8, rows 16-byte aligned (tile 16-byte aligned,
 * ld and the column a multiple of 8). Lane-for-lane equal to
 * ng_mma_frag_a / _b_rows / _b_cols above (cuda_emu_self checks the
 * layouts against those). */

/* ng_mma_frag_a: matrices (r0, k0), (r0 + 8, k0), (r0, k0 + 8), (r0 + 8, k0 + 8). */
__device__ __forceinline__ void ng_mma_ldm_a(uint32_t a[4], const uint16_t *tile, int ld, int r0,
                                             int k0, int lane) {
    const int m = lane >> 3, r = lane & 7;
    ng_ldmatrix<4>(a, tile + (r0 + 8 * (m & 1) + r) * ld + k0 + 8 * (m >> 1));
}

/* ng_mma_frag_b_rows of n-tiles n0 (b0) and n0 + 8 (b1): matrices
 * (n0, k0), (n0, k0 + 8), (n0 + 8, k0), (n0 + 8, k0 + 8) of the row-major
 * tile, not transposed (a row of Y is a column of B). */
__device__ __forceinline__ void ng_mma_ldm_b_rows2(uint32_t b0[2], uint32_t b1[2],
                                                   const uint16_t *tile, int ld, int n0, int k0,
                                                   int lane) {
    const int m = lane >> 3, r = lane & 7;
    uint32_t x[4];
    ng_ldmatrix<4>(x, tile + (n0 + 8 * (m >> 1) + r) * ld + k0 + 8 * (m & 1));
    b0[0] = x[0], b0[1] = x[1], b1[0] = x[2], b1[1] = x[3];
}

/* ng_mma_frag_b_cols of n-tiles n0 (b0) and n0 + 8 (b1): matrices
 * (k0, n0), (k0 + 8, n0), (k0, n0 + 8), (k0 + 8, n0 + 8), transposed. */
__device__ __forceinline__ void ng_mma_ldm_b_cols2(uint32_t b0[2], uint32_t b1[2],
                                                   const uint16_t *tile, int ld, int k0, int n0,
                                                   int lane) {
    const int m = lane >> 3, r = lane & 7;
    uint32_t x[4];
    ng_ldmatrix<4, true>(x, tile + (k0 + 8 * (m & 1) + r) * ld + n0 + 8 * (m >> 1));
    b0[0] = x[0], b0[1] = x[1], b1[0] = x[2], b1[1] = x[3];
}

/* D += A B on the tensor cores: mma.sync.aligned.m16n8k16.row.col.f32 with
 * fp16 or bf16 A and B (T), fp32 C = D. Inline PTX, as ldmatrix and
 * cp.async are (kernels/cuda_ptx.h); the CPU emulator of the CUDA execution
 * model (tests/cuda_emu) serves the same fragments through
 * NG_EMU_MMA_M16N8K16. */
template <ng_dtype T>
__device__ __forceinline__ void ng_mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(NG_CUDA_EMU)
    NG_EMU_MMA_M16N8K16(T == NG_BF16, c, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (T == NG_F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void)c, (void)a, (void)b;
    __trap(); /* never launched: the dispatcher requires compute capability 8.0 */
#endif
}
#endif

#endif /* NG_KERNELS_ATTENTION_MMA_H */
