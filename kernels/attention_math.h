/*
 * kernels/attention_math.h - the per-score arithmetic of safe_sdpa, shared by
 * the CPU kernel (attention.c), the CUDA kernels (attention*.cu) and the ctest
 * suite, so the tests exercise the arithmetic the GPU runs.
 *
 * Score pipeline for query i, key j (PyTorch's SDPA plus two opt-in guards):
 *
 *   s   = scale * <q_i, k_j>                   (fp32; fp64 for fp64 inputs)
 *   s   = clamp(s, -max_score, +max_score)      when max_score > 0
 *   s   = softcap * tanh(s / softcap)           when softcap > 0 (Gemma-2)
 *   s   = s + mask_ij   (additive mask)  or  -inf where masked
 *   p   = softmax_j(s)                          online: running max m, sum l
 *   o_i = sum_j p_ij * keep_ij / (1 - dropout_p) * v_j
 *
 * A position is masked when a bool mask is false, when an additive mask value
 * is -inf or <= the lowest finite value of the mask's dtype (Hugging Face
 * writes finfo.min), or when is_causal and j > i (top-left alignment, as
 * torch.nn.functional.scaled_dot_product_attention: tril(ones(L, S))).
 *
 * Non-obvious choices:
 * - A row whose running max is still -inf has seen only masked positions: it
 *   is "empty", contributes nothing and its rescale factor is never formed
 *   as exp(-inf - -inf). A fully masked row ends with l = 0: output 0,
 *   logsumexp -inf, and the backward gives it p = 0, hence zero gradients.
 *   No 0/0 is ever formed.
 * - NaN is never hidden: clamp is written with comparisons that keep NaN,
 *   and the max used by the online softmax propagates NaN (a row that saw a
 *   NaN score has a NaN max, so its output is NaN).
 * - clamp'(s) is 1 for |s| <= max_score and 0 outside (the true derivative,
 *   with the subgradient 1 taken at the boundary); softcap'(s) = 1 - tanh^2.
 * - Dropout uses Philox4x32-10 (Salmon et al., "Parallel random numbers: as
 *   easy as 1, 2, 3", SC'11), keyed by the 64-bit seed, with the counter
 *   (e / 4, offset) for flat element index e = ((b*Hq + h)*L + i)*S + j; word
 *   e % 4 of the block is element e's draw. CPU and CUDA therefore drop the
 *   same elements, and the backward regenerates the mask from (seed, offset).
 *   An element is kept when its 24-bit uniform u = (w >> 8) * 2^-24
 *   satisfies u >= dropout_p.
 */
#ifndef NG_KERNELS_ATTENTION_MATH_H
#define NG_KERNELS_ATTENTION_MATH_H

#include <float.h>
#include <math.h>

#include "kernels/common.h"

/* ---- score transforms --------------------------------------------------- */

/* clamp to [-c, c], keeping NaN (c <= 0: off). */
NG_HD float ng_attn_clamp_f32(float s, float c) {
    if (c > 0.0f) {
        if (s > c) return c;
        if (s < -c) return -c;
    }
    return s;
}

NG_HD double ng_attn_clamp_f64(double s, double c) {
    if (c > 0.0) {
        if (s > c) return c;
        if (s < -c) return -c;
    }
    return s;
}

/* d clamp / d s: 0 where clamped, else 1 (NaN stays NaN through the product). */
NG_HD float ng_attn_clamp_grad_f32(float s, float c) {
    return (c > 0.0f && (s > c || s < -c)) ? 0.0f : 1.0f;
}

NG_HD double ng_attn_clamp_grad_f64(double s, double c) {
    return (c > 0.0 && (s > c || s < -c)) ? 0.0 : 1.0;
}

/* c * tanh(s / c) (c <= 0: off). */
NG_HD float ng_attn_softcap_f32(float s, float c) { return c > 0.0f ? c * tanhf(s / c) : s; }

NG_HD double ng_attn_softcap_f64(double s, double c) { return c > 0.0 ? c * tanh(s / c) : s; }

/* d softcap / d s = 1 - tanh^2(s / c). */
NG_HD float ng_attn_softcap_grad_f32(float s, float c) {
    if (!(c > 0.0f)) return 1.0f;
    float t = tanhf(s / c);
    return 1.0f - t * t;
}

NG_HD double ng_attn_softcap_grad_f64(double s, double c) {
    if (!(c > 0.0)) return 1.0;
    double t = tanh(s / c);
    return 1.0 - t * t;
}

/* Scaled raw score -> guarded score (clamp, then soft-cap), and the product
 * of both derivatives at the same point. */
NG_HD float ng_attn_transform_f32(float s, float max_score, float softcap) {
    return ng_attn_softcap_f32(ng_attn_clamp_f32(s, max_score), softcap);
}

NG_HD double ng_attn_transform_f64(double s, double max_score, double softcap) {
    return ng_attn_softcap_f64(ng_attn_clamp_f64(s, max_score), softcap);
}

NG_HD float ng_attn_transform_grad_f32(float s, float max_score, float softcap) {
    return ng_attn_clamp_grad_f32(s, max_score) *
           ng_attn_softcap_grad_f32(ng_attn_clamp_f32(s, max_score), softcap);
}

NG_HD double ng_attn_transform_grad_f64(double s, double max_score, double softcap) {
    return ng_attn_clamp_grad_f64(s, max_score) *
           ng_attn_softcap_grad_f64(ng_attn_clamp_f64(s, max_score), softcap);
}

/* ---- masks -------------------------------------------------------------- */

