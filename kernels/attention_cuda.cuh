/*
 * kernels/attention_cuda.cuh - what the CUDA files of safe_sdpa share: the
 * SIMT geometry and per-score device helpers (the per-score math itself is
 * attention_math.h's, shared with the CPU), the host helpers of
 * attention.cu, and the launcher each kernel file gives attention.cu. A
 * private header of the kernels (the public one is kernels/attention.h).
 *
 * One file per algorithm:
 *   attention.cu            the C launchers: argument checks, workspaces, and
 *                           which kernel a call takes (dispatch)
 *   attention_simt_fwd.cu   SIMT forward: fp32, head dims up to 256, E != Ev
 *   attention_bwd_pre.cu    the backward's pre-kernels: D = rowsum(dout . out)
 *                           into the workspace, and the live flags of a
 *                           padding mask; both backward paths read them
 *   attention_simt_bwd.cu   SIMT backward: the dk / dv and dq kernels
 *   attention_mma_fwd.cu    tensor-core forward: fp16 / bf16, E == Ev in
 *                           {64, 128}, sm_80+ (mma.sync m16n8k16)
 *   attention_mma_bwd.cu    tensor-core backward, the same shapes
 *   attention_decode.cu     decode (L <= 16 rows): the SIMT and tensor-core
 *                           kernels and the split-KV combine
 *   attention_bwd.cuh       the backward's per-score terms and D, both paths
 *   attention_mma_tile.cuh  the tensor-core tile helpers: staging, fragment
 *                           products, online softmax, score variants
 *
 * Grids are one-dimensional: block x = blk + nblk * (h + heads * b) (see
 * block_coords), so batch x heads may exceed the 65535 of gridDim.y / z.
 * fp64 has no CUDA path (it exists for gradcheck on the CPU): NG_ERR_DTYPE.
 */
#ifndef NG_KERNELS_ATTENTION_CUDA_CUH
#define NG_KERNELS_ATTENTION_CUDA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/cuda_launch.h"

namespace ng_attn_cu {

/* ---- host helpers (attention.cu) ------------------------------------------ */

/* What is cached per device (compute capability, SM count, and per kernel
 * the dynamic shared memory it has been allowed: cudaFuncSetAttribute is
 * per device). Device ordinals past kMaxDevices are queried every time. */
constexpr int kMaxDevices = 64;

ng_status cuda_check();
/* The device the launch goes to; -1 when it cannot be read. */
int current_device();
/* Compute capability major of the current device; 0 when it cannot be read
 * (and the SIMT kernels run). */
int device_major();
/* The most dynamic shared memory a block of the current device may opt into. */
int device_optin_smem();
/* The current device's SM count (0 when it cannot be read). */
int device_sms();
/* The one-dimensional grid of nblk blocks per (b, head) (block_coords). */
ng_status fold_grid(int64_t nblk, int64_t heads, int64_t batch, dim3 *grid);
/* A [B, heads, seq, D] operand of elements `el` bytes wide whose every row
 * starts on 16 bytes. */
int rows_aligned(const void *p, const int64_t stride[3], int64_t el);
/* The same for 16-bit elements. */
int rows_aligned16(const void *p, const int64_t stride[3]);
/* The tensor-core kernels take fp16 / bf16 with E == Ev in {64, 128} on a
 * device of compute capability 8.0 or newer; everything else runs SIMT. */
int mma_eligible(const ng_attention_args *a);
/* How many live flags the backward takes: one per 64-key block of each kv
 * head with a padding mask (a mask that does not depend on the query), [B,
 * Hkv, ceil(S / 64)]; 0 without one. Shape and mask only. */
int64_t bwd_live_count(const ng_attention_args *a);
/* The backward's workspace after D: the live flags (NULL without them). */
const int *bwd_live(const ng_attention_args *a, const float *ws);

/* Dynamic shared memory above 48 KiB (K and V tiles of head dims > 192, the
 * tensor-core backward) must be opted into per kernel and device; `allowed`
 * is the kernel's own per-device record of what it was granted. */
template <typename Kernel>
ng_status allow_smem(Kernel kernel, size_t bytes, std::atomic<int> (&allowed)[kMaxDevices]) {
    if (bytes <= 48 * 1024) return NG_OK;
    const int dev = current_device();
    if (dev >= 0 && dev < kMaxDevices &&
        (size_t)allowed[dev].load(std::memory_order_relaxed) >= bytes)
        return NG_OK;
    NG_TRY(ng_cuda_record(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes)));
    if (dev >= 0 && dev < kMaxDevices) {
        int seen = allowed[dev].load(std::memory_order_relaxed);
        while (seen < (int)bytes && !allowed[dev].compare_exchange_weak(seen, (int)bytes)) {
        }
    }
    return NG_OK;
}

