/*
 * tests/cuda_emu/cuda_emu.h - the device side of the CUDA execution model as
 * host C++, for running nanguard's own kernels (the .cu files of kernels/) on the CPU.
 *
 * A .cu file compiled by g++ with -I tests/cuda_emu/include gets this header
 * through <cuda_runtime.h>. The kernel sources change only mechanically for
 * it: launches go through NG_LAUNCH and shared memory through NG_SHARED and
 * NG_DYNAMIC_SMEM (kernels/cuda_launch.h), and the inline PTX sits behind
 * wrappers: mma.sync behind ng_mma_16816 (kernels/attention_mma.h), ldmatrix
 * and cp.async behind ng_ldmatrix / ng_cp_async_* (kernels/cuda_ptx.h).
 *
 * Model (the runtime is tests/cuda_emu/cuda_emu.cpp):
 * - Blocks run one after another; the threads of a block are fibers with
 *   stacks of their own. A thread runs until it reaches __syncthreads, a warp
 *   intrinsic or its end, then the next lane of its warp runs; when the warp
 *   has none left, the schedule picks the next warp. __syncthreads releases
 *   when every thread of the block has arrived; a barrier that part of the
 *   block can never reach (threads that exited, or wait elsewhere) is an
 *   error, never a hang.
 * - Warp intrinsics (__shfl*_sync, __ballot_sync, __any_sync, __all_sync,
 *   __syncwarp, mma.sync, ldmatrix) complete when every lane their mask names has
 *   reached the same intrinsic with the same mask; a mask naming a lane that
 *   has exited or does not exist, a lane outside its own mask, or lanes of
 *   one mask at different intrinsics is an error.
 * - NG_SHARED variables live in one arena (each its own place, those of
 *   function templates too), and dynamic shared memory in a buffer of
 *   exactly the launch's size; both are filled before each block with 0xff
 *   bytes in the first schedule and 0x00 bytes in the second, so reading
 *   shared memory before writing it changes results.
 * - Every launch runs twice from the same device memory: blocks in order,
 *   lanes in order, warps in lockstep (each advances one warp intrinsic per
 *   sweep); then blocks shuffled, lanes reversed, and the next warp drawn at
 *   random (seed NG_EMU_SEED) whenever one stops. The two results must agree
 *   bit for bit. NG_EMU_SCHEDULES=1 runs the first only (the sanitizer
 *   build's sample).
 * - With the kernels compiled for it (NG_EMU_RACECHECK, gcc's
 *   -fsanitize=thread instrumentation calling into cuda_emu.cpp), every
 *   shared-memory access is checked for a hazard with another warp in the
 *   same barrier epoch, and for a read of bytes the block never wrote.
 * - Launch limits are a GPU's: at most 1024 threads (z <= 64) per block,
 *   gridDim.x < 2^31, gridDim.y and z <= 65535, dynamic shared memory above
 *   48 KiB only after cudaFuncSetAttribute raised it and never above the
 *   device's opt-in limit (227 KiB on sm_90), kernel parameters <= 32764
 *   bytes. A refused launch prints why (kernel, value, limit) and sets
 *   cudaErrorInvalidConfiguration / cudaErrorInvalidValue, as a GPU would.
 * - ldmatrix: every lane's row address must be 16-byte aligned and in shared
 *   memory (those the form uses); the rows are read by the lanes that name
 *   them, the fragments dealt per the PTX ISA's layout.
 * - cp.async: per thread, a copy's source is read when it is issued (it must
 *   lie in one device buffer, the destination in shared memory, both aligned
 *   to the size); the destination is written only when the thread's
 *   wait_group / wait_all retires its group, so reading it before (a missing
 *   wait) reads what was there, the poison or the race detector's unwritten
 *   bytes. Copies still queued when the thread ends are an error.
 * - Device memory (cudaMalloc) is host memory between inaccessible guard
 *   regions, so a stray access faults or is caught by AddressSanitizer.
 * Errors inside a kernel print the kernel, block, thread and source line and
 * leave a sticky cudaErrorLaunchFailure, as a faulting kernel does.
 */
