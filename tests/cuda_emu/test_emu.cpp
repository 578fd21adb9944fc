/*
 * tests/cuda_emu/test_emu.cpp - the CPU emulator of the CUDA execution model
 * tested on small kernels of its own: every intrinsic against its CUDA
 * definition, fp16 / bf16 conversions against independent references, and
 * every error the emulator must report (a launch over a GPU's limits, a
 * barrier only part of a block reaches, a warp mask naming an inactive lane,
 * a race) reported as an error, never a hang or a pass. ldmatrix and cp.async
 * (kernels/cuda_ptx.h) are checked against the PTX ISA's fragment layout and
 * commit-group rules.
 *
 * `test_emu --ptx` runs the ldmatrix / cp.async tests alone (the
 * cuda_emu_mutant_self_* tests run it on mutated copies of this file).
 *
 * Faults are sticky, as on a GPU; cudaDeviceReset clears them between cases.
 * Exit 0 when every check passed; the last line is "N passed, M failed".
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "kernels/attention_mma.h"

static int g_pass, g_fail;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            g_pass++;                                                                              \
        } else {                                                                                   \
            g_fail++;                                                                              \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                   \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

template <typename T>
static T *dalloc(size_t n) {
    void *p = nullptr;
    if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    return (T *)p;
}

template <typename T>
static std::vector<T> download(const T *d, size_t n) {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
}

/* ---- fp16 / bf16 conversions ------------------------------------------------ */

static uint16_t ref_f16(float f) { /* GCC's _Float16: IEEE round to nearest even */
    if (isnan(f)) return 0x7fff;   /* CUDA's canonical NaN */
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static uint16_t
ref_bf16(float f) { /* the nearer of the two bf16 neighbours, ties to even, in fp64 */
    if (isnan(f)) return 0x7fff;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    if (isinf(flo)) return (uint16_t)(lo >> 16);
    const double dl = fabs((double)f - (double)flo),
                 dh = isnan(fhi) ? INFINITY : fabs((double)fhi - (double)f);
    if (isinf(fhi) &&
        !isinf(f)) { /* above the largest finite bf16: inf only past the rounding midpoint */
        const double mid =
            fabs((double)flo) + 0.5 * ldexp(1.0, ((int)((lo >> 23) & 0xff) - 127) - 7);
        if (fabs((double)f) < fabs(mid) || (fabs((double)f) == fabs(mid) && !((lo >> 16) & 1u)))
            return (uint16_t)(lo >> 16);
        return (uint16_t)(hi >> 16);
    }
    if (dl < dh || (dl == dh && !((lo >> 16) & 1u))) return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

static void test_conversions() {
    int bad16 = 0, bad_back16 = 0, badbf = 0;
    for (uint32_t h = 0; h < 65536; h++) { /* fp16 -> fp32 exactly */
        _Float16 x;
        uint16_t hb = (uint16_t)h;
        memcpy(&x, &hb, 2);
        const float want = (float)x, got = __half2float(__half{hb});
        if (!(got == want || (isnan(got) && isnan(want)))) bad_back16++;
    }
    /* fp32 -> 16 bits: every float on a stride, plus every value near the
     * rounding boundaries of both formats */
    auto one = [&](uint32_t u) {
        float f;
        memcpy(&f, &u, 4);
        if (__float2half_rn(f).__x != ref_f16(f) && bad16++ < 5)
            fprintf(stderr, "  f16(%a): got 0x%04x want 0x%04x\n", f, __float2half_rn(f).__x,
                    ref_f16(f));
        if (__float2bfloat16_rn(f).__x != ref_bf16(f) && badbf++ < 5)
            fprintf(stderr, "  bf16(%a): got 0x%04x want 0x%04x\n", f, __float2bfloat16_rn(f).__x,
                    ref_bf16(f));
    };
    for (uint64_t u = 0; u < (1ull << 32); u += 4093) one((uint32_t)u);
    for (uint32_t e = 0; e < 256; e++)
        for (uint32_t m : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7fffu, 0x8000u,
                           0x8001u, 0x18000u, 0x7fffffu, 0x7ff000u, 0x7fe000u, 0x7fefffu})
            for (uint32_t s : {0u, 0x80000000u}) one(s | e << 23 | m);
    CHECK(bad_back16 == 0, "fp16 -> fp32: %d of 65536 differ", bad_back16);
    CHECK(bad16 == 0, "fp32 -> fp16: %d values differ from IEEE round-to-nearest-even", bad16);
    CHECK(badbf == 0, "fp32 -> bf16: %d values differ from round-to-nearest-even", badbf);
    CHECK(__float2half_rn(65519.99f).__x == 0x7bff && __float2half_rn(65520.0f).__x == 0x7c00,
          "fp16 overflow edge");
    CHECK(__floats2half2_rn(1.0f, 2.0f).x.__x == 0x3c00 &&
              __floats2half2_rn(1.0f, 2.0f).y.__x == 0x4000,
          "half2: low half first");
}

/* ---- warp intrinsics ------------------------------------------------------- */

static __global__ void warp_kernel(int *out, int width) {
    const int t = threadIdx.x, lane = t & 31;
    int *o = out + t * 8;
    o[0] = __shfl_xor_sync(0xffffffffu, t, 5, width);
    o[1] = __shfl_down_sync(0xffffffffu, t, 3, width);
    o[2] = __shfl_up_sync(0xffffffffu, t, 2, width);
    o[3] = __shfl_sync(0xffffffffu, t, 7, width);
    o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    o[5] = __any_sync(0xffffffffu, lane == 17);
    o[6] = __all_sync(0xffffffffu, lane < 31);
    o[7] = (int)(__shfl_xor_sync(0xffffffffu, (double)t + 0.5, 1) * 2); /* 64-bit values */
}

/* Half of the warp shuffles among itself with its own mask. */
static __global__ void half_warp_kernel(int *out) {
    const int lane = threadIdx.x & 31;
    if (lane < 16)
        out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, lane * 10, 1);
    else
        out[threadIdx.x] = -1;
}

