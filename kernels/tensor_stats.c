/*
 * kernels/tensor_stats.c - CPU tensor_stats (see tensor_stats.h for the
 * interface and tensor_stats_math.h for the arithmetic).
 *
 * The tensor is walked as rows of its innermost (coalesced) dimension. Rows
 * whose elements are adjacent (stride 1) go through a branch-free integer
 * loop on the bit patterns (`omp simd` reductions: counts, max and min of the
 * magnitude bits), compiled for baseline x86-64, AVX2 and AVX-512 and picked
 * at run time; rows of a strided view take the scalar ng_ts_fold.
 *
 * Parallelism: the flat element range is cut into at most TS_MAX_BLOCKS
 * blocks of at least TS_TASK_ELEMS elements, each block writes its own
 * partial, and the partials are merged afterwards. Integer max / min / sums
 * are exact, so the result is the same for any split and thread count; a
 * tensor below TS_TASK_ELEMS elements (the common case when watching a model)
 * runs on the calling thread without touching the pool.
 */
#include "kernels/tensor_stats.h"

#include "kernels/cpu_isa.h"

#if defined(__GNUC__) || defined(__clang__)
#define TS_INLINE static inline __attribute__((always_inline))
#else
#define TS_INLINE static inline
#endif

/* Elements per parallel task (about a millisecond of work at most; waking a
 * pool thread costs tens of microseconds). */
#define TS_TASK_ELEMS ((int64_t)1 << 18)
#define TS_MAX_BLOCKS 64
/* Elements per inner sub-block: the int32 lane counters cannot overflow. */
#define TS_SUB ((int64_t)1 << 20)
/* Elements per chunk of the finite-only first pass (below): 8-16 KiB, so a
 * chunk that holds a NaN or an Inf is still in L1 when the full loop reads it
 * again. */
#define TS_CHUNK ((int64_t)4096)

/* ---- contiguous bodies (inlined into each ISA's wrappers) ------------------ */

TS_INLINE void ts_full_u16(const uint16_t *restrict x, int64_t n, uint16_t e, ng_ts_part *p) {
    const uint16_t ninf = (uint16_t)(e | 0x8000u), em1 = (uint16_t)(e - 1u);
    for (int64_t i0 = 0; i0 < n; i0 += TS_SUB) {
        const int64_t m = NG_MIN(TS_SUB, n - i0);
        const uint16_t *restrict y = x + i0;
        int32_t cn = 0, cp = 0, cm = 0;
        uint16_t mx = 0, mn = 0xffffu;
#pragma omp simd reduction(+ : cn, cp, cm) reduction(max : mx) reduction(min : mn)
        for (int64_t i = 0; i < m; i++) {
            const uint16_t u = y[i];
            const uint16_t a = (uint16_t)(u & 0x7fffu);
            cn += a > e;
            cp += u == e;
            cm += u == ninf;
            const uint16_t f = a < e ? a : (uint16_t)0;
            mx = f > mx ? f : mx;
            const uint16_t g = (uint16_t)(a - 1u) < em1 ? a : (uint16_t)0xffffu;
            mn = g < mn ? g : mn;
        }
        ng_ts_part q = {cn, cp, cm, mx, mn == 0xffffu ? NG_TS_NONE : mn};
        ng_ts_merge(p, &q);
    }
}

TS_INLINE void ts_full_u32(const uint32_t *restrict x, int64_t n, ng_ts_part *p) {
    const uint32_t e = 0x7f800000u, ninf = 0xff800000u, em1 = e - 1u;
    for (int64_t i0 = 0; i0 < n; i0 += TS_SUB) {
        const int64_t m = NG_MIN(TS_SUB, n - i0);
        const uint32_t *restrict y = x + i0;
        int32_t cn = 0, cp = 0, cm = 0;
        uint32_t mx = 0, mn = 0xffffffffu;
#pragma omp simd reduction(+ : cn, cp, cm) reduction(max : mx) reduction(min : mn)
        for (int64_t i = 0; i < m; i++) {
            const uint32_t u = y[i];
            const uint32_t a = u & 0x7fffffffu;
            cn += a > e;
            cp += u == e;
            cm += u == ninf;
            const uint32_t f = a < e ? a : 0u;
            mx = f > mx ? f : mx;
            const uint32_t g = a - 1u < em1 ? a : 0xffffffffu;
            mn = g < mn ? g : mn;
        }
        ng_ts_part q = {cn, cp, cm, mx, mn == 0xffffffffu ? NG_TS_NONE : mn};
        ng_ts_merge(p, &q);
    }
}

