/*
 * kernels/attention.cu - safe_sdpa on CUDA: tiled attention with an online
 * softmax, fp32 accumulation, the per-score math of attention_math.h.
 *
 * Two implementations of the same three kernels (forward, dk/dv, dq) and
 * of the decode forward (L <= 16 rows against S >= 1 keys, with its
 * split-KV combine):
 * - tensor cores (mma.sync m16n8k16) for fp16 / bf16 with E == Ev in
 *   {64, 128} on sm_80+, described at their sections below;
 * - SIMT for everything else (fp32, other head dims up to 256, E != Ev).
 *
 * SIMT: one warp per query row (fwd, dq) or per key (dk/dv); each lane
 * holds head-dim elements lane, lane+32, ... (NT = ceil(E/32) of them,
 * E <= 256), dot products are warp reductions, K/V (or Q/dout) tiles are
 * staged in shared memory as fp32.
 *
 * Grids are one-dimensional: block x = blk + nblk * (h + heads * b) (see
 * block_coords), so batch x heads may exceed the 65535 of gridDim.y / z.
 *
 *   fwd:  nblk = ceil(L/32) per (b, h), 8 warps x 4 query rows. Per tile of 32
 *         keys, lane j owns key j's score: guarded, masked, folded into
 *         (m, l) with one warp max and one warp sum, then p_j is broadcast
 *         lane by lane into the [Ev] accumulator.
 *   bwd:  two kernels (key blocks, query blocks), no atomics; the dq one
 *         computes the scores again (docs/cuda.md says why):
 *         dot:  D = rowsum(dout . out) of every query row, once, into the
 *               caller's workspace (ng_attention_bwd_cuda_ws): fp32
 *               [B, Hq, L] contiguous, row (b, h, i) at (b Hq + h) L + i (the
 *               layout of lse), 4 B Hq L bytes; one warp per row, row_dot.
 *               Without a workspace (ng_attention_bwd_cuda, which allocates
 *               nothing) it is not launched and the two kernels below compute
 *               D themselves with the same row_dot, per staged query tile
 *               (dkdv) or per block (dq). Every backward kernel takes the
 *               source of D as a template flag (WsD), so that neither
 *               instantiation carries the other's registers.
 *         live: with a padding mask and the workspace, one int per 64-key
 *               block of each kv head after D: whether any query head of
 *               the group sees a key of it; both dkdv kernels write
 *               dk = dv = 0 for a block that none does, computing nothing.
 *         dkdv: nblk = ceil(S/16) per (b, kv head), 8 warps x 2 keys; loops over the
 *               query heads of the group and all query tiles (16 rows staged
 *               with their lse and D).
 *         dq:   nblk = ceil(L/16) per (b, h), 8 warps x 2 query rows; loops over
 *               key tiles.
 * fp64 has no CUDA path (it exists for gradcheck on the CPU): NG_ERR_DTYPE.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/cuda_launch.h"
#include "kernels/attention_mma.h"

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

/* cp.async exists from sm_80; the sm_75 device code of the tensor-core and
 * decode kernels (never asked for it there: mma_eligible, launch_decode)
 * keeps ordinary loads. */
#if defined(NG_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
constexpr bool kAsyncCopy = true;
#else
constexpr bool kAsyncCopy = false;
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

/* ---- forward ------------------------------------------------------------ */

template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kThreads, NT > 4 ? 4 : 0)
    attention_fwd_kernel(ng_attention_args a) {
    NG_DYNAMIC_SMEM(float, smem);
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kFwdBQ), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = bc.blk * kFwdBQ, row0 = blk0 + warp * kFwdRows;
    const float scale = (float)a.scale;
    const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);

    float q[kFwdRows][NT], acc[kFwdRows][NT], m[kFwdRows], l[kFwdRows];
    for (int r = 0; r < kFwdRows; r++) {
        for (int t = 0; t < NT; t++) {
            int64_t e = lane + 32 * t, i = row0 + r;
            q[r][t] = (e < a.E && i < a.L) ? ld<T>(qb, i * a.q_stride[2] + e) : 0.0f;
            acc[r][t] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }

    const int64_t kend = a.is_causal ? NG_MIN(a.S, blk0 + kFwdBQ) : a.S;
    for (int64_t j0 = 0; j0 < kend; j0 += kBK) {
        const int64_t nk = NG_MIN((int64_t)kBK, kend - j0);
        stage_kv<T>(ks, vs, kb, vb, a, j0, nk);
        for (int r = 0; r < kFwdRows; r++) {
            const int64_t i = row0 + r, j = j0 + lane;
            float mine = 0.0f;
            for (int jj = 0; jj < nk; jj++) {
                float part = 0.0f;
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) part += q[r][t] * ks[jj * a.E + e];
                }
                float dot = warp_sum(part);
                if (lane == jj) mine = dot;
            }
            float s =
                (i < a.L && lane < nk) ? guarded_score(a, mine * scale, b, h, i, j) : -INFINITY;
            float m_new = ng_attn_max_nan_f32(m[r], warp_max_nan(s));
            float alpha = ng_attn_rescale_f32(m[r], m_new);
            float p = ng_attn_exp_shift_f32(s, m_new);
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = m_new;
            if (i < a.L && lane < nk) p *= dropout_scale(a, b, h, i, j);
            for (int t = 0; t < NT; t++) acc[r][t] *= alpha;
            for (int jj = 0; jj < nk; jj++) {
                float pj = __shfl_sync(kFull, p, jj);
                for (int t = 0; t < NT; t++) {
                    int d = lane + 32 * t;
                    if (d < a.Ev) acc[r][t] += pj * vs[jj * a.Ev + d];
                }
            }
        }
    }

    for (int r = 0; r < kFwdRows; r++) {
        if (row0 + r >= a.L) break;
        store_row<T, NT>(a, b, h, row0 + r, acc[r], m[r], l[r]);
    }
}

/* ---- decode: a few query rows against a long key sequence ---------------
 * A generation step has L <= NG_ATTN_DEC_MAX_L query rows against S >= 1
 * cached keys. The query-block kernels would leave most of a 32- or 64-row
 * block empty and read each kv head once per query head. Here a block takes
 * one kv head hk, up to kDecRows rows of the query heads that share it
 * (r = g * L + i is query i of head hk * G + g, G = Hq / Hkv) and one split
 * of the keys; each K / V tile staged in shared memory serves every query
 * head of the group.
 *
 * Warp w owns rows r0 + w + kDecWarps * t. Per tile of kBK keys, lane j
 * scores key j for each of its warp's rows (the query row, fp32, is
 * broadcast from shared memory) and the online softmax folds the tile as in
 * the forward; then P V broadcasts p_j lane by lane (lane d accumulates
 * columns d, d + 32, ...). A pair of probability zero (masked, dropped,
 * underflowed) is skipped: it adds nothing, not even 0 * NaN.
 *
 * Staging (FlashDecoding-style): K and V tiles stay in shared memory in
 * their own dtype (fp16 / bf16 as 16 bits, fp32 as fp32) and are widened to
 * fp32 in registers as they are read, which is exact. A K row is
 * ceil(E / W) W + W elements long (W = 16 bytes of the dtype: 8 or 4), so
 * that every row starts on 16 bytes and the lanes' 16-byte reads of 32
 * different rows hit distinct banks; a V row is ceil(Ev / W) W (the lanes
 * read consecutive columns of one row). Where every row of K and V starts on
 * 16 bytes and W divides E and Ev, and the device has cp.async (sm_80+), the
 * tiles are copied as 16-byte cp.async.cg chunks; otherwise element by
 * element with ordinary loads (the same layout). Each thread's walk over a
 * tile's chunks is precomputed (dec_walk): no divide in the loop.
 *
 * Pipeline: two stages of (K, V) tiles. At the top of each tile one
 * wait_group 0 and one barrier make tile t visible to every thread and
 * retire the other stage's readers; tile t + 1 is then issued into the
 * other stage and lands while tile t is scored and accumulated. Where two
 * stages do not fit the device's shared memory (E = Ev above 112 in fp32
 * and 200 in 16 bits on sm_75, above 172 in fp32 on sm_86 / sm_89), one
 * buffer takes the K tile, then the V tile, with a barrier on each side of
 * each.
 *
 * With a mask, a tile the mask hides from every row of the block (padding)
 * is not read: its probabilities would all be 0, nothing would change. The
 * scan for the next tile runs before the top barrier and that barrier
 * publishes its answer (ep, two slots by scan parity), so a live tile costs
 * no barrier of its own; each skipped one costs one.
 *
 * Split-KV ("flash-decoding"): when the caller gives a workspace and there
 * are fewer than kDecWaves blocks per SM of the device, the keys are split
 * over blocks of at least kDecMinSplit keys (a power-of-two count of splits,
 * each a multiple of the kernel's key tile). Each split leaves its (m, l) and
 * unnormalized output in the workspace and decode_combine merges them in
 * split order, one warp per row, as the CPU's split-KV combine does. The
 * split sizes depend on the shape and the device's SM count alone (the
 * workspace query and the launch run on the same device): results are
 * deterministic for a given shape and device, and may differ in the last
 * bits between devices of different SM counts. */
constexpr int kDecWarps = 4;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kDecRowsPerWarp = 4;
constexpr int kDecRows = kDecWarps * kDecRowsPerWarp; /* 16 query rows per block */
/* Resident blocks per SM the decode kernel is compiled for: a ceiling of
 * 65536 / (4 x 128) = 128 registers a thread, 16 warps per SM at least. Left
 * to itself ptxas settled at 72, 96 or 128 registers and spilled a few words
 * there; with the bound stated, every instantiation fits without spilling. */
constexpr int kDecMinBlocks = 4;
constexpr int64_t kDecWaves = 4;      /* split until there are this many blocks per SM */
constexpr int64_t kDecBlocks = 256;   /* the target when the SM count cannot be read */
constexpr int64_t kDecMinSplit = 128; /* but no split shorter than this (keys) */

struct dec_plan {
    int64_t groups;    /* row groups of kDecRows per (batch, kv head) */
    int64_t klen;      /* keys any row can see */
    int64_t nsplit;    /* key splits */
    int64_t split_len; /* keys per split, a multiple of the kernel's key tile */
};

__host__ __device__ inline int64_t dec_rows(const ng_attention_args &a) { return a.B * a.Hq * a.L; }

/* sms: the device's SM count (0: unknown, kDecBlocks blocks targeted);
 * tile: the decode kernel's keys per tile (kBK, or kMmaRows for the
 * tensor-core decode), which every split but the last fills. */
dec_plan plan_decode(const ng_attention_args *a, int can_split, int sms, int64_t tile) {
    dec_plan p;
    p.groups = NG_CEIL_DIV((a->Hq / a->Hkv) * a->L, (int64_t)kDecRows);
    p.klen = a->is_causal ? NG_MIN(a->S, a->L) : a->S; /* causal: keys past the last query unseen */
    const int64_t blocks = a->B * a->Hkv * p.groups;
    const int64_t target = sms > 0 ? kDecWaves * sms : kDecBlocks;
    int64_t n = 1;
    while (can_split && blocks * n < target && p.klen / (n * 2) >= kDecMinSplit) n *= 2;
    p.split_len = NG_MAX(tile, NG_CEIL_DIV(NG_CEIL_DIV(p.klen, n), tile) * tile);
    p.nsplit = NG_MAX((int64_t)1, NG_CEIL_DIV(p.klen, p.split_len));
    return p;
}

/* A K / V element in shared memory: the tensor's own bits. */
template <ng_dtype T>
using dec_elem = typename std::conditional<T == NG_F32, float, uint16_t>::type;

/* Elements of 16 bytes, the K and V tile row lengths (elements), and the
 * dynamic shared memory of the two layouts: Q (fp32), then two (K, V)
 * stages, or one buffer that takes K, then V. */
__host__ __device__ constexpr int dec_w(ng_dtype t) { return t == NG_F32 ? 4 : 8; }
__host__ __device__ constexpr int dec_kld(ng_dtype t, int e) {
    return (e + dec_w(t) - 1) / dec_w(t) * dec_w(t) + dec_w(t);
}
__host__ __device__ constexpr int dec_vld(ng_dtype t, int e) {
    return (e + dec_w(t) - 1) / dec_w(t) * dec_w(t);
}
constexpr size_t dec_smem(ng_dtype t, int e, int ev, bool pipe) {
    const size_t q = sizeof(float) * (size_t)(kDecRows * e), el = t == NG_F32 ? 4 : 2;
    const int kl = dec_kld(t, e), vl = dec_vld(t, ev);
    return q + el * (size_t)kBK * (pipe ? 2 * (kl + vl) : (kl > vl ? kl : vl));
}

template <ng_dtype T>
__device__ __forceinline__ float dec_widen(dec_elem<T> v) {
    if constexpr (T == NG_F32) {
        return v;
    } else if constexpr (T == NG_BF16) {
        return ng_bf16_to_f32(v);
    } else {
        __half h;
        memcpy(&h, &v, sizeof h);
        return __half2float(h);
    }
}

/* One thread's walk over a tile's kBK x n chunks (a chunk: 16 bytes, or
 * one element): its first (row, chunk) and the step of kDecThreads chunks,
 * so that the loop adds instead of dividing. */
struct dec_walk {
    int r, c, dr, dc, n;
};
__device__ __forceinline__ dec_walk dec_walk_of(int n) {
    const int t = threadIdx.x;
    return {t / n, t % n, kDecThreads / n, kDecThreads % n, n};
}

/* Keys [j0, j0 + nk) of a [seq, *] slice (row stride rs) into kBK tile rows
 * ld elements apart, zeros past nk, in the slice's own dtype. vec: 16-byte
 * chunks by cp.async.cg, landing at the caller's wait_group (the zero rows
 * are stored at once); otherwise element copies, stored at once. */
template <typename S>
__device__ __forceinline__ void dec_load(S *tile, int ld, const S *base, int64_t rs, int64_t j0,
                                         int64_t nk, dec_walk w, int vec) {
    constexpr int kW = 16 / sizeof(S);
#pragma unroll 1
    for (int r = w.r, c = w.c; r < kBK;) {
        if (vec) {
            S *dst = tile + r * ld + c * kW;
            const S *src = base + (j0 + r) * rs + c * kW;
            if (r >= nk)
                *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
            else if constexpr (kAsyncCopy)
                ng_cp_async_cg16(dst, src);
            else
                *(uint4 *)dst = *(const uint4 *)src;
        } else {
            tile[r * ld + c] = r < nk ? base[(j0 + r) * rs + c] : (S)0;
        }
        c += w.dc, r += w.dr;
        if (c >= w.n) c -= w.n, r++;
    }
}