#ifndef NG_CUDA_EMU_H
#define NG_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "include/cuda_bf16.h"
#include "include/cuda_runtime_api.h"

/* ---- keywords --------------------------------------------------------------- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
/* Static shared memory is declared with NG_SHARED (kernels/cuda_launch.h),
 * which the emulator places in its own arena, poisons before every block and
 * watches; a plain __shared__ (which it could do neither for, e.g. in a
 * function template) does not compile. */
#define __shared__                                                                                 \
    static_assert(false, "declare shared memory with NG_SHARED(type, name, [dims]) "               \
                         "(kernels/cuda_launch.h) so that the emulator poisons and watches it");

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}

#define NG_EMU_STR2(x) #x
#define NG_EMU_STR(x) NG_EMU_STR2(x)
#define NG_EMU_SITE __FILE__ ":" NG_EMU_STR(__LINE__)

namespace ng_emu {

/* The running emulated thread (its first member is threadIdx). */
struct lane_view {
    uint3 idx;
};
extern lane_view *g_cur;
extern uint3 g_block_idx;
extern dim3 g_block_dim, g_grid_dim;

enum warp_kind {
    W_SHFL_IDX,
    W_SHFL_UP,
    W_SHFL_DOWN,
    W_SHFL_XOR,
    W_BALLOT,
    W_ANY,
    W_ALL,
    W_SYNCWARP,
    W_MMA,
    W_LDMATRIX
};

void syncthreads(const char *site);
int syncthreads_or(int pred, const char *site);
uint64_t warp_op(warp_kind kind, unsigned mask, uint64_t value, int arg, int width,
                 const char *site);
unsigned activemask();
void mma_m16n8k16(int bf16, float c[4], const uint32_t a[4], const uint32_t b[2], const char *site);
bool ldmatrix_row(int num, const void *row, const char *site);
void ldmatrix_post(int num, int trans, uint32_t *r, const uint32_t row[4], const char *site);
void cp_async(int bytes, int cg, void *dst, const void *src, const char *site);
void cp_async_commit(const char *site);
int cp_async_retire(int n, void **dst, uint32_t words[4], const char *site);
[[noreturn]] void trap(const char *site);
void *dynamic_smem();
struct smem_slot {
    uint32_t off, size; /* size 0: not placed yet */
};
void *static_smem(smem_slot *slot, size_t size, size_t align, const char *name, const char *site);

inline void syncwarp(const char *site, unsigned mask = 0xffffffffu) {
    (void)warp_op(W_SYNCWARP, mask, 0, 0, 32, site);
}

template <typename T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "shuffle of a type over 64 bits");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <typename T>
inline T from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
template <typename T>
inline T shfl(warp_kind k, const char *site, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(warp_op(k, mask, to_bits(v), arg, width, site));
}

/* ---- launches ------------------------------------------------------------ */
struct kernel_body {
    virtual void run() = 0;

  protected:
    ~kernel_body() = default;
};

cudaError_t launch_impl(const char *kernel, const char *where, const void *fn, dim3 grid,
                        dim3 block, size_t smem, cudaStream_t stream, size_t param_bytes,
                        kernel_body *body);
cudaError_t func_set_attribute(const void *fn, int attr, int value);

/* Bytes of the parameter buffer: each parameter at its own alignment, as
 * the CUDA ABI lays them out. */
