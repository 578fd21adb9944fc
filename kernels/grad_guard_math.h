/*
 * kernels/grad_guard_math.h - arithmetic shared by the CPU and CUDA gradient
 * guard (fused unscale + non-finite check + global norm + clip).
 *
 * Per element, with s = inv_scale (fp32, 1 / loss scale):
 *
 *     u   = fp32(x) * s                (the unscaled gradient, in registers)
 *     NaN : x != x                     (counted)
 *     Inf : |x| == inf, or |u| >= the overflow limit of x's dtype
 *                                      (counted separately)
 *     p=2 : ssq += (double)u * (double)u
 *     p=inf: amax = max(amax, |u|)
 *
 * Non-finite values are classified on the stored gradient x, as
 * torch._amp_foreach_non_finite_check_and_unscale_ does, and one case more:
 * a finite x whose unscaled value the gradient's dtype cannot hold (|u| at
 * or above NG_GG_F16_OVERFLOW for fp16, NG_GG_BF16_OVERFLOW for bf16, |u| =
 * inf for fp32 / fp64: the values that round to +-Inf) counts as an Inf,
 * because the unscaled gradient written back would be one. That takes
 * |inv_scale| > 1 (a loss scale below 1, after many skipped steps):
 * |x * s| <= |x| otherwise. torch's unscale_ writes that Inf and reports the
 * step finite; the optimizer then steps on it.
 *
 * An inv_scale that is not a finite number above 0 skips the step, its
 * total norm NaN, whatever the counts (ng_gg_step_norm): a NaN or +-Inf one
 * makes every unscaled value NaN or +-Inf; a negative one would flip every
 * gradient's sign and a zero one zero them, with a finite norm (a loss
 * scale is positive: GradScaler's inverse never is either).
 *
 * Sum of squares. For fp32/fp16/bf16 gradients u is an fp32 number, so u*u is
 * exact in fp64 (24+24 significant bits < 53) and lies in [2^-298, 2^256]:
 * the square can neither overflow nor underflow, and an fp64 sum of up to
 * 2^50 such squares cannot overflow either. This is what makes a huge but
 * finite fp32 gradient (|g| ~ 1e30, whose fp32 square is inf) give the right
 * norm, where an fp32 sum of squares reports inf. Each block of NG_GG_CHUNK
 * elements is summed on its own (vector lanes, then lanes combined) and the
 * block partials are added in a fixed order, so the result depends neither on
 * the number of threads nor on the CUDA launch configuration.
 *
 * fp64 gradients (CPU only, for gradcheck-style tests) are squared in fp64:
 * |u| above ~1.3e154 overflows the sum of squares to inf and is then treated
 * as a non-finite norm (step skipped, found_inf set, NaN/Inf counts 0).
 *
 * Clip coefficient, as torch.nn.utils.clip_grad_norm_:
 *     clip = min(1, max_norm / (total_norm + 1e-6))
 * A non-finite total (or any NaN/Inf counted) means "do not touch": the
 * gradients keep their scaled values and found_inf is set to 1.
 *
 * Stats vector (NG_GG_NSTATS doubles, written by the reduce pass, combined by
 * the caller across calls, dtype groups and ranks, read by the apply pass):
 *     [NG_GG_NORM]      p=2: sum of squares of u;  p=inf: max |u|    (sum / max)
 *     [NG_GG_NAN]       number of NaN elements                      (sum)
 *     [NG_GG_INF]       number of +-Inf elements                    (sum)
 *     [NG_GG_FIRST_BAD] index (in the call's list) of the first tensor holding
 *                       a NaN or Inf, -1 when none                  (min over >= 0)
 * Counts are exact up to 2^53.
 */
#ifndef NG_KERNELS_GRAD_GUARD_MATH_H
#define NG_KERNELS_GRAD_GUARD_MATH_H

#include <math.h>

#include "kernels/common.h"

enum {
    NG_GG_NORM = 0,
    NG_GG_NAN = 1,
    NG_GG_INF = 2,
    NG_GG_FIRST_BAD = 3,
    NG_GG_NSTATS = 4,
};

/* Elements per block of work: one CPU task / one CUDA thread block. Fixed so
 * that the order of the reduction is fixed. */
#define NG_GG_CHUNK ((int64_t)65536)

#define NG_GG_EPS 1e-6

/* The smallest |u| that rounding to nearest even turns into +-Inf in fp16
 * (65504 + half its last step) and in bf16 ((2 - 2^-8) * 2^127). */