/* q . k over E columns in order (as a plain loop would add them), k read
 * from shared memory 16 bytes at a time and widened in registers. */
template <ng_dtype T>
__device__ __forceinline__ float dec_dot(const float *qr, const dec_elem<T> *kr, int E) {
    using S = dec_elem<T>;
    constexpr int kW = 16 / sizeof(S);
    float dot = 0.0f;
    int e = 0;
    for (; e + kW <= E; e += kW) {
        const uint4 v = *(const uint4 *)(kr + e);
        S k[kW];
        memcpy(k, &v, sizeof k);
#pragma unroll
        for (int w = 0; w < kW; w++) dot += qr[e + w] * dec_widen<T>(k[w]);
    }
    for (; e < E; e++) dot += qr[e] * dec_widen<T>(kr[e]);
    return dot;
}

/* ws: nsplit > 1 only; [nsplit][B*Hq*L][2] (m, l), then [nsplit][B*Hq*L][Ev].
 * Pipe: two (K, V) stages; otherwise one buffer (see above). vec: K and V by
 * cp.async (launch_decode). */
template <ng_dtype T, int NT, bool Pipe>
static __global__ void __launch_bounds__(kDecThreads, kDecMinBlocks)
    attention_decode_kernel(ng_attention_args a, dec_plan p, float *ws, int vec) {
    using S = dec_elem<T>;
    constexpr int kW = 16 / sizeof(S);
    NG_DYNAMIC_SMEM(uint4, dec_smem_base);
    const int E = (int)a.E, Ev = (int)a.Ev, kld = dec_kld(T, E), vld = dec_vld(T, Ev);
    float *const qs = (float *)dec_smem_base;
    S *const tiles = (S *)(qs + kDecRows * E);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(p.nsplit * p.groups, a.Hkv);
    const int64_t b = bc.b, hk = bc.h, split = bc.blk % p.nsplit, r0 = bc.blk / p.nsplit * kDecRows;
    const int64_t G = a.Hq / a.Hkv, M = G * a.L;
    const float scale = (float)a.scale;
    const S *kb = (const S *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const S *vb = (const S *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];

    /* Q rows, one row's head and position worked out once */
    for (int rr = 0; rr < kDecRows; rr++) {
        const int64_t r = r0 + rr;
        const int64_t qo = r < M ? b * a.q_stride[0] + (hk * G + r / a.L) * a.q_stride[1] +
                                       (r % a.L) * a.q_stride[2]
                                 : 0;
        for (int e = threadIdx.x; e < E; e += kDecThreads)
            qs[rr * E + e] = r < M ? ld<T>(a.q, qo + e) : 0.0f;
    }
    /* The block's rows: head and position of row rr in shared memory (read
     * by the mask, causal and dropout terms, rarely: registers are kept for
     * the accumulators), rows rr < nrow valid. The barrier after ep's
     * initialisation below publishes them. */
    NG_SHARED(int64_t, row_h, [kDecRows]);
    NG_SHARED(int, row_i, [kDecRows]); /* < L <= NG_ATTN_DEC_MAX_L */
    if (threadIdx.x < kDecRows) {
        const int64_t r = r0 + threadIdx.x;
        row_h[threadIdx.x] = hk * G + (r < M ? r / a.L : 0);
        row_i[threadIdx.x] = r < M ? (int)(r % a.L) : 0;
    }
    const int nrow = (int)NG_MIN((int64_t)kDecRows, M - r0);
    /* the warp's row t: block row warp + kDecWarps t */
    auto row_ok = [&](int t) { return warp + kDecWarps * t < nrow; };
    float acc[kDecRowsPerWarp][NT], m[kDecRowsPerWarp], l[kDecRowsPerWarp];
#pragma unroll
    for (int t = 0; t < kDecRowsPerWarp; t++) {
#pragma unroll
        for (int u = 0; u < NT; u++) acc[t][u] = 0.0f;
        m[t] = -INFINITY;
        l[t] = 0.0f;
    }
    const dec_walk wk = dec_walk_of(vec ? E / kW : E), wv = dec_walk_of(vec ? Ev / kW : Ev);

    /* ep[k & 1] == k: mask scan k found a key of its tile that the mask
     * leaves to some row of the block */
    NG_SHARED(int, ep, [2]);
    if (threadIdx.x == 0) ep[0] = ep[1] = -1;
    __syncthreads(); /* ep set before any scan writes it */
    const bool masked = a.mask_kind != NG_MASK_NONE;
    int k = 0; /* mask scans so far */
    const int64_t jb = split * p.split_len, je = NG_MIN(p.klen, jb + p.split_len);
    /* this thread's part of scan k of the tile at j0 */
    auto scan = [&](int64_t j0) {
        bool any = false;
#pragma unroll
        for (int t = 0; t < kDecRowsPerWarp; t++)
            if (row_ok(t) && j0 + lane < je &&
                mask_value(a, b, row_h[warp + kDecWarps * t], row_i[warp + kDecWarps * t],
                           j0 + lane) != -INFINITY)
                any = true;
        if (any) ep[k & 1] = k;
    };
    /* the first live tile at or after j (je if none); scanned: scan k of j
     * was made and a barrier has passed since */
    auto next_live = [&](int64_t j, bool scanned) {
        for (; j < je; j += kBK, scanned = false) {
            if (!scanned) {
                scan(j);
                __syncthreads();
            }
            const bool live = ep[k & 1] == k; /* block-uniform */
            k++;
            if (live) break;
        }
        return j;
    };
    auto score = [&](const S *ks, int64_t j0, int64_t nk, float (&pr)[kDecRowsPerWarp]) {
#pragma unroll
        for (int t = 0; t < kDecRowsPerWarp; t++) {
            pr[t] = 0.0f;
            if (!row_ok(t)) continue; /* warp-uniform */
            const int rr = warp + kDecWarps * t;
            const int64_t h = row_h[rr], i = row_i[rr], j = j0 + lane;
            const float dot = dec_dot<T>(qs + (warp + kDecWarps * t) * E, ks + lane * kld, E);
            const float s = lane < nk ? guarded_score(a, dot * scale, b, h, i, j) : -INFINITY;
            const float m_new = ng_attn_max_nan_f32(m[t], warp_max_nan(s));
            const float alpha = ng_attn_rescale_f32(m[t], m_new);
            pr[t] = ng_attn_exp_shift_f32(s, m_new);
            l[t] = l[t] * alpha + warp_sum(pr[t]);
            m[t] = m_new;
            if (lane < nk) pr[t] *= dropout_scale(a, b, h, i, j);
#pragma unroll
            for (int u = 0; u < NT; u++) acc[t][u] *= alpha;
        }
    };
    auto accumulate = [&](const S *vs, int64_t nk, const float (&pr)[kDecRowsPerWarp]) {
#pragma unroll
        for (int t = 0; t < kDecRowsPerWarp; t++) {
            if (!row_ok(t)) break;
            for (int jj = 0; jj < nk; jj++) {
                const float pj = __shfl_sync(kFull, pr[t], jj);
                if (pj == 0.0f) continue; /* warp-uniform */
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    const int d = lane + 32 * u;
                    if (d < Ev) acc[t][u] += pj * dec_widen<T>(vs[jj * vld + d]);
                }
            }
        }
    };

    int64_t jc = masked ? next_live(jb, false) : jb;
    if constexpr (Pipe) {
        const int stage = kBK * (kld + vld); /* a (K, V) stage, elements */
        if (jc < je) {                       /* tile jc into stage 0 */
            dec_load<S>(tiles, kld, kb, a.k_stride[2], jc, je - jc, wk, vec);
            dec_load<S>(tiles + kBK * kld, vld, vb, a.v_stride[2], jc, je - jc, wv, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
        for (int st = 0; jc < je; st ^= 1) {
            int64_t jn = jc + kBK;
            if (masked && jn < je) scan(jn); /* answered by the barrier below */
            /* tile jc complete and visible to all, every warp done with the
             * other stage (the previous tile) */
            if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>(); /* this thread's K / V chunks */
            __syncthreads();
            if (masked) jn = next_live(jn, true);
            if (jn < je) { /* tile jn into the other stage, behind this one's math */
                S *const kn = tiles + (st ^ 1) * stage;
                dec_load<S>(kn, kld, kb, a.k_stride[2], jn, je - jn, wk, vec);
                dec_load<S>(kn + kBK * kld, vld, vb, a.v_stride[2], jn, je - jn, wv, vec);
                if constexpr (kAsyncCopy) ng_cp_async_commit();
            }
            const S *const ks = tiles + st * stage;
            const int64_t nk = NG_MIN((int64_t)kBK, je - jc);
            float pr[kDecRowsPerWarp]; /* lane j: p of key j for each of the warp's rows */
            score(ks, jc, nk, pr);
            accumulate(ks + kBK * kld, nk, pr);
            jc = jn;
        }
    } else {
        while (jc < je) {
            const int64_t nk = NG_MIN((int64_t)kBK, je - jc);
            float pr[kDecRowsPerWarp];
            __syncthreads(); /* the previous tile's V readers are done */
            dec_load<S>(tiles, kld, kb, a.k_stride[2], jc, nk, wk, vec);
            if constexpr (kAsyncCopy) ng_cp_async_wait_all();
            __syncthreads();
            score(tiles, jc, nk, pr);
            __syncthreads(); /* the K tile's readers are done: V takes its place */
            dec_load<S>(tiles, vld, vb, a.v_stride[2], jc, nk, wv, vec);
            if constexpr (kAsyncCopy) ng_cp_async_wait_all();
            __syncthreads();
            accumulate(tiles, nk, pr);
            jc = masked ? next_live(jc + kBK, false) : jc + kBK;
        }
    }

    const int64_t rows = dec_rows(a);
#pragma unroll
    for (int t = 0; t < kDecRowsPerWarp; t++) {
        if (!row_ok(t)) break;
        const int64_t h = row_h[warp + kDecWarps * t], i = row_i[warp + kDecWarps * t];
        const int64_t row = (b * a.Hq + h) * a.L + i;
        if (p.nsplit == 1) {
            store_row<T, NT>(a, b, h, i, acc[t], m[t], l[t]);
        } else {
            float *part = ws + 2 * p.nsplit * rows + (split * rows + row) * Ev;
            for (int u = 0; u < NT; u++) {
                const int d = lane + 32 * u;
                if (d < Ev) part[d] = acc[t][u];
            }
            if (lane == 0) {
                ws[2 * (split * rows + row)] = m[t];
                ws[2 * (split * rows + row) + 1] = l[t];
            }
        }
    }
}

/* One warp per row of B*Hq*L: the splits' (m, l, acc) merged in split
 * order, then out = acc / l and lse = m + log l. A split that saw only
 * masked keys has m = -inf and weighs 0; a NaN m makes the row NaN. */
template <ng_dtype T, int NT>
static __global__ void __launch_bounds__(kDecThreads)
    attention_decode_combine_kernel(ng_attention_args a, int64_t nsplit, const float *ws) {
    const int lane = threadIdx.x & 31;
    const int64_t rows = dec_rows(a), row = (int64_t)blockIdx.x * kDecWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float *part = ws + 2 * nsplit * rows;
    float mx = -INFINITY, l = 0.0f, acc[NT];
    for (int64_t s = 0; s < nsplit; s++) mx = ng_attn_max_nan_f32(mx, ws[2 * (s * rows + row)]);
    for (int u = 0; u < NT; u++) acc[u] = 0.0f;
    for (int64_t s = 0; s < nsplit; s++) {
        const float alpha = ng_attn_rescale_f32(ws[2 * (s * rows + row)], mx);
        l += ws[2 * (s * rows + row) + 1] * alpha;
        for (int u = 0; u < NT; u++) {
            const int d = lane + 32 * u;
            if (d < a.Ev) acc[u] += part[(s * rows + row) * a.Ev + d] * alpha;
        }
    }
    const int64_t bh = row / a.L;
    store_row<T, NT>(a, bh / a.Hq, bh % a.Hq, row % a.L, acc, mx, l);
}

/* ---- backward ----------------------------------------------------------- */

/* For one (query i, key j), from its raw dot products: p, pd = p times the
 * dropout factor, and dS (already times scale and the guard's derivative). */
struct bwd_terms {
    float p, pd, ds;
};

/* keep: the dropout factor of (i, j), 0 or 1 / (1 - dropout_p); 1 without
 * dropout. A pair whose probability is zero (a fully masked row or a row
 * past L, checked before the mask is read; a masked pair; a probability
 * that underflows) contributes exactly nothing, whatever NaN dout, out or v
 * hold: the rule the CPU kernel follows too (attention_cpu.inc). */
__device__ __forceinline__ bwd_terms bwd_score_keep(const ng_attention_args &a, float qk, float dp,
                                                    float lse, float D, int64_t b, int64_t h,
                                                    int64_t i, int64_t j, float keep) {
    bwd_terms o = {0.0f, 0.0f, 0.0f};
    if (lse == -INFINITY) return o;
    const float scale = (float)a.scale;
    const float raw = qk * scale;
    const float s = guarded_score(a, raw, b, h, i, j);
    if (s == -INFINITY) return o;
    const float p = expf(s - lse); /* NaN for every unmasked pair of a NaN row */
    if (p == 0.0f) return o;
    o.p = p;
    o.pd = p * keep;
    o.ds = p * (dp * keep - D) * scale *
           ng_attn_transform_grad_f32(raw, (float)a.max_score, (float)a.softcap);
    return o;
}

__device__ __forceinline__ bwd_terms bwd_score(const ng_attention_args &a, float qk, float dp,
                                               float lse, float D, int64_t b, int64_t h, int64_t i,
                                               int64_t j) {
    return bwd_score_keep(a, qk, dp, lse, D, b, h, i, j, dropout_scale(a, b, h, i, j));
}

/* D = dout . out of query row i of the (b, h) slice whose dout / out rows
 * start at gb / ob, over n columns (N when N > 0, a compile-time head dim),
 * in fp32: lane l adds columns l, l + 32, ... in order, then the warp's
 * butterfly sum; every lane gets the total (0 where !valid: a row past L).
 * The one computation of D, by the pre-kernel and by the kernels' in-kernel
 * path alike. Called by a whole warp. */
template <ng_dtype T, int N = 0>
__device__ __forceinline__ float row_dot(const ng_attention_args &a, const void *gb, const void *ob,
                                         int64_t i, bool valid) {
    const int n = N > 0 ? N : (int)a.Ev;
    float part = 0.0f;
    if (valid)
        for (int d = threadIdx.x & 31; d < n; d += 32)
            part += ld<T>(gb, i * a.dout_stride[2] + d) * ld<T>(ob, i * a.out_stride[2] + d);
    return warp_sum(part);
}

/* Row (b, h, i)'s D in the pre-kernel's workspace ([B, Hq, L], as lse). */
__device__ __forceinline__ float ws_d(const float *dsum, const ng_attention_args &a, int64_t b,
                                      int64_t h, int64_t i) {
    return dsum[(b * a.Hq + h) * a.L + i];
}

/* The SIMT kernels' D of row i (0 where !valid): the workspace's (WsD), or
 * row_dot. */
template <ng_dtype T, bool WsD>
__device__ __forceinline__ float simt_row_d(const float *dsum, const ng_attention_args &a,
                                            int64_t b, int64_t h, const void *gb, const void *ob,
                                            int64_t i, bool valid) {
    if constexpr (WsD)
        return valid ? ws_d(dsum, a, b, h, i) : 0.0f;
    else
        return row_dot<T>(a, gb, ob, i, valid);
}

/* The pre-kernel: one warp per query row of B Hq L (row = (b Hq + h) L + i),
 * kWarps rows a block, D into dsum[row]. Reads dout and out through their
 * strides, as the backward kernels do. */
template <ng_dtype T>
static __global__ void __launch_bounds__(kThreads)
    attention_bwd_dot_kernel(ng_attention_args a, float *dsum) {
    const int64_t rows = a.B * a.Hq * a.L, row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (row >= rows) return; /* the last block's spare warps */
    const int64_t i = row % a.L, bh = row / a.L, h = bh % a.Hq, b = bh / a.Hq;
    const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    const float d = row_dot<T>(a, gb, ob, i, true);
    if ((threadIdx.x & 31) == 0) dsum[row] = d;
}

/* The second pre-kernel, with a padding mask (one that does not depend on
 * the query: mask_stride[2] == 0): live[(b Hkv + hk) nkb + kb], nkb =
 * ceil(S / 64), says whether any of the keys [64 kb, 64 kb + 64) is
 * unmasked for any query head of kv head hk's group. A key that no query
 * sees has p = 0 and dS = 0 for every query, so the dk / dv kernels (SIMT
 * and tensor-core) give a block of such keys dk = dv = 0 without staging a
 * query tile. These are the 64-key blocks the CPU backward skips for every
 * query tile (rows_masked), so a NaN in dout reaches neither side's dk / dv
 * at those keys. One warp per entry, kWarps entries a block. */
static __global__ void __launch_bounds__(kThreads)
    attention_bwd_live_kernel(ng_attention_args a, int *live) {
    const int64_t nkb = NG_CEIL_DIV(a.S, (int64_t)kLiveKeys);
    const int64_t e = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (e >= a.B * a.Hkv * nkb) return; /* the last block's spare warps */
    const int64_t kb = e % nkb, bh = e / nkb, hk = bh % a.Hkv, b = bh / a.Hkv;
    const int64_t grp = a.Hq / a.Hkv;
    const int64_t heads = a.mask_stride[1] == 0 ? 1 : grp; /* [B, 1, 1, S]: one row for all */
    const int lane = threadIdx.x & 31;
    int any = 0;
    for (int64_t g = 0; g < heads && !any; g++) { /* any is the warp's: a uniform loop */
        const int64_t row = b * a.mask_stride[0] + (hk * grp + g) * a.mask_stride[1];
        /* unrolled: as a loop over j (to min(S, 64 kb + 64)) it spilled 8 B on sm_90 */
#pragma unroll
        for (int x = 0; x < kLiveKeys; x += 32) {
            const int64_t j = kb * kLiveKeys + x + lane;
            if (j < a.S)
                any |= ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype,
                                          row + j * a.mask_stride[3]) != -INFINITY;
        }
        any = __any_sync(kFull, any);
    }
    if (lane == 0) live[e] = any;
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int NT, bool WsD>
static __global__ void __launch_bounds__(kThreads, NT > 4 ? 1 : kSimtMinBlocks)
    attention_bwd_dkdv_kernel(ng_attention_args a, const float *dsum, const int *live) {
    NG_DYNAMIC_SMEM(float, smem);
    float *qs = smem, *gs = qs + kBwdBQ * a.E, *lses = gs + kBwdBQ * a.Ev, *Ds = lses + kBwdBQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.S, (int64_t)kBwdBlock), a.Hkv);
    const int64_t b = bc.b, hk = bc.h, grp = a.Hq / a.Hkv;
    const int64_t jblk = bc.blk * kBwdBlock, j0 = jblk + warp * kBwdPer;
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);

    float kr[kBwdPer][NT], vr[kBwdPer][NT], dk[kBwdPer][NT], dv[kBwdPer][NT];
    for (int c = 0; c < kBwdPer; c++)
        for (int t = 0; t < NT; t++) {
            int64_t j = j0 + c, e = lane + 32 * t;
            kr[c][t] = (j < a.S && e < a.E) ? ld<T>(kb, j * a.k_stride[2] + e) : 0.0f;
            vr[c][t] = (j < a.S && e < a.Ev) ? ld<T>(vb, j * a.v_stride[2] + e) : 0.0f;
            dk[c][t] = 0.0f;
            dv[c][t] = 0.0f;
        }

    /* causal: query tiles that end before this block's first key see none
     * of it; live: a padding mask hides the 64 keys around this block from
     * every query of the group (dk = dv = 0) */
    const int64_t istart = a.is_causal ? (jblk / kBwdBQ) * kBwdBQ : 0;
    const bool dead =
        WsD && live &&
        !live[(b * a.Hkv + hk) * NG_CEIL_DIV(a.S, (int64_t)kLiveKeys) + jblk / kLiveKeys];
    for (int64_t h = dead ? (hk + 1) * grp : hk * grp; h < (hk + 1) * grp; h++) {
        const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
        const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
        const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
        const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;
        for (int64_t i0 = istart; i0 < a.L; i0 += kBwdBQ) {
            const int64_t nq = NG_MIN((int64_t)kBwdBQ, a.L - i0);
            __syncthreads();
            stage<T>(qs, a.E, kBwdBQ, qb, a.q_stride[2], i0, nq, a.E);
            stage<T>(gs, a.Ev, kBwdBQ, gb, a.dout_stride[2], i0, nq, a.Ev);
            for (int r = warp; r < kBwdBQ; r += kWarps) { /* D, one warp per row */
                const float d = simt_row_d<T, WsD>(dsum, a, b, h, gb, ob, i0 + r, r < nq);
                if (lane == 0) {
                    Ds[r] = d;
                    lses[r] = r < nq ? lse[i0 + r] : -INFINITY;
                }
            }
            __syncthreads();
            for (int r = 0; r < nq; r++) {
                const int64_t i = i0 + r;
                for (int c = 0; c < kBwdPer; c++) {
                    const int64_t j = j0 + c;
                    float pq = 0.0f, pg = 0.0f;
                    for (int t = 0; t < NT; t++) {
                        int e = lane + 32 * t;
                        if (e < a.E) pq += qs[r * a.E + e] * kr[c][t];
                        if (e < a.Ev) pg += gs[r * a.Ev + e] * vr[c][t];
                    }
                    const float qk = warp_sum(pq), dp = warp_sum(pg);
                    if (j >= a.S) continue;
                    bwd_terms w = bwd_score(a, qk, dp, lses[r], Ds[r], b, h, i, j);
                    for (int t = 0; t < NT; t++) {
                        int e = lane + 32 * t;
                        if (e < a.E) dk[c][t] += w.ds * qs[r * a.E + e];
                        if (e < a.Ev) dv[c][t] += w.pd * gs[r * a.Ev + e];
                    }
                }
            }
        }
    }

    for (int c = 0; c < kBwdPer; c++) {
        const int64_t j = j0 + c;
        if (j >= a.S) break;
        const int64_t kofs = b * a.dk_stride[0] + hk * a.dk_stride[1] + j * a.dk_stride[2];
        const int64_t vofs = b * a.dv_stride[0] + hk * a.dv_stride[1] + j * a.dv_stride[2];
        for (int t = 0; t < NT; t++) {
            int e = lane + 32 * t;
            if (e < a.E) ng_store_f32(a.dk, T, kofs + e, dk[c][t]);
            if (e < a.Ev) ng_store_f32(a.dv, T, vofs + e, dv[c][t]);
        }
    }
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int NT, bool WsD>
static __global__ void __launch_bounds__(kThreads, kSimtMinBlocks)
    attention_bwd_dq_kernel(ng_attention_args a, const float *dsum) {
    NG_DYNAMIC_SMEM(float, smem);
    float *ks = smem, *vs = smem + kBK * a.E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kBwdBlock), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t blk0 = bc.blk * kBwdBlock, row0 = blk0 + warp * kBwdPer;
    const void *qb = slice<T>(a.q, b * a.q_stride[0] + h * a.q_stride[1]);
    const void *gb = slice<T>(a.dout, b * a.dout_stride[0] + h * a.dout_stride[1]);
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    const void *kb = slice<T>(a.k, b * a.k_stride[0] + hk * a.k_stride[1]);
    const void *vb = slice<T>(a.v, b * a.v_stride[0] + hk * a.v_stride[1]);
    const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;

    float q[kBwdPer][NT], g[kBwdPer][NT], dq[kBwdPer][NT], D[kBwdPer], L[kBwdPer];
    for (int r = 0; r < kBwdPer; r++) {
        const int64_t i = row0 + r;
        for (int t = 0; t < NT; t++) {
            int64_t e = lane + 32 * t;
            q[r][t] = (i < a.L && e < a.E) ? ld<T>(qb, i * a.q_stride[2] + e) : 0.0f;
            g[r][t] = (i < a.L && e < a.Ev) ? ld<T>(gb, i * a.dout_stride[2] + e) : 0.0f;
            dq[r][t] = 0.0f;
        }
        D[r] = simt_row_d<T, WsD>(dsum, a, b, h, gb, ob, i, i < a.L);
        L[r] = i < a.L ? lse[i] : -INFINITY;
    }

    const int64_t kend = a.is_causal ? NG_MIN(a.S, blk0 + kBwdBlock) : a.S;
    for (int64_t j0 = 0; j0 < kend; j0 += kBK) {
        const int64_t nk = NG_MIN((int64_t)kBK, kend - j0);
        stage_kv<T>(ks, vs, kb, vb, a, j0, nk);
        for (int r = 0; r < kBwdPer; r++) {
            const int64_t i = row0 + r;
            for (int jj = 0; jj < nk; jj++) {
                float pq = 0.0f, pg = 0.0f;
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) pq += q[r][t] * ks[jj * a.E + e];
                    if (e < a.Ev) pg += g[r][t] * vs[jj * a.Ev + e];
                }
                const float qk = warp_sum(pq), dp = warp_sum(pg);
                if (i >= a.L) continue;
                bwd_terms w = bwd_score(a, qk, dp, L[r], D[r], b, h, i, j0 + jj);
                for (int t = 0; t < NT; t++) {
                    int e = lane + 32 * t;
                    if (e < a.E) dq[r][t] += w.ds * ks[jj * a.E + e];
                }
            }
        }
    }

    for (int r = 0; r < kBwdPer; r++) {
        const int64_t i = row0 + r;
        if (i >= a.L) break;
        const int64_t ofs = b * a.dq_stride[0] + h * a.dq_stride[1] + i * a.dq_stride[2];
        for (int t = 0; t < NT; t++) {
            int e = lane + 32 * t;
            if (e < a.E) ng_store_f32(a.dq, T, ofs + e, dq[r][t]);
        }
    }
}

