/*
 * tests/cuda_emu/include/cuda_bf16.h - __nv_bfloat16 for the CPU emulator,
 * with CUDA's device conversions bit for bit: fp32 -> bf16 rounds to nearest
 * even (cvt.rn.bf16.f32), keeps subnormals and infinities, and every NaN
 * becomes the canonical NaN 0x7fff; bf16 -> fp32 is exact.
 */
#ifndef NG_CUDA_EMU_BF16_H
#define NG_CUDA_EMU_BF16_H

#include "cuda_fp16.h"

struct __nv_bfloat16 {
    uint16_t __x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y; /* x in the low 16 bits */
};

namespace ng_emu {
inline uint16_t f32_to_bf16_bits(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* canonical NaN */
    /* round the low 16 bits away, ties to even; a carry may reach the
     * exponent, and the largest finite values round to inf, as IEEE wants */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
} // namespace ng_emu

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __nv_bfloat16{ng_emu::f32_to_bf16_bits(f)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return ng_emu::bf16_bits_to_f32(h.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}

#endif /* NG_CUDA_EMU_BF16_H */