static void test_warp() {
    for (int width : {32, 16, 8}) {
        int *d = dalloc<int>(64 * 8);
        NG_LAUNCH((warp_kernel), 1, 64, 0, 0, d, width);
        CHECK(cudaGetLastError() == cudaSuccess, "warp_kernel launch (width %d)", width);
        auto h = download(d, 64 * 8);
        int bad = 0;
        for (int t = 0; t < 64; t++) {
            const int lane = t & 31, seg = lane & ~(width - 1), base = t - lane;
            const int x = (lane ^ 5) < seg + width ? base + (lane ^ 5) : t;
            const int dn = lane + 3 < seg + width ? t + 3 : t;
            const int up = lane - 2 >= seg ? t - 2 : t;
            const int idx = base + seg + (7 & (width - 1));
            unsigned ballot = 0;
            for (int l = 0; l < 32; l++)
                if (l % 3 == 0) ballot |= 1u << l;
            const int want[8] = {x, dn, up, idx, (int)ballot, 1, 0, 2 * (t ^ 1) + 1};
            for (int k = 0; k < 8; k++)
                if (h[t * 8 + k] != want[k] && bad++ < 5)
                    fprintf(stderr, "  width %d thread %d op %d: got %d want %d\n", width, t, k,
                            h[t * 8 + k], want[k]);
        }
        CHECK(bad == 0, "warp intrinsics, width %d: %d results wrong", width, bad);
        cudaFree(d);
    }
    int *d = dalloc<int>(32);
    NG_LAUNCH((half_warp_kernel), 1, 32, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess, "half-warp mask launch");
    auto h = download(d, 32);
    int bad = 0;
    for (int l = 0; l < 32; l++) bad += h[l] != (l < 16 ? (l ^ 1) * 10 : -1);
    CHECK(bad == 0, "a half-warp mask: %d results wrong", bad);
    cudaFree(d);
}

/* ---- shared memory, barriers, atomics --------------------------------------- */

/* Block sum through static shared memory; every block its own data. */
static __global__ void block_sum_kernel(const float *x, float *out, unsigned long long *count) {
    NG_SHARED(float, part, [256]);
    part[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
    atomicAdd(count, 1ull);
}

/* __syncthreads_or twice per block: block b's thread (37 b) % 96 alone
 * sets the predicate in the first round (none in block 3), nobody in the
 * second; out[2 t] and out[2 t + 1] the two results of thread t. */
static __global__ void sync_or_kernel(int *out) {
    const int b = blockIdx.x, t = threadIdx.x;
    const int first = __syncthreads_or(b != 3 && t == (37 * b) % 96);
    const int second = __syncthreads_or(0);
    out[(b * 96 + t) * 2] = first;
    out[(b * 96 + t) * 2 + 1] = second;
}

/* Whether n bytes at p all hold the schedule's shared-memory poison. Not
 * seen by the race detector, to which reading unwritten shared memory is an
 * error. */
__attribute__((no_sanitize_thread)) static __device__ int poisoned(const void *p, size_t n) {
    const unsigned char *c = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++)
        if (c[i] != (unsigned char)ng_emu_shared_poison()) return 0;
    return 1;
}

/* Dynamic shared memory nobody wrote holds the poison (1 per thread). */
static __global__ void read_unwritten_kernel(uint32_t *out) {
    NG_DYNAMIC_SMEM(uint32_t, smem);
    out[threadIdx.x] = (uint32_t)poisoned(&smem[threadIdx.x], 4);
}

/* Static shared memory of a function template (where GCC ignores a section
 * attribute on a static): in the arena, poisoned at the start of every
 * block, although the block before wrote it (out[block] = 1 when so). */
template <typename T>
static __device__ int tmpl_shared_fresh() {
    NG_SHARED(T, s_val);
    NG_SHARED(T, s_arr, [3][5]);
    const int fresh = poisoned(&s_val, sizeof s_val) && poisoned(&s_arr, sizeof s_arr) &&
                      ng_emu_is_shared(&s_val, sizeof s_val) &&
                      ng_emu_is_shared(&s_arr, sizeof s_arr);
    __syncthreads();
    if (threadIdx.x == 0) {
        s_val = (T)(blockIdx.x + 1);
        for (int i = 0; i < 15; i++) s_arr[i / 5][i % 5] = (T)i;
    }
    return fresh;
}
template <typename T>
static __global__ void tmpl_shared_kernel(int *out) {
    const int fresh = tmpl_shared_fresh<T>();
    if (threadIdx.x == 0) out[blockIdx.x] = fresh;
}

/* gg_apply_kernel's pattern without its barrier: thread 0 writes a template
 * __shared__ the block then reads; the value read before the write is the
 * poison, which differs between the schedules. */
template <typename T>
static __global__ void tmpl_read_before_write_kernel(T *out) {
    NG_SHARED(T, s_coef);
    if (threadIdx.x == 0) s_coef = (T)2;
    /* __syncthreads() missing */
    out[blockIdx.x * blockDim.x + threadIdx.x] = s_coef;
}

/* tensor_stats' pattern with a read one slot too far: an unsigned min over
 * per-warp partials that also reads an unwritten slot. 0xff bytes are the
 * identity of the min, so only the second poison (0x00) changes the result. */
static __global__ void identity_read_kernel(unsigned long long *out) {
    NG_SHARED(unsigned long long, s_min, [32]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) s_min[warp] = 1000u + (unsigned)warp;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long mn = ~0ull;
        for (int w = 0; w <= nwarps; w++) mn = s_min[w] < mn ? s_min[w] : mn; /* <=: one too far */
        out[blockIdx.x] = mn;
    }
}

/* layernorm's block_sum called twice without its write-after-read barrier:
 * the second call's write of red[warp] may land before a slower warp has read
 * red in the first call. Five shuffles separate the two in every warp, so
 * warps that advance in lockstep (one warp intrinsic each per sweep) never
 * see it; warps that run independently do. */
static __device__ float lockstep_hidden_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    /* __syncthreads() missing: red may still be read from the previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < nwarps; w++) s += red[w];
    return s;
}
static __global__ void lockstep_hidden_kernel(const float *x, float *out) {
    NG_SHARED(float, red, [32]);
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const float a = lockstep_hidden_sum(v, red);
    const float b = lockstep_hidden_sum(v * v, red);
    out[blockIdx.x * blockDim.x + threadIdx.x] = a + b;
}
/* The same with the barrier: correct under every schedule. */
static __device__ float fixed_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < nwarps; w++) s += red[w];
    return s;
}
static __global__ void fixed_sum_kernel(const float *x, float *out) {
    NG_SHARED(float, red, [32]);
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const float a = fixed_sum(v, red);
    const float b = fixed_sum(v * v, red);
    out[blockIdx.x * blockDim.x + threadIdx.x] = a + b;
}

static __global__ void index_kernel(int *out) {
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    out[b * blockDim.x * blockDim.y * blockDim.z + t] = b * 1000 + t;
}