/* ---- tensor cores: fp16 / bf16, head dim 64 or 128 ------------------------
 *
 * The same three kernels on mma.sync m16n8k16 (fp32 accumulators) for the
 * common case E == Ev in {64, 128} on sm_80+. 4 warps; every warp owns 16
 * rows of a 64-row block and walks 64-row tiles of the other operand, staged
 * in shared memory as raw 16-bit elements (rows padded to D + 8, see
 * attention_mma.h). Scores and dp live in C fragments; the per-score math is
 * the SIMT kernels' (guarded_score, bwd_score); p and dS are rounded to the
 * input dtype and fed back as A fragments, as FlashAttention-2 does.
 *
 *   fwd:  ceil(L/64) blocks per (b, h). Warp rows are queries; per key tile:
 *         S = Q K^T, online softmax (row max over the 4 lanes of a group),
 *         O = O * alpha + P V. Q's A fragments are read once (ldmatrix.x4)
 *         and stay in registers; K's B fragments come through ldmatrix.x4,
 *         V's through ldmatrix.x4.trans. K / V tiles are double-buffered:
 *         two stages of (K, V), the next tile's rows issued as 16-byte
 *         cp.async.cg right after the barrier that opens the current one, so
 *         they are in flight during its math; one wait_group 0 and one
 *         __syncthreads per tile. Rows past the end are zero-filled by
 *         ordinary stores, and when any row of q / k / v is not 16-byte
 *         aligned (vec == 0) every row is staged by ordinary loads.
 *   dkdv: ceil(S/64) blocks per (b, kv head). Warp rows are keys; per query tile of
 *         every head of the group: S^T = K Q^T and dP^T = V dO^T, then
 *         dV += P^T dO and dK += dS^T Q (at D = 128 the tile's queries in
 *         two parts of 32: registers, see the kernel).
 *   dq:   ceil(L/64) blocks per (b, h). Warp rows are queries; per key tile:
 *         S = Q K^T, dP = dO V^T, dQ += dS K.
 *         Both read every fragment through ldmatrix: the A operands (the
 *         warp's own K / V or Q / dO rows) with ldmatrix.x4, the streamed
 *         tile's rows as B of X Y^T with ldmatrix.x4 and as B of W Y (P^T dO,
 *         dS^T Q, dS K, as P V in the forward: one helper, mma_wy) with
 *         ldmatrix.x4.trans. The streamed tiles (Q, dO and the rows'
 *         dout . out and lse for dkdv; K, V for dq) are double-buffered as in
 *         the forward: the next tile issued as cp.async.cg right after the
 *         barrier that opens the current one, one wait_group 0 and one
 *         __syncthreads per tile; the fixed tiles travel in the first group.
 *         At D = 128 two stages take 103 KiB of shared memory, more than
 *         sm_86 / sm_89 have (99 KiB): there the kernels run one stage, the
 *         next tile issued after a second barrier. Unaligned rows and rows
 *         past the end are staged by ordinary stores, as in the forward.
 *
 * fp16 has a 65504 ceiling that dS (unlike p in [0, 1/(1-p)]) can exceed
 * while dq and dk stay in range, so the fp16 kernels scale each dS row by a
 * power of two before rounding (ng_mma_ds_exponent) and undo it, exactly, on
 * the fp32 accumulator. bf16 has fp32's range and needs none of it. */

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaRows = 64;         /* rows per block and per staged tile */
constexpr int kMmaNT = kMmaRows / 8; /* n-tiles of 8 across a staged tile */
static_assert(kMmaRows == kLiveKeys, "a tensor-core dk / dv block is one flag's keys");