/* ---- the kernel files' launchers ------------------------------------------
 * T: NG_F32, NG_F16 or NG_BF16 (the tensor-core ones: NG_F16, NG_BF16),
 * instantiated in each file for those. a: checked, non-empty, mask NULL
 * without a mask (attention.cu's dispatch). dsum: the pre-kernel's D (the
 * workspace) or NULL, when the backward kernels compute D themselves. */
template <ng_dtype T>
ng_status simt_fwd(const ng_attention_args *a, cudaStream_t st);
template <ng_dtype T>
ng_status bwd_pre(const ng_attention_args *a, cudaStream_t st, float *dsum);
template <ng_dtype T>
ng_status simt_bwd(const ng_attention_args *a, cudaStream_t st, const float *dsum);
/* vec: every row of q, k, v (and dout in the backward) starts on 16 bytes */
template <ng_dtype T>
ng_status mma_fwd(const ng_attention_args *a, cudaStream_t st, int vec);
template <ng_dtype T>
ng_status mma_bwd(const ng_attention_args *a, cudaStream_t st, int vec, const float *dsum);
/* ws: the split-KV workspace (decode_workspace_bytes) or NULL */
template <ng_dtype T>
ng_status decode(const ng_attention_args *a, cudaStream_t st, float *ws);
/* A forward the decode kernels take (L <= NG_ATTN_DEC_MAX_L, S >= 1). */
int decode_shape(const ng_attention_args *a);
/* The decode's split-KV workspace for a, 0 without splits (or when a is not
 * a decode shape). Shape and current device only: a need not be checked. */
int64_t decode_workspace_bytes(const ng_attention_args *a);

/* ---- device helpers --------------------------------------------------------
 * SIMT: one warp per query row (fwd, dq) or per key (dk/dv); each lane
 * holds head-dim elements lane, lane+32, ... (NT = ceil(E/32) of them,
 * E <= 256), dot products are warp reductions, K/V (or Q/dout) tiles are
 * staged in shared memory as fp32. */
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kFwdRows = 4;                 /* query rows per warp, forward */
constexpr int kFwdBQ = kWarps * kFwdRows;   /* 32 query rows per block */
constexpr int kBK = 32;                     /* keys per shared tile, one per lane */
constexpr int kBwdPer = 2;                  /* keys (dkdv) or rows (dq) per warp */
constexpr int kBwdBlock = kWarps * kBwdPer; /* 16 keys or rows per block */
constexpr int kBwdBQ = 16;                  /* query rows per shared tile in dkdv */
constexpr int kLiveKeys = 64;               /* keys per block of the backward's live flags */
static_assert(kLiveKeys % kBwdBlock == 0, "a SIMT dk / dv block inside one flag's keys");
constexpr unsigned kFull = 0xffffffffu;
/* Resident blocks per SM the SIMT backward kernels are compiled for: a
 * ceiling of 65536 / (2 x 256) = 128 registers a thread. Left to itself
 * ptxas settled at 64 or 80 registers (4 or 3 blocks) and spilled there. The
 * dk / dv kernel at NT = 8 (head dims 129-256) holds 64 fp32 accumulators and
 * K / V values a thread and spills even at 128: it asks for one block (255
 * registers). The forward keeps its rows in local memory (its row loop is
 * not unrolled) and needs few registers: unbounded (a minimum of 0 blocks
 * emits no .minnctapersm) it takes 32 and does not spill, except at NT = 8,
 * which asks for 4 blocks (64 registers; sm_75 holds at most 4 blocks of
 * 256 threads) where it spilled at 40. */
constexpr int kSimtMinBlocks = 2;

/* cp.async exists from sm_80; the sm_75 device code of the SIMT decode
 * kernel (never asked for it there: launch_decode) keeps ordinary loads. */
#if defined(NG_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
constexpr bool kAsyncCopy = true;
#else
constexpr bool kAsyncCopy = false;
#endif

/* The tensor-core kernels run from sm_80 on only (mma_eligible, dec_mma).
 * Their bodies sit inside #if NG_MMA_DEVICE: for an older architecture each
 * compiles to a trap (NG_MMA_UNREACHABLE), so neither the build nor the
 * fatbin carries sm_75 tensor-core code that can never run (56 s of nvcc
 * time for attention_mma_bwd.cu alone). The host pass and the emulator see
 * the real bodies. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define NG_MMA_DEVICE 0
#define NG_MMA_UNREACHABLE() __trap()
#else
#define NG_MMA_DEVICE 1
#endif

/* This block's place in a one-dimensional grid of nblk blocks per (batch,
 * head): block x = blk + nblk * (h + heads * b). */