TS_INLINE void ts_full_u64(const uint64_t *restrict x, int64_t n, ng_ts_part *p) {
    const uint64_t e = 0x7ff0000000000000ull, ninf = 0xfff0000000000000ull, em1 = e - 1u;
    for (int64_t i0 = 0; i0 < n; i0 += TS_SUB) {
        const int64_t m = NG_MIN(TS_SUB, n - i0);
        const uint64_t *restrict y = x + i0;
        int64_t cn = 0, cp = 0, cm = 0;
        uint64_t mx = 0, mn = NG_TS_NONE;
#pragma omp simd reduction(+ : cn, cp, cm) reduction(max : mx) reduction(min : mn)
        for (int64_t i = 0; i < m; i++) {
            const uint64_t u = y[i];
            const uint64_t a = u & 0x7fffffffffffffffull;
            cn += a > e;
            cp += u == e;
            cm += u == ninf;
            const uint64_t f = a < e ? a : 0u;
            mx = f > mx ? f : mx;
            const uint64_t g = a - 1u < em1 ? a : NG_TS_NONE;
            mn = g < mn ? g : mn;
        }
        ng_ts_part q = {cn, cp, cm, mx, mn};
        ng_ts_merge(p, &q);
    }
}

/* One contiguous run of n elements of dtype t. */
/* The common case first: a chunk with no NaN and no Inf needs no counts, and
 * its max / min non-zero magnitude are a max of a and a min of a - 1 (0 wraps
 * to the all-ones pattern, so it never wins): two reductions per element
 * instead of the full loop's six compares. The chunk's max magnitude says
 * whether that held; when it did not (a >= e: NaN or Inf present), the chunk
 * goes through the full loop, which counts and skips them. Both passes give
 * the same partial on an all-finite chunk. */
// clang-format off
#define TS_DEFINE_CHUNKED(W, T)                                                                    \
    TS_INLINE int ts_finite_##W(const T *restrict y, int64_t m, T e, ng_ts_part *p) {              \
        const T none = (T)~(T)0, mag = (T)(none >> 1);                                             \
        T mx = 0, mn = none;                                                                       \
        _Pragma("omp simd reduction(max : mx) reduction(min : mn)")                                \
        for (int64_t i = 0; i < m; i++) {                                                          \
            const T a = (T)(y[i] & mag);                                                           \
            mx = a > mx ? a : mx;                                                                  \
            const T g = (T)(a - 1u);                                                               \
            mn = g < mn ? g : mn;                                                                  \
        }                                                                                          \
        if (mx >= e) return 0;                                                                     \
        ng_ts_part q = {0, 0, 0, mx, mn == none ? NG_TS_NONE : (uint64_t)mn + 1u};                 \
        ng_ts_merge(p, &q);                                                                        \
        return 1;                                                                                  \
    }
// clang-format on

TS_DEFINE_CHUNKED(u16, uint16_t)
TS_DEFINE_CHUNKED(u32, uint32_t)
TS_DEFINE_CHUNKED(u64, uint64_t)

TS_INLINE void ts_body_u16(const uint16_t *restrict x, int64_t n, uint16_t e, ng_ts_part *p) {
    for (int64_t i = 0; i < n; i += TS_CHUNK) {
        const int64_t m = NG_MIN(TS_CHUNK, n - i);
        if (!ts_finite_u16(x + i, m, e, p)) ts_full_u16(x + i, m, e, p);
    }
}

TS_INLINE void ts_body_u32(const uint32_t *restrict x, int64_t n, ng_ts_part *p) {
    for (int64_t i = 0; i < n; i += TS_CHUNK) {
        const int64_t m = NG_MIN(TS_CHUNK, n - i);
        if (!ts_finite_u32(x + i, m, 0x7f800000u, p)) ts_full_u32(x + i, m, p);
    }
}

TS_INLINE void ts_body_u64(const uint64_t *restrict x, int64_t n, ng_ts_part *p) {
    for (int64_t i = 0; i < n; i += TS_CHUNK) {
        const int64_t m = NG_MIN(TS_CHUNK, n - i);
        if (!ts_finite_u64(x + i, m, 0x7ff0000000000000ull, p)) ts_full_u64(x + i, m, p);
    }
}

typedef void (*ts_contig_fn)(const void *x, int64_t n, ng_dtype t, ng_ts_part *p);

#define TS_DEFINE_PATH(SFX, ATTR)                                                                  \
    ATTR static void ts_contig##SFX(const void *x, int64_t n, ng_dtype t, ng_ts_part *p) {         \
        switch (t) {                                                                               \
        case NG_F16:                                                                               \
        case NG_BF16: ts_body_u16((const uint16_t *)x, n, (uint16_t)ng_ts_exp_mask(t), p); break;  \
        case NG_F32: ts_body_u32((const uint32_t *)x, n, p); break;                                \
        case NG_F64: ts_body_u64((const uint64_t *)x, n, p); break;                                \
        }                                                                                          \
    }

TS_DEFINE_PATH(_base, )
#if NG_X86
TS_DEFINE_PATH(_avx2, NG_TARGET_AVX2)
TS_DEFINE_PATH(_avx512, NG_TARGET_AVX512)
#endif