template <ng_dtype T>
__device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
    uint32_t u;
    if constexpr (T == NG_F16) {
        __half2 h = __floats2half2_rn(lo, hi);
        memcpy(&u, &h, sizeof u);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        memcpy(&u, &h, sizeof u);
    }
    return u;
}

/* Rows [r0, r0 + n) of a [seq, D] slice (row stride rs) into a 64-row tile,
 * zeros past n. vec: every row start is 16-byte aligned (one 128-bit load per
 * 8 elements); otherwise element loads. */
template <int D>
__device__ __forceinline__ void mma_stage(uint16_t *tile, const uint16_t *base, int64_t rs,
                                          int64_t r0, int64_t n, int vec) {
    constexpr int kLd = D + 8, kChunks = D / 8;
    for (int x = threadIdx.x; x < kMmaRows * kChunks; x += kMmaThreads) {
        const int r = x / kChunks, c = (x % kChunks) * 8;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < n) {
            const uint16_t *src = base + (r0 + r) * rs + c;
            if (vec) {
                w = *(const uint4 *)src;
            } else {
                w.x = ng_mma_pack(src[0], src[1]);
                w.y = ng_mma_pack(src[2], src[3]);
                w.z = ng_mma_pack(src[4], src[5]);
                w.w = ng_mma_pack(src[6], src[7]);
            }
        }
        *(uint4 *)(tile + r * kLd + c) = w;
    }
}

/* mma_stage, with the 16-byte chunks of valid rows issued as cp.async.cg
 * (landing at the caller's wait_group) when vec; rows >= n (zeros) and
 * unaligned rows (element loads) are stored at once, as mma_stage does.
 * The caller commits the group, waits for it and then __syncthreads before
 * any thread reads the tile. */
template <int D>
__device__ __forceinline__ void mma_stage_async(uint16_t *tile, const uint16_t *base, int64_t rs,
                                                int64_t r0, int64_t n, int vec) {
    constexpr int kLd = D + 8, kChunks = D / 8;
    if constexpr (kAsyncCopy) {
        if (vec) {
#pragma unroll 1
            for (int x = threadIdx.x; x < kMmaRows * kChunks; x += kMmaThreads) {
                const int r = x / kChunks, c = (x % kChunks) * 8;
                uint16_t *dst = tile + r * kLd + c;
                if (r < n)
                    ng_cp_async_cg16(dst, base + (r0 + r) * rs + c);
                else
                    *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
            }
            return;
        }
    }
    mma_stage<D>(tile, base, rs, r0, n, vec);
}

/* c[16 x 8 NT] += X Y^T over the 16 columns k0 .. k0 + 15, X's A fragment
 * given: the 8 NT rows of tile y (n-tile nt = rows 8 nt .. 8 nt + 7) as B
 * fragments through ldmatrix.x4, two n-tiles each. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_xyt_step(float c[NT][4], const uint32_t a[4], const uint16_t *y,
                                             int k0, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b0[2], b1[2];
        ng_mma_ldm_b_rows2(b0, b1, y, D + 8, nt * 8, k0, lane);
        ng_mma_16816<T>(c[nt], a, b0);
        ng_mma_16816<T>(c[nt + 1], a, b1);
    }
}

/* c[16 x 64] += Q K^T for the forward: Q's A fragments held in registers
 * (qf[k-step]). */
template <ng_dtype T, int D>
__device__ __forceinline__ void mma_qkt(float c[kMmaNT][4], const uint32_t qf[D / 16][4],
                                        const uint16_t *k, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) mma_xyt_step<T, D, kMmaNT>(c, qf[kk], k, kk * 16, lane);
}

/* c[16 x 8 NT] += X Y^T for the backward: the 16 rows of tile x from row
 * xr0 (A fragments through ldmatrix.x4, one per k-step) against the 8 NT
 * rows of tile y, over the D columns. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_xyt(float c[NT][4], const uint16_t *x, int xr0,
                                        const uint16_t *y, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        ng_mma_ldm_a(a, x, D + 8, xr0, kk * 16, lane);
        mma_xyt_step<T, D, NT>(c, a, y, kk * 16, lane);
    }
}

/* Key step kt (16 keys) of W[16 x 64], given as C fragments (w[nt][4],
 * fp32), rounded to T as an A fragment. */
template <ng_dtype T, int NT>
__device__ __forceinline__ void mma_w_to_a(uint32_t a[4], const float w[NT][4], int kt) {
    const uint32_t lo[2] = {pack_f32x2<T>(w[2 * kt][0], w[2 * kt][1]),
                            pack_f32x2<T>(w[2 * kt][2], w[2 * kt][3])};
    const uint32_t hi[2] = {pack_f32x2<T>(w[2 * kt + 1][0], w[2 * kt + 1][1]),
                            pack_f32x2<T>(w[2 * kt + 1][2], w[2 * kt + 1][3])};
    ng_mma_c_to_a(a, lo, hi);
}

/* acc[16 x D] += W[16 x 64] Y, W given as C fragments (w[nt][4], fp32) that
 * are rounded to T here, Y a 64-row tile read as B[k][n] = Y[k][n] through
 * ldmatrix.x4.trans (two d-tiles each): P V in the forward; P^T dO, dS^T Q
 * and dS K in the backward. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_wy(float acc[D / 8][4], const float w[NT][4], const uint16_t *y,
                                       int lane) {
    constexpr int kLd = D + 8;
#pragma unroll
    for (int kt = 0; kt < NT / 2; kt++) {
        uint32_t a[4];
        mma_w_to_a<T, NT>(a, w, kt);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
            uint32_t b0[2], b1[2];
            ng_mma_ldm_b_cols2(b0, b1, y, kLd, kt * 16, dt * 8, lane);
            ng_mma_16816<T>(acc[dt], a, b0);
            ng_mma_16816<T>(acc[dt + 1], a, b1);
        }
    }
}

/* fp16 dS rows: pick each row's exponent (max over the 4 lanes holding it),
 * move the accumulator to a larger one when needed, scale the row down. */
template <ng_dtype T, int D, int NT>
__device__ __forceinline__ void mma_scale_ds(float ds[NT][4], float acc[D / 8][4], int ex[2]) {
    if constexpr (T != NG_F16) return;
    float mx[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            mx[c >> 1] = fmaxf(mx[c >> 1], fabsf(ds[nt][c])); /* fmaxf skips NaN */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 2));
        const int need = ng_mma_ds_exponent(mx[r]);
        if (need > ex[r]) {
            const float f = ldexpf(1.0f, ex[r] - need);
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                acc[dt][2 * r] *= f;
                acc[dt][2 * r + 1] *= f;
            }
            ex[r] = need;
        }
    }
    if (ex[0] == 0 && ex[1] == 0) return;
    const float f0 = ldexpf(1.0f, -ex[0]), f1 = ldexpf(1.0f, -ex[1]);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        ds[nt][0] *= f0;
        ds[nt][1] *= f0;
        ds[nt][2] *= f1;
        ds[nt][3] *= f1;
    }
}

/* Row r (0: g, 1: g + 8) and column of C-fragment element c of n-tile nt. */
__device__ __forceinline__ int frag_row(int lane, int c) { return (lane >> 2) + 8 * (c >> 1); }
__device__ __forceinline__ int frag_col(int lane, int nt, int c) {
    return nt * 8 + 2 * (lane & 3) + (c & 1);
}

/* Dropout keep bits of a lane's 4 nts C-fragment elements of nts n-tiles
 * (bit 4 * nt + c), rows from row0 and columns from col0; rows are keys and
 * columns queries when keys_are_rows. A loop that is not unrolled, so each
 * kernel carries one Philox body rather than one per fragment element. */
__device__ __forceinline__ uint32_t mma_keep_bits(const ng_attention_args &a, int64_t b, int64_t h,
                                                  int64_t row0, int64_t col0, int keys_are_rows,
                                                  int nts, int lane) {
    uint32_t bits = 0;
#pragma unroll 1
    for (int x = 0; x < 4 * nts; x++) {
        const int64_t r = row0 + frag_row(lane, x & 3), c = col0 + frag_col(lane, x >> 2, x & 3);
        const int64_t i = keys_are_rows ? c : r, j = keys_are_rows ? r : c;
        if (i < a.L && j < a.S) {
            const uint64_t e = (uint64_t)(((b * a.Hq + h) * a.L + i) * a.S + j);
            bits |= (uint32_t)ng_attn_dropout_keep(a.seed, a.offset, e, (float)a.dropout_p) << x;
        }
    }
    return bits;
}

/* The factor bit 4 * nt + c of keep-bits stands for: 0 or 1 / (1 - p). */
__device__ __forceinline__ float keep_factor(uint32_t bits, int nt, int c, float inv_keep) {
    return (bits >> (4 * nt + c)) & 1u ? inv_keep : 0.0f;
}

/* ---- score variants of a tile ----------------------------------------------
 * The general per-score path (guarded_score: bounds, causality, clamp /
 * soft-cap, a mask element read through 64-bit index math) is what a tile
 * at an edge needs; most tiles of a long sequence need much less. The
 * tensor-core kernels pick one of these per 64 x 64 tile at run time (one
 * branch, uniform over the block), each compiled with only its own steps:
 *   kScorePlain    an interior tile (every query row < L, every key < kend,
 *                  none above the causal diagonal) of a call without mask,
 *                  clamp or soft-cap: s = raw * scale;
 *   kScoreKeyMask  an interior tile without clamp or soft-cap whose mask
 *                  does not depend on the query (mask_stride[2] == 0: a
 *                  padding mask [B, 1, 1, S] or [B, H, 1, S]): the mask
 *                  element at the key alone, s = raw * scale + mask;
 *   kScoreGeneral  everything else: guarded_score per element, bounds too.
 * Where a variant applies it computes what guarded_score does: with both
 * guards off the transform is the identity and its derivative exactly 1,
 * and the mask adds the same float (or masks the same keys). */
enum score_variant { kScorePlain, kScoreKeyMask, kScoreGeneral };

/* Whether a score clamp or soft-cap is on ("on" as in attention_math.h):
 * otherwise a score is raw * scale, guarded_score's identity. */
__device__ __forceinline__ bool score_guards_on(const ng_attention_args &a) {
    return (float)a.max_score > 0.0f || (float)a.softcap > 0.0f;
}

/* The variant of the tile of query rows [i0, i0 + 64) and keys [j0, j0 + 64),
 * keys valid below kend. */
__device__ __forceinline__ score_variant tile_variant(const ng_attention_args &a, int64_t i0,
                                                      int64_t j0, int64_t kend) {
    const bool interior =
        i0 + kMmaRows <= a.L && j0 + kMmaRows <= kend && (!a.is_causal || j0 + kMmaRows - 1 <= i0);
    if (!interior || score_guards_on(a)) return kScoreGeneral;
    if (a.mask_kind == NG_MASK_NONE) return kScorePlain;
    return a.mask_stride[2] == 0 ? kScoreKeyMask : kScoreGeneral;
}

/* f(variant_tag<V>{}) for the variant var, V a compile-time constant: the
 * one run-time branch by which a tile picks its compiled score step. */
template <score_variant V>
struct variant_tag {
    static constexpr score_variant value = V;
};
template <typename F>
__device__ __forceinline__ void with_variant(score_variant var, F &&f) {
    switch (var) {
    case kScorePlain: f(variant_tag<kScorePlain>{}); break;
    case kScoreKeyMask: f(variant_tag<kScoreKeyMask>{}); break;
    default: f(variant_tag<kScoreGeneral>{});
    }
}

/* Score of element (i, j) of a tile of variant V (the masked ones: the
 * plain variant's score is the scaled dot product itself, which its
 * callers fold into their own step) from its scaled raw dot product x:
 * mrow, the offset of (b, h)'s mask row (kScoreKeyMask: the element's is
 * mrow + j mask_stride[3]), ok that i < L and j < kend (kScoreGeneral). */
template <score_variant V>
__device__ __forceinline__ float tile_score(const ng_attention_args &a, float x, int64_t b,
                                            int64_t h, int64_t i, int64_t j, bool ok,
                                            int64_t mrow) {
    static_assert(V != kScorePlain, "the plain variant has no tile_score");
    if constexpr (V == kScoreKeyMask) {
        const double mv =
            ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype, mrow + j * a.mask_stride[3]);
        return mv == -INFINITY ? -INFINITY : x + (float)mv;
    }
    return ok ? guarded_score(a, x, b, h, i, j) : -INFINITY;
}

/* The tensor-core kernels take exp in base 2: a score x is carried as
 * x log2(e), so that exp(x - m) is one FMA and one ex2 (exp2f) where expf
 * needs a range reduction of its own, and the plain variant folds the
 * scale in (raw * scale log2(e)). Their p is rounded to fp16 / bf16 right
 * after, far coarser than the few ulp by which this differs from expf. */
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* The offset of (b, h)'s row of a mask (what tile_score takes). */
__device__ __forceinline__ int64_t mask_row(const ng_attention_args &a, int64_t b, int64_t h) {
    return b * a.mask_stride[0] + h * a.mask_stride[1];
}

/* This thread's vote on whether the 64 keys [j0, j0 + 64) are live for
 * head h: with a mask that does not depend on the query (a padding mask),
 * thread t < 64 says whether key j0 + t is below kend and not masked (the
 * others say no); with any other mask, or none, every thread says yes.
 * Through __syncthreads_or the block learns whether any key is live: a tile
 * none of whose keys is gives every row p = 0 (and dS = 0), and its math is
 * skipped (a NaN that K or V hold at those keys does not reach the rows,
 * the "may" of the numerics contract, as on the CPU). */
