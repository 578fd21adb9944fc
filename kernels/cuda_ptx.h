/*
 * kernels/cuda_ptx.h - the data-movement PTX the tensor-core kernels build on:
 * ldmatrix (warp-collective loads of 8x8 16-bit matrices from shared memory
 * into mma.sync fragments) and cp.async (asynchronous global -> shared copies
 * in commit groups). Included by kernels/attention_mma.h.
 *
 * Three layers, as ng_mma_16816 there: under nvcc inline PTX; under the CPU
 * emulator (NG_CUDA_EMU, tests/cuda_emu) the instruction's model in
 * cuda_emu.h / cuda_emu.cpp (NG_EMU_LDMATRIX, NG_EMU_CP_ASYNC*), which checks
 * what the hardware leaves undefined (alignment, shared / global addresses, a
 * lane missing from the warp, copies never waited for) and shows a missing
 * wait as a wrong value or a race; nothing at all in a plain C / C++ build.
 *
 * ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16 (PTX ISA, "Data
 * Movement and Conversion Instructions: ldmatrix", the "ldmatrix fragment"
 * figure): every lane of the warp executes it. Lanes 0-7 give the addresses
 * of rows 0-7 of matrix 0, lanes 8-15 those of matrix 1, 16-23 of matrix 2,
 * 24-31 of matrix 3 (.x1 uses lanes 0-7 only, .x2 lanes 0-15); a row is 8
 * contiguous 16-bit elements, 16-byte aligned, in shared memory. Register i
 * of lane l (g = l / 4, t = l % 4) receives matrix i's elements
 *   (row g, cols 2t, 2t + 1)           without .trans,
 *   (rows 2t, 2t + 1, col g)           with .trans (the transpose's row g),
 * the lower column (row) in the low half: exactly the mma.m16n8k16 A / B / C
 * fragment of one 8x8 quarter (kernels/attention_mma.h).
 *
 * cp.async.{ca,cg}.shared.global [dst], [src], bytes (PTX ISA, "cp.async",
 * "cp.async.commit_group", "cp.async.wait_group / cp.async.wait_all"): per
 * thread; 4, 8 or 16 bytes with .ca (cached in L1), 16 with .cg (L2 only),
 * dst and src aligned to the size. commit_group closes the thread's copies
 * issued since the last commit into a group; wait_group N waits until at most
 * the newest N committed groups are pending; wait_all commits and waits for
 * all. A wait orders the copies before the executing thread's later accesses
 * only: other threads see the data after that thread's wait and a barrier
 * (__syncthreads) between.
 *
 * The ldmatrix wrappers need sm_75, cp.async sm_80: below that they trap
 * (no kernel dispatches there).
 */
#ifndef NG_KERNELS_CUDA_PTX_H
#define NG_KERNELS_CUDA_PTX_H

#include <stdint.h>

#if defined(__CUDACC__) || defined(NG_CUDA_EMU)

/* Loads N (1, 2 or 4) 8x8 matrices of 16-bit elements: r[i] is matrix i's
 * fragment of this lane, `row` this lane's row address (shared memory; lanes
 * whose rows the form does not use may pass any address). Trans: the
 * matrices' transposes. */
template <int N, bool Trans = false>
__device__ __forceinline__ void ng_ldmatrix(uint32_t *r, const void *row) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(NG_CUDA_EMU)
    NG_EMU_LDMATRIX(N, Trans, r, row);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    /* No "memory" clobber, as the loads of a fragment should stay free to be
     * scheduled: the tile's stores are ordered before it by the barrier
     * (__syncthreads / __syncwarp, compiler barriers both) that a tile
     * written by other lanes needs anyway. */
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (N == 1 && !Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                     : "=r"(r[0])
                     : "r"(a));
    else if constexpr (N == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                     : "=r"(r[0])
                     : "r"(a));
    else if constexpr (N == 2 && !Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(a));
    else if constexpr (N == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(a));
    else if constexpr (!Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#else
    (void)r, (void)row;
    __trap(); /* never launched: ldmatrix needs compute capability 7.5 */
#endif
}

/* cp.async.ca.shared.global of Bytes (4, 8 or 16) bytes from global `src` to
 * shared `dst`, both Bytes-aligned. */
template <int Bytes>
__device__ __forceinline__ void ng_cp_async_ca(void *dst, const void *src) {
    static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(NG_CUDA_EMU)
    NG_EMU_CP_ASYNC(Bytes, 0, dst, src);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(Bytes)
                 : "memory");
#else
    (void)dst, (void)src;
    __trap(); /* never launched: cp.async needs compute capability 8.0 */
#endif
}

/* cp.async.cg.shared.global of 16 bytes (the only size .cg takes). */
__device__ __forceinline__ void ng_cp_async_cg16(void *dst, const void *src) {
#if defined(NG_CUDA_EMU)
    NG_EMU_CP_ASYNC(16, 1, dst, src);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
    (void)dst, (void)src;
    __trap();
#endif
}

/* cp.async.commit_group: this thread's copies since the last commit become a group. */
__device__ __forceinline__ void ng_cp_async_commit() {
#if defined(NG_CUDA_EMU)
    NG_EMU_CP_ASYNC_COMMIT();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
    __trap();
#endif
}

/* cp.async.wait_group N: returns when at most the newest N of this thread's
 * committed groups are still pending; the others' data is then visible to
 * this thread. */
template <int N>
__device__ __forceinline__ void ng_cp_async_wait_group() {
    static_assert(N >= 0 && N < 8, "cp.async.wait_group N: a small immediate");
#if defined(NG_CUDA_EMU)
    NG_EMU_CP_ASYNC_WAIT(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
    __trap();
#endif
}

/* cp.async.wait_all: commit_group, then wait_group 0. */
__device__ __forceinline__ void ng_cp_async_wait_all() {
#if defined(NG_CUDA_EMU)
    NG_EMU_CP_ASYNC_WAIT_ALL();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#else
    __trap();
#endif
}

#endif /* __CUDACC__ || NG_CUDA_EMU */

#endif /* NG_KERNELS_CUDA_PTX_H */