static void test_shared() {
    const int nb = 7;
    std::vector<float> hx(nb * 256);
    for (size_t i = 0; i < hx.size(); i++) hx[i] = (float)(i % 97);
    float *x = dalloc<float>(hx.size()), *out = dalloc<float>(nb);
    unsigned long long *count = dalloc<unsigned long long>(1);
    cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(count, 0, 8);
    NG_LAUNCH((block_sum_kernel), nb, 256, 0, 0, x, out, count);
    CHECK(cudaGetLastError() == cudaSuccess, "block_sum_kernel launch");
    auto h = download(out, nb);
    for (int b = 0; b < nb; b++) {
        double want = 0;
        for (int i = 0; i < 256; i++) want += hx[b * 256 + i];
        CHECK(h[b] == (float)want, "block %d sum %g, want %g", b, h[b], want);
    }
    CHECK(download(count, 1)[0] == (unsigned long long)nb * 256, "atomicAdd count %llu",
          download(count, 1)[0]);

    uint32_t *u = dalloc<uint32_t>(64);
    NG_LAUNCH((read_unwritten_kernel), 1, 64, 64 * 4, 0, u);
    CHECK(cudaGetLastError() == cudaSuccess, "read_unwritten_kernel launch");
    auto hu = download(u, 64);
    int npoisoned = 0;
    for (uint32_t v : hu) npoisoned += v == 1u;
    CHECK(npoisoned == 64, "unwritten dynamic shared memory holds the poison (%d of 64)",
          npoisoned);

    int *fresh = dalloc<int>(5);
    NG_LAUNCH((tmpl_shared_kernel<double>), 5, 64, 0, 0, fresh);
    NG_LAUNCH((tmpl_shared_kernel<short>), 5, 64, 0, 0, fresh);
    CHECK(cudaGetLastError() == cudaSuccess, "tmpl_shared_kernel launches");
    auto hf = download(fresh, 5);
    int nfresh = 0;
    for (int v : hf) nfresh += v == 1;
    CHECK(
        nfresh == 5,
        "a function template's NG_SHARED variables are in the arena and poisoned before every block (%d of 5)",
        nfresh);
    cudaFree(fresh);

    float *sx = dalloc<float>(6 * 256), *so = dalloc<float>(6 * 256);
    std::vector<float> hsx(6 * 256);
    for (size_t i = 0; i < hsx.size(); i++) hsx[i] = (float)(i % 13) - 6.0f;
    cudaMemcpy(sx, hsx.data(), hsx.size() * 4, cudaMemcpyHostToDevice);
    NG_LAUNCH((fixed_sum_kernel), 6, 256, 0, 0, sx, so);
    CHECK(cudaGetLastError() == cudaSuccess, "two block sums with their barriers pass");
    cudaFree(sx), cudaFree(so);

    int *sor = dalloc<int>(5 * 96 * 2);
    NG_LAUNCH((sync_or_kernel), 5, 96, 0, 0, sor);
    CHECK(cudaGetLastError() == cudaSuccess, "sync_or_kernel launch");
    auto hs = download(sor, 5 * 96 * 2);
    int bad_or = 0;
    for (int b = 0; b < 5; b++)
        for (int t = 0; t < 96; t++)
            bad_or += hs[(b * 96 + t) * 2] != (b != 3) || hs[(b * 96 + t) * 2 + 1] != 0;
    CHECK(bad_or == 0, "__syncthreads_or: %d of 960 results wrong", bad_or);
    cudaFree(sor);

    int *idx = dalloc<int>(3 * 2 * 2 * 4 * 3 * 2);
    NG_LAUNCH((index_kernel), dim3(3, 2, 2), dim3(4, 3, 2), 0, 0, idx);
    auto hi = download(idx, 3 * 2 * 2 * 4 * 3 * 2);
    int bad = 0;
    for (int b = 0; b < 12; b++)
        for (int t = 0; t < 24; t++) bad += hi[b * 24 + t] != b * 1000 + t;
    CHECK(bad == 0, "threadIdx / blockIdx / blockDim / gridDim in 3-d: %d wrong", bad);
    cudaFree(x), cudaFree(out), cudaFree(count), cudaFree(u), cudaFree(idx);
}

/* ---- mma.sync --------------------------------------------------------------- */

static __global__ void mma_kernel(const uint16_t *A, const uint16_t *B, float *D, int bf16) {
    /* fragments by the PTX ISA tables, written out element by element */
    const int l = threadIdx.x, g = l >> 2, t = l & 3;
    uint32_t a[4], b[2];
    float c[4];
    for (int r = 0; r < 4; r++) {
        const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
        a[r] = (uint32_t)A[row * 16 + col] | (uint32_t)A[row * 16 + col + 1] << 16;
    }
    for (int r = 0; r < 2; r++) {
        const int k = 2 * t + 8 * r;
        b[r] = (uint32_t)B[k * 8 + g] | (uint32_t)B[(k + 1) * 8 + g] << 16;
    }
    for (int i = 0; i < 4; i++) c[i] = 0.25f * (float)i;
    NG_EMU_MMA_M16N8K16(bf16, c, a, b);
    for (int i = 0; i < 4; i++) D[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = c[i];
}

static void test_mma() {
    for (int bf16 = 0; bf16 < 2; bf16++) {
        uint16_t hA[256], hB[128];
        float fA[256], fB[128];
        for (int i = 0; i < 256; i++) {
            fA[i] = (float)((i * 7) % 13 - 6);
            hA[i] = bf16 ? __float2bfloat16_rn(fA[i]).__x : __float2half_rn(fA[i]).__x;
        }
        for (int i = 0; i < 128; i++) {
            fB[i] = (float)((i * 5) % 11 - 5) * 0.5f;
            hB[i] = bf16 ? __float2bfloat16_rn(fB[i]).__x : __float2half_rn(fB[i]).__x;
        }
        uint16_t *A = dalloc<uint16_t>(256), *B = dalloc<uint16_t>(128);
        float *D = dalloc<float>(128);
        cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice);
        cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice);
        NG_LAUNCH((mma_kernel), 1, 32, 0, 0, A, B, D, bf16);
        CHECK(cudaGetLastError() == cudaSuccess, "mma launch");
        auto h = download(D, 128);
        int bad = 0;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 8; n++) {
                double s = 0.25 * ((r >= 8) * 2 + (n & 1)); /* the c[i] each lane put there */
                for (int k = 0; k < 16; k++) s += (double)fA[r * 16 + k] * fB[k * 8 + n];
                bad += h[r * 8 + n] != (float)s;
            }
        CHECK(bad == 0, "mma.m16n8k16 %s: %d of 128 results differ from A B + C",
              bf16 ? "bf16" : "f16", bad);
        cudaFree(A), cudaFree(B), cudaFree(D);
    }
}