__device__ __forceinline__ int key_vote(const ng_attention_args &a, int64_t b, int64_t h,
                                        int64_t j0, int64_t kend) {
    if (a.mask_kind == NG_MASK_NONE || a.mask_stride[2] != 0) return 1;
    const int64_t j = j0 + threadIdx.x;
    return threadIdx.x < kMmaRows && j < kend &&
           ng_attn_mask_value(a.mask, a.mask_kind, a.mask_dtype,
                              mask_row(a, b, h) + j * a.mask_stride[3]) != -INFINITY;
}

/* Store a warp's 16 x D accumulator rows, row r times mul[r], to rows
 * row0 + frag_row of a [seq, D] slice; rows >= n are skipped. */
template <ng_dtype T, int D>
__device__ __forceinline__ void mma_store_rows(void *dst, int64_t base, int64_t rs, int64_t row0,
                                               int64_t n, const float acc[D / 8][4],
                                               const float mul[2], int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = row0 + frag_row(lane, 2 * r);
        if (i >= n) continue;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; c++)
                ng_store_f32(dst, T, base + i * rs + frag_col(lane, dt, c), acc[dt][c] * mul[r]);
    }
}

/* D (dout . out) of rows [i0, i0 + 64) of head h into dl[64] and their
 * logsumexp times log2(e) into ls[64] (-inf past L, so those rows get
 * p = 0). WsD: D from
 * the pre-kernel's workspace dsum, one thread per row; otherwise row_dot,
 * one warp per row. */
template <ng_dtype T, int D, bool WsD>
__device__ __forceinline__ void mma_row_terms(float *dl, float *ls, const ng_attention_args &a,
                                              int64_t b, int64_t h, const void *gb, const void *ob,
                                              const float *dsum, int64_t i0) {
    const float *lse = (const float *)a.lse + (b * a.Hq + h) * a.L;
    if constexpr (WsD) {
        for (int r = threadIdx.x; r < kMmaRows; r += kMmaThreads) {
            const int64_t i = i0 + r;
            dl[r] = i < a.L ? ws_d(dsum, a, b, h, i) : 0.0f;
            ls[r] = i < a.L ? lse[i] * kLog2e : -INFINITY;
        }
    } else {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 1
        for (int r = warp; r < kMmaRows; r += kMmaWarps) {
            const int64_t i = i0 + r;
            const float d = row_dot<T, D>(a, gb, ob, i, i < a.L);
            if (lane == 0) {
                dl[r] = d;
                ls[r] = i < a.L ? lse[i] * kLog2e : -INFINITY;
            }
        }
    }
}

/* The forward's scores of a key tile, variant V: s[nt][c] (raw dot
 * products of the warp's rows from i0 against keys from j0) becomes each
 * element's score times log2(e), bm[r] the max over the lane's part of
 * row r. */
template <score_variant V>
__device__ __forceinline__ void
fwd_scores(float s[kMmaNT][4], float bm[2], const ng_attention_args &a, int64_t b, int64_t h,
           int64_t i0, int64_t j0, int64_t kend, float scale, int lane) {
    const int64_t mrow = mask_row(a, b, h);
    const float scale2 = scale * kLog2e;
#pragma unroll
    for (int nt = 0; nt < kMmaNT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int64_t i = i0 + frag_row(lane, c), j = j0 + frag_col(lane, nt, c);
            if constexpr (V == kScorePlain)
                s[nt][c] *= scale2;
            else
                s[nt][c] =
                    tile_score<V>(a, s[nt][c] * scale, b, h, i, j, i < a.L && j < kend, mrow) *
                    kLog2e;
            bm[c >> 1] = ng_attn_max_nan_f32(bm[c >> 1], s[nt][c]);
        }
}

/* Keys [j0, j0 + 64) of K and V (those below end; zeros past it) into a
 * stage's K tile and the V tile after it, issued as one committed cp.async
 * group (mma_stage_async). */
template <int D>
__device__ __forceinline__ void mma_issue_kv(uint16_t *stage, const uint16_t *kb,
                                             const uint16_t *vb, const ng_attention_args &a,
                                             int64_t j0, int64_t end, int vec) {
    mma_stage_async<D>(stage, kb, a.k_stride[2], j0, end - j0, vec);
    mma_stage_async<D>(stage + kMmaRows * (D + 8), vb, a.v_stride[2], j0, end - j0, vec);
    if constexpr (kAsyncCopy) ng_cp_async_commit();
}

/* One step of the online softmax of a warp's 16 rows in base 2 over a
 * tile's NT n-tiles: s holds the scores times log2(e) and bm[r] the max of
 * the lane's part of row r (0: g, 1: g + 8). The row max is taken over the
 * 4 lanes of the group; m, l and the accumulator o move to it, and s
 * becomes p times its dropout keep bit (keep, bit 4 nt + c; unused without
 * drop). Only the bit: p / (1 - p_drop) can exceed fp16's range once
 * rounded for the tensor cores, so the factor is the caller's, on the fp32
 * output. */
template <int D, int NT>
__device__ __forceinline__ void mma_softmax_step(float s[NT][4], float bm[2], float m[2],
                                                 float l[2], float o[D / 8][4], bool drop,
                                                 uint32_t keep) {
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        bm[r] = ng_attn_max_nan_f32(bm[r], __shfl_xor_sync(kFull, bm[r], 1));
        bm[r] = ng_attn_max_nan_f32(bm[r], __shfl_xor_sync(kFull, bm[r], 2));
        const float m_new = ng_attn_max_nan_f32(m[r], bm[r]);
        alpha[r] = ng_attn_rescale2_f32(m[r], m_new);
        m[r] = m_new;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int r = c >> 1;
            const float p = ng_attn_exp2_shift_f32(s[nt][c], m[r]);
            l[r] += p;
            s[nt][c] = drop ? p * keep_factor(keep, nt, c, 1.0f) : p;
        }
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[dt][c] *= alpha[c >> 1];
}

template <ng_dtype T, int D>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_fwd_mma_kernel(ng_attention_args a, int vec) {
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* two stages of (K, V) tiles, stage st at smem + 2 st kTile; Q is staged
     * in stage 1's K tile and read into registers before tile 1 lands there */
    uint16_t *const smem = (uint16_t *)mma_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kMmaRows), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t q0 = bc.blk * kMmaRows;
    const float scale = (float)a.scale;
    const bool drop = a.dropout_p > 0.0;
    const float inv_keep = drop ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];
    const int64_t kend = a.is_causal ? NG_MIN(a.S, q0 + kMmaRows) : a.S;
    /* group 0: Q; group 1: key tile 0 (empty when there are no keys) */
    mma_stage_async<D>(smem + 2 * kTile, qb, a.q_stride[2], q0, a.L - q0, vec);
    if constexpr (kAsyncCopy) ng_cp_async_commit();
    if (kend > 0) {
        mma_stage_async<D>(smem, kb, a.k_stride[2], 0, kend, vec);
        mma_stage_async<D>(smem + kTile, vb, a.v_stride[2], 0, kend, vec);
    }
    if constexpr (kAsyncCopy) {
        ng_cp_async_commit();
        ng_cp_async_wait_group<1>(); /* Q landed; tile 0 may still be in flight */
    }
    /* live: whether the tile about to be computed has a live key (tile 0's
     * copies are issued before its vote, the others' after) */
    bool live = __syncthreads_or(key_vote(a, b, h, 0, kend));
    uint32_t qf[D / 16][4]; /* the warp's 16 query rows as A fragments, for every key tile */
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ng_mma_ldm_a(qf[kk], smem + 2 * kTile, D + 8, warp * 16, kk * 16, lane);

    /* m: each row's running max times log2(e) (fwd_scores) */
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int st = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += kMmaRows, st ^= 1) {
        /* tile j0 complete and visible to all; every warp done with the
         * other stage (tile j0 - 64, or Q on the first pass) */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>();
        /* the block's vote on the next tile: copied only when it has a
         * live key */
        const int64_t jn = j0 + kMmaRows;
        const bool live_next = __syncthreads_or(jn < kend && key_vote(a, b, h, jn, kend));
        const uint16_t *ks = smem + 2 * st * kTile, *vs = ks + kTile;
        if (live_next) { /* tile jn into the other stage, behind this one's math */
            mma_issue_kv<D>(smem + 2 * (st ^ 1) * kTile, kb, vb, a, jn, kend, vec);
        }
        const bool dead = !live;
        live = live_next;
        if (dead) continue; /* every key of the tile masked: p = 0 for every row */
        float s[kMmaNT][4] = {};
        mma_qkt<T, D>(s, qf, ks, lane);

        float bm[2] = {-INFINITY, -INFINITY};
        with_variant(tile_variant(a, q0, j0, kend), [&](auto v) {
            fwd_scores<decltype(v)::value>(s, bm, a, b, h, q0 + warp * 16, j0, kend, scale, lane);
        });
        const uint32_t keep =
            drop ? mma_keep_bits(a, b, h, q0 + warp * 16, j0, 0, kMmaNT, lane) : 0u;
        mma_softmax_step<D, kMmaNT>(s, bm, m, l, o, drop, keep);
        mma_wy<T, D, kMmaNT>(o, s, vs, lane);
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) { /* the 4 lanes of a group hold disjoint parts of the row sum */
        l[r] += __shfl_xor_sync(kFull, l[r], 1);
        l[r] += __shfl_xor_sync(kFull, l[r], 2);
        inv[r] = ng_attn_inv_sum_f32(l[r]) * inv_keep;
        const int64_t i = q0 + warp * 16 + frag_row(lane, 2 * r);
        if ((lane & 3) == 0 && i < a.L)
            ((float *)a.lse)[(b * a.Hq + h) * a.L + i] = ng_attn_lse_f32(m[r] * kLn2, l[r]);
    }
    mma_store_rows<T, D>(a.out, b * a.out_stride[0] + h * a.out_stride[1], a.out_stride[2],
                         q0 + warp * 16, a.L, o, inv, lane);
}

/* ---- decode on the tensor cores ---------------------------------------------
 * The decode shape in fp16 / bf16 with E == Ev in {64, 128} on sm_80+
 * (dec_mma): the SIMT decode's rows and splits (a block takes kDecRows = 16
 * rows of (b, hk)'s group, row r = query r % L of head hk G + r / L, and one
 * split of the keys) with the tensor-core forward's math. The split's keys
 * stream through two stages of 64-key (K, V) tiles as in the forward:
 * 16-byte cp.async.cg, the next tile issued right after the barrier that
 * opens the current one, and with a padding mask that every row of the
 * block shares, a tile without a live key neither copied nor computed.
 *
 * Warp w takes keys 16 w .. 16 w + 15 of every tile: S = Q K^T (two
 * n-tiles; the block's 16 rows as A fragments held in registers, zeros past
 * the group), its own online softmax, O_w += P V (one k-step, P rounded to
 * T as in the forward). Every warp sees all 16 rows and a quarter of the
 * keys, so a single query row (MHA) keeps the four warps busy, and a kv
 * head's K / V bytes serve up to 16 rows of its group through the tensor
 * cores where the SIMT decode spends an FMA per row and element. The four
 * warps' (m, l, O) merge through shared memory in warp order at the end;
 * the block then writes out and lse, or (with splits) its (m, l) and
 * unnormalized O for decode_combine, as the SIMT decode does. */

/* Whether every row of a decode block reads one mask row: a padding mask
 * ([B, 1, 1, S], or [B, Hq, 1, S] when the rows are all of one head) is
 * then one vote per key (key_vote), and a tile it hides is skipped. */
__device__ __forceinline__ bool dec_shared_mask(const ng_attention_args &a, int64_t G) {
    return a.mask_kind != NG_MASK_NONE && a.mask_stride[2] == 0 &&
           (a.mask_stride[1] == 0 || G == 1);
}

