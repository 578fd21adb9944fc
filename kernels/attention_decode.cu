/*
 * kernels/attention_decode.cu - safe_sdpa's CUDA decode forward: L <= 16
 * query rows (NG_ATTN_DEC_MAX_L, a generation step) against S >= 1 cached
 * keys, every dtype and head dim the forward takes. Two kernels and the
 * split-KV combine:
 *   attention_decode_kernel      SIMT, every dtype and head dim (below);
 *   attention_decode_mma_kernel  tensor cores, fp16 / bf16 with E == Ev in
 *                                {64, 128} on sm_80+ (dec_mma), unless
 *                                NANGUARD_CUDA_DECODE=simt;
 *   attention_decode_combine_kernel  the merge of a split decode's partials.
 */
#include "kernels/attention_mma_tile.cuh"

namespace ng_attn_cu {
namespace {

/* ---- the SIMT decode -------------------------------------------------------
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

/* ---- the tensor-core decode -------------------------------------------------
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
#if NG_MMA_DEVICE
__device__ __forceinline__ bool dec_shared_mask(const ng_attention_args &a, int64_t G) {
    return a.mask_kind != NG_MASK_NONE && a.mask_stride[2] == 0 &&
           (a.mask_stride[1] == 0 || G == 1);
}
#endif

template <ng_dtype T, int D>
static __global__ void __launch_bounds__(kMmaThreads)
    attention_decode_mma_kernel(ng_attention_args a, dec_plan p, float *ws, int vec) {
#if NG_MMA_DEVICE
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
#else
    NG_MMA_UNREACHABLE();
#endif
}

/* ---- launchers ------------------------------------------------------------ */

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

/* NANGUARD_CUDA_DECODE=simt: the SIMT decode even where the tensor-core one
 * applies (to compare the two), read once. */
int decode_simt_forced() {
    static const int forced = [] {
        const char *v = getenv("NANGUARD_CUDA_DECODE");
        return v != nullptr && strcmp(v, "simt") == 0;
    }();
    return forced;
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

} // namespace

int decode_shape(const ng_attention_args *a) {
    return a->L >= 1 && a->L <= NG_ATTN_DEC_MAX_L && a->S >= 1;
}

/* The decode plan's workspace: (m, l) and Ev partial outputs per split and
 * row; 0 without splits. */
int64_t decode_workspace_bytes(const ng_attention_args *a) {
    if (a->dtype == NG_F64 || a->B <= 0 || a->Hkv <= 0 || a->Hq % a->Hkv || !decode_shape(a))
        return 0;
    const dec_plan p = plan_decode(a, 1, device_sms(), dec_mma(a) ? kMmaRows : kBK);
    return p.nsplit > 1 ? (int64_t)sizeof(float) * p.nsplit * dec_rows(*a) * (a->Ev + 2) : 0;
}

/* The tensor-core decode where it applies; otherwise the SIMT one, NT =
 * ceil(Ev / 32) rounded up to 1, 2, 4, 8. */
template <ng_dtype T>
ng_status decode(const ng_attention_args *a, cudaStream_t st, float *ws) {
    if constexpr (T != NG_F32)
        if (dec_mma(a))
            return a->E == 64 ? launch_decode_mma<T, 64>(a, st, ws)
                              : launch_decode_mma<T, 128>(a, st, ws);
    if (a->Ev <= 32) return launch_decode<T, 1>(a, st, ws);
    if (a->Ev <= 64) return launch_decode<T, 2>(a, st, ws);
    if (a->Ev <= 128) return launch_decode<T, 4>(a, st, ws);
    return launch_decode<T, 8>(a, st, ws);
}

template ng_status decode<NG_F32>(const ng_attention_args *, cudaStream_t, float *);
template ng_status decode<NG_F16>(const ng_attention_args *, cudaStream_t, float *);
template ng_status decode<NG_BF16>(const ng_attention_args *, cudaStream_t, float *);

} // namespace ng_attn_cu
