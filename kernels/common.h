/*
 * kernels/common.h - what every nanguard kernel shares: status codes, dtype
 * tags, index helpers, fp16/bf16 <-> fp32 conversions and the CPU
 * parallel-range hook.
 *
 * This header knows nothing about PyTorch or Python. It compiles as C11 and,
 * under nvcc, as CUDA C++; functions marked NG_HD are host+device so that the
 * CPU tests exercise the same arithmetic the GPU runs.
 *
 * fp16 / bf16 are carried as raw uint16_t bit patterns. Conversions to fp32 are
 * exact; conversions from fp32 round to nearest even, keep NaN a (quiet) NaN
 * and overflow to +-inf, as IEEE 754 and PyTorch do.
 */
#ifndef NG_KERNELS_COMMON_H
#define NG_KERNELS_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define NG_HD static __host__ __device__ __forceinline__
#else
#define NG_HD static inline
#endif

#ifdef __cplusplus
#define NG_EXTERN_C extern "C"
#else
#define NG_EXTERN_C
#endif

#define NG_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#define NG_MIN(a, b) ((a) < (b) ? (a) : (b))
#define NG_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Errors are values: every launcher and CPU kernel returns one of these. */
typedef enum ng_status {
    NG_OK = 0,
    NG_ERR_INVALID_ARG = 1, /* a size, stride or pointer the kernel cannot take */
    NG_ERR_DTYPE = 2,       /* a dtype this kernel has no path for */
    NG_ERR_ALLOC = 3,       /* host workspace allocation failed */
    NG_ERR_CUDA = 4,        /* a CUDA launch or runtime call failed */
    NG_ERR_UNSUPPORTED = 5, /* a valid request this build cannot serve */
} ng_status;

static inline const char *ng_status_str(ng_status s) {
    switch (s) {
    case NG_OK: return "ok";
    case NG_ERR_INVALID_ARG: return "invalid argument";
    case NG_ERR_DTYPE: return "unsupported dtype";
    case NG_ERR_ALLOC: return "out of host memory";
    case NG_ERR_CUDA: return "CUDA error";
    case NG_ERR_UNSUPPORTED: return "unsupported";
    }
    return "unknown status";
}

/* Propagate a non-OK status from an expression. */
#define NG_TRY(expr)                                                                               \
    do {                                                                                           \
        ng_status ng_try_s_ = (expr);                                                              \
        if (ng_try_s_ != NG_OK) return ng_try_s_;                                                  \
    } while (0)

/* Element types the kernels handle. The op layer maps PyTorch dtypes here. */
typedef enum ng_dtype {
    NG_F32 = 0,
    NG_F64 = 1,
    NG_F16 = 2,
    NG_BF16 = 3,
} ng_dtype;

static inline size_t ng_dtype_size(ng_dtype t) { return t == NG_F64 ? 8 : t == NG_F32 ? 4 : 2; }

static inline const char *ng_dtype_name(ng_dtype t) {
    switch (t) {
    case NG_F32: return "float32";
    case NG_F64: return "float64";
    case NG_F16: return "float16";
    case NG_BF16: return "bfloat16";
    }
    return "?";
}

/* ---- bit casts and 16-bit float conversions (host + device) ------------ */

NG_HD uint32_t ng_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

NG_HD float ng_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

NG_HD float ng_bf16_to_f32(uint16_t h) { return ng_bits_f32((uint32_t)h << 16); }

NG_HD uint16_t ng_f32_to_bf16(float f) {
    uint32_t u = ng_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

NG_HD float ng_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return ng_bits_f32(sign | 0x7f800000u | (man << 13)); /* inf / NaN */
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return ng_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

NG_HD uint16_t ng_f32_to_f16(float f) {
    uint32_t u = ng_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {
        /* result is subnormal or zero: round a * 2^24 to an integer, ties to even */
        float v = ng_bits_f32(a) * 16777216.0f;
        uint32_t r = (uint32_t)v;
        float frac = v - (float)r;
        if (frac > 0.5f || (frac == 0.5f && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    /* normal: rebias exponent, round mantissa from 23 to 10 bits, ties to even */
    uint32_t m = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (m >> 13));
}

/* Load element i of a buffer of dtype t as fp32 (fp64 buffers are narrowed:
 * callers that handle fp64 use ng_load_f64 instead). */
NG_HD float ng_load_f32(const void *p, ng_dtype t, int64_t i) {
    switch (t) {
    case NG_F32: return ((const float *)p)[i];
    case NG_F64: return (float)((const double *)p)[i];
    case NG_F16: return ng_f16_to_f32(((const uint16_t *)p)[i]);
    case NG_BF16: return ng_bf16_to_f32(((const uint16_t *)p)[i]);
    }
    return 0.0f;
}

NG_HD double ng_load_f64(const void *p, ng_dtype t, int64_t i) {
    return t == NG_F64 ? ((const double *)p)[i] : (double)ng_load_f32(p, t, i);
}

NG_HD void ng_store_f32(void *p, ng_dtype t, int64_t i, float v) {
    switch (t) {
    case NG_F32: ((float *)p)[i] = v; break;
    case NG_F64: ((double *)p)[i] = (double)v; break;
    case NG_F16: ((uint16_t *)p)[i] = ng_f32_to_f16(v); break;
    case NG_BF16: ((uint16_t *)p)[i] = ng_f32_to_bf16(v); break;
    }
}

NG_HD void ng_store_f64(void *p, ng_dtype t, int64_t i, double v) {
    if (t == NG_F64)
        ((double *)p)[i] = v;
    else
        ng_store_f32(p, t, i, (float)v);
}

/* ---- CPU parallelism ---------------------------------------------------
 * Kernels never create threads. The caller hands them a runner that splits
 * [0, n) into ranges and calls fn on each, possibly concurrently; the op
 * layer passes one backed by PyTorch's thread pool (torch_parallel_for), the
 * ctest suite passes NULL for a serial run. */
typedef void (*ng_range_fn)(int64_t begin, int64_t end, void *ctx);
typedef void (*ng_parallel_fn)(int64_t n, int64_t grain, ng_range_fn fn, void *ctx);

static inline void ng_parallel_run(ng_parallel_fn par, int64_t n, int64_t grain, ng_range_fn fn,
                                   void *ctx) {
    if (n <= 0) return;
    if (par)
        par(n, grain, fn, ctx);
    else
        fn(0, n, ctx);
}

#endif /* NG_KERNELS_COMMON_H */
