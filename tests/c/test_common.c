/* tests/c/test_common.c - fp16 / bf16 conversions against the compiler's own
 * _Float16 / exhaustive bit patterns, the status strings, and the CPU path
 * rules of kernels/cpu_isa.h. */
#include <string.h>

#include "kernels/common.h"
#include "kernels/cpu_isa.h"
#include "tests/c/ng_test.h"

static uint16_t ref_f32_to_bf16(float f) {
    /* round to nearest even via double arithmetic on the dropped bits */
    uint32_t u = ng_f32_bits(f);
    if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
    uint32_t hi = u >> 16, lo = u & 0xffff;
    if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) hi++;
    return (uint16_t)hi;
}

int main(void) {
    /* every fp16 pattern: widen, narrow back, bit-identical (NaNs stay NaN) */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ng_f16_to_f32((uint16_t)h);
#if defined(__FLT16_MAX__)
        _Float16 hh;
        uint16_t hb = (uint16_t)h;
        memcpy(&hh, &hb, 2);
        if (!(isnan(f) && isnan((float)hh)) && f != (float)hh) bad++;
#endif
        uint16_t back = ng_f32_to_f16(f);
        if (isnan(f) ? !isnan(ng_f16_to_f32(back)) : back != (uint16_t)h) bad++;
    }
    NG_EXPECT(bad == 0);

    /* random fp32 values (all exponents) narrowed to fp16 vs the compiler */
#if defined(__FLT16_MAX__)
    ng_rng rng = {42};
    bad = 0;
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)ng_rng_u64(&rng);
        float f = ng_bits_f32(u);
        _Float16 want = (_Float16)f;
        uint16_t wb;
        memcpy(&wb, &want, 2);
        uint16_t got = ng_f32_to_f16(f);
        if (isnan(f) ? !isnan(ng_f16_to_f32(got)) : got != wb) {
            if (bad < 3) fprintf(stderr, "  f16(%a): got %04x want %04x\n", f, got, wb);
            bad++;
        }
    }
    NG_EXPECT(bad == 0);
#endif
    /* edge values */
    NG_EXPECT(ng_f32_to_f16(65504.0f) == 0x7bff);
    NG_EXPECT(ng_f32_to_f16(65520.0f) == 0x7c00); /* rounds to inf */
    NG_EXPECT(ng_f32_to_f16(65519.996f) == 0x7bff);
    NG_EXPECT(ng_f32_to_f16(5.9604644775390625e-8f) == 0x0001);  /* smallest subnormal */
    NG_EXPECT(ng_f32_to_f16(2.98023223876953125e-8f) == 0x0000); /* tie to even: 0 */

    /* bf16: random patterns vs a direct reference */
    ng_rng r2 = {7};
    bad = 0;
    for (int i = 0; i < 2000000; i++) {
        float f = ng_bits_f32((uint32_t)ng_rng_u64(&r2));
        uint16_t got = ng_f32_to_bf16(f), want = ref_f32_to_bf16(f);
        if (isnan(f) ? !isnan(ng_bf16_to_f32(got)) : got != want) bad++;
        if (!isnan(f) &&
            ng_bf16_to_f32(ng_f32_to_bf16(ng_bf16_to_f32(want))) != ng_bf16_to_f32(want))
            bad++;
    }
    NG_EXPECT(bad == 0);

    NG_EXPECT(strcmp(ng_status_str(NG_OK), "ok") == 0);
    NG_EXPECT(strcmp(ng_status_str(NG_ERR_CUDA), "CUDA error") == 0);
    NG_EXPECT(NG_CEIL_DIV(7, 3) == 3 && NG_CEIL_DIV(6, 3) == 2);

    /* CPU paths: baseline everywhere; on aarch64 neon and no x86 path, on
     * x86 the paths up to the widest supported and no neon */
    const ng_cpu_isa sup = ng_cpu_isa_supported();
    NG_EXPECT(ng_cpu_isa_set(NG_ISA_BASELINE) == NG_OK && ng_cpu_isa_active() == NG_ISA_BASELINE);
    NG_EXPECT(ng_cpu_isa_set(sup) == NG_OK && ng_cpu_isa_active() == sup);
    NG_EXPECT(ng_cpu_isa_set((ng_cpu_isa)NG_ISA_COUNT) == NG_ERR_UNSUPPORTED);
    NG_EXPECT(strcmp(ng_cpu_isa_name(NG_ISA_NEON), "neon") == 0);
#if NG_NEON
    NG_EXPECT(sup == NG_ISA_NEON);
    NG_EXPECT(ng_cpu_isa_set(NG_ISA_AVX2) == NG_ERR_UNSUPPORTED);
    NG_EXPECT(ng_cpu_isa_set(NG_ISA_AVX512) == NG_ERR_UNSUPPORTED);
    NG_EXPECT(!ng_cpu_bf16_dot_supported() && !ng_cpu_amx_supported());
#else
    NG_EXPECT(sup != NG_ISA_NEON && ng_cpu_isa_set(NG_ISA_NEON) == NG_ERR_UNSUPPORTED);
#endif
    NG_EXPECT(ng_cpu_isa_active() == sup);
    return ng_test_finish("test_common");
}