/* Mask element types: a bool mask (uint8, nonzero = attend) or an additive
 * float mask in one of the four float dtypes. */
typedef enum ng_mask_kind {
    NG_MASK_NONE = 0,
    NG_MASK_BOOL = 1,
    NG_MASK_ADD = 2,
} ng_mask_kind;

/* Additive value of mask element i as fp64, or -inf when the element masks
 * its position (bool false; additive -inf or <= the dtype's lowest finite). */
NG_HD double ng_attn_mask_value(const void *mask, ng_mask_kind kind, ng_dtype dtype, int64_t i) {
    if (kind == NG_MASK_BOOL) return ((const uint8_t *)mask)[i] ? 0.0 : -INFINITY;
    double v = ng_load_f64(mask, dtype, i);
    double lowest = dtype == NG_F64   ? -DBL_MAX
                    : dtype == NG_F32 ? -(double)FLT_MAX
                    : dtype == NG_F16 ? -65504.0
                                      : -3.3895313892515355e38; /* bf16 */
    return v <= lowest ? -INFINITY : v;                         /* NaN stays NaN */
}

NG_HD int ng_attn_causal_masked(int64_t i, int64_t j) { return j > i; }

/* ---- online softmax ------------------------------------------------------
 * State per query row: running max m (-inf: empty so far) and running sum l
 * of exp(s - m). Folding a block whose max is bm rescales the old state by
 * alpha = exp(m - m_new); the block's own terms use exp(s - m_new). */

/* max that propagates NaN (fmaxf would drop it and hide a NaN row). */
NG_HD float ng_attn_max_nan_f32(float a, float b) {
    return (a != a) ? a : (b != b || b > a) ? b : a;
}

NG_HD double ng_attn_max_nan_f64(double a, double b) {
    return (a != a) ? a : (b != b || b > a) ? b : a;
}

/* exp(x - m) for a row max m; 0 for an empty row (m == -inf), which only
 * happens when every x seen is -inf: the term is 0 and no -inf - -inf forms. */
NG_HD float ng_attn_exp_shift_f32(float x, float m) { return m == -INFINITY ? 0.0f : expf(x - m); }

NG_HD double ng_attn_exp_shift_f64(double x, double m) { return m == -INFINITY ? 0.0 : exp(x - m); }

/* Rescale factor of the old state when the max moves from m_old to m_new. */
NG_HD float ng_attn_rescale_f32(float m_old, float m_new) {
    return m_old == -INFINITY ? (m_new != m_new ? m_new : 0.0f) : expf(m_old - m_new);
}

NG_HD double ng_attn_rescale_f64(double m_old, double m_new) {
    return m_old == -INFINITY ? (m_new != m_new ? m_new : 0.0) : exp(m_old - m_new);
}

/* The same two in base 2, for scores carried times log2(e) (the CUDA
 * tensor-core kernels): exp2(x2 - m2), 0 where m2 is -inf (nothing seen
 * yet), and the old state's factor when the max moves from m2_old to
 * m2_new. */
NG_HD float ng_attn_exp2_shift_f32(float x2, float m2) {
    return m2 == -INFINITY ? 0.0f : exp2f(x2 - m2);
}

NG_HD float ng_attn_rescale2_f32(float m2_old, float m2_new) {
    return m2_old == -INFINITY ? (m2_new != m2_new ? m2_new : 0.0f) : exp2f(m2_old - m2_new);
}

/* logsumexp of a finished row: -inf when it is empty (l == 0). */
NG_HD float ng_attn_lse_f32(float m, float l) {
    return l > 0.0f ? m + logf(l) : (l != l || m != m ? NAN : -INFINITY);
}

NG_HD double ng_attn_lse_f64(double m, double l) {
    return l > 0.0 ? m + log(l) : (l != l || m != m ? NAN : -INFINITY);
}

/* 1 / l for the final normalization; 0 for an empty row (output 0, not 0/0). */
NG_HD float ng_attn_inv_sum_f32(float l) { return l > 0.0f ? 1.0f / l : (l != l ? l : 0.0f); }

NG_HD double ng_attn_inv_sum_f64(double l) { return l > 0.0 ? 1.0 / l : (l != l ? l : 0.0); }

/* Probability in the backward from the saved logsumexp; 0 for an empty row. */
NG_HD float ng_attn_prob_f32(float s, float lse) { return lse == -INFINITY ? 0.0f : expf(s - lse); }

NG_HD double ng_attn_prob_f64(double s, double lse) {
    return lse == -INFINITY ? 0.0 : exp(s - lse);
}

/* ---- Philox4x32-10 ------------------------------------------------------ */

NG_HD void ng_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* The 4 draws of block e / 4 for flat element index e (see header). */
NG_HD void ng_attn_dropout_block(uint64_t seed, uint64_t offset, uint64_t block, uint32_t out[4]) {
    uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)offset,
                       (uint32_t)(offset >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    ng_philox4x32_10(ctr, key, out);
}

/* Keep test for one 32-bit draw: 24-bit uniform in [0, 1) against p. */
NG_HD int ng_attn_keep_word(uint32_t w, float p) {
    return (float)(w >> 8) * 5.9604644775390625e-8f >= p;
}

NG_HD int ng_attn_dropout_keep(uint64_t seed, uint64_t offset, uint64_t e, float p) {
    uint32_t w[4];
    ng_attn_dropout_block(seed, offset, e >> 2, w);
    return ng_attn_keep_word(w[e & 3u], p);
}

#endif /* NG_KERNELS_ATTENTION_MATH_H */