template <ng_dtype T, int D>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_decode_mma_kernel(ng_attention_args a, dec_plan p, float *ws, int vec) {
    constexpr int kLd = D + 8, kTile = kMmaRows * kLd;
    static_assert(kDecRows == 16 && kMmaWarps * 16 == kMmaRows, "one m16 tile, 16 keys a warp");
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    uint16_t *const smem = (uint16_t *)mma_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(p.nsplit * p.groups, a.Hkv);
    const int64_t b = bc.b, hk = bc.h, split = bc.blk % p.nsplit, r0 = bc.blk / p.nsplit * kDecRows;
    const int64_t G = a.Hq / a.Hkv, M = G * a.L;
    const float scale = (float)a.scale, scale2 = scale * kLog2e;
    const bool drop = a.dropout_p > 0.0;
    const float inv_keep = drop ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const bool plain = a.mask_kind == NG_MASK_NONE && !a.is_causal && !score_guards_on(a);
    const bool vote = dec_shared_mask(a, G);
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];
    const int64_t jb = split * p.split_len, je = NG_MIN(p.klen, jb + p.split_len);

    /* group 0: the block's Q rows (zeros past M) in stage 1's K tile */
    uint16_t *const qs = smem + 2 * kTile;
    for (int x = threadIdx.x; x < kDecRows * (D / 8); x += kMmaThreads) {
        const int rr = x / (D / 8), c = (x % (D / 8)) * 8;
        const int64_t r = r0 + rr;
        uint16_t *dst = qs + rr * kLd + c;
        if (r >= M) {
            *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
            continue;
        }
        const uint16_t *src = (const uint16_t *)a.q + b * a.q_stride[0] +
                              (hk * G + r / a.L) * a.q_stride[1] + (r % a.L) * a.q_stride[2] + c;
        if (kAsyncCopy && vec)
            ng_cp_async_cg16(dst, src);
        else if (vec)
            *(uint4 *)dst = *(const uint4 *)src;
        else
            *(uint4 *)dst = make_uint4(ng_mma_ld2(src), ng_mma_ld2(src + 2), ng_mma_ld2(src + 4),
                                       ng_mma_ld2(src + 6));
    }
    if constexpr (kAsyncCopy) ng_cp_async_commit();
    /* group 1: the split's first tile, or an empty group when the split has
     * no keys (the wait counts groups) */
    if (jb < je)
        mma_issue_kv<D>(smem, kb, vb, a, jb, je, vec);
    else if constexpr (kAsyncCopy)
        ng_cp_async_commit();
    if constexpr (kAsyncCopy) ng_cp_async_wait_group<1>(); /* Q landed; tile jb may be in flight */
    /* live: whether the tile about to be computed has a live key */
    bool live = __syncthreads_or(jb < je && (!vote || key_vote(a, b, hk * G, jb, je)));
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ng_mma_ldm_a(qf[kk], qs, kLd, 0, kk * 16, lane);

    /* the lane's two rows (g, g + 8): valid, head, query position */
    bool rok[2];
    int64_t rh[2], ri[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t row = r0 + (lane >> 2) + 8 * r;
        rok[r] = row < M;
        rh[r] = hk * G + (rok[r] ? row / a.L : 0);
        ri[r] = rok[r] ? row % a.L : 0;
    }

    /* m: each row's running max over the warp's keys, times log2(e) */
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    int st = 0;
    for (int64_t j0 = jb; j0 < je; j0 += kMmaRows, st ^= 1) {
        /* tile j0 complete and visible to all; every warp done with the
         * other stage (tile j0 - 64, or Q on the first pass) */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>();
        const int64_t jn = j0 + kMmaRows;
        const bool live_next =
            __syncthreads_or(jn < je && (!vote || key_vote(a, b, hk * G, jn, je)));
        const uint16_t *ks = smem + 2 * st * kTile + warp * 16 * kLd, *vs = ks + kTile;
        if (live_next) { /* tile jn into the other stage, behind this one's math */
            mma_issue_kv<D>(smem + 2 * (st ^ 1) * kTile, kb, vb, a, jn, je, vec);
        }
        const bool dead = !live;
        live = live_next;
        if (dead) continue; /* every key of the tile masked: p = 0 for every row */

        float s[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) mma_xyt_step<T, D, 2>(s, qf[kk], ks, kk * 16, lane);
        const int64_t jw = j0 + warp * 16; /* the warp's first key */
        float bm[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int r = c >> 1;
                const int64_t j = jw + frag_col(lane, nt, c);
                float x = -INFINITY;
                if (rok[r] && j < je)
                    x = plain ? s[nt][c] * scale2
                              : guarded_score(a, s[nt][c] * scale, b, rh[r], ri[r], j) * kLog2e;
                s[nt][c] = x;
                bm[r] = ng_attn_max_nan_f32(bm[r], x);
            }
        uint32_t keep = 0u; /* dropout keep bit of element 4 nt + c */
        if (drop) {
#pragma unroll 1
            for (int x = 0; x < 8; x++) {
                const bool hi = (x & 3) >> 1; /* row g + 8 (selects, not an index:
                                                   the arrays stay in registers) */
                const int64_t j = jw + frag_col(lane, x >> 2, x & 3);
                if ((hi ? rok[1] : rok[0]) && j < je) {
                    const int64_t h = hi ? rh[1] : rh[0], i = hi ? ri[1] : ri[0];
                    const uint64_t e = (uint64_t)(((b * a.Hq + h) * a.L + i) * a.S + j);
                    keep |= (uint32_t)ng_attn_dropout_keep(a.seed, a.offset, e, (float)a.dropout_p)
                            << x;
                }
            }
        }
        mma_softmax_step<D, 2>(s, bm, m, l, o, drop, keep);
        mma_wy<T, D, 2>(o, s, vs, lane);
    }

    /* merge the warps: (m, l) of each warp's 16 rows, then its O scaled to
     * the block's max, in the stages' shared memory */
    if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>();
    __syncthreads(); /* every warp done with the stages */
    float *const mw = (float *)mma_smem, *const lw = mw + kMmaWarps * 16;
    /* ow: [warp][16][D]; fm, fl: each row's max and rescaled sum */
    float *const ow = lw + kMmaWarps * 16, *const fm = ow + kMmaWarps * 16 * D, *const fl = fm + 16;
    static_assert((2 * kMmaWarps * 16 + kMmaWarps * 16 * D + 2 * 16) * sizeof(float) <=
                      4 * kTile * sizeof(uint16_t),
                  "the merge fits in the stages");
#pragma unroll
    for (int r = 0; r < 2; r++) { /* the 4 lanes of a group hold disjoint parts of the row sum */
        l[r] += __shfl_xor_sync(kFull, l[r], 1);
        l[r] += __shfl_xor_sync(kFull, l[r], 2);
        if ((lane & 3) == 0) {
            mw[warp * 16 + (lane >> 2) + 8 * r] = m[r];
            lw[warp * 16 + (lane >> 2) + 8 * r] = l[r];
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = (lane >> 2) + 8 * r;
        float mx = -INFINITY;
        for (int w = 0; w < kMmaWarps; w++) mx = ng_attn_max_nan_f32(mx, mw[w * 16 + row]);
        const float f = ng_attn_rescale2_f32(m[r], mx);
        if (warp == 0 && (lane & 3) == 0) { /* the row's max and its rescaled sum, once */
            float lsum = 0.0f;
            for (int w = 0; w < kMmaWarps; w++)
                lsum += lw[w * 16 + row] * ng_attn_rescale2_f32(mw[w * 16 + row], mx);
            fm[row] = mx;
            fl[row] = lsum;
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; c++)
                ow[(warp * 16 + row) * D + frag_col(lane, dt, c)] = o[dt][c] * f;
    }
    __syncthreads();
    const int64_t rows = dec_rows(a);
    for (int x = threadIdx.x; x < kDecRows * D; x += kMmaThreads) {
        const int rr = x / D, d = x % D;
        const int64_t r = r0 + rr;
        if (r >= M) break; /* rows past M come last */
        const float mx = fm[rr], lsum = fl[rr];
        float acc = 0.0f;
        for (int w = 0; w < kMmaWarps; w++) acc += ow[(w * 16 + rr) * D + d];
        acc *= inv_keep;
        const int64_t h = hk * G + r / a.L, i = r % a.L, row = (b * a.Hq + h) * a.L + i;
        const float m_nat = mx * kLn2; /* natural units, as lse and the SIMT decode's m */
        if (p.nsplit == 1) {
            ng_store_f32(a.out, T,
                         b * a.out_stride[0] + h * a.out_stride[1] + i * a.out_stride[2] + d,
                         acc * ng_attn_inv_sum_f32(lsum));
            if (d == 0) ((float *)a.lse)[row] = ng_attn_lse_f32(m_nat, lsum);
        } else {
            ws[2 * p.nsplit * rows + (split * rows + row) * D + d] = acc;
            if (d == 0) {
                ws[2 * (split * rows + row)] = m_nat;
                ws[2 * (split * rows + row) + 1] = lsum;
            }
        }
    }
}

/* The elementwise part of mma_bwd_scores for a tile of variant V, from the
 * raw dot products st (q . k) and dpt (dout . v). */
template <score_variant V, bool KeyRows, int NT>
__device__ __forceinline__ void
mma_bwd_elems(float pd[NT][4], float ds[NT][4], const float st[NT][4], const float dpt[NT][4],
              const ng_attention_args &a, uint32_t keep, const float *ls, const float *dl,
              int64_t b, int64_t h, int64_t row0, int64_t col0, int rl0, int64_t kend, int lane) {
    const bool drop = a.dropout_p > 0.0;
    const float inv_keep = drop ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const float scale = (float)a.scale, scale2 = scale * kLog2e;
    const int64_t mrow = mask_row(a, b, h);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int rl = frag_row(lane, c), cl = frag_col(lane, nt, c);
            const int ql = KeyRows ? cl : rl0 + rl; /* the query's place in its block */
            const int64_t i = KeyRows ? col0 + cl : row0 + rl, j = KeyRows ? row0 + rl : col0 + cl;
            const float kf = drop ? keep_factor(keep, nt, c, inv_keep) : 1.0f;
            /* bwd_score_keep's steps in base 2; rows past L (the last
             * tile's) never reach the mask */
            float p = 0.0f, dsc = 0.0f;
            if ((V != kScoreGeneral || (j < kend && i < a.L)) && ls[ql] != -INFINITY) {
                if constexpr (V == kScorePlain) {
                    p = exp2f(fmaf(st[nt][c], scale2, -ls[ql]));
                } else {
                    const float sc = tile_score<V>(a, st[nt][c] * scale, b, h, i, j, true, mrow);
                    p = sc == -INFINITY ? 0.0f : exp2f(fmaf(sc, kLog2e, -ls[ql]));
                }
                if (p != 0.0f) {
                    dsc = p * (dpt[nt][c] * kf - dl[ql]) * scale;
                    if constexpr (V == kScoreGeneral)
                        dsc *= ng_attn_transform_grad_f32(st[nt][c] * scale, (float)a.max_score,
                                                          (float)a.softcap);
                }
            }
            pd[nt][c] = kf != 0.0f ? p : 0.0f;
            ds[nt][c] = dsc;
        }
}

/* One warp's backward scores against 8 NT rows of a staged tile, in C fragments:
 * pd = p times the dropout keep bit (0 or 1: the factor 1/(1-p_drop) is
 * applied to the fp32 dv accumulator by the caller, so no rounding to fp16
 * can overflow) and ds = dS (bwd_score_keep) of the 16 x 8 NT block whose raw
 * dot products are x . y^T (q . k) and x2 . y2^T (dout . v). KeyRows: the
 * warp's rows are keys and the tile's rows queries (dk/dv kernel), else the
 * reverse (dq kernel). row0 / col0: first global row / column index; rl0:
 * the warp's first row inside its block (the lse / D arrays ls, dl are
 * indexed by the query's position in its 64-row block); keys >= kend are
 * out of range; var: the tile's score variant (tile_variant). */
template <ng_dtype T, int D, bool KeyRows, int NT>
__device__ __forceinline__ void
mma_bwd_scores(float pd[NT][4], float ds[NT][4], const ng_attention_args &a, const uint16_t *x,
               const uint16_t *y, const uint16_t *x2, const uint16_t *y2, const float *ls,
               const float *dl, int64_t b, int64_t h, int64_t row0, int64_t col0, int rl0,
               int64_t kend, score_variant var, int lane) {
    float st[NT][4] = {}, dpt[NT][4] = {};
    mma_xyt<T, D, NT>(st, x, rl0, y, lane);
    mma_xyt<T, D, NT>(dpt, x2, rl0, y2, lane);
    const uint32_t keep =
        a.dropout_p > 0.0 ? mma_keep_bits(a, b, h, row0, col0, KeyRows, NT, lane) : 0u;
    with_variant(var, [&](auto v) {
        mma_bwd_elems<decltype(v)::value, KeyRows, NT>(pd, ds, st, dpt, a, keep, ls, dl, b, h, row0,
                                                       col0, rl0, kend, lane);
    });
}

/* Query tile (h, i0) of the dk / dv kernel into a stage: its Q and dO rows
 * issued as cp.async (mma_stage_async; the caller commits), its rows'
 * D and lse (mma_row_terms) stored at once. */
template <ng_dtype T, int D, bool WsD>
__device__ __forceinline__ void mma_dkdv_issue(uint16_t *qs, uint16_t *gs, float *dl, float *ls,
                                               const ng_attention_args &a, const float *dsum,
                                               int64_t b, int64_t h, int64_t i0, int vec) {
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *gb = (const uint16_t *)a.dout + b * a.dout_stride[0] + h * a.dout_stride[1];
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);
    mma_stage_async<D>(qs, qb, a.q_stride[2], i0, a.L - i0, vec);
    mma_stage_async<D>(gs, gb, a.dout_stride[2], i0, a.L - i0, vec);
    mma_row_terms<T, D, WsD>(dl, ls, a, b, h, gb, ob, dsum, i0);
}

/* NStage (1 or 2) stages of the streamed tiles (launch_mma picks 2 where the
 * device's shared memory allows). With 2 the next tile is issued right after
 * the barrier that opens the current one; with 1 it is issued after a second
 * barrier, once every warp is done with the current one. WsD: D from the
 * pre-kernel's dsum; otherwise computed per query tile (dsum unused). */
