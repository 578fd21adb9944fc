/*
 * kernels/layernorm_math.h - per-row arithmetic shared by the CPU and CUDA
 * LayerNorm / RMSNorm kernels.
 *
 *   LayerNorm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)
 *   RMSNorm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
 *
 * Statistics are accumulated in fp32 (fp64 for fp64 input) with a shift:
 * d_i = x_i - x_0, mean = x_0 + mean(d), var = mean((d - mean(d))^2). A row
 * whose values are all equal therefore has d == 0 exactly, var == 0 and
 * centred values of exactly 0, so y == b (or 0) bit for bit; the two-pass
 * variance never goes negative the way E[x^2] - E[x]^2 can.
 *
 * The one place a 0/0 could arise is var + eps == 0 (eps = 0 on a constant
 * row, or an all-zero row for RMSNorm): rstd is then defined as 0, so the
 * output is b (or 0) and the gradient through the statistics is 0. Any other
 * var + eps > 0 gives a finite rstd (1/sqrt of the smallest fp32 subnormal is
 * about 2.7e22). NaN or Inf in a row makes that row's statistics NaN, which
 * reaches every output of the row and no other row.
 *
 * Backward, with xhat = (x - mean) * rstd and g = dy * w (w = 1 if absent):
 *   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
 *   RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
 *   dw = sum_rows(dy * xhat), db = sum_rows(dy)
 */
#ifndef NG_KERNELS_LAYERNORM_MATH_H
#define NG_KERNELS_LAYERNORM_MATH_H

#include <math.h>

#include "kernels/common.h"

/* rstd from the variance (or mean square). var + eps == 0 gives 0 (see
 * above); a NaN or infinite variance gives NaN, so a row holding Inf comes out
 * NaN instead of being normalized to zeros. A finite row whose fp32 sum of
 * squares overflows is not "infinite": the kernels detect var == inf and
 * recompute it scaled by max|d| (ng_ln_rstd_scaled_f32). */
NG_HD float ng_ln_rstd_f32(float var, float eps) {
    float den = var + eps;
    if (den > 0.0f && den < INFINITY) return 1.0f / sqrtf(den);
    return den == 0.0f ? 0.0f : NAN;
}

NG_HD double ng_ln_rstd_f64(double var, double eps) {
    double den = var + eps;
    if (den > 0.0 && den < INFINITY) return 1.0 / sqrt(den);
    return den == 0.0 ? 0.0 : NAN;
}

/* rstd when var = scale^2 * var_s: 1 / (scale * sqrt(var_s + eps / scale^2)),
 * for 0 < scale < inf. The product is computed in a way that cannot overflow
 * before the final reciprocal. */
NG_HD float ng_ln_rstd_scaled_f32(float var_s, float scale, float eps) {
    float e = eps / scale / scale;
    return (1.0f / scale) / sqrtf(var_s + e);
}

/* dx for one element given the row reductions a = mean(g), b = mean(g*xhat). */
NG_HD float ng_ln_dx_f32(float g, float xhat, float rstd, float a, float b) {
    return rstd * (g - a - xhat * b);
}

NG_HD double ng_ln_dx_f64(double g, double xhat, double rstd, double a, double b) {
    return rstd * (g - a - xhat * b);
}

#endif /* NG_KERNELS_LAYERNORM_MATH_H */