static void expect_refused(cudaError_t want, const char *what) {
    const cudaError_t got = cudaGetLastError();
    CHECK(got == want, "%s: got %s, want %s", what, cudaGetErrorName(got), cudaGetErrorName(want));
}

static void expect_fault(const char *what) {
    const cudaError_t got = cudaGetLastError();
    CHECK(got == cudaErrorLaunchFailure, "%s: got %s, want cudaErrorLaunchFailure", what,
          cudaGetErrorName(got));
    CHECK(cudaMemset(nullptr, 0, 0) == cudaErrorLaunchFailure, "%s: the fault is sticky", what);
    cudaDeviceReset();
}

/* ---- ldmatrix ---------------------------------------------------------------- */

/* A 16 x 16 tile of 16-bit elements, rows kLdTile elements apart (a 16-byte
 * pad, as the attention kernels use), copied to shared memory; matrix m of
 * the ldmatrix is its 8 x 8 quarter at rows 8 (m & 1), cols 8 (m >> 1) (the
 * order of the mma A fragment's registers). Lanes whose address the form
 * does not use pass a misaligned global one, which must be ignored. */
static const int kLdTile = 24;
template <int N, bool Trans>
static __global__ void ldmatrix_kernel(const uint16_t *src, uint32_t *out) {
    NG_SHARED(uint16_t, tile, [16 * kLdTile]);
    const int l = threadIdx.x, m = l >> 3, r = l & 7;
    for (int i = l; i < 16 * kLdTile; i += 32) tile[i] = src[i];
    __syncwarp(0xffffffffu);
    const void *row = m < N ? (const void *)&tile[(8 * (m & 1) + r) * kLdTile + 8 * (m >> 1)]
                            : (const void *)(src + 1);
    uint32_t reg[4] = {0, 0, 0, 0};
    ng_ldmatrix<N, Trans>(reg, row);
    for (int i = 0; i < 4; i++) out[l * 4 + i] = reg[i];
}

template <int N, bool Trans>
static void check_ldmatrix(const uint16_t *dsrc, const uint16_t *hsrc) {
    const char *form = Trans ? ".trans" : "";
    uint32_t *out = dalloc<uint32_t>(32 * 4);
    NG_LAUNCH((ldmatrix_kernel<N, Trans>), 1, 32, 0, 0, dsrc, out);
    CHECK(cudaGetLastError() == cudaSuccess, "ldmatrix.x%d%s launch", N, form);
    const std::vector<uint32_t> h = download(out, 32 * 4);
    int bad = 0;
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int m = 0; m < 4; m++) {
            /* the PTX ISA's layout, element by element */
            const uint16_t *q = hsrc + 8 * (m & 1) * kLdTile + 8 * (m >> 1);
            const uint32_t lo = Trans ? q[2 * t * kLdTile + g] : q[g * kLdTile + 2 * t],
                           hi = Trans ? q[(2 * t + 1) * kLdTile + g] : q[g * kLdTile + 2 * t + 1];
            const uint32_t want = m < N ? lo | hi << 16 : 0u;
            if (h[l * 4 + m] != want && bad++ < 5)
                fprintf(stderr, "  ldmatrix.x%d%s lane %d reg %d: got 0x%08x want 0x%08x\n", N,
                        form, l, m, h[l * 4 + m], want);
        }
    }
    CHECK(bad == 0, "ldmatrix.x%d%s: %d registers differ from the PTX ISA's fragment layout", N,
          form, bad);
    /* the fragments the mma kernels load element by element (attention_mma.h) */
    if (N == 4 && !Trans) {
        int bad_a = 0;
        for (int l = 0; l < 32; l++) {
            uint32_t a[4];
            ng_mma_frag_a(a, hsrc, kLdTile, 0, 0, l);
            for (int i = 0; i < 4; i++) bad_a += h[l * 4 + i] != a[i];
        }
        CHECK(bad_a == 0, "ldmatrix.x4 = ng_mma_frag_a: %d registers differ", bad_a);
    }
    if (N == 2 && Trans) {
        int bad_b = 0;
        for (int l = 0; l < 32; l++) {
            uint32_t b[2];
            ng_mma_frag_b_cols(b, hsrc, kLdTile, 0, 0, l);
            for (int i = 0; i < 2; i++) bad_b += h[l * 4 + i] != b[i];
        }
        CHECK(bad_b == 0, "ldmatrix.x2.trans = ng_mma_frag_b_cols: %d registers differ", bad_b);
    }
    cudaFree(out);
}

/* Misuse the emulator must report: a row address off its 16-byte alignment,
 * one in global memory, a warp with a lane missing. */
static __global__ void ldmatrix_misaligned_kernel(uint32_t *out) {
    NG_SHARED(uint16_t, rows, [32 * 8 + 8]);
    const int l = threadIdx.x;
    for (int i = 0; i < 8; i++) rows[l * 8 + i] = (uint16_t)i;
    __syncwarp(0xffffffffu);
    uint32_t r[1];
    ng_ldmatrix<1>(r, &rows[l * 8 + (l == 3)]); /* lane 3: 2 bytes off */
    out[l] = r[0];
}
static __global__ void ldmatrix_global_kernel(const uint16_t *src, uint32_t *out) {
    uint32_t r[2];
    ng_ldmatrix<2>(r, src + 8 * threadIdx.x);
    out[threadIdx.x] = r[0];
}
static __global__ void ldmatrix_exited_kernel(uint32_t *out) {
    NG_SHARED(uint16_t, rows, [32 * 8]);
    const int l = threadIdx.x;
    for (int i = 0; i < 8; i++) rows[l * 8 + i] = (uint16_t)i;
    __syncwarp(0xffffffffu);
    if (l == 30) return;
    uint32_t r[4];
    ng_ldmatrix<4, true>(r, &rows[l * 8]);
    out[l] = r[0];
}