template <ng_dtype T, int D, int NStage, bool WsD>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_bwd_dkdv_mma_kernel(ng_attention_args a, const float *dsum, const int *live,
                                  int vec) {
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* K, V, then stage st's (Q, dO) tiles at (2 + 2 st) kTile; after the
     * tiles, stage st's dl, ls (dout . out and lse of its 64 rows) */
    uint16_t *const ks = (uint16_t *)mma_smem, *const vs = ks + kTile;
    float *const rows = (float *)(ks + (2 + 2 * NStage) * kTile);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.S, (int64_t)kMmaRows), a.Hkv);
    const int64_t b = bc.b, hk = bc.h, grp = a.Hq / a.Hkv;
    const int64_t j0 = bc.blk * kMmaRows;
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];

    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    int ex[2] = {0, 0};
    /* The query tiles, head by head of the group. causal: query tiles that
     * end before this block's first key see none of it; live: a padding
     * mask hides its keys from every query of the group. */
    const int64_t istart = a.is_causal ? j0 : 0, hend = (hk + 1) * grp;
    int64_t h = hk * grp, i0 = istart;
    /* (the flags' blocks are this grid's: flag blockIdx.x is this block's) */
    if (istart >= a.L || (WsD && live && !live[blockIdx.x])) {
        h = hend; /* no query sees these keys: dk = dv = 0 */
    } else {      /* group: K, V and query tile 0 */
        mma_stage_async<D>(ks, kb, a.k_stride[2], j0, a.S - j0, vec);
        mma_stage_async<D>(vs, vb, a.v_stride[2], j0, a.S - j0, vec);
        mma_dkdv_issue<T, D, WsD>(ks + 2 * kTile, ks + 3 * kTile, rows, rows + kMmaRows, a, dsum, b,
                                  h, i0, vec);
        if constexpr (kAsyncCopy) ng_cp_async_commit();
    }
    for (int st = 0; h < hend; st ^= NStage - 1) {
        /* query tile (h, i0) complete and visible to all; with two stages,
         * every warp done with the other one (the previous tile) */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>(); /* this thread's Q / dO rows */
        __syncthreads();
        const uint16_t *qs = ks + (2 + 2 * st) * kTile, *gs = qs + kTile;
        const float *dl = rows + 2 * st * kMmaRows, *ls = dl + kMmaRows;
        if (NStage == 2) { /* the next tile into the other stage, behind this math */
            const bool more = i0 + kMmaRows < a.L;
            const int64_t hn = more ? h : h + 1, in = more ? i0 + kMmaRows : istart;
            const int sn = 2 + 2 * (st ^ 1);
            if (hn < hend) {
                mma_dkdv_issue<T, D, WsD>(
                    ks + sn * kTile, ks + (sn + 1) * kTile, rows + 2 * (st ^ 1) * kMmaRows,
                    rows + (2 * (st ^ 1) + 1) * kMmaRows, a, dsum, b, hn, in, vec);
                if constexpr (kAsyncCopy) ng_cp_async_commit();
            }
        }
        /* D = 128: the tile's queries in two parts of 32, so that p and dS
         * take 32 registers beside the 128 of the dk / dv accumulators
         * instead of 64 (with 64 the kernel spills) */
        constexpr int kParts = D == 128 ? 2 : 1, kPartNT = kMmaNT / kParts;
        /* the variants in the hot kernel only: the in-kernel D's registers
         * leave no room for them (it would spill) */
        const score_variant var = WsD ? tile_variant(a, i0, j0, a.S) : kScoreGeneral;
#pragma unroll 1
        for (int q = 0; q < kMmaRows; q += kMmaRows / kParts) {
            const uint16_t *qp = qs + q * (D + 8), *gp = gs + q * (D + 8);
            float pd[kPartNT][4], ds[kPartNT][4];
            mma_bwd_scores<T, D, true, kPartNT>(pd, ds, a, ks, qp, vs, gp, ls + q, dl + q, b, h,
                                                j0 + warp * 16, i0 + q, warp * 16, a.S, var, lane);
            mma_scale_ds<T, D, kPartNT>(ds, dk, ex);
            mma_wy<T, D, kPartNT>(dv, pd, gp, lane);
            mma_wy<T, D, kPartNT>(dk, ds, qp, lane);
        }
        if (i0 + kMmaRows < a.L) {
            i0 += kMmaRows;
        } else {
            h++;
            i0 = istart;
        }
        if (NStage == 1 && h < hend) { /* every warp done with the one stage */
            __syncthreads();
            mma_dkdv_issue<T, D, WsD>(ks + 2 * kTile, ks + 3 * kTile, rows, rows + kMmaRows, a,
                                      dsum, b, h, i0, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
    }

    const float inv_keep = a.dropout_p > 0.0 ? (float)(1.0 / (1.0 - a.dropout_p)) : 1.0f;
    const float vmul[2] = {inv_keep, inv_keep},
                kmul[2] = {ldexpf(1.0f, ex[0]), ldexpf(1.0f, ex[1])};
    mma_store_rows<T, D>(a.dk, b * a.dk_stride[0] + hk * a.dk_stride[1], a.dk_stride[2],
                         j0 + warp * 16, a.S, dk, kmul, lane);
    mma_store_rows<T, D>(a.dv, b * a.dv_stride[0] + hk * a.dv_stride[1], a.dv_stride[2],
                         j0 + warp * 16, a.S, dv, vmul, lane);
}

/* WsD: D from the pre-kernel's dsum; otherwise computed here (dsum unused). */
template <ng_dtype T, int D, int NStage, bool WsD>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_bwd_dq_mma_kernel(ng_attention_args a, const float *dsum, int vec) {
    constexpr int kTile = kMmaRows * (D + 8);
    NG_DYNAMIC_SMEM(uint4, mma_smem);
    /* Q, dO, then stage st's (K, V) tiles at (2 + 2 st) kTile; after the
     * tiles, dl, ls (dout . out and lse of the block's 64 rows) */
    uint16_t *const qs = (uint16_t *)mma_smem, *const gs = qs + kTile;
    float *const dl = (float *)(qs + (2 + 2 * NStage) * kTile), *const ls = dl + kMmaRows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const block_coord bc = block_coords(NG_CEIL_DIV(a.L, (int64_t)kMmaRows), a.Hq);
    const int64_t b = bc.b, h = bc.h, hk = h / (a.Hq / a.Hkv);
    const int64_t q0 = bc.blk * kMmaRows;
    const uint16_t *qb = (const uint16_t *)a.q + b * a.q_stride[0] + h * a.q_stride[1];
    const uint16_t *gb = (const uint16_t *)a.dout + b * a.dout_stride[0] + h * a.dout_stride[1];
    const uint16_t *kb = (const uint16_t *)a.k + b * a.k_stride[0] + hk * a.k_stride[1];
    const uint16_t *vb = (const uint16_t *)a.v + b * a.v_stride[0] + hk * a.v_stride[1];
    const void *ob = slice<T>(a.out, b * a.out_stride[0] + h * a.out_stride[1]);

    float dq[D / 8][4] = {};
    int ex[2] = {0, 0};
    const int64_t kend = a.is_causal ? NG_MIN(a.S, q0 + kMmaRows) : a.S;
    if (kend > 0) { /* group: Q, dO and key tile 0 (without keys dq = 0) */
        mma_stage_async<D>(qs, qb, a.q_stride[2], q0, a.L - q0, vec);
        mma_stage_async<D>(gs, gb, a.dout_stride[2], q0, a.L - q0, vec);
        mma_stage_async<D>(qs + 2 * kTile, kb, a.k_stride[2], 0, kend, vec);
        mma_stage_async<D>(qs + 3 * kTile, vb, a.v_stride[2], 0, kend, vec);
        if constexpr (kAsyncCopy) ng_cp_async_commit();
        mma_row_terms<T, D, WsD>(dl, ls, a, b, h, gb, ob, dsum, q0);
    }
    int st = 0;
    /* live: whether key tile j0 has a live key, from the vote at the
     * previous tile's barrier (tile 0, copied with Q and dO, is computed) */
    bool live = true;
    for (int64_t j0 = 0; j0 < kend; j0 += kMmaRows, st ^= NStage - 1) {
        /* key tile j0 complete and visible to all; with two stages, every
         * warp done with the other one (the previous tile). The block's
         * vote on the next tile: copied only when it has a live key. */
        if constexpr (kAsyncCopy) ng_cp_async_wait_group<0>(); /* this thread's K / V rows */
        const int64_t jn = j0 + kMmaRows;
        const bool live_next = __syncthreads_or(jn < kend && key_vote(a, b, h, jn, kend));
        const uint16_t *ks = qs + (2 + 2 * st) * kTile, *vs = ks + kTile;
        if (NStage == 2 && live_next) { /* the next tile into the other stage, behind this math */
            uint16_t *kn = qs + (2 + 2 * (st ^ 1)) * kTile;
            mma_stage_async<D>(kn, kb, a.k_stride[2], jn, kend - jn, vec);
            mma_stage_async<D>(kn + kTile, vb, a.v_stride[2], jn, kend - jn, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
        if (live) { /* else every key of the tile masked: dS = 0 */
            float pd[kMmaNT][4], ds[kMmaNT][4];
            mma_bwd_scores<T, D, false, kMmaNT>(pd, ds, a, qs, ks, gs, vs, ls, dl, b, h,
                                                q0 + warp * 16, j0, warp * 16, kend,
                                                tile_variant(a, q0, j0, kend), lane);
            mma_scale_ds<T, D, kMmaNT>(ds, dq, ex);
            mma_wy<T, D, kMmaNT>(dq, ds, ks, lane);
        }
        if (NStage == 1 && live_next) { /* every warp done with the one stage */
            __syncthreads();
            mma_stage_async<D>(qs + 2 * kTile, kb, a.k_stride[2], jn, kend - jn, vec);
            mma_stage_async<D>(qs + 3 * kTile, vb, a.v_stride[2], jn, kend - jn, vec);
            if constexpr (kAsyncCopy) ng_cp_async_commit();
        }
        live = live_next;
    }

    const float qmul[2] = {ldexpf(1.0f, ex[0]), ldexpf(1.0f, ex[1])};
    mma_store_rows<T, D>(a.dq, b * a.dq_stride[0] + h * a.dq_stride[1], a.dq_stride[2],
                         q0 + warp * 16, a.L, dq, qmul, lane);
}

/* ---- launch helpers ------------------------------------------------------ */

ng_status cuda_check() { return ng_cuda_record(cudaSuccess); }

/* The device the launch goes to, and what is cached per device: its compute
 * capability, and per kernel the dynamic shared memory it has been allowed
 * (cudaFuncSetAttribute is per device). Device ordinals past kMaxDevices are
 * queried every time. */
constexpr int kMaxDevices = 64;

int current_device() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError(); /* leave no error behind for an unrelated check */
        return -1;
    }
    return dev;
}

/* An attribute of the current device, cached per device in `cache` (0: not
 * read yet); 0 when it cannot be read (the error is cleared). */
int device_attr(cudaDeviceAttr attr, std::atomic<int> (&cache)[kMaxDevices]) {
    const int dev = current_device();
    if (dev < 0) return 0;
    if (dev < kMaxDevices) {
        const int c = cache[dev].load(std::memory_order_relaxed);
        if (c) return c;
    }
    int v = 0;
    if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (dev < kMaxDevices) cache[dev].store(v, std::memory_order_relaxed);
    return v;
}

/* Compute capability major of the current device; 0 when it cannot be read
 * (and the SIMT kernels run). */
int device_major() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrComputeCapabilityMajor, cache);
}

/* The most dynamic shared memory a block of the current device may opt into. */
int device_optin_smem() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, cache);
}

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

/* The one-dimensional grid of nblk blocks per (b, head) (block_coords). */
ng_status fold_grid(int64_t nblk, int64_t heads, int64_t batch, dim3 *grid) {
    const int64_t n = nblk * heads * batch;
    if (nblk <= 0 || heads <= 0 || batch <= 0) return NG_ERR_INVALID_ARG;
    if (n / batch / heads != nblk || n > 2147483647LL) return NG_ERR_UNSUPPORTED; /* gridDim.x */
    *grid = dim3((unsigned)n);
    return NG_OK;
}

template <ng_dtype T, int NT>
ng_status launch_fwd(const ng_attention_args *a, cudaStream_t st) {
    static std::atomic<int> allowed[kMaxDevices];
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kFwdBQ), a->Hq, a->B, &grid));
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_fwd_kernel<T, NT>, sm, allowed));
    NG_LAUNCH((attention_fwd_kernel<T, NT>), grid, kThreads, sm, st, *a);
    return cuda_check();
}

/* How many live flags the backward takes: one per 64-key block of each kv
 * head with a padding mask (a mask that does not depend on the query), [B,
 * Hkv, ceil(S / 64)]; 0 without one. Shape and mask only. */
int64_t bwd_live_count(const ng_attention_args *a) {
    if (a->mask_kind == NG_MASK_NONE || a->mask_stride[2] != 0 || a->Hkv <= 0 || a->S <= 0)
        return 0;
    return a->B * a->Hkv * NG_CEIL_DIV(a->S, (int64_t)kLiveKeys);
}

/* The backward's workspace after D: the live flags (NULL without them). */
const int *bwd_live(const ng_attention_args *a, const float *ws) {
    return ws && bwd_live_count(a) > 0 ? (const int *)(ws + a->B * a->Hq * a->L) : nullptr;
}

/* The pre-kernels: D of every query row into dsum (B Hq L floats), then
 * with a padding mask the key blocks' live flags after it. */
template <ng_dtype T>
ng_status launch_bwd_pre(const ng_attention_args *a, cudaStream_t st, float *dsum) {
    int64_t nb = NG_CEIL_DIV(a->B * a->Hq * a->L, (int64_t)kWarps);
    if (nb > 2147483647LL) return NG_ERR_UNSUPPORTED; /* gridDim.x */
    NG_LAUNCH((attention_bwd_dot_kernel<T>), dim3((unsigned)nb), kThreads, 0, st, *a, dsum);
    NG_TRY(cuda_check());
    int *live = (int *)bwd_live(a, dsum); /* the caller's workspace, written here */
    if (!live) return NG_OK;
    nb = NG_CEIL_DIV(bwd_live_count(a), (int64_t)kWarps);
    if (nb > 2147483647LL) return NG_ERR_UNSUPPORTED;
    NG_LAUNCH((attention_bwd_live_kernel), dim3((unsigned)nb), kThreads, 0, st, *a, live);
    return cuda_check();
}

template <ng_dtype T, int NT, bool WsD>
ng_status launch_bwd_d(const ng_attention_args *a, cudaStream_t st, const float *dsum) {
    static std::atomic<int> allowed_dkdv[kMaxDevices], allowed_dq[kMaxDevices];
    if (a->S > 0) {
        dim3 grid;
        NG_TRY(fold_grid(NG_CEIL_DIV(a->S, (int64_t)kBwdBlock), a->Hkv, a->B, &grid));
        size_t sm = sizeof(float) * (size_t)(kBwdBQ * (a->E + a->Ev) + 2 * kBwdBQ);
        NG_TRY(allow_smem(attention_bwd_dkdv_kernel<T, NT, WsD>, sm, allowed_dkdv));
        NG_LAUNCH((attention_bwd_dkdv_kernel<T, NT, WsD>), grid, kThreads, sm, st, *a, dsum,
                  bwd_live(a, dsum));
        NG_TRY(cuda_check());
    }
    if (a->L == 0) return NG_OK;
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kBwdBlock), a->Hq, a->B, &grid));
    size_t sm = sizeof(float) * (size_t)(kBK * (a->E + a->Ev));
    NG_TRY(allow_smem(attention_bwd_dq_kernel<T, NT, WsD>, sm, allowed_dq));
    NG_LAUNCH((attention_bwd_dq_kernel<T, NT, WsD>), grid, kThreads, sm, st, *a, dsum);
    return cuda_check();
}

/* dsum: the pre-kernel's D (the WsD instantiations) or NULL (D in-kernel). */
template <ng_dtype T, int NT>
ng_status launch_bwd(const ng_attention_args *a, cudaStream_t st, const float *dsum) {
    if (dsum) return launch_bwd_d<T, NT, true>(a, st, dsum);
    return launch_bwd_d<T, NT, false>(a, st, nullptr);
}

/* The backward's dynamic shared memory: two fixed tiles (dkdv: K, V; dq: Q,
 * dO), NStage stages of the two streamed ones, and `rows` pairs of 64 floats
 * (the rows' dout . out and lse; dkdv: one per stage, dq: one). */
constexpr size_t mma_bwd_smem(int D, int nstage, int rows) {
    return sizeof(uint16_t) * (size_t)((2 + 2 * nstage) * kMmaRows * (D + 8)) +
           (size_t)rows * 2 * kMmaRows * sizeof(float);
}