static ts_contig_fn ts_pick(void) {
#if NG_X86
    ng_cpu_isa isa = ng_cpu_isa_active();
    if (isa >= NG_ISA_AVX512) return ts_contig_avx512;
    if (isa >= NG_ISA_AVX2) return ts_contig_avx2;
#endif
    return ts_contig_base;
}

/* ---- the walk over rows ---------------------------------------------------- */

typedef struct ts_ctx {
    const ng_tensor_stats_args *a; /* coalesced: ndim >= 1 */
    ts_contig_fn contig;
    int64_t numel, per_block;
    ng_ts_part part[TS_MAX_BLOCKS];
} ts_ctx;

/* Element offset of the first element of row r (all dims but the last). */
static int64_t ts_row_offset(const ng_tensor_stats_args *a, int64_t r) {
    int64_t off = 0;
    for (int64_t d = a->ndim - 2; d >= 0 && r > 0; d--) {
        off += (r % a->sizes[d]) * a->strides[d];
        r /= a->sizes[d];
    }
    return off;
}

static void ts_blocks(int64_t b0, int64_t b1, void *vctx) {
    ts_ctx *c = (ts_ctx *)vctx;
    const ng_tensor_stats_args *a = c->a;
    const int64_t inner = a->sizes[a->ndim - 1], istride = a->strides[a->ndim - 1];
    const size_t es = ng_dtype_size(a->dtype);
    const uint64_t e = ng_ts_exp_mask(a->dtype), sign = ng_ts_sign_bit(a->dtype);
    for (int64_t b = b0; b < b1; b++) {
        ng_ts_part p = ng_ts_part_init();
        int64_t i = b * c->per_block;
        const int64_t end = NG_MIN(c->numel, i + c->per_block);
        while (i < end) {
            const int64_t r = i / inner, j0 = i % inner;
            const int64_t j1 = NG_MIN(inner, j0 + (end - i));
            const int64_t base = ts_row_offset(a, r) + j0 * istride;
            if (istride == 1) {
                c->contig((const char *)a->x + (size_t)base * es, j1 - j0, a->dtype, &p);
            } else {
                for (int64_t j = 0; j < j1 - j0; j++)
                    ng_ts_fold(&p, ng_ts_bits_at(a->x, a->dtype, base + j * istride), e, sign);
            }
            i += j1 - j0;
        }
        c->part[b] = p;
    }
}

static void ts_write(const ng_tensor_stats_args *a, const ng_ts_part *p) {
    a->counts[NG_TS_NAN] = p->nan;
    a->counts[NG_TS_POSINF] = p->pinf;
    a->counts[NG_TS_NEGINF] = p->ninf;
    a->values[NG_TS_MAX_ABS] = ng_ts_max_abs(p, a->dtype);
    a->values[NG_TS_MIN_ABS] = ng_ts_min_abs(p, a->dtype);
}

ng_status ng_tensor_stats(const ng_tensor_stats_args *a, ng_parallel_fn par) {
    if (!a || !a->counts || !a->values) return NG_ERR_INVALID_ARG;
    if ((unsigned)a->dtype > NG_BF16) return NG_ERR_DTYPE;
    if (a->ndim < 0 || a->ndim > NG_TS_MAX_DIMS) return NG_ERR_INVALID_ARG;
    ng_tensor_stats_args c = *a;
    int64_t numel = 1;
    for (int64_t d = 0; d < c.ndim; d++) {
        if (c.sizes[d] < 0) return NG_ERR_INVALID_ARG;
        numel *= c.sizes[d];
    }
    ng_ts_part total = ng_ts_part_init();
    if (numel == 0) {
        ts_write(a, &total);
        return NG_OK;
    }
    if (!c.x) return NG_ERR_INVALID_ARG;
    c.ndim = ng_ts_coalesce(c.ndim, c.sizes, c.strides);
    if (c.ndim == 0) { /* a scalar or all sizes 1: one element */
        c.ndim = 1;
        c.sizes[0] = 1;
        c.strides[0] = 1;
    }
    ts_ctx ctx;
    ctx.a = &c;
    ctx.contig = ts_pick();
    ctx.numel = numel;
    int64_t nblk = NG_MIN((int64_t)TS_MAX_BLOCKS, NG_CEIL_DIV(numel, TS_TASK_ELEMS));
    ctx.per_block = NG_CEIL_DIV(numel, nblk);
    nblk = NG_CEIL_DIV(numel, ctx.per_block);
    if (nblk == 1)
        ts_blocks(0, 1, &ctx);
    else
        ng_parallel_run(par, nblk, 1, ts_blocks, &ctx);
    for (int64_t b = 0; b < nblk; b++) ng_ts_merge(&total, &ctx.part[b]);
    ts_write(a, &total);
    return NG_OK;
}