struct block_coord {
    int64_t blk, h, b;
};
__device__ __forceinline__ block_coord block_coords(int64_t nblk, int64_t heads) {
    const int64_t x = blockIdx.x, bh = x / nblk;
    return {x % nblk, bh % heads, bh / heads};
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
    return x;
}

__device__ __forceinline__ float warp_max_nan(float x) {
    for (int o = 16; o > 0; o >>= 1) x = ng_attn_max_nan_f32(x, __shfl_xor_sync(kFull, x, o));
    return x;
}

template <ng_dtype T>
__device__ __forceinline__ float ld(const void *p, int64_t i) {
    return ng_load_f32(p, T, i);
}

/* The mask's value at (b, h, i, j): 0 without a mask, -inf where masked. */
__device__ __forceinline__ double mask_value(const ng_attention_args &a, int64_t b, int64_t h,
                                             int64_t i, int64_t j) {
    if (a.mask_kind == NG_MASK_NONE) return 0.0;
    const int64_t off =
        b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2] + j * a.mask_stride[3];
    return ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype, off);
}

/* Scaled raw score -> guarded, masked score (-inf where masked). */
__device__ __forceinline__ float guarded_score(const ng_attention_args &a, float raw, int64_t b,
                                               int64_t h, int64_t i, int64_t j) {
    float s = ng_attn_transform_f32(raw, (float)a.max_score, (float)a.softcap);
    if (a.is_causal && ng_attn_causal_masked(i, j)) return -INFINITY;
    if (a.mask_kind != NG_MASK_NONE) {
        const double mv = mask_value(a, b, h, i, j);
        if (mv == -INFINITY) return -INFINITY;
        s += (float)mv;
    }
    return s;
}

__device__ __forceinline__ float dropout_scale(const ng_attention_args &a, int64_t b, int64_t h,
                                               int64_t i, int64_t j) {
    if (!(a.dropout_p > 0.0)) return 1.0f;
    uint64_t e = (uint64_t)(((b * a.Hq + h) * a.L + i) * a.S + j);
    return ng_attn_dropout_keep(a.seed, a.offset, e, (float)a.dropout_p)
               ? (float)(1.0 / (1.0 - a.dropout_p))
               : 0.0f;
}

/* Stage rows [r0, r0+n) of a [seq, dim] slice as fp32 into `rows` tile rows
 * tile_ld floats apart (zeros past n), by the block's NTHREADS threads. */
template <ng_dtype T, int NTHREADS = kThreads>
__device__ __forceinline__ void stage(float *tile, int64_t tile_ld, int rows, const void *base,
                                      int64_t rs, int64_t r0, int64_t n, int64_t dim) {
    for (int x = threadIdx.x; x < rows * dim; x += NTHREADS) {
        int r = x / (int)dim, d = x % (int)dim;
        tile[r * tile_ld + d] = r < n ? ld<T>(base, (r0 + r) * rs + d) : 0.0f;
    }
}

/* A finished query row i of head h: out = acc / l (the lane holds columns
 * lane + 32 u) and lse = m + log l (-inf and zeros for an empty row). */
template <ng_dtype T, int NT>
__device__ __forceinline__ void store_row(const ng_attention_args &a, int64_t b, int64_t h,
                                          int64_t i, const float (&acc)[NT], float m, float l) {
    const int lane = threadIdx.x & 31;
    const float inv = ng_attn_inv_sum_f32(l);
    const int64_t ob = b * a.out_stride[0] + h * a.out_stride[1] + i * a.out_stride[2];
    for (int u = 0; u < NT; u++) {
        const int d = lane + 32 * u;
        if (d < a.Ev) ng_store_f32(a.out, T, ob + d, acc[u] * inv);
    }
    if (lane == 0) ((float *)a.lse)[(b * a.Hq + h) * a.L + i] = ng_attn_lse_f32(m, l);
}

/* Keys [j0, j0 + nk) of K and V into ks and vs (kBK rows each), between
 * barriers: the previous tile's readers are done, the new one is complete. */
template <ng_dtype T>
__device__ __forceinline__ void stage_kv(float *ks, float *vs, const void *kb, const void *vb,
                                         const ng_attention_args &a, int64_t j0, int64_t nk) {
    __syncthreads();
    stage<T>(ks, a.E, kBK, kb, a.k_stride[2], j0, nk, a.E);
    stage<T>(vs, a.Ev, kBK, vb, a.v_stride[2], j0, nk, a.Ev);
    __syncthreads();
}

template <ng_dtype T>
__device__ __forceinline__ const void *slice(const void *p, int64_t off) {
    return (const char *)p + off * (int64_t)(T == NG_F32 ? 4 : 2);
}

} // namespace
} // namespace ng_attn_cu

#endif