/* Lane l writes row l; the block's lanes 24..31 do not exist. */
static __global__ void ldmatrix_rows_kernel(uint32_t *out, int skip_row) {
    NG_SHARED(uint16_t, rows, [32 * 8]);
    const int l = threadIdx.x;
    if (l != skip_row)
        for (int i = 0; i < 8; i++) rows[l * 8 + i] = (uint16_t)(l * 8 + i);
    __syncthreads();
    uint32_t r[1];
    ng_ldmatrix<1>(r, &rows[l * 8]);
    out[l] = r[0];
}
/* Warp 1 writes the matrix warp 0 loads, with no __syncthreads between. */
static __global__ void ldmatrix_race_kernel(uint32_t *out) {
    NG_SHARED(uint16_t, rows, [8 * 8]);
    const int l = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (w == 1 && l < 8)
        for (int i = 0; i < 8; i++) rows[l * 8 + i] = (uint16_t)(l * 8 + i + 1);
    /* __syncthreads() missing */
    uint32_t r[1];
    ng_ldmatrix<1>(r, &rows[(l & 7) * 8]);
    out[threadIdx.x] = r[0];
}

/* The mma kernels' ldmatrix fragment loaders (attention_mma.h) against
 * their scalar counterparts, on a 32 x 32 tile (kLdFrag apart) at offsets
 * that exercise every term of the row addresses. */
static const int kLdFrag = 40;
static __global__ void ldmatrix_frag_kernel(const uint16_t *src, uint32_t *out) {
    NG_SHARED(uint16_t, tile, [32 * kLdFrag]);
    const int l = threadIdx.x;
    for (int i = l; i < 32 * kLdFrag; i += 32) tile[i] = src[i];
    __syncwarp(0xffffffffu);
    uint32_t *o = out + 12 * l;
    ng_mma_ldm_a(o, tile, kLdFrag, 16, 8, l);
    ng_mma_ldm_b_rows2(o + 4, o + 6, tile, kLdFrag, 8, 16, l);
    ng_mma_ldm_b_cols2(o + 8, o + 10, tile, kLdFrag, 16, 8, l);
}

static void test_ldmatrix_frags() {
    uint16_t hsrc[32 * kLdFrag];
    for (int i = 0; i < 32 * kLdFrag; i++) hsrc[i] = (uint16_t)(0x2000 + 5 * i);
    uint16_t *dsrc = dalloc<uint16_t>(32 * kLdFrag);
    uint32_t *out = dalloc<uint32_t>(32 * 12);
    cudaMemcpy(dsrc, hsrc, sizeof hsrc, cudaMemcpyHostToDevice);
    NG_LAUNCH((ldmatrix_frag_kernel), 1, 32, 0, 0, dsrc, out);
    CHECK(cudaGetLastError() == cudaSuccess, "ldmatrix fragment loaders launch");
    const std::vector<uint32_t> h = download(out, 32 * 12);
    int bad = 0;
    for (int l = 0; l < 32; l++) {
        uint32_t want[12];
        ng_mma_frag_a(want, hsrc, kLdFrag, 16, 8, l);
        ng_mma_frag_b_rows(want + 4, hsrc, kLdFrag, 8, 16, l);
        ng_mma_frag_b_rows(want + 6, hsrc, kLdFrag, 16, 16, l);
        ng_mma_frag_b_cols(want + 8, hsrc, kLdFrag, 16, 8, l);
        ng_mma_frag_b_cols(want + 10, hsrc, kLdFrag, 16, 16, l);
        for (int i = 0; i < 12; i++) bad += h[12 * l + i] != want[i];
    }
    CHECK(bad == 0, "ng_mma_ldm_a / _b_rows2 / _b_cols2 = ng_mma_frag_*: %d registers differ", bad);
    cudaFree(out);
    cudaFree(dsrc);
}

static void test_ldmatrix() {
    uint16_t hsrc[16 * kLdTile];
    for (int i = 0; i < 16 * kLdTile; i++) hsrc[i] = (uint16_t)(0x1000 + 7 * i); /* all distinct */
    uint16_t *dsrc = dalloc<uint16_t>(16 * kLdTile);
    cudaMemcpy(dsrc, hsrc, sizeof hsrc, cudaMemcpyHostToDevice);
    check_ldmatrix<1, false>(dsrc, hsrc);
    check_ldmatrix<2, false>(dsrc, hsrc);
    check_ldmatrix<4, false>(dsrc, hsrc);
    check_ldmatrix<1, true>(dsrc, hsrc);
    check_ldmatrix<2, true>(dsrc, hsrc);
    check_ldmatrix<4, true>(dsrc, hsrc);
    cudaFree(dsrc);
    test_ldmatrix_frags();
}

static void test_ldmatrix_faults() {
    uint32_t *out = dalloc<uint32_t>(32);
    NG_LAUNCH((ldmatrix_misaligned_kernel), 1, 32, 0, 0, out);
    expect_fault("ldmatrix: a row address not 16-byte aligned");
    uint16_t *src = dalloc<uint16_t>(32 * 8);
    out = dalloc<uint32_t>(32);
    cudaMemset(src, 0, 32 * 8 * 2);
    NG_LAUNCH((ldmatrix_global_kernel), 1, 32, 0, 0, src, out);
    expect_fault("ldmatrix: a row address in global memory");
    out = dalloc<uint32_t>(32);
    NG_LAUNCH((ldmatrix_exited_kernel), 1, 32, 0, 0, out);
    expect_fault("ldmatrix: a lane of the warp has exited");
    out = dalloc<uint32_t>(32);
    NG_LAUNCH((ldmatrix_rows_kernel), 1, 24, 0, 0, out, -1);
    expect_fault("ldmatrix in a warp of 24 threads");
    out = dalloc<uint32_t>(32);
    NG_LAUNCH((ldmatrix_rows_kernel), 1, 32, 0, 0, out, -1);
    CHECK(cudaGetLastError() == cudaSuccess, "ldmatrix of rows the lanes wrote");
    out = dalloc<uint32_t>(32);
    NG_LAUNCH((ldmatrix_rows_kernel), 1, 32, 0, 0, out, 5);
    expect_fault("ldmatrix of a row no thread wrote");
    out = dalloc<uint32_t>(64);
    NG_LAUNCH((ldmatrix_race_kernel), 1, 64, 0, 0, out);
    expect_fault("ldmatrix of rows another warp writes with no barrier between");
}

/* ---- cp.async ---------------------------------------------------------------- */

/* A two-stage pipeline: tiles of 256 floats through two shared buffers, 64
 * threads each copying 16 bytes of a tile (cp.async.cg, or .ca as two 8-byte
 * copies for tile 0) while the block works on the tile before; each thread
 * then reads words another warp copied. wait_group 1 lands all but the tile
 * just issued (this thread's part), the barrier after it everyone's; the
 * barrier at the end of an iteration keeps the next copy off a stage still
 * being read. */