template <ng_dtype T, int D, int NStage, bool WsD>
ng_status launch_mma_bwd_d(const ng_attention_args *a, cudaStream_t st, int vec,
                           const float *dsum) {
    static std::atomic<int> allowed_dkdv[kMaxDevices], allowed_dq[kMaxDevices];
    dim3 grid;
    if (a->S > 0) {
        constexpr size_t sm = mma_bwd_smem(D, NStage, NStage);
        NG_TRY(fold_grid(NG_CEIL_DIV(a->S, (int64_t)kMmaRows), a->Hkv, a->B, &grid));
        NG_TRY(allow_smem(attention_bwd_dkdv_mma_kernel<T, D, NStage, WsD>, sm, allowed_dkdv));
        NG_LAUNCH((attention_bwd_dkdv_mma_kernel<T, D, NStage, WsD>), grid, kMmaThreads, sm, st, *a,
                  dsum, bwd_live(a, dsum), vec);
        NG_TRY(cuda_check());
    }
    if (a->L == 0) return NG_OK;
    constexpr size_t sm = mma_bwd_smem(D, NStage, 1);
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kMmaRows), a->Hq, a->B, &grid));
    NG_TRY(allow_smem(attention_bwd_dq_mma_kernel<T, D, NStage, WsD>, sm, allowed_dq));
    NG_LAUNCH((attention_bwd_dq_mma_kernel<T, D, NStage, WsD>), grid, kMmaThreads, sm, st, *a, dsum,
              vec);
    return cuda_check();
}

/* dsum: the pre-kernel's D (the WsD instantiations) or NULL (D in-kernel). */
template <ng_dtype T, int D, int NStage>
ng_status launch_mma_bwd(const ng_attention_args *a, cudaStream_t st, int vec, const float *dsum) {
    if (dsum) return launch_mma_bwd_d<T, D, NStage, true>(a, st, vec, dsum);
    return launch_mma_bwd_d<T, D, NStage, false>(a, st, vec, nullptr);
}

/* ws: the backward's D (dsum) or NULL; unused by the forward. */
template <ng_dtype T, int D>
ng_status launch_mma(const ng_attention_args *a, cudaStream_t st, int backward, int vec,
                     const float *ws) {
    if (backward) {
        /* Two stages of the streamed tiles where the device's shared memory
         * per block allows them (always at D = 64; at D = 128 they need
         * 103 KiB: sm_80 and sm_90 have it, sm_86 / sm_89 have 99 KiB and
         * take one). */
        if (D == 64 || (size_t)device_optin_smem() >= mma_bwd_smem(D, 2, 2))
            return launch_mma_bwd<T, D, 2>(a, st, vec, ws);
        return launch_mma_bwd<T, 128, 1>(a, st, vec, ws);
    }
    static std::atomic<int> allowed_fwd[kMaxDevices];
    const size_t tile = sizeof(uint16_t) * (size_t)(kMmaRows * (D + 8));
    dim3 grid;
    NG_TRY(fold_grid(NG_CEIL_DIV(a->L, (int64_t)kMmaRows), a->Hq, a->B, &grid));
    NG_TRY(allow_smem(attention_fwd_mma_kernel<T, D>, 4 * tile, allowed_fwd));
    NG_LAUNCH((attention_fwd_mma_kernel<T, D>), grid, kMmaThreads, 4 * tile, st, *a, vec);
    return cuda_check();
}

/* The current device's SM count (0 when it cannot be read). */
int device_sms() {
    static std::atomic<int> cache[kMaxDevices];
    return device_attr(cudaDevAttrMultiProcessorCount, cache);
}

/* A [B, heads, seq, D] operand of elements `el` bytes wide whose every row
 * starts on 16 bytes. */
int rows_aligned(const void *p, const int64_t stride[3], int64_t el) {
    const int64_t w = 16 / el;
    return (uintptr_t)p % 16 == 0 && stride[0] % w == 0 && stride[1] % w == 0 && stride[2] % w == 0;
}

template <ng_dtype T, int NT, bool Pipe>
ng_status launch_decode_kernel(const ng_attention_args *a, cudaStream_t st, const dec_plan &p,
                               float *ws, int vec) {
    static std::atomic<int> allowed[kMaxDevices];
    dim3 grid;
    NG_TRY(fold_grid(p.nsplit * p.groups, a->Hkv, a->B, &grid));
    const size_t sm = dec_smem(T, (int)a->E, (int)a->Ev, Pipe);
    NG_TRY(allow_smem(attention_decode_kernel<T, NT, Pipe>, sm, allowed));
    NG_LAUNCH((attention_decode_kernel<T, NT, Pipe>), grid, kDecThreads, sm, st, *a, p, ws, vec);
    return cuda_check();
}

/* The combine of a split decode (p.nsplit > 1). */
template <ng_dtype T, int NT>
ng_status launch_decode_combine(const ng_attention_args *a, cudaStream_t st, const dec_plan &p,
                                const float *ws) {
    const int64_t nb = NG_CEIL_DIV(dec_rows(*a), (int64_t)kDecWarps);
    if (nb > 2147483647LL) return NG_ERR_UNSUPPORTED; /* gridDim.x */
    NG_LAUNCH((attention_decode_combine_kernel<T, NT>), dim3((unsigned)nb), kDecThreads, 0, st, *a,
              p.nsplit, ws);
    return cuda_check();
}

/* The decode kernel, then (with splits) the combine; ws may be NULL (no
 * splits). Two (K, V) stages where the device's shared memory per block
 * takes them, one buffer otherwise; cp.async (vec) on sm_80+ where every K
 * and V row starts on 16 bytes and 16 bytes divide both head dims. */
template <ng_dtype T, int NT>
ng_status launch_decode(const ng_attention_args *a, cudaStream_t st, float *ws) {
    const dec_plan p = plan_decode(a, ws != nullptr, device_sms(), kBK);
    const int64_t el = (int64_t)ng_dtype_size(T), w = dec_w(T);
    const int vec = device_major() >= 8 && a->E % w == 0 && a->Ev % w == 0 &&
                    rows_aligned(a->k, a->k_stride, el) && rows_aligned(a->v, a->v_stride, el);
    const size_t optin = (size_t)device_optin_smem();
    if (dec_smem(T, (int)a->E, (int)a->Ev, true) <= NG_MAX(optin, (size_t)48 * 1024))
        NG_TRY((launch_decode_kernel<T, NT, true>(a, st, p, ws, vec)));
    else
        NG_TRY((launch_decode_kernel<T, NT, false>(a, st, p, ws, vec)));
    return p.nsplit == 1 ? NG_OK : launch_decode_combine<T, NT>(a, st, p, ws);
}

/* A forward the decode kernel takes. */
int decode_shape(const ng_attention_args *a) {
    return a->L >= 1 && a->L <= NG_ATTN_DEC_MAX_L && a->S >= 1;
}

/* NANGUARD_CUDA_DECODE=simt: the SIMT decode even where the tensor-core one
 * applies (to compare the two), read once. */
int decode_simt_forced() {
    static const int forced = [] {
        const char *v = getenv("NANGUARD_CUDA_DECODE");
        return v != nullptr && strcmp(v, "simt") == 0;
    }();
    return forced;
}

/* A [B, heads, seq, D] operand whose every row starts on 16 bytes. */
int rows_aligned16(const void *p, const int64_t stride[3]) {
    return (uintptr_t)p % 16 == 0 && stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0;
}

/* The tensor-core kernels take fp16 / bf16 with E == Ev in {64, 128} on a
 * device of compute capability 8.0 or newer; everything else runs SIMT. */
int mma_eligible(const ng_attention_args *a) {
    if ((a->dtype != NG_F16 && a->dtype != NG_BF16) || a->E != a->Ev || (a->E != 64 && a->E != 128))
        return 0;
    return device_major() >= 8;
}

/* The decode shapes the tensor-core decode takes: those of the tensor-core
 * kernels, unless NANGUARD_CUDA_DECODE=simt. */
int dec_mma(const ng_attention_args *a) { return mma_eligible(a) && !decode_simt_forced(); }

/* The tensor-core decode (two 64-key (K, V) stages, the forward's shared
 * memory), then (with splits) the combine. */
template <ng_dtype T, int D>
ng_status launch_decode_mma(const ng_attention_args *a, cudaStream_t st, float *ws) {
    static std::atomic<int> allowed[kMaxDevices];
    const dec_plan p = plan_decode(a, ws != nullptr, device_sms(), kMmaRows);
    const int vec = rows_aligned16(a->q, a->q_stride) && rows_aligned16(a->k, a->k_stride) &&
                    rows_aligned16(a->v, a->v_stride);
    const size_t sm = 4 * sizeof(uint16_t) * (size_t)(kMmaRows * (D + 8));
    dim3 grid;
    NG_TRY(fold_grid(p.nsplit * p.groups, a->Hkv, a->B, &grid));
    NG_TRY(allow_smem(attention_decode_mma_kernel<T, D>, sm, allowed));
    NG_LAUNCH((attention_decode_mma_kernel<T, D>), grid, kMmaThreads, sm, st, *a, p, ws, vec);
    NG_TRY(cuda_check());
    return p.nsplit == 1 ? NG_OK : launch_decode_combine<T, D / 32>(a, st, p, ws);
}

/* Dispatch on NT = ceil(max(E, Ev) / 32) rounded up to 1, 2, 4, 8. ws: the
 * forward's split-KV workspace, or the backward's D (the pre-kernel runs
 * first); NULL without one. */
template <ng_dtype T>
ng_status dispatch_nt(const ng_attention_args *a, cudaStream_t st, int backward, float *ws) {
    if (backward && ws) NG_TRY(launch_bwd_pre<T>(a, st, ws));
    if (!backward && decode_shape(a)) {
        if constexpr (T != NG_F32)
            if (dec_mma(a))
                return a->E == 64 ? launch_decode_mma<T, 64>(a, st, ws)
                                  : launch_decode_mma<T, 128>(a, st, ws);
        if (a->Ev <= 32) return launch_decode<T, 1>(a, st, ws);
        if (a->Ev <= 64) return launch_decode<T, 2>(a, st, ws);
        if (a->Ev <= 128) return launch_decode<T, 4>(a, st, ws);
        return launch_decode<T, 8>(a, st, ws);
    }
    if constexpr (T != NG_F32) {
        if (mma_eligible(a)) {
            const int vec = rows_aligned16(a->q, a->q_stride) &&
                            rows_aligned16(a->k, a->k_stride) &&
                            rows_aligned16(a->v, a->v_stride) &&
                            (!backward || rows_aligned16(a->dout, a->dout_stride));
            return a->E == 64 ? launch_mma<T, 64>(a, st, backward, vec, ws)
                              : launch_mma<T, 128>(a, st, backward, vec, ws);
        }
    }
    const int64_t dmax = NG_MAX(a->E, a->Ev);
    if (dmax <= 32) return backward ? launch_bwd<T, 1>(a, st, ws) : launch_fwd<T, 1>(a, st);
    if (dmax <= 64) return backward ? launch_bwd<T, 2>(a, st, ws) : launch_fwd<T, 2>(a, st);
    if (dmax <= 128) return backward ? launch_bwd<T, 4>(a, st, ws) : launch_fwd<T, 4>(a, st);
    return backward ? launch_bwd<T, 8>(a, st, ws) : launch_fwd<T, 8>(a, st);
}

/* The decode plan's workspace: (m, l) and Ev partial outputs per split and
 * row; 0 without splits. Shape and current device only: the args need not
 * be checked yet. */
int64_t fwd_workspace_bytes(const ng_attention_args *a) {
    if (a->dtype == NG_F64 || a->B <= 0 || a->Hkv <= 0 || a->Hq % a->Hkv || !decode_shape(a))
        return 0;
    const dec_plan p = plan_decode(a, 1, device_sms(), dec_mma(a) ? kMmaRows : kBK);
    return p.nsplit > 1 ? (int64_t)sizeof(float) * p.nsplit * dec_rows(*a) * (a->Ev + 2) : 0;
}

/* The backward's D: one fp32 per query row, [B, Hq, L], then with a
 * padding mask one int per 64-key block of each kv head, [B, Hkv,
 * ceil(S / 64)] (bwd_live_count); 0 where there is no row (or fp64, which has no
 * CUDA path). Shape and mask only: the args need not be checked yet. */
int64_t bwd_workspace_bytes(const ng_attention_args *a) {
    if (a->dtype == NG_F64 || a->B <= 0 || a->Hq <= 0 || a->L <= 0) return 0;
    return (int64_t)sizeof(float) * a->B * a->Hq * a->L + (int64_t)sizeof(int) * bwd_live_count(a);
}

ng_status dispatch(const ng_attention_args *a, void *stream, int backward, void *ws,
                   int64_t ws_bytes) {
    NG_TRY(ng_attention_check(a, backward));
    const int64_t need = backward ? bwd_workspace_bytes(a) : fwd_workspace_bytes(a);
    if (ws && (ws_bytes < need || (uintptr_t)ws % alignof(float))) return NG_ERR_INVALID_ARG;
    if (a->B == 0 || (a->L == 0 && !backward) || (a->L == 0 && a->S == 0)) return NG_OK;
    ng_attention_args n = *a;
    if (n.mask_kind == NG_MASK_NONE) n.mask = nullptr;
    cudaStream_t st = (cudaStream_t)stream;
    float *w = need > 0 ? (float *)ws : nullptr;
    switch (a->dtype) {
    case NG_F32: return dispatch_nt<NG_F32>(&n, st, backward, w);
    case NG_F16: return dispatch_nt<NG_F16>(&n, st, backward, w);
    case NG_BF16: return dispatch_nt<NG_BF16>(&n, st, backward, w);
    case NG_F64: return NG_ERR_DTYPE;
    }
    return NG_ERR_DTYPE;
}

} // namespace

extern "C" ng_status ng_attention_fwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 0, nullptr, 0);
}

extern "C" ng_status ng_attention_fwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                              int64_t workspace_bytes, void *stream) {
    return dispatch(a, stream, 0, workspace, workspace_bytes);
}

extern "C" int64_t ng_attention_fwd_cuda_workspace_bytes(const ng_attention_args *a) {
    return a ? fwd_workspace_bytes(a) : 0;
}

extern "C" ng_status ng_attention_bwd_cuda(const ng_attention_args *a, void *stream) {
    return dispatch(a, stream, 1, nullptr, 0);
}

extern "C" ng_status ng_attention_bwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                              int64_t workspace_bytes, void *stream) {
    return dispatch(a, stream, 1, workspace, workspace_bytes);
}

extern "C" int64_t ng_attention_bwd_cuda_workspace_bytes(const ng_attention_args *a) {
    return a ? bwd_workspace_bytes(a) : 0;
}
