/*
 * tests/c/test_cuda_attention.c - the attention launchers (forward, backward,
 * decode) against the CPU kernels (the fixture's rules: cuda_fixture.h; the
 * cases and their builders: attn_cases.h, shared with test_attention.c).
 *
 * Cases: fwd + bwd, fp32 / fp16 / bf16: E == Ev in {64, 128} (the
 * tensor-core path for fp16 / bf16) over every L, S in {1, 7, 64, 129, 300},
 * plain and causal; then head dims 1, 40, 80, 256 and E != Ev; GQA (Hq 4,
 * Hkv 2) and MQA; bool and additive masks (-inf, finfo.min, fp32 masks on
 * 16-bit data) in [B,Hq,L,S], [B,1,1,S] and [L,S] shapes with fully masked
 * rows; clamp and soft-cap; dropout with fixed seed / offset (also above
 * 2^32); [B,S,H,D] strides, padded rows and a base off 16 bytes (the tensor
 * cores' unaligned staging); scores beyond fp16's range; a NaN in q; L or
 * S = 0; decode shapes (L <= 16, any S: the tensor-core decode for fp16 /
 * bf16 at head dims 64 and 128, the SIMT one otherwise) with and without
 * the split-KV workspace; every backward with D from the pre-kernel's workspace, a third
 * of them also without one (D in the kernels); fp64, Hq % Hkv != 0 and a
 * short or misaligned workspace must be refused.
 *
 * Tolerances (rtol / afrac / aabs; afrac of the row's largest |cpu|):
 *                 out               lse (fp32)          dq, dk, dv
 *        fp32   1e-4 / 1e-4      1e-5 rtol, 1e-4 aabs   2e-4 / 2e-4 / 2e-6
 *        fp16   2e-2 / 3e-3      1e-5 rtol, 2e-3 aabs   2e-2 / 1e-2 / 4e-6
 *        bf16   2e-2 / 1e-2      1e-5 rtol, 8e-3 aabs   3e-2 / 2e-2 / 1e-5
 * fp32: the same fp32 arithmetic in another order, and CUDA's expf against
 * the CPU's polynomial exp (~1 ulp). fp16 / bf16: the tensor-core path
 * (E == Ev, 64 or 128) rounds probabilities (and dS in the backward) to the
 * input dtype before its matrix products, 2^-11 / 2^-8 per term where the
 * CPU keeps fp32, and each side rounds the output once; its lse may come
 * from a sum of rounded probabilities. The gradients' aabs is scaled by the
 * q, k magnitude and the square root of the number of terms summed: rows
 * with a single key have dP - D = rounding noise. Fully masked rows are
 * exact: out and dq rows 0, lse -inf. Inputs are chosen so that no result
 * hangs on a rounding difference: clamp cases put q, k on a 1/8 grid with
 * scale 1/8 (raw scores exact, so both sides clamp the same ones), and the
 * scores beyond fp16's range are integers far apart (an exactly one-hot
 * softmax).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "tests/c/cuda_fixture.h" /* before attn_cases.h: it includes ng_test.h */
#include "tests/c/attn_cases.h"

#define HI_OFFSET ((1ull << 32) + 7)