static __global__ void cp_async_pipeline_kernel(const float *x, float *y, int ntiles) {
    NG_SHARED(float, buf, [2][256]);
    const int t = threadIdx.x;
    ng_cp_async_ca<8>(&buf[0][4 * t], x + 4 * t);
    ng_cp_async_ca<8>(&buf[0][4 * t + 2], x + 4 * t + 2);
    ng_cp_async_commit();
    for (int i = 0; i < ntiles; i++) {
        const int s = i & 1;
        if (i + 1 < ntiles) {
            const float *src = x + (i + 1) * 256 + 4 * t;
            if (i & 1)
                ng_cp_async_ca<16>(&buf[s ^ 1][4 * t], src);
            else
                ng_cp_async_cg16(&buf[s ^ 1][4 * t], src);
        }
        ng_cp_async_commit(); /* an empty group after the last tile */
        ng_cp_async_wait_group<1>();
        __syncthreads();
        for (int k = 0; k < 4; k++) {
            const int j = (4 * t + k + 128) % 256; /* a word of the other warp's */
            y[i * 256 + j] = buf[s][j] * 2.0f + 1.0f;
        }
        __syncthreads();
    }
    ng_cp_async_wait_all();
}

/* One thread's view, group by group: a copy's destination keeps what it held
 * until the wait that retires the copy's group. out[8 t + k]: 7 = the old
 * value, else the copied word. */
static __global__ void cp_async_groups_kernel(const uint32_t *x, uint32_t *out) {
    NG_SHARED(uint32_t, s, [32][4]);
    const int t = threadIdx.x;
    for (int k = 0; k < 4; k++) s[t][k] = 7;
    ng_cp_async_ca<4>(&s[t][0], x + 4 * t); /* group 0 */
    ng_cp_async_commit();
    ng_cp_async_ca<4>(&s[t][1], x + 4 * t + 1); /* group 1 */
    ng_cp_async_commit();
    ng_cp_async_ca<8>(&s[t][2], x + 4 * t + 2); /* not committed yet */
    uint32_t *o = out + 8 * t;
    o[0] = s[t][0], o[1] = s[t][1];
    ng_cp_async_wait_group<1>(); /* group 0 lands */
    o[2] = s[t][0], o[3] = s[t][1];
    ng_cp_async_wait_group<0>(); /* group 1 lands; the uncommitted copy does not */
    o[4] = s[t][1], o[5] = s[t][2];
    ng_cp_async_wait_all(); /* commits it and lands it */
    o[6] = s[t][2], o[7] = s[t][3];
}

/* Misuse: copies never committed or never waited for, a destination in
 * global memory, a source in shared memory, a misaligned copy. */
static __global__ void cp_async_misuse_kernel(const float *x, float *y, int how) {
    NG_SHARED(float, buf, [64 * 4]);
    const int t = threadIdx.x;
    switch (how) {
    case 0: ng_cp_async_cg16(&buf[4 * t], x + 4 * t); break; /* never committed */
    case 1:
        ng_cp_async_cg16(&buf[4 * t], x + 4 * t);
        ng_cp_async_commit(); /* never waited for */
        break;
    case 2: ng_cp_async_cg16(y + 4 * t, x + 4 * t); break;
    case 3:
        buf[4 * t] = 1.0f;
        __syncthreads();
        ng_cp_async_ca<4>(&buf[4 * t + 1], &buf[4 * ((t + 1) % 64)]);
        break;
    case 4: ng_cp_async_ca<8>(&buf[4 * t + 1], x + 4 * t + 1); break;
    }
    if (how >= 2) ng_cp_async_wait_all();
    y[t] = 0.0f;
}

/* Each thread's own wait, then a read of words the other warp copied, with
 * no barrier after that warp's wait: a race, as on a GPU. one_way: only
 * warp 1 reads (warp 0's words), so that in the first schedule warp 0 has
 * waited first and the race detector sees the copy's store, by warp 0's
 * thread at its wait, before warp 1's read. */
static __global__ void cp_async_nobarrier_kernel(const float *x, float *y, int one_way) {
    NG_SHARED(float, buf, [256]);
    const int t = threadIdx.x;
    ng_cp_async_cg16(&buf[4 * t], x + 4 * t);
    ng_cp_async_wait_all();
    /* __syncthreads() missing */
    y[t] = !one_way || t >= 32 ? buf[(4 * t + 128) % 256] : 0.0f;
}

static void test_cp_async() {
    const int ntiles = 5;
    std::vector<float> hx(ntiles * 256);
    for (size_t i = 0; i < hx.size(); i++) hx[i] = (float)i * 0.25f - 100.0f;
    float *x = dalloc<float>(hx.size()), *y = dalloc<float>(hx.size());
    cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice);
    NG_LAUNCH((cp_async_pipeline_kernel), 1, 64, 0, 0, (const float *)x, y, ntiles);
    CHECK(cudaGetLastError() == cudaSuccess, "the cp.async pipeline's launch");
    const std::vector<float> hy = download(y, hx.size());
    int bad = 0;
    for (size_t i = 0; i < hx.size(); i++)
        if (hy[i] != hx[i] * 2.0f + 1.0f && bad++ < 5)
            fprintf(stderr, "  pipeline y[%zu] = %g, want %g\n", i, hy[i], hx[i] * 2.0f + 1.0f);
    CHECK(bad == 0, "a two-stage cp.async pipeline reproduces the array: %d of %zu wrong", bad,
          hx.size());
    cudaFree(x), cudaFree(y);

    std::vector<uint32_t> hs(128);
    for (int i = 0; i < 128; i++) hs[i] = 1000u + (uint32_t)i;
    uint32_t *s = dalloc<uint32_t>(128), *o = dalloc<uint32_t>(256);
    cudaMemcpy(s, hs.data(), 128 * 4, cudaMemcpyHostToDevice);
    NG_LAUNCH((cp_async_groups_kernel), 1, 32, 0, 0, (const uint32_t *)s, o);
    CHECK(cudaGetLastError() == cudaSuccess, "cp_async_groups_kernel launch");
    const std::vector<uint32_t> ho = download(o, 256);
    int bad_g = 0;
    for (int t = 0; t < 32; t++) {
        const uint32_t c = 1000u + 4u * (uint32_t)t;
        const uint32_t want[8] = {7, 7, c, 7, c + 1, 7, c + 2, c + 3};
        for (int k = 0; k < 8; k++)
            if (ho[8 * t + k] != want[k] && bad_g++ < 5)
                fprintf(stderr, "  cp.async groups: thread %d step %d: %u, want %u\n", t, k,
                        ho[8 * t + k], want[k]);
    }
    CHECK(bad_g == 0, "cp.async lands a group at the wait that retires it: %d wrong", bad_g);
    cudaFree(s), cudaFree(o);
}