template <typename... P>
constexpr size_t param_bytes() {
    size_t off = 0;
    ((off = (off + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
    return off;
}

template <typename... P, typename... A>
void launch(const char *kernel, const char *where, void (*fn)(P...), dim3 grid, dim3 block,
            size_t smem, cudaStream_t stream, A &&...args) {
    struct body_t final : kernel_body {
        void (*fn)(P...);
        std::tuple<std::decay_t<P>...> params; /* the kernel's own copy, as on a GPU */
        explicit body_t(void (*f)(P...), A &&...a) : fn(f), params(std::forward<A>(a)...) {}
        void run() override { std::apply(fn, params); }
    } body(fn, std::forward<A>(args)...);
    launch_impl(kernel, where, reinterpret_cast<const void *>(fn), grid, block, smem, stream,
                param_bytes<std::decay_t<P>...>(), &body);
}

} // namespace ng_emu

#define NG_EMU_UNPAREN(...) __VA_ARGS__
#define NG_LAUNCH(kernel, grid, block, smem, stream, ...)                                          \
    ng_emu::launch(#kernel, __PRETTY_FUNCTION__, NG_EMU_UNPAREN kernel, (grid), (block), (smem),   \
                   (stream), __VA_ARGS__)
#define NG_DYNAMIC_SMEM(type, name) type *name = static_cast<type *>(ng_emu::dynamic_smem())
/* NG_SHARED(float, red, [32]): a reference to the variable's place in the
 * arena (the slot, a static of the enclosing function, is one per template
 * instantiation, as the __shared__ variable is). */
#define NG_SHARED(type, name, ...)                                                                 \
    static ng_emu::smem_slot ng_emu_slot_##name;                                                   \
    typedef type ng_emu_type_##name __VA_ARGS__;                                                   \
    ng_emu_type_##name &name = *static_cast<ng_emu_type_##name *>(                                 \
        ng_emu::static_smem(&ng_emu_slot_##name, sizeof(ng_emu_type_##name),                       \
                            alignof(ng_emu_type_##name), #name, NG_EMU_SITE))

template <typename F>
inline cudaError_t cudaFuncSetAttribute(F *fn, enum cudaFuncAttribute attr, int value) {
    return ng_emu::func_set_attribute(reinterpret_cast<const void *>(fn), (int)attr, value);
}

/* ---- built-in variables -------------------------------------------------- */
#define threadIdx (ng_emu::g_cur->idx)
#define blockIdx (ng_emu::g_block_idx)
#define blockDim (ng_emu::g_block_dim)
#define gridDim (ng_emu::g_grid_dim)
constexpr int warpSize = 32;

/* ---- synchronisation and warp intrinsics --------------------------------- */
#define __syncthreads() ng_emu::syncthreads(NG_EMU_SITE)
#define __syncthreads_or(pred) ng_emu::syncthreads_or((pred), NG_EMU_SITE)
#define __syncwarp(...) ng_emu::syncwarp(NG_EMU_SITE, ##__VA_ARGS__)
#define __shfl_sync(...) ng_emu::shfl(ng_emu::W_SHFL_IDX, NG_EMU_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ng_emu::shfl(ng_emu::W_SHFL_UP, NG_EMU_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) ng_emu::shfl(ng_emu::W_SHFL_DOWN, NG_EMU_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ng_emu::shfl(ng_emu::W_SHFL_XOR, NG_EMU_SITE, __VA_ARGS__)
#define __ballot_sync(mask, pred)                                                                  \
    ((unsigned)ng_emu::warp_op(ng_emu::W_BALLOT, (mask), (pred) != 0, 0, 32, NG_EMU_SITE))
#define __any_sync(mask, pred)                                                                     \
    ((int)ng_emu::warp_op(ng_emu::W_ANY, (mask), (pred) != 0, 0, 32, NG_EMU_SITE))
#define __all_sync(mask, pred)                                                                     \
    ((int)ng_emu::warp_op(ng_emu::W_ALL, (mask), (pred) != 0, 0, 32, NG_EMU_SITE))
#define __activemask() ng_emu::activemask()
#define __trap() ng_emu::trap(NG_EMU_SITE)
/* mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, for ng_mma_16816 */
#define NG_EMU_MMA_M16N8K16(bf16, c, a, b) ng_emu::mma_m16n8k16((bf16), (c), (a), (b), NG_EMU_SITE)

/* ldmatrix and cp.async, for kernels/cuda_ptx.h. Their memory accesses are
 * made here, in the kernel's own translation unit, so that the race detector
 * (NG_EMU_RACECHECK) sees them as the accesses of the thread that makes them:
 * an ldmatrix row as a 16-byte read by the lane that gives its address, a
 * cp.async copy as a store by the issuing thread at the wait that retires it
 * (not before: until then the destination holds what it held). */
namespace ng_emu {
typedef uint32_t __attribute__((may_alias)) u32_alias;
/* ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16: the lane checks and
 * reads its row (when the form uses it), then the warp exchanges them. */
inline void ldmatrix(int num, int trans, uint32_t *r, const void *row, const char *site) {
    uint32_t w[4] = {0, 0, 0, 0};
    if (ldmatrix_row(num, row, site)) {
        const u32_alias *p = static_cast<const u32_alias *>(row);
        for (int i = 0; i < 4; i++) w[i] = p[i];
    }
    ldmatrix_post(num, trans, r, w, site);
}
/* cp.async.wait_group n: every copy of the groups it retires lands now. */
inline void cp_async_wait(int n, const char *site) {
    void *dst;
    uint32_t w[4];
    int bytes;
    while ((bytes = cp_async_retire(n, &dst, w, site)) > 0) {
        u32_alias *d = static_cast<u32_alias *>(dst);
        for (int i = 0; i < bytes / 4; i++) d[i] = w[i];
    }
}
} // namespace ng_emu
#define NG_EMU_LDMATRIX(num, trans, r, row)                                                        \
    ng_emu::ldmatrix((num), (trans), (r), (row), NG_EMU_SITE)
#define NG_EMU_CP_ASYNC(bytes, cg, dst, src)                                                       \
    ng_emu::cp_async((bytes), (cg), (dst), (src), NG_EMU_SITE)
#define NG_EMU_CP_ASYNC_COMMIT() ng_emu::cp_async_commit(NG_EMU_SITE)
#define NG_EMU_CP_ASYNC_WAIT(n) ng_emu::cp_async_wait((n), NG_EMU_SITE)
#define NG_EMU_CP_ASYNC_WAIT_ALL()                                                                 \
    (ng_emu::cp_async_commit(NG_EMU_SITE), ng_emu::cp_async_wait(0, NG_EMU_SITE))

/* ---- atomics: one host thread runs every emulated thread, and none is
 * interrupted inside these, so a plain read-modify-write is atomic ------- */
namespace ng_emu {
/* *p = f(*p); returns the old value */
template <typename T, typename F>
inline T rmw(T *p, F f) {
    const T o = *p;
    *p = f(o);
    return o;
}
} // namespace ng_emu
template <typename T>
inline T atomicAdd(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return o + v; });
}
template <typename T>
inline T atomicSub(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return o - v; });
}
template <typename T>
inline T atomicMax(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return v > o ? v : o; });
}
template <typename T>
inline T atomicMin(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return v < o ? v : o; });
}
template <typename T>
inline T atomicExch(T *p, T v) {
    return ng_emu::rmw(p, [v](T) { return v; });
}
template <typename T>
inline T atomicOr(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return o | v; });
}
template <typename T>
inline T atomicAnd(T *p, T v) {
    return ng_emu::rmw(p, [v](T o) { return o & v; });
}
template <typename T>
inline T atomicCAS(T *p, T cmp, T v) {
    return ng_emu::rmw(p, [cmp, v](T o) { return o == cmp ? v : o; });
}

/* ---- device functions ---------------------------------------------------- */
inline long long __double_as_longlong(double d) { return ng_emu::bit_cast<long long>(d); }
inline double __longlong_as_double(long long x) { return ng_emu::bit_cast<double>(x); }
inline int __float_as_int(float f) { return ng_emu::bit_cast<int>(f); }
inline float __int_as_float(int x) { return ng_emu::bit_cast<float>(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

#endif /* NG_CUDA_EMU_H */