/* clang-format off */
static const acase ATTN_CASES[] = {
    /* name                     B  Hq Hkv L    S    E    Ev   lay       out_lay   mask        mshape   full caus clamp soft drop mag  mf32 special   offset tail */
    {"E40",                     1, 2, 2,  129, 300, 40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E80_bshd",                2, 2, 2,  300, 129, 80,  80,  LAY_BSHD, LAY_BSHD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E256",                    1, 2, 2,  64,  129, 256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E256_causal_pad",         1, 1, 1,  129, 129, 256, 256, LAY_PAD,  LAY_PAD,  AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E64_Ev128",               1, 2, 2,  64,  129, 64,  128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E128_Ev64_gqa",           1, 2, 1,  129, 64,  128, 64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E24_Ev40",                2, 2, 2,  7,   300, 24,  40,  LAY_BHSD, LAY_PAD,  AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E1_Ev3",                  1, 1, 1,  7,   7,   1,   3,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"E256_Ev8",                1, 1, 1,  33,  65,  256, 8,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"gqa_E64",                 2, 4, 2,  129, 64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"gqa_E128_causal",         1, 4, 2,  300, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"gqa_E80_bool_full_rows",  1, 4, 2,  64,  129, 80,  80,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"mqa_E64",                 1, 4, 1,  129, 129, 64,  64,  LAY_BSHD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"bool_full_rows_E64",      2, 2, 2,  64,  129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"bool_full_rows_E128_bshd", 1, 2, 2, 129, 300, 128, 128, LAY_BSHD, LAY_BSHD, AM_BOOL,    MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"neginf_full_rows_E64_gqa", 2, 2, 1, 129, 64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"lowest_LS_causal_E128",   1, 2, 2,  129, 129, 128, 128, LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_LS,   1, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"pad_mask_E64",            3, 2, 2,  64,  300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"f32_mask_E64",            1, 2, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   0,   0,   1,   1, SP_NONE, 42, 0},
    {"f32_lowest_mask_E40",     1, 2, 2,  64,  7,   40,  40,  LAY_BHSD, LAY_BHSD, AM_LOWEST,  MS_FULL, 1, 0, 0,   0,   0,   1,   1, SP_NONE, 42, 0},
    {"bool_causal_E40",         1, 2, 2,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"additive_E128",           1, 2, 2,  300, 7,   128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"clamp_E64",               1, 2, 2,  64,  129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 2.5, 0,   0,   4,   0, SP_NONE, 42, 0},
    {"softcap_E128",            1, 2, 2,  129, 64,  128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   3.0, 0,   4,   0, SP_NONE, 42, 0},
    {"clamp_softcap_E80_mask",  1, 2, 1,  64,  64,  80,  80,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 1, 3.0, 2.0, 0,   4,   0, SP_NONE, 42, 0},
    {"clamp_softcap_E64_gqa",   1, 4, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 0, 3.0, 5.0, 0,   4,   0, SP_NONE, 42, 0},
    {"dropout_E64",             1, 2, 2,  129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42, 0},
    {"dropout_E128_causal_gqa", 1, 4, 2,  129, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0.2, 1,   0, SP_NONE, 42, 0},
    {"dropout_bool_E40",        1, 2, 1,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 1, 1, 0,   0,   0.5, 1,   0, SP_NONE, 42, 0},
    {"dropout_E256",            1, 1, 1,  64,  64,  256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.1, 1,   0, SP_NONE, 42, 0},
    {"dropout_hi_offset_E64",   2, 2, 2,  7,   129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1,   0, SP_NONE, HI_OFFSET, 0},
    {"dropout_softcap_E128_mask", 1, 2, 2, 64, 129, 128, 128, LAY_PAD,  LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 0, 0,   4.0, 0.25, 3,  0, SP_NONE, 42, 0},
    {"pad_rows_E64",            1, 2, 2,  129, 129, 64,  64,  LAY_PAD,  LAY_PAD,  AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"shifted_base_E64",        1, 2, 2,  129, 300, 64,  64,  LAY_SHIFT, LAY_SHIFT, AM_NONE,  MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"shifted_base_E128_gqa_mask", 2, 4, 2, 64, 129, 128, 128, LAY_SHIFT, LAY_BHSD, AM_BOOL,  MS_FULL, 1, 1, 0,   0,   0.2, 1,   0, SP_NONE, 42, 0},
    {"pad_rows_E128_causal",    2, 2, 2,  64,  300, 128, 128, LAY_BSHD, LAY_PAD,  AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"many_heads_E64",          3, 6, 3,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    /* a padding mask with causality and dropout past one 64 x 64 tile: the
     * tensor-core kernels' key-mask tiles (below the diagonal) beside their
     * general ones (on it, and the last partial tiles) */
    {"pad_causal_dropout_E128", 2, 2, 2,  129, 200, 128, 128, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 1, 0,   0,   0.2, 1,   0, SP_NONE, 42, 0},
    /* padding that covers whole 64-key tiles (batch 0 past S / 3): the
     * tensor-core kernels skip those tiles' math */
    {"pad_tail_E64",            2, 2, 2,  129, 300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_PAD_TAIL, 42, 0},
    {"pad_tail_E128_causal_dropout", 1, 2, 1, 300, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD, 0, 1, 0, 0, 0.2, 1,   0, SP_PAD_TAIL, 42, 0},
    /* left padding over whole tiles (batch 0's keys below S - S / 8): the
     * tensor-core kernels copy no dead tile, and the live one after them */
    {"pad_head_E64",            2, 2, 2,  129, 300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_PAD_HEAD, 42, 0},
    {"pad_head_E128_causal",    1, 2, 2,  300, 300, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  0, 1, 0,   0,   0,   1,   0, SP_PAD_HEAD, 42, 0},
    /* a padding mask per head: head 0 of batch 0 pads past S / 3, head 1,
     * which shares its keys (GQA), does not; the dk / dv kernel must keep
     * those tiles for head 1 */
    {"pad_head_tail_E64_gqa",   2, 4, 2,  129, 300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD_H, 0, 0, 0,  0,   0,   1,   0, SP_PAD_TAIL, 42, 0},
    {"large_scores_E64",        1, 2, 2,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_LARGE, 42, 0},
    {"large_scores_E128",       1, 1, 1,  7,   129, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_LARGE, 42, 0},
    {"nan_in_q_E64",            1, 2, 2,  64,  64,  64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NAN, 42, 0},
    {"nan_in_q_E40_clamp",      1, 1, 1,  7,   33,  40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 5.0, 0,   0,   1,   0, SP_NAN, 42, 0},
    /* a NaN in a row that also has masked positions: masked pairs add exactly
     * nothing to any gradient, on both sides, whatever the tile sizes */
    {"nan_in_q_causal_mask_E64", 1, 2, 2, 129, 129, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NAN, 42, 0},
    {"nan_in_dout_pad_mask_E128", 2, 2, 2, 64, 129, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NAN_DOUT, 42, 0},
    {"nan_in_dout_causal_E40",  1, 2, 2,  64,  64,  40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NAN_DOUT, 42, 0},
    /* a NaN in dout with the keys past S / 2 padded in every row (whole
     * 64-key blocks, and one block partly): the blocks' dk / dv are 0 on
     * both sides, the live flags' skip (without it the NaN row meets their
     * zero p and dS inside the tile products); with GQA, and at E 128 */
    {"nan_in_dout_pad_tail_E64_gqa", 2, 4, 2, 129, 300, 64, 64, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NAN_DOUT, 42, 150},
    {"nan_in_q_pad_tail_E128",  1, 2, 2,  64,  200, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NAN, 42, 100},
    /* decode shapes (L <= 16 against any S: the CPU kernel's split-KV decode path) */
    /* fewer keys than one tile (32 SIMT, 64 tensor-core): one partial tile */
    {"decode_L1_S5_gqa_pad",    2, 8, 2,  1,   5,   64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L16_S20_causal_E128", 1, 4, 2, 16, 20, 128, 128, LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L3_S1_E40_dropout", 1, 4, 1, 3,   1,   40,  40,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42, 0},
    {"decode_L1_S300_pad_gqa",  2, 8, 2,  1,   300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L5_S129_causal_E40", 1, 4, 1, 5,  129, 40,  40,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 1, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L16_S1000_softcap", 1, 2, 2, 16, 1000, 128, 128, LAY_BSHD, LAY_BHSD, AM_LOWEST,  MS_PAD,  0, 0, 0,   3.0, 0,   3,   0, SP_NONE, 42, 0},
    /* the CPU's decode cases (tests/python/test_attention.py DECODE_CASES) */
    {"decode_L1_gqa_bool_pad",  2, 8, 2,  1,   600, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L1_mha_S2048_E128", 1, 4, 4, 1,  2048, 128, 128, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L1_mqa_neginf",    1, 4, 1,  1,  1500, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L4_mqa_lowest_full_rows", 1, 6, 1, 4, 1100, 40, 24, LAY_BHSD, LAY_BHSD, AM_LOWEST, MS_FULL, 1, 0, 0, 0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L3_bool_full_rows_ls", 2, 4, 2, 3, 333, 16,  16,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_LS,   1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L16_gqa_additive", 1, 8, 2,  16,  513, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L3_causal",        1, 4, 2,  3,   700, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L2_guards_mask",   1, 4, 2,  2,   900, 32,  32,  LAY_BHSD, LAY_BHSD, AM_NEG_INF, MS_LS,   0, 0, 3.0, 2.0, 0,   4,   0, SP_NONE, 42, 0},
    {"decode_L7_S33_odd",       1, 3, 1,  7,   33,  20,  12,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L3_S200_dropout",  1, 2, 2,  3,   200, 8,   5,   LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0.4, 1,   0, SP_NONE, 5, 0},
    {"decode_L1_S77_dropout_gqa", 2, 6, 3, 1,  77,  64,  64,  LAY_BSHD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42, 0},
    {"decode_L2_nan_in_q_gqa",  1, 4, 2,  2,   300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NAN, 42, 0},
    {"decode_L2_S700_dropout_splits", 1, 4, 2, 2, 700, 64, 64, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0.3, 1,   0, SP_NONE, 42, 0},
    {"decode_L3_padded_layouts", 2, 6, 2, 3,   520, 40,  40,  LAY_PAD,  LAY_PAD,  AM_LOWEST,  MS_FULL, 1, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    /* head dim 256: the decode kernel's shared memory must fit sm_75's 64 KiB */
    {"decode_L2_E256_gqa",      1, 4, 2,  2,   400, 256, 256, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    /* the same unmasked: no mask scan's barrier stands between one tile's V
     * readers and the next K tile's copy (sm_75's single-stage loop) */
    {"decode_L2_E256_gqa_nomask", 1, 4, 2, 2,  400, 256, 256, LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    /* batch 1 all padding, batch 0 padding past S / 3: whole key splits
     * see only masked keys and must weigh nothing in the combine */
    {"decode_L1_pad_tail_splits", 2, 8, 2, 1,  900, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  1, 0, 0,   0,   0,   1,   0, SP_PAD_TAIL, 42, 0},
    /* left padding (batched generation's layout): batch 0 sees only keys
     * past S - S / 8, all in the last of its 4 splits, so the combine's
     * common max must include the last split (every other split's max is
     * -inf) */
    {"decode_L1_left_pad_splits", 2, 8, 2, 1,  900, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD,  0, 0, 0,   0,   0,   1,   0, SP_PAD_HEAD, 42, 0},
    /* B * Hq * L = 3 rows, not a multiple of the combine's 4 rows (warps) a
     * block: its last block has a warp past the last row */
    {"decode_L1_H3_splits",     1, 3, 3,  1,  2048, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    /* the tensor-core decode (fp16 / bf16, E = Ev in {64, 128}): causal
     * rows of a GQA group; a per-head padding mask that the heads of a
     * group do not share (no tile skipped), and one that a block's rows all
     * share (MHA: left-padded tiles skipped) */
    {"decode_L4_causal_E64_gqa", 1, 8, 2, 4,   300, 64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 1, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"decode_L1_pad_h_gqa_E128", 2, 8, 2, 1,   900, 128, 128, LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD_H, 0, 0, 0,  0,   0,   1,   0, SP_PAD_TAIL, 42, 0},
    {"decode_L2_pad_h_mha_left", 2, 4, 4, 2,   700, 64,  64,  LAY_BHSD, LAY_BHSD, AM_BOOL,    MS_PAD_H, 0, 0, 0,  0,   0,   1,   0, SP_PAD_HEAD, 42, 0},
    /* more heads than gridDim.y / z allow (65535) */
    {"heads_65537",             1, 65537, 65537, 1, 3,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"empty_S",                 1, 2, 2,  5,   0,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
    {"empty_L",                 1, 2, 2,  0,   7,   64,  64,  LAY_BHSD, LAY_BHSD, AM_NONE,    MS_FULL, 0, 0, 0,   0,   0,   1,   0, SP_NONE, 42, 0},
};
/* fp16 / bf16 only (the tensor-core path): a dropout keep factor 1/(1-p) =
 * 2^17, above fp16's 65504. With S = 2 every row has a probability >= 1/2,
 * and Philox offset 14771 keeps 2 of the 256 elements (found by search), so
 * p * keep exceeds fp16's range where it is kept. */
static const acase ATTN_CASES_16[] = {
    {"dropout_scale_above_fp16_max_E64", 1, 2, 2, 64, 2, 64, 64, LAY_BHSD, LAY_BHSD, AM_NONE, MS_FULL, 0, 0, 0, 0, 1.0 - 1.0 / 131072.0, 1, 0, SP_NONE, 14771, 0},
};
/* clang-format on */

/* ---- tensors on both sides ----------------------------------------------------- */

/* A host buffer (the CPU kernel's) and a device buffer (the launcher's). */
static atensor at_new_dev(ng_dtype t, int64_t B, int64_t H, int64_t N, int64_t D, int lay) {
    atensor x = at_new(t, B, H, N, D, lay);
    x.d = x.span ? dmalloc(at_bytes(&x)) : NULL;
    return x;
}

static void at_free(atensor *x) {
    free(x->h);
    dfree(x->d);
}

/* Elements of the buffer outside the view (row padding) must keep the 0xff fill. */
static void at_check_gaps(const char *what, const atensor *x, const void *buf) {
    if (!x->span) return;
    uint8_t *used = calloc((size_t)x->span, 1);
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t n = 0; n < x->N; n++)
                for (int64_t d = 0; d < x->D; d++) used[at_off(x, b, h, n, d)] = 1;
    int64_t bad = 0;
    for (int64_t i = 0; i < x->span; i++)
        if (!used[i] && !all_ff((const char *)buf + (size_t)i * x->es, x->es)) bad++;
    CHECK(bad == 0, "%s: %lld elements outside the view were written", what, (long long)bad);
    free(used);
}

/* Download x's device buffer, compare with the CPU's over rows of D, check
 * the padding; returns the downloaded buffer. forgive (NULL, or one flag
 * per row of [B, H, N]): rows where a NaN on one side only is accepted
 * (attn_forgive says which and why). Every other element compares as
 * usual. */
static void *at_compare_forgive(const char *what, const atensor *x, ng_dtype t, tol tl,
                                const uint8_t *forgive) {
    void *g = ddownload(x->d, at_bytes(x));
    double *r = at_dense(x, t, x->h), *d = at_dense(x, t, g);
    for (int64_t row = 0; forgive && row < x->B * x->H * x->N; row++)
        for (int64_t e = 0; forgive[row] && e < x->D; e++) {
            const int64_t at = row * x->D + e;
            if (isnan(r[at]) != isnan(d[at])) r[at] = d[at] = 0.0;
        }
    close_rows(what, d, r, x->B * x->H * x->N, x->D, tl, NULL);
    at_check_gaps(what, x, g);
    free(r);
    free(d);
    return g;
}

static void *at_compare(const char *what, const atensor *x, ng_dtype t, tol tl) {
    return at_compare_forgive(what, x, t, tl, NULL);
}

/* Elements of the fully masked rows (empty_row[(b * H + h) * N + i]) of a
 * downloaded [B, H, N, D] tensor that are not exactly 0. */
static int64_t empty_row_nonzeros(const void *g, ng_dtype t, const atensor *x,
                                  const uint8_t *empty_row) {
    int64_t nonzero = 0;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t i = 0; i < x->N; i++)
                if (empty_row[(b * x->H + h) * x->N + i])
                    for (int64_t d = 0; d < x->D; d++)
                        nonzero += ng_load_f64(g, t, at_off(x, b, h, i, d)) != 0.0;
    return nonzero;
}

/* Gradients get an absolute floor too: a row with a single key (S = 1, the
 * first row of a causal mask) has dP - D = 0 up to rounding, so its dq and
 * that key's dk are pure fp32 rounding noise on both sides (~5e-8 per term
 * for unit q, k), summed over `terms` rows or keys; fp16 results that small
 * are subnormals 6e-8 apart. The floor is aabs * mag * sqrt(terms). */
static tol attn_tol(ng_dtype t, int which, double mag,
                    int64_t terms) { /* 0 out, 1 lse, 2 gradients */
#define W "the table in the header comment"
    static const tol tab[3][3] = {
        /*          out                   lse                    dq, dk, dv */
        /* fp32 */ {{1e-4, 1e-4, 0, W}, {1e-5, 0, 1e-4, W}, {2e-4, 2e-4, 2e-6, W}},
        /* fp16 */ {{2e-2, 3e-3, 0, W}, {1e-5, 0, 2e-3, W}, {2e-2, 1e-2, 4e-6, W}},
        /* bf16 */ {{2e-2, 1e-2, 0, W}, {1e-5, 0, 8e-3, W}, {3e-2, 2e-2, 1e-5, W}},
    };
#undef W
    tol r = tab[t == NG_F32 ? 0 : t == NG_F16 ? 1 : 2][which];
    if (which == 2) r.aabs *= mag * sqrt((double)NG_MAX(terms, (int64_t)1));
    return r;
}

/* ---- one case ------------------------------------------------------------------ */

/* SP_LARGE: even integers: q in [100, 150], key j = one vector in [100, 120]
 * plus 2 * (37 j mod S) everywhere, exact in fp16 and bf16; every q.k is an
 * integer below 2^24 (exact in fp32 in any order) and far beyond 65504, and
 * a row's scores are at least 2 * sum(q) * scale > 1000 apart, so the
 * softmax is exactly one-hot on both sides */
static void attn_large_scores(const acase *c, ng_dtype t, aio *io, ng_rng *rng) {
    double base[NG_ATTN_MAX_HEAD_DIM];
    for (int64_t e = 0; e < c->E; e++) base[e] = 2.0 * floor(50.0 + 10.0 * urand(rng));
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < c->L; i++)
                for (int64_t e = 0; e < c->E; e++)
                    ng_store_f64(io->q.h, t, at_off(&io->q, b, h, i, e),
                                 2.0 * floor(50.0 + 25.0 * urand(rng)));
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hkv; h++)
            for (int64_t j = 0; j < c->S; j++)
                for (int64_t e = 0; e < c->E; e++)
                    ng_store_f64(io->k.h, t, at_off(&io->k, b, h, j, e),
                                 base[e] + 2.0 * (double)((j * 37) % c->S));
}

/* q, k, v, dout (the padding of a padded layout holds values too: they must
 * not matter); clamp cases put q, k on a 1/8 grid. */
static void attn_inputs(const acase *c, ng_dtype t, aio *io, ng_rng *rng) {
    const int grid = c->max_score > 0.0;
    for (int64_t i = 0; i < io->q.span; i++) {
        double x = c->mag * ng_rng_unif(rng);
        ng_store_f64(io->q.h, t, i, grid ? round(8.0 * x) / 8.0 : x);
    }
    for (int64_t i = 0; i < io->k.span; i++) {
        double x = c->mag * ng_rng_unif(rng);
        ng_store_f64(io->k.h, t, i, grid ? round(8.0 * x) / 8.0 : x);
    }
    if (c->special == SP_LARGE) attn_large_scores(c, t, io, rng);
    for (int64_t i = 0; i < io->v.span; i++) ng_store_f64(io->v.h, t, i, ng_rng_unif(rng));
    for (int64_t i = 0; i < io->dout.span; i++) ng_store_f64(io->dout.h, t, i, ng_rng_unif(rng));
    const int64_t L = c->L;
    if (c->special == SP_NAN && L > 0)
        ng_store_f64(io->q.h, t, at_off(&io->q, 0, 0, NG_MIN(2, L - 1), NG_MIN(3, c->E - 1)), NAN);
    if (c->special == SP_NAN_DOUT && L > 0)
        ng_store_f64(io->dout.h, t, at_off(&io->dout, 0, 0, NG_MIN(2, L - 1), NG_MIN(3, c->Ev - 1)),
                     NAN);
}

/* The device side of a case: buffers, the CPU's forward results, the mask. */
typedef struct adev {
    void *mask_d;
    float *lse, *lse_d; /* the CPU's lse, the device's */
    size_t lse_bytes;
    uint8_t *empty_row; /* rows the CPU left fully masked (lse -inf) */
    int64_t n_empty;
    uint8_t *dead_key; /* [B, Hkv, S]: keys of the 64-key blocks that a padding
                          mask hides from every query head of their group */
} adev;

/* dead_key of a case with a padding mask ([B or 1, Hq or 1, 1, S]; NULL
 * otherwise): the blocks the backward's live flags mark dead. */
static uint8_t *attn_dead_keys(const acase *c, const amask *m) {
    if (!m->p || (c->mshape != MS_PAD && c->mshape != MS_PAD_H)) return NULL;
    const int64_t grp = c->Hq / c->Hkv, S = c->S;
    uint8_t *dead = calloc((size_t)(c->B * c->Hkv * S) + 1, 1);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t hk = 0; hk < c->Hkv; hk++)
            for (int64_t j0 = 0; j0 < S; j0 += 64) {
                int all = 1;
                for (int64_t h = hk * grp; all && h < (hk + 1) * grp; h++)
                    for (int64_t j = j0; all && j < NG_MIN(S, j0 + 64); j++)
                        all = m->flag[b * m->st[0] + h * m->st[1] + j];
                for (int64_t j = j0; all && j < NG_MIN(S, j0 + 64); j++)
                    dead[(b * c->Hkv + hk) * S + j] = 1;
            }
    return dead;
}

/* The dk / dv rows ([B, Hkv, S]) of a NaN case (SP_NAN, SP_NAN_DOUT: a NaN
 * in q or dout, row NG_MIN(2, L - 1) of (b 0, head 0)) where a NaN on one
 * side only is accepted, or NULL where there are none. The pairs masked for
 * the NaN row add exactly nothing on both sides, but its NaN values still
 * meet their zero coefficients inside the dense tile products (0 * NaN), so
 * a key that shares a computed tile with the row may come out NaN, and
 * which ones depends on which tiles a side computes:
 * - causal: keys j > the row (CPU and CUDA tile sizes differ);
 * - without the workspace (ws 0): the keys of blocks a padding mask hides
 *   from the whole group (dead_key), which the CPU and the CUDA backward
 *   with its workspace skip (0) and the CUDA backward without one computes.
 * With the workspace those keys compare as usual: both sides give 0. */
static uint8_t *attn_forgive(const acase *c, const adev *dv, int ws) {
    if ((c->special != SP_NAN && c->special != SP_NAN_DOUT) || c->L == 0) return NULL;
    const int64_t leak_row = NG_MIN(2, c->L - 1), S = c->S;
    if (!c->causal && (ws || !dv->dead_key)) return NULL;
    uint8_t *f = calloc((size_t)(c->B * c->Hkv * S) + 1, 1);
    for (int64_t j = leak_row + 1; c->causal && j < S; j++) f[j] = 1; /* b 0, kv head 0 */
    for (int64_t r = 0; !ws && dv->dead_key && r < c->B * c->Hkv * S; r++) f[r] |= dv->dead_key[r];
    return f;
}

/* The forward as the op calls it (with the split-KV workspace of a decode
 * shape), then, for a decode shape, without a workspace: one block over all
 * keys. out and lse against the CPU's; fully masked rows exactly 0. */
static void attn_check_fwd(const acase *c, ng_dtype t, aio *io, const ng_attention_args *ad,
                           adev *dv) {
    const int64_t rows = c->B * c->Hq * c->L;
    const int64_t wsb = ng_attention_fwd_cuda_workspace_bytes(ad);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;
    const int decode = c->L >= 1 && c->L <= NG_ATTN_DEC_MAX_L && c->S >= 1;
    const size_t case_len = strlen(g_case);
    for (int form = 0; form < (decode ? 2 : 1); form++) {
        if (form == 1)
            snprintf(g_case + strlen(g_case), sizeof g_case - strlen(g_case), " [no workspace]");
        dpoison(io->o.d, at_bytes(&io->o));
        dpoison(dv->lse_d, dv->lse_bytes);
        if (ws_d) dpoison(ws_d, (size_t)wsb);
        if (LAUNCHED(form ? ng_attention_fwd_cuda(ad, g_stream)
                          : ng_attention_fwd_cuda_ws(ad, ws_d, wsb, g_stream))) {
            void *og = at_compare("out", &io->o, t, attn_tol(t, 0, c->mag, 0));
            float *lg = ddownload(dv->lse_d, dv->lse_bytes);
            double *lr = to_f64(dv->lse, NG_F32, rows), *lc = to_f64(lg, NG_F32, rows);
            close_rows("lse", lc, lr, rows, 1, attn_tol(t, 1, c->mag, 0), NULL);
            const int64_t nonzero = empty_row_nonzeros(og, t, &io->o, dv->empty_row);
            CHECK(nonzero == 0, "%lld output values of fully masked rows are not 0",
                  (long long)nonzero);
            free(og), free(lg), free(lr), free(lc);
        }
        g_case[case_len] = 0;
    }
    dfree(ws_d);
}

/* One form of the backward: with ws (D by the pre-kernel) or without (ws
 * NULL, D in the kernels). */
static void attn_check_bwd_form(const acase *c, ng_dtype t, aio *io, const ng_attention_args *ad,
                                adev *dv, void *ws, int64_t wsb) {
    const int64_t L = c->L, S = c->S, grp = c->Hq / c->Hkv;
    if (io->o.span) dcopy_to(io->o.d, io->o.h, at_bytes(&io->o));
    if (L) dcopy_to(dv->lse_d, dv->lse, dv->lse_bytes);
    dpoison(io->dq.d, at_bytes(&io->dq));
    dpoison(io->dk.d, at_bytes(&io->dk));
    dpoison(io->dv.d, at_bytes(&io->dv));
    if (!LAUNCHED(ws ? ng_attention_bwd_cuda_ws(ad, ws, wsb, g_stream)
                     : ng_attention_bwd_cuda(ad, g_stream)))
        return;
    void *g = at_compare("dq", &io->dq, t, attn_tol(t, 2, c->mag, S));
    const int64_t nonzero = empty_row_nonzeros(g, t, &io->dq, dv->empty_row);
    CHECK(nonzero == 0, "%lld dq values of fully masked rows are not 0", (long long)nonzero);
    free(g);
    uint8_t *forgive = attn_forgive(c, dv, ws != NULL);
    free(at_compare_forgive("dk", &io->dk, t, attn_tol(t, 2, c->mag, L * grp), forgive));
    free(at_compare_forgive("dv", &io->dv, t, attn_tol(t, 2, c->mag, L * grp), forgive));
    free(forgive);
    /* the backward only reads out and lse */
    void *og = ddownload(io->o.d, at_bytes(&io->o));
    void *lg = ddownload(dv->lse_d, L ? dv->lse_bytes : 0);
    CHECK((!io->o.span || memcmp(og, io->o.h, at_bytes(&io->o)) == 0) &&
              (!L || memcmp(lg, dv->lse, dv->lse_bytes) == 0),
          "the backward wrote to out or lse");
    free(og), free(lg);
}

/* The backward, fed the CPU forward's out and lse, as the op calls it (D by
 * the pre-kernel into a workspace, poisoned first), then for a third of the
 * cases without a workspace (D in the kernels): dq, dk, dv against the
 * CPU's, both forms to the same tolerances; fully masked rows' dq exactly 0;
 * out and lse only read. */
static void attn_check_bwd(const acase *c, ng_dtype t, aio *io, const ng_attention_args *ad,
                           adev *dv) {
    const int64_t wsb = ng_attention_bwd_cuda_workspace_bytes(ad);
    /* D, then with a padding mask one int per 64-key block of each kv head */
    const int pad = dv->dead_key != NULL; /* attn_dead_keys: a padding mask */
    const int64_t want =
        c->L ? (int64_t)sizeof(float) * c->B * c->Hq * c->L +
                   (pad ? (int64_t)sizeof(int) * c->B * c->Hkv * NG_CEIL_DIV(c->S, (int64_t)64) : 0)
             : 0;
    CHECK(wsb == want, "backward workspace: %lld bytes, not %lld", (long long)wsb, (long long)want);
    void *ws_d = wsb ? dmalloc((size_t)wsb) : NULL;
    const int no_ws = (c->L * 7 + c->S * 3 + c->E + c->Ev + c->causal + (int64_t)t) % 3 == 0;
    const size_t case_len = strlen(g_case);
    for (int form = 0; form < (no_ws ? 2 : 1); form++) {
        if (form == 1)
            snprintf(g_case + strlen(g_case), sizeof g_case - strlen(g_case),
                     " [bwd no workspace]");
        if (ws_d) dpoison(ws_d, (size_t)wsb);
        attn_check_bwd_form(c, t, io, ad, dv, form ? NULL : ws_d, wsb);
        g_case[case_len] = 0;
    }
    dfree(ws_d);
}

static void attn_case(const acase *c, ng_dtype t) {
    if (!case_begin("attention  %-34s %s", c->name, ng_dtype_name(t))) return;
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, L = c->L, S = c->S, E = c->E, Ev = c->Ev;
    ng_rng rng = {0x9E3779B97F4A7C15ull ^
                  (uint64_t)(L * 131 + S * 7 + E + Ev * 3 + B * 17 + Hq * 5 + c->mask * 1009 +
                             c->causal * 4099 + (int64_t)t * 1000003)};
    aio io = {at_new_dev(t, B, Hq, L, E, c->lay),      at_new_dev(t, B, Hkv, S, E, c->lay),
              at_new_dev(t, B, Hkv, S, Ev, c->lay),    at_new_dev(t, B, Hq, L, Ev, c->lay),
              at_new_dev(t, B, Hq, L, Ev, c->out_lay), at_new_dev(t, B, Hq, L, E, c->out_lay),
              at_new_dev(t, B, Hkv, S, E, c->out_lay), at_new_dev(t, B, Hkv, S, Ev, c->out_lay)};
    attn_inputs(c, t, &io, &rng);
    amask m = amask_new(c, c->mask_f32 ? NG_F32 : t, &rng);
    adev dv = {NULL, NULL, NULL, (size_t)(B * Hq * L) * sizeof(float), NULL, 0, NULL};
    dv.lse = L ? calloc((size_t)(B * Hq * L), sizeof(float)) : NULL;

    /* clamp cases: q, k on a 1/8 grid and scale 1/8 make every raw score
     * exact in fp32 whatever the summation order, so both sides clamp the
     * same scores (a score a rounding error away from the bound would get
     * clamp' = 0 on one side and 1 on the other) */
    const double scale = c->max_score > 0.0 ? 0.125 : 1.0 / sqrt((double)E);
    ng_attention_args a = attn_args(c, t, &io, 0, dv.lse, &m, m.p, scale);
    ng_status st = ng_attention_fwd(&a, NULL);
    CHECK(st == NG_OK, "CPU forward: %s", ng_status_str(st));
    /* sample: the decode_* cases check the decode forward; their backward is
     * the tiled one, which the grid's L 1 and L 7 cases run */
    const int do_bwd = c->special != SP_LARGE && !(g_sample && strncmp(c->name, "decode_", 7) == 0);
    if (st == NG_OK && do_bwd) {
        st = ng_attention_bwd(&a, NULL);
        CHECK(st == NG_OK, "CPU backward: %s", ng_status_str(st));
    }

    /* the same arguments with device pointers */
    dv.mask_d = m.p ? dupload(m.p, m.bytes) : NULL;
    dv.lse_d = L ? dmalloc(dv.lse_bytes) : NULL;
    atensor *in[4] = {&io.q, &io.k, &io.v, &io.dout};
    for (int i = 0; i < 4; i++)
        if (in[i]->span) dcopy_to(in[i]->d, in[i]->h, at_bytes(in[i]));
    ng_attention_args ad = attn_args(c, t, &io, 1, dv.lse_d, &m, dv.mask_d, scale);
    dv.empty_row = calloc((size_t)(B * Hq * L) + 1, 1);
    for (int64_t r = 0; r < B * Hq * L; r++)
        if (dv.lse[r] == -INFINITY) dv.empty_row[r] = 1, dv.n_empty++;
    dv.dead_key = attn_dead_keys(c, &m);

    if (st == NG_OK) attn_check_fwd(c, t, &io, &ad, &dv);
    if (st == NG_OK && do_bwd) attn_check_bwd(c, t, &io, &ad, &dv);
    if (dv.n_empty)
        snprintf(g_case + strlen(g_case), sizeof g_case - strlen(g_case), " [%lld empty rows]",
                 (long long)dv.n_empty);

    atensor *all[8] = {&io.q, &io.k, &io.v, &io.dout, &io.o, &io.dq, &io.dk, &io.dv};
    for (int i = 0; i < 8; i++) at_free(all[i]);
    dfree(dv.mask_d), dfree(dv.lse_d);
    amask_free(&m), free(dv.lse), free(dv.empty_row), free(dv.dead_key);
    case_end();
}

static void attn_rejects_fp64(void) {
    if (!case_begin("attention  %-34s %s", "rejects", "float64")) return;
    double *buf = dmalloc(64 * sizeof(double));
    float *lse = dmalloc(4 * sizeof(float));
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F64;
    a.B = 1, a.Hq = 1, a.Hkv = 1, a.L = 2, a.S = 2, a.E = 8, a.Ev = 8;
    const int64_t st[3] = {16, 16, 8};
    a.q = a.k = a.v = a.dout = buf;
    a.out = a.dq = a.dk = a.dv = buf;
    attn_same_strides(&a, st);
    a.lse = lse;
    a.scale = 0.35;
    ng_status s1 = ng_attention_fwd_cuda(&a, g_stream), s2 = ng_attention_bwd_cuda(&a, g_stream);
    CHECK(s1 == NG_ERR_DTYPE && s2 == NG_ERR_DTYPE, "fp64: fwd %s, bwd %s (want %s)",
          ng_status_str(s1), ng_status_str(s2), ng_status_str(NG_ERR_DTYPE));
    a.dtype = NG_F16;
    a.Hq = 3, a.Hkv = 2;
    s1 = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s1 == NG_ERR_INVALID_ARG, "Hq %% Hkv != 0: %s (want %s)", ng_status_str(s1),
          ng_status_str(NG_ERR_INVALID_ARG));
    CU(cudaStreamSynchronize(g_stream));
    dfree(buf), dfree(lse);
    case_end();
}

/* The split-KV workspace: asked for by long decode shapes only, and a
 * smaller or misaligned one refused before anything is launched. */
static void attn_workspace_contract(void) {
    if (!case_begin("attention  %-34s %s", "decode_workspace", "float32")) return;
    const int64_t L = 1, S = 1024, E = 64;
    float *buf = dmalloc(sizeof(float) * (size_t)(2 * S * E));
    float *lse = dmalloc(4 * sizeof(float));
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F32;
    a.B = 1, a.Hq = 2, a.Hkv = 1, a.L = L, a.S = S, a.E = E, a.Ev = E;
    const int64_t qst[3] = {2 * L * E, L * E, E}, kst[3] = {S * E, S * E, E};
    a.q = a.out = buf;
    a.k = a.v = buf;
    memcpy(a.q_stride, qst, sizeof qst), memcpy(a.out_stride, qst, sizeof qst);
    memcpy(a.k_stride, kst, sizeof kst), memcpy(a.v_stride, kst, sizeof kst);
    a.lse = lse;
    a.scale = 0.125;
    const int64_t need = ng_attention_fwd_cuda_workspace_bytes(&a);
    /* 1024 keys over 2 rows: 8 splits of 128 keys, each (m, l) + 64 outputs per row */
    CHECK(need == (int64_t)sizeof(float) * 8 * 2 * (E + 2), "workspace of L 1, S 1024: %lld bytes",
          (long long)need);
    ng_attention_args t = a;
    t.L = 17;
    CHECK(ng_attention_fwd_cuda_workspace_bytes(&t) == 0,
          "L 17 (not a decode shape) asks for a workspace");
    t = a;
    t.S = 255;
    CHECK(ng_attention_fwd_cuda_workspace_bytes(&t) == 0, "S 255 (one split) asks for a workspace");
    char *ws = dmalloc((size_t)need + 4);
    ng_status s = ng_attention_fwd_cuda_ws(&a, ws, need - 4, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a workspace 4 bytes short: %s", ng_status_str(s));
    s = ng_attention_fwd_cuda_ws(&a, ws + 2, need, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a misaligned workspace: %s", ng_status_str(s));
    CU(cudaStreamSynchronize(g_stream));
    dfree(ws), dfree(buf), dfree(lse);
    case_end();
}

/* The backward's workspace: 4 B Hq L bytes of D, taken when given in full;
 * a smaller or misaligned one refused before anything is launched. */
static void attn_bwd_workspace_contract(void) {
    if (!case_begin("attention  %-34s %s", "bwd_workspace", "float16")) return;
    const int64_t B = 2, H = 3, L = 5, S = 7, E = 64, n = B * H * 8 * E;
    const size_t bytes = sizeof(uint16_t) * (size_t)n;
    uint16_t *in = dmalloc(bytes), *dq = dmalloc(bytes), *dk = dmalloc(bytes), *dv = dmalloc(bytes);
    float *lse = dmalloc(sizeof(float) * (size_t)(B * H * L));
    CU(cudaMemsetAsync(in, 0, bytes, g_stream));
    CU(cudaMemsetAsync(lse, 0, sizeof(float) * (size_t)(B * H * L), g_stream));
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F16;
    a.B = B, a.Hq = H, a.Hkv = H, a.L = L, a.S = S, a.E = E, a.Ev = E;
    const int64_t st[3] = {H * 8 * E, 8 * E, E};
    a.q = a.k = a.v = a.dout = in;
    a.out = in;
    a.dq = dq, a.dk = dk, a.dv = dv;
    attn_same_strides(&a, st);
    a.lse = lse;
    a.scale = 0.125;
    const int64_t need = ng_attention_bwd_cuda_workspace_bytes(&a);
    CHECK(need == (int64_t)sizeof(float) * B * H * L, "workspace of B 2, Hq 3, L 5: %lld bytes",
          (long long)need);
    ng_attention_args t = a;
    t.L = 0;
    CHECK(ng_attention_bwd_cuda_workspace_bytes(&t) == 0, "L 0 asks for a workspace");
    t = a;
    t.dtype = NG_F64;
    CHECK(ng_attention_bwd_cuda_workspace_bytes(&t) == 0, "fp64 asks for a workspace");
    char *ws = dmalloc((size_t)need + 4);
    ng_status s = ng_attention_bwd_cuda_ws(&a, ws, need, g_stream);
    CHECK(s == NG_OK, "a workspace of exactly the size asked for: %s", ng_status_str(s));
    s = ng_attention_bwd_cuda_ws(&a, ws, need - 4, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a workspace 4 bytes short: %s", ng_status_str(s));
    s = ng_attention_bwd_cuda_ws(&a, ws + 2, need, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a misaligned workspace: %s", ng_status_str(s));
    s = ng_attention_bwd_cuda_ws(&a, ws, 0, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "an empty workspace: %s", ng_status_str(s));

    /* a padding mask ([B, 1, 1, S], every key attended): the live flags
     * after D, one int per 64-key block of each kv head; D's bytes alone
     * are short. A mask that depends on the query asks for D only. */
    uint8_t *mask = dmalloc((size_t)(B * S));
    CU(cudaMemsetAsync(mask, 1, (size_t)(B * S), g_stream));
    ng_attention_args m = a;
    m.mask = mask, m.mask_kind = NG_MASK_BOOL, m.mask_dtype = NG_F16;
    m.mask_stride[0] = S, m.mask_stride[1] = 0, m.mask_stride[2] = 0, m.mask_stride[3] = 1;
    const int64_t need_pad = ng_attention_bwd_cuda_workspace_bytes(&m);
    CHECK(need_pad == need + (int64_t)sizeof(int) * B * H * 1,
          "workspace of B 2, Hkv 3, S 7 with a padding mask: %lld bytes", (long long)need_pad);
    s = ng_attention_bwd_cuda_ws(&m, ws, need, g_stream);
    CHECK(s == NG_ERR_INVALID_ARG, "a padding mask's workspace without its flags: %s",
          ng_status_str(s));
    char *ws_pad = dmalloc((size_t)need_pad);
    s = ng_attention_bwd_cuda_ws(&m, ws_pad, need_pad, g_stream);
    CHECK(s == NG_OK, "a padding mask's workspace of exactly the size asked for: %s",
          ng_status_str(s));
    t = m;
    t.mask_stride[2] = S; /* a [B, 1, L, S] mask's strides: sized only, never launched */
    CHECK(ng_attention_bwd_cuda_workspace_bytes(&t) == need,
          "a mask that depends on the query asks for the live flags");
    CU(cudaStreamSynchronize(g_stream));
    dfree(ws_pad), dfree(mask);
    dfree(ws), dfree(in), dfree(dq), dfree(dk), dfree(dv), dfree(lse);
    case_end();
}

void test_cuda_attention(void) {
    static const int64_t sizes[5] = {1, 7, 64, 129, 300};
    static const int64_t dims[2] = {64, 128};
    /* the tensor-core head dims over every (L, S), plain and causal */
    for (int ei = 0; ei < 2; ei++)
        for (int causal = 0; causal < 2; causal++)
            for (int li = 0; li < 5; li++)
                for (int si = 0; si < 5; si++) {
                    char name[64];
                    snprintf(name, sizeof name, "E%lld_L%lld_S%lld%s", (long long)dims[ei],
                             (long long)sizes[li], (long long)sizes[si], causal ? "_causal" : "");
                    acase c = {name,     2,        2,        2,        sizes[li], sizes[si],
                               dims[ei], dims[ei], LAY_BHSD, LAY_BHSD, AM_NONE,   MS_FULL,
                               0,        causal,   0,        0,        0,         1,
                               0,        SP_NONE,  42,       0};
                    /* sample: the tensor-core types at every size up to 129 and a
                     * third of the rest; fp32 (SIMT) a third of those up to 129 */
                    const int third = (li + si + ei + causal) % 3 == 0, big = li == 4 || si == 4;
                    for (int di = 0; di < 3; di++)
                        if (!g_sample || (di ? (!big || third) : (!big && third)))
                            attn_case(&c, FLOAT_TYPES[di]);
                }
    for (size_t ci = 0; ci < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; ci++) {
        /* sample: not the 65537-head grid (65537 blocks of 256 threads take
         * minutes on the emulator; the mutation test cuda_emu_mutant_grid
         * shows the launch it guards against being refused) */
        const acase *c = &ATTN_CASES[ci];
        if (g_sample && c->B * c->Hq > 65535) continue;
        /* sample: cases of over 30K scores, whose SIMT runs take the
         * emulator seconds, in the tensor-core types only (head dims 64 and
         * 128) or in bf16 only (the others, SIMT in every type) */
        const int big = c->B * c->Hq * c->L * c->S > 30000,
                  tc = c->E == c->Ev && (c->E == 64 || c->E == 128);
        for (int di = 0; di < 3; di++)
            if (!g_sample || !big || (tc ? di > 0 : di == 2)) attn_case(c, FLOAT_TYPES[di]);
    }
    for (size_t ci = 0; ci < sizeof ATTN_CASES_16 / sizeof ATTN_CASES_16[0]; ci++)
        for (int di = 1; di < 3; di++) attn_case(&ATTN_CASES_16[ci], FLOAT_TYPES[di]);
    attn_rejects_fp64();
    attn_workspace_contract();
    attn_bwd_workspace_contract();
}