static void test_cp_async_faults() {
    static const char *const what[5] = {"cp.async never committed at the thread's end",
                                        "cp.async never waited for", "cp.async to global memory",
                                        "cp.async from shared memory", "cp.async misaligned"};
    for (int how = 0; how < 5; how++) {
        float *x = dalloc<float>(256), *y = dalloc<float>(256);
        cudaMemset(x, 0, 1024);
        NG_LAUNCH((cp_async_misuse_kernel), 1, 64, 0, 0, (const float *)x, y, how);
        expect_fault(what[how]);
    }
    float *x = dalloc<float>(256), *y = dalloc<float>(64);
    cudaMemset(x, 0x41, 1024);
    NG_LAUNCH((cp_async_nobarrier_kernel), 1, 64, 0, 0, (const float *)x, y, 0);
    expect_fault("a read of another warp's cp.async data after its wait but no barrier");
    const char *rc = getenv("NG_EMU_RACECHECK");
    if (ng_emu_racecheck() && !(rc && strcmp(rc, "0") == 0)) {
        x = dalloc<float>(256), y = dalloc<float>(64);
        cudaMemset(x, 0x41, 1024);
        NG_LAUNCH((cp_async_nobarrier_kernel), 1, 64, 0, 0, (const float *)x, y, 1);
        expect_fault("the race detector: a read after another warp's cp.async wait, no barrier");
    }
}

/* ---- limits and faults ----------------------------------------------------- */

static __global__ void empty_kernel(int) {}

struct big_param {
    char bytes[32768];
};
static __global__ void big_param_kernel(big_param) {}