#define NG_GG_F16_OVERFLOW 65520.0f
#define NG_GG_BF16_OVERFLOW 0x1.ffp+127f

/* Norm selector. */
typedef enum ng_gg_norm {
    NG_GG_NORM_2 = 0,
    NG_GG_NORM_INF = 1,
} ng_gg_norm;

/* Partial result of one block of elements. */
typedef struct ng_gg_partial {
    double norm; /* sum of squares or max |u| */
    int64_t nan_count;
    int64_t inf_count;
} ng_gg_partial;

/* Element-level pieces, written so that they vectorize in the CPU loops. */
NG_HD int ng_gg_isnan_f(float v) { return v != v; }
NG_HD int ng_gg_isinf_f(float v) { return (v < 0.0f ? -v : v) == (float)INFINITY; }
NG_HD int ng_gg_isnan_d(double v) { return v != v; }
NG_HD int ng_gg_isinf_d(double v) { return (v < 0.0 ? -v : v) == (double)INFINITY; }
NG_HD int ng_gg_isfinite_d(double v) { return v - v == 0.0; }

/* Unscale in fp32, as torch's unscale_ does, and square exactly in fp64. */
NG_HD float ng_gg_unscale(float x, float inv_scale) { return x * inv_scale; }
NG_HD double ng_gg_sq(float u) { return (double)u * (double)u; }
NG_HD float ng_gg_absf(float u) { return u < 0.0f ? -u : u; }

/* Fold one unscaled fp32 value into a (sum of squares | max) accumulator. */
NG_HD double ng_gg_acc_f(double acc, float u, ng_gg_norm p) {
    if (p == NG_GG_NORM_2) return acc + ng_gg_sq(u);
    double a = (double)ng_gg_absf(u);
    /* NaN compares false and leaves acc; NaN is reported by the counts. */
    return a > acc ? a : acc;
}

NG_HD double ng_gg_acc_d(double acc, double u, ng_gg_norm p) {
    if (p == NG_GG_NORM_2) return acc + u * u;
    double a = u < 0.0 ? -u : u;
    return a > acc ? a : acc;
}

/* Combine two norm partials (sum for p=2, max for p=inf). */
NG_HD double ng_gg_combine(double a, double b, ng_gg_norm p) {
    if (p == NG_GG_NORM_2) return a + b;
    return b > a ? b : a;
}

/* Total norm from the combined accumulator. NaN/Inf counts make it NaN/Inf
 * as the norm of the tensors themselves would be. */
NG_HD double ng_gg_total_norm(const double *stats, ng_gg_norm p) {
    if (stats[NG_GG_NAN] > 0.0) return (double)NAN;
    if (stats[NG_GG_INF] > 0.0) return (double)INFINITY;
    double acc = stats[NG_GG_NORM];
    return p == NG_GG_NORM_2 ? sqrt(acc) : acc;
}

/* Whether inv_scale can unscale a step: finite and above 0 (NaN fails). */
NG_HD int ng_gg_scale_ok(float inv_scale) {
    return inv_scale > 0.0f && ng_gg_isfinite_d((double)inv_scale);
}

/* The total norm a step reports and is decided on: ng_gg_total_norm, or NaN
 * for an inv_scale that cannot unscale it (ng_gg_scale_ok). */
NG_HD double ng_gg_step_norm(const double *stats, float inv_scale, ng_gg_norm p) {
    if (!ng_gg_scale_ok(inv_scale)) return (double)NAN;
    return ng_gg_total_norm(stats, p);
}

/* min(1, max_norm / (total + 1e-6)); 1 ("do not touch") for a non-finite total. */
NG_HD double ng_gg_clip_coef(double total_norm, double max_norm) {
    if (!ng_gg_isfinite_d(total_norm)) return 1.0;
    double c = max_norm / (total_norm + NG_GG_EPS);
    return c < 1.0 ? c : 1.0;
}

/* Does the apply pass write? Returns 1 and the multiplier when every value
 * was finite; 0 when the step must be skipped. */
NG_HD int ng_gg_coef(const double *stats, float inv_scale, double max_norm, ng_gg_norm p,
                     double *coef) {
    double total = ng_gg_step_norm(stats, inv_scale, p);
    if (!ng_gg_isfinite_d(total)) {
        *coef = 1.0;
        return 0;
    }
    *coef = (double)inv_scale * ng_gg_clip_coef(total, max_norm);
    return 1;
}

#endif /* NG_KERNELS_GRAD_GUARD_MATH_H */
