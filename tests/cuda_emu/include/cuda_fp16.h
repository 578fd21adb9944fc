/*
 * tests/cuda_emu/include/cuda_fp16.h - __half for the CPU emulator, with
 * CUDA's device conversions bit for bit: fp32 -> fp16 rounds to nearest
 * even (cvt.rn.f16.f32), overflow gives +-inf, subnormals are kept, and every
 * NaN becomes the canonical NaN 0x7fff; fp16 -> fp32 is exact.
 */
#ifndef NG_CUDA_EMU_FP16_H
#define NG_CUDA_EMU_FP16_H

#include <stdint.h>
#include <string.h>

struct __half {
    uint16_t __x;
};
struct __half2 {
    __half x, y; /* x in the low 16 bits */
};

namespace ng_emu {
/* The bits of `from` as a To of the same size. */
template <typename To, typename From>
inline To bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To to;
    memcpy(&to, &from, sizeof to);
    return to;
}
inline uint32_t f32_bits(float f) { return bit_cast<uint32_t>(f); }
inline float bits_f32(uint32_t u) { return bit_cast<float>(u); }
/* Round-to-nearest-even of a positive integer m shifted right by s bits. */
inline uint32_t rne_shift(uint32_t m, int s) {
    if (s <= 0) return m << -s;
    if (s > 31) return 0;
    const uint32_t q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}
inline uint16_t f32_to_f16_bits(float f) {
    const uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu; /* canonical NaN */
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    const int e = (int)(a >> 23) - 127; /* unbiased exponent (-127: fp32 subnormal) */
    if (e < -26) return (uint16_t)sign; /* below half the smallest fp16 subnormal */
    const uint32_t m = (a & 0x7fffffu) | (e > -127 ? 0x800000u : 0u);
    if (e < -14) { /* fp16 subnormal: value = m * 2^(e-23), unit 2^-24 */
        return (uint16_t)(sign | rne_shift(m, -e - 14 + 13));
    }
    /* normal: 10 fraction bits; a carry out of the mantissa bumps the exponent */
    const uint32_t r = rne_shift(m, 13); /* 1024 .. 2048 */
    const uint32_t bits = ((uint32_t)(e + 15) << 10) + (r - 1024u);
    if (bits >= 0x7c00u) return (uint16_t)(sign | 0x7c00u);
    return (uint16_t)(sign | bits);
}
inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
} // namespace ng_emu

inline __half __float2half_rn(float f) { return __half{ng_emu::f32_to_f16_bits(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return ng_emu::f16_bits_to_f32(h.__x); }
inline __half2 __floats2half2_rn(float lo, float hi) {
    return __half2{__float2half_rn(lo), __float2half_rn(hi)};
}
inline __half2 __float22half2_rn(float lo, float hi) { return __floats2half2_rn(lo, hi); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }

#endif /* NG_CUDA_EMU_FP16_H */