static __global__ void dyn_smem_kernel(float *out) {
    NG_DYNAMIC_SMEM(float, smem);
    smem[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = smem[threadIdx.x];
}

static __global__ void partial_barrier_kernel(int *out) {
    if (threadIdx.x >= 40) return; /* part of the block leaves */
    __syncthreads();
    out[threadIdx.x] = 1;
}

static __global__ void exited_lane_kernel(int *out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static __global__ void own_mask_kernel(int *out) {
    out[threadIdx.x] =
        __shfl_xor_sync(0x0000fffeu, (int)threadIdx.x, 1); /* lane 0 calls with a mask without it */
}

static __global__ void race_kernel(int *out) {
    NG_SHARED(int, cell, [64]);
    cell[threadIdx.x] = (int)threadIdx.x;
    /* no __syncthreads: the neighbour's cell may not be written yet */
    out[threadIdx.x] = cell[(threadIdx.x + 33) % 64];
}

static __global__ void warp_waits_for_barrier_kernel(int *out) {
    if (threadIdx.x == 5)
        __syncthreads();
    else
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}

#ifdef NG_EMU_RACECHECK
/* A write-after-read race whose results coincide: every thread reads cell,
 * then thread 32 (warp 1) overwrites it, with no barrier between; a thread
 * of warp 0 may read either value, and keeps only whether it is positive.
 * Both schedules compute the same results; only the race detector sees it,
 * and names both sites. */
static const int kRaceReadLine = __LINE__ + 6;
static const int kRaceWriteLine = __LINE__ + 6;
static __global__ void same_value_race_kernel(int *out) {
    NG_SHARED(int, cell);
    if (threadIdx.x == 0) cell = 7;
    __syncthreads();
    const int v = cell;
    if (threadIdx.x == 32) cell = 8;
    out[threadIdx.x] = v > 0;
}

/* Stores that leave shared memory as it was are not races: a flag set by
 * every thread that sees a key (many warps, one epoch), and cleared when it
 * is already clear while slower warps still read it (the decode kernel's
 * mask-skip flag). */
static __global__ void flag_kernel(const int *x, int *out) {
    NG_SHARED(int, any);
    for (int it = 0; it < 3; it++) {
        if (threadIdx.x == 0) any = 0;
        __syncthreads();
        if (x[it * blockDim.x + threadIdx.x] > 0) any = 1;
        __syncthreads();
        if (!any) continue;
        if (threadIdx.x == 0) out[it] = 1;
        __syncthreads();
    }
}
#endif

static __global__ void oob_kernel(float *x, int n) {
    x[threadIdx.x + n + 16384] = 1.0f; /* 64 KiB past the end */
}

static void test_limits() {
    NG_LAUNCH((empty_kernel), 1, 1025, 0, 0, 0);
    expect_refused(cudaErrorInvalidConfiguration, "1025 threads per block");
    NG_LAUNCH((empty_kernel), 1, dim3(1, 1, 65), 0, 0, 0);
    expect_refused(cudaErrorInvalidConfiguration, "blockDim.z 65");
    NG_LAUNCH((empty_kernel), dim3(1, 65536), 1, 0, 0, 0);
    expect_refused(cudaErrorInvalidConfiguration, "gridDim.y 65536");
    NG_LAUNCH((empty_kernel), dim3(1, 1, 65536), 1, 0, 0, 0);
    expect_refused(cudaErrorInvalidConfiguration, "gridDim.z 65536");
    NG_LAUNCH((empty_kernel), dim3(1, 65535, 1), 1, 0, 0, 0);
    expect_refused(cudaSuccess, "gridDim.y 65535 is allowed");
    NG_LAUNCH((big_param_kernel), 1, 1, 0, 0, big_param{});
    expect_refused(cudaErrorInvalidValue, "32768 bytes of parameters");

    float *out = dalloc<float>(64);
    NG_LAUNCH((dyn_smem_kernel), 1, 64, 49 * 1024, 0, out);
    expect_refused(cudaErrorInvalidValue, "49 KiB of dynamic shared memory without the attribute");
    CHECK(cudaFuncSetAttribute(dyn_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               228 * 1024) == cudaErrorInvalidValue,
          "the attribute above 227 KiB is refused");
    (void)cudaGetLastError();
    CHECK(cudaFuncSetAttribute(dyn_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               100 * 1024) == cudaSuccess,
          "the attribute at 100 KiB");
    NG_LAUNCH((dyn_smem_kernel), 1, 64, 100 * 1024, 0, out);
    expect_refused(cudaSuccess, "100 KiB of dynamic shared memory after the attribute");
    cudaFree(out);
}

static void test_faults() {
    int *out = dalloc<int>(64);
    NG_LAUNCH((partial_barrier_kernel), 1, 64, 0, 0, out);
    expect_fault("a __syncthreads part of the block never reaches");
    out = dalloc<int>(64);
    NG_LAUNCH((exited_lane_kernel), 1, 32, 0, 0, out);
    expect_fault("a shuffle mask naming an exited lane");
    out = dalloc<int>(64);
    NG_LAUNCH((exited_lane_kernel), 1, 20, 0, 0, out);
    expect_fault("a full mask in a warp of 20 threads");
    out = dalloc<int>(64);
    NG_LAUNCH((own_mask_kernel), 1, 32, 0, 0, out);
    expect_fault("a lane outside its own mask");
    out = dalloc<int>(64);
    NG_LAUNCH((race_kernel), 1, 64, 0, 0, out);
    expect_fault("a missing barrier (the two schedules disagree)");
    float *d = dalloc<float>(4 * 256);
    std::vector<float> hd(4 * 256);
    for (size_t i = 0; i < hd.size(); i++) hd[i] = (float)(i % 7);
    cudaMemcpy(d, hd.data(), hd.size() * 4, cudaMemcpyHostToDevice);
    float *o = dalloc<float>(4 * 256);
    NG_LAUNCH((lockstep_hidden_kernel), 4, 256, 0, 0, d, o);
    expect_fault("a missing barrier that warps in lockstep would hide");
    double *dd = dalloc<double>(64);
    NG_LAUNCH((tmpl_read_before_write_kernel<double>), 1, 64, 0, 0, dd);
    expect_fault("a function template's __shared__ read before thread 0 writes it");
    unsigned long long *mn = dalloc<unsigned long long>(2);
    NG_LAUNCH((identity_read_kernel), 2, 128, 0, 0, mn);
    expect_fault("an unsigned min reading an unwritten slot (0xff bytes are its identity)");
    out = dalloc<int>(64);
    NG_LAUNCH((warp_waits_for_barrier_kernel), 1, 32, 0, 0, out);
    expect_fault("a warp waiting on a lane stuck at a barrier (deadlock)");
}

/* A far out-of-bounds access ends the process with a report: run in a child. */
static void test_oob_in_child(const char *self) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' --oob 2>&1", self);
    FILE *p = popen(cmd, "r");
    char buf[4096];
    size_t n = p ? fread(buf, 1, sizeof buf - 1, p) : 0;
    buf[n] = 0;
    const int rc = p ? pclose(p) : 0;
    CHECK(rc != 0, "an out-of-bounds store ends the process (exit %d)", rc);
    CHECK(strstr(buf, "past the end of a device buffer") || strstr(buf, "AddressSanitizer"),
          "an out-of-bounds store is reported with its buffer; got:\n%s", buf);
}

#ifdef NG_EMU_RACECHECK
/* The race detector: a race the schedules cannot see is reported with both
 * sites (in a child, to read its message); correct kernels pass. */
static void test_racecheck(const char *self) {
    CHECK(ng_emu_racecheck() && ng_emu_racecheck_accesses() > 0,
          "the race detector saw the shared-memory accesses of the kernels so far (%lld)",
          ng_emu_racecheck_accesses());
    int *x = dalloc<int>(3 * 128), *out = dalloc<int>(3);
    std::vector<int> hx(3 * 128, 0);
    for (int i = 128; i < 256; i += 3) hx[i] = 1; /* iteration 1 sees keys, 0 and 2 none */
    cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(out, 0, 12);
    NG_LAUNCH((flag_kernel), 1, 128, 0, 0, x, out);
    CHECK(cudaGetLastError() == cudaSuccess,
          "a flag set and cleared by stores that change nothing");
    const std::vector<int> ho = download(out, 3);
    CHECK(ho[0] == 0 && ho[1] == 1 && ho[2] == 0, "flag_kernel: %d %d %d", ho[0], ho[1], ho[2]);
    cudaFree(x), cudaFree(out);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' --race 2>&1", self);
    FILE *p = popen(cmd, "r");
    char buf[8192];
    size_t n = p ? fread(buf, 1, sizeof buf - 1, p) : 0;
    buf[n] = 0;
    const int rc = p ? pclose(p) : 0;
    char rd[64], wr[64];
    snprintf(rd, sizeof rd, "test_emu.cpp:%d", kRaceReadLine);
    snprintf(wr, sizeof wr, "test_emu.cpp:%d", kRaceWriteLine);
    CHECK(
        rc == 0 && strstr(buf, "race-detected") &&
            strstr(buf, "shared-memory race (write after read)") && strstr(buf, "NG_SHARED cell") &&
            strstr(buf, rd) && strstr(buf, wr) && strstr(buf, "thread (32, 0, 0)") &&
            strstr(buf, "thread (0, 0, 0)"),
        "a same-value write-after-read race is reported with both threads and sites (%s, %s); got:\n%s",
        rd, wr, buf);
}
#endif

int main(int argc, char **argv) {
#ifdef NG_EMU_RACECHECK
    if (argc > 1 && strcmp(argv[1], "--race") == 0) {
        int *out = dalloc<int>(64);
        NG_LAUNCH((same_value_race_kernel), 1, 64, 0, 0, out);
        printf("%s\n",
               cudaGetLastError() == cudaErrorLaunchFailure ? "race-detected" : "race-missed");
        return 0;
    }
#endif
    if (argc > 1 && strcmp(argv[1], "--ptx") == 0) { /* the mutation tests' run */
        test_ldmatrix();
        test_cp_async();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc > 1 && strcmp(argv[1], "--oob") == 0) {
        float *x = dalloc<float>(100);
        NG_LAUNCH((oob_kernel), 1, 32, 0, 0, x, 100);
        return 0; /* not reached */
    }
    test_conversions();
    test_warp();
    test_shared();
    test_mma();
    test_ldmatrix();
    test_cp_async();
    test_limits();
    test_faults();
    test_ldmatrix_faults();
    test_cp_async_faults();
    test_oob_in_child(argv[0]);
#ifdef NG_EMU_RACECHECK
    /* NG_EMU_RACECHECK=0 (ctest cuda_emu_self_norace): what the schedules
     * and poisons catch without the detector */
    if (!(getenv("NG_EMU_RACECHECK") && strcmp(getenv("NG_EMU_RACECHECK"), "0") == 0))
        test_racecheck(argv[0]);
#endif
    printf("test_emu: %lld launches, each under %d schedules\n", ng_emu_launches(),
           ng_emu_schedules());
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
