/*
 * kernels/tensor_stats_math.h - per-element arithmetic shared by the CPU and
 * CUDA tensor_stats kernels.
 *
 * For every element x of a tensor the kernels count
 *
 *     NaN                       x != x
 *     +Inf / -Inf               x == +inf / x == -inf
 *
 * and, over the finite elements only,
 *
 *     max_abs          = max |x|               (0 when there is none)
 *     min_nonzero_abs  = min |x| over x != 0   (+inf when there is none)
 *
 * Everything is computed on the IEEE bit pattern, never on converted values:
 * with a = bits & ~sign (the magnitude bits) and E the exponent mask of the
 * dtype (all exponent bits set, mantissa 0),
 *
 *     NaN  <=> a >  E        Inf <=> a == E        finite <=> a < E
 *
 * and for finite values |x| < |y| <=> a_x < a_y, so max and min are integer
 * max / min over the magnitude bits. Integer reductions are exact and
 * associative, so the result is bitwise the same whatever the order of the
 * work: any thread count, any split, any CUDA launch configuration. Counts are
 * int64 and exact. The two magnitudes are returned as fp64, which holds every
 * fp16 / bf16 / fp32 / fp64 value exactly.
 *
 * Bit patterns of the four dtypes (u: the unsigned integer of that width):
 *                 width  E                       sign
 *     float16     16     0x7c00                  0x8000
 *     bfloat16    16     0x7f80                  0x8000
 *     float32     32     0x7f800000              0x80000000
 *     float64     64     0x7ff0000000000000      0x8000000000000000
 */
#ifndef NG_KERNELS_TENSOR_STATS_MATH_H
#define NG_KERNELS_TENSOR_STATS_MATH_H

#include "kernels/common.h"

/* Stats buffer layout, one row ("slot") per recorded tensor:
 *   counts: int64   [slots, NG_TS_NCOUNTS]   NaN, +Inf, -Inf
 *   values: float64 [slots, NG_TS_NVALUES]   max |x| finite, min non-zero |x| finite */
enum {
    NG_TS_NAN = 0,
    NG_TS_POSINF = 1,
    NG_TS_NEGINF = 2,
    NG_TS_NCOUNTS = 3,
};
enum {
    NG_TS_MAX_ABS = 0,
    NG_TS_MIN_ABS = 1,
    NG_TS_NVALUES = 2,
};

/* Partial result over some elements, in magnitude bits of the dtype
 * (widened to 64 bits). min_bits == NG_TS_NONE: no finite non-zero seen. */
#define NG_TS_NONE (~(uint64_t)0)

typedef struct ng_ts_part {
    int64_t nan, pinf, ninf;
    uint64_t max_bits; /* 0 when no finite element */
    uint64_t min_bits; /* NG_TS_NONE when no finite non-zero element */
} ng_ts_part;

NG_HD ng_ts_part ng_ts_part_init(void) {
    ng_ts_part p;
    p.nan = p.pinf = p.ninf = 0;
    p.max_bits = 0;
    p.min_bits = NG_TS_NONE;
    return p;
}

NG_HD void ng_ts_merge(ng_ts_part *a, const ng_ts_part *b) {
    a->nan += b->nan;
    a->pinf += b->pinf;
    a->ninf += b->ninf;
    if (b->max_bits > a->max_bits) a->max_bits = b->max_bits;
    if (b->min_bits < a->min_bits) a->min_bits = b->min_bits;
}

/* Exponent mask E and sign bit of a dtype, as 64-bit values. */
NG_HD uint64_t ng_ts_exp_mask(ng_dtype t) {
    switch (t) {
    case NG_F16: return 0x7c00u;
    case NG_BF16: return 0x7f80u;
    case NG_F32: return 0x7f800000u;
    case NG_F64: return 0x7ff0000000000000ull;
    }
    return 0;
}

NG_HD uint64_t ng_ts_sign_bit(ng_dtype t) {
    switch (t) {
    case NG_F16:
    case NG_BF16: return 0x8000u;
    case NG_F32: return 0x80000000u;
    case NG_F64: return 0x8000000000000000ull;
    }
    return 0;
}

/* Fold one element given as its raw bits u (zero-extended to 64). */
NG_HD void ng_ts_fold(ng_ts_part *p, uint64_t u, uint64_t e, uint64_t sign) {
    uint64_t a = u & (sign - 1u);
    if (a > e) {
        p->nan++;
    } else if (a == e) {
        if (u & sign)
            p->ninf++;
        else
            p->pinf++;
    } else {
        if (a > p->max_bits) p->max_bits = a;
        if (a != 0 && a < p->min_bits) p->min_bits = a;
    }
}

/* Raw bits of element i (element offset, not bytes). */
NG_HD uint64_t ng_ts_bits_at(const void *x, ng_dtype t, int64_t i) {
    switch (t) {
    case NG_F16:
    case NG_BF16: return ((const uint16_t *)x)[i];
    case NG_F32: return ((const uint32_t *)x)[i];
    case NG_F64: return ((const uint64_t *)x)[i];
    }
    return 0;
}

/* The magnitude bits of a finite value of dtype t, as fp64 (exact). */
NG_HD double ng_ts_bits_to_f64(uint64_t a, ng_dtype t) {
    switch (t) {
    case NG_F16: return (double)ng_f16_to_f32((uint16_t)a);
    case NG_BF16: return (double)ng_bf16_to_f32((uint16_t)a);
    case NG_F32: return (double)ng_bits_f32((uint32_t)a);
    case NG_F64: {
        double d;
        memcpy(&d, &a, sizeof d);
        return d;
    }
    }
    return 0.0;
}

/* The two values a partial stands for: max |x| (0 when none) and min
 * non-zero |x| (+inf when none). */
NG_HD double ng_ts_max_abs(const ng_ts_part *p, ng_dtype t) {
    return ng_ts_bits_to_f64(p->max_bits, t);
}

NG_HD double ng_ts_min_abs(const ng_ts_part *p, ng_dtype t) {
    if (p->min_bits == NG_TS_NONE) return ng_bits_f32(0x7f800000u); /* +inf */
    return ng_ts_bits_to_f64(p->min_bits, t);
}

#endif /* NG_KERNELS_TENSOR_STATS_MATH_H */
