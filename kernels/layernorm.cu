/*
 * kernels/layernorm.cu - CUDA LayerNorm / RMSNorm, forward and backward.
 *
 * Same arithmetic as the CPU kernel (layernorm_math.h): shifted two-pass
 * fp32 statistics, rstd = 0 when var + eps == 0, NaN for a non-finite row,
 * scaled recomputation when a finite row's sum of squares overflows fp32.
 *
 * Launch math:
 *   forward / dx: one block per row (grid.x = rows, one launch up to
 *     2^31 - 1 rows), threads_for(cols) threads (about 4 columns each,
 *     32 to 4 * NG_LN_THREADS) striding over the columns;
 *     block reductions by warp shuffle, then one value per warp in shared
 *     memory. Rows are re-read from global memory for each pass; at the
 *     widths LayerNorm sees (<= 16K) the row stays in L1/L2.
 *   dweight / dbias: the rows are cut into ln_param_chunks(rows) chunks of
 *     consecutive rows; grid (ceil(cols / 32), chunks) blocks of 32 x 8
 *     threads: lane x owns a column, the 8 y-threads stride over the chunk's
 *     rows (coalesced across x), and the 8 partials are summed in a fixed
 *     order in shared memory. With one chunk (also when the caller gives no
 *     workspace: ng_layernorm_bwd_cuda) that is the result; otherwise
 *     each block writes an fp32 partial to the workspace ([2][chunks][cols])
 *     and a second kernel sums a column's partials in chunk order. No
 *     atomics: the result is deterministic, and short fp32 sums per thread
 *     keep it as accurate as the CPU's blocked partials.
 * Element type is a run-time argument (warp-uniform switch in ng_load_f32),
 * the parameters' too (fp32 weight / bias of 16-bit input, params_f32, are
 * read and applied in fp32; dweight / dbias are fp32 sums stored in it);
 * the kernels are memory-bound, so the conversions are free.
 */
#include <cuda_runtime.h>

#include "kernels/layernorm.h"
#include "kernels/cuda_launch.h"
#include "kernels/layernorm_math.h"

#define NG_LN_THREADS 256
#define NG_LN_MAX_GRID 2147483647LL /* gridDim.x */
#define NG_LN_CHUNK_ROWS 256        /* rows per dweight / dbias chunk, at least */
#define NG_LN_MAX_CHUNKS 256

/* Sum over the block; every thread gets the result. `red` holds 32 floats. */
static __device__ float block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nwarps = (blockDim.x + 31) / 32;
    __syncthreads(); /* red may still be read from the previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < nwarps; w++) s += red[w]; /* fixed order: deterministic */
    return s;
}

static __device__ float block_max(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = (u > v || u != u) ? u : v; /* NaN wins */
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nwarps = (blockDim.x + 31) / 32;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < nwarps; w++) m = (red[w] > m || red[w] != red[w]) ? red[w] : m;
    return m;
}

/* Statistics of one row: the shift (its first value; 0 for RMSNorm), the
 * shifted mean md (mean = shift + md) and rstd. The output is computed from
 * shift and md, as the CPU does: rebuilding md from the rounded mean would
 * put the rounding of shift + md into every centred value. */
static __device__ void row_stats(const void *x, ng_dtype t, int64_t base, int64_t n, float eps,
                                 int rms, float *red, float *shift_out, float *md_out,
                                 float *rstd_out) {
    const float inv_n = 1.0f / (float)n;
    const float shift = rms ? 0.0f : ng_load_f32(x, t, base);
    float s = 0.0f;
    if (!rms) {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            s += ng_load_f32(x, t, base + i) - shift;
        s = block_sum(s, red);
    }
    float md = s * inv_n;
    /* the corrected two-pass of layernorm_rows.inc: the mean of e = d - md
     * repairs the rounding of the first sum */
    float v = 0.0f, c = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float e = (ng_load_f32(x, t, base + i) - shift) - md;
        c += e;
        v += e * e;
    }
    v = block_sum(v, red);
    c = rms ? 0.0f : block_sum(c, red);
    const float cm = c * inv_n;
    md += cm;
    float var = v == INFINITY ? INFINITY : v * inv_n - cm * cm;
    if (var < 0.0f) var = 0.0f;
    float rstd = ng_ln_rstd_f32(var, eps);
    if (v == INFINITY) { /* rare: finite row whose squares overflow, or a row with Inf */
        float amax = 0.0f;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            float d = fabsf((ng_load_f32(x, t, base + i) - shift) - md);
            amax = (d > amax || d != d) ? d : amax;
        }
        amax = block_max(amax, red);
        if (amax > 0.0f && amax < INFINITY) {
            float vs = 0.0f;
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
                float d = ((ng_load_f32(x, t, base + i) - shift) - md) / amax;
                vs += d * d;
            }
            vs = block_sum(vs, red);
            rstd = ng_ln_rstd_scaled_f32(vs * inv_n, amax, eps);
        }
    }
    *shift_out = shift;
    *md_out = md;
    *rstd_out = rstd;
}

static __global__ void __launch_bounds__(1024) ln_fwd_kernel(ng_layernorm_args a, int64_t row0) {
    NG_SHARED(float, red, [32]);
    const int64_t r = row0 + blockIdx.x;
    if (r >= a.rows) return;
    const int64_t n = a.cols, base = r * n;
    float shift, md, rstd;
    const ng_dtype pt = ng_layernorm_param_dtype(&a);
    row_stats(a.x, a.dtype, base, n, (float)a.eps, a.rms, red, &shift, &md, &rstd);
    if (threadIdx.x == 0) {
        if (!a.rms) ((float *)a.mean)[r] = shift + md;
        ((float *)a.rstd)[r] = rstd;
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float o = ((ng_load_f32(a.x, a.dtype, base + i) - shift) - md) * rstd;
        if (a.weight) o *= ng_load_f32(a.weight, pt, i);
        if (a.bias && !a.rms) o += ng_load_f32(a.bias, pt, i);
        ng_store_f32(a.y, a.dtype, base + i, o);
    }
}

static __global__ void __launch_bounds__(1024) ln_bwd_dx_kernel(ng_layernorm_args a, int64_t row0) {
    NG_SHARED(float, red, [32]);
    const int64_t r = row0 + blockIdx.x;
    if (r >= a.rows) return;
    const int64_t n = a.cols, base = r * n;
    const float mean = a.rms ? 0.0f : ((const float *)a.mean)[r];
    const float rstd = ((const float *)a.rstd)[r];
    const ng_dtype pt = ng_layernorm_param_dtype(&a);
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float g = ng_load_f32(a.dy, a.dtype, base + i);
        if (a.weight) g *= ng_load_f32(a.weight, pt, i);
        sg += g;
        sgx += g * ((ng_load_f32(a.x, a.dtype, base + i) - mean) * rstd);
    }
    sg = block_sum(sg, red);
    sgx = block_sum(sgx, red);
    const float inv_n = 1.0f / (float)n;
    const float ca = a.rms ? 0.0f : sg * inv_n, cb = sgx * inv_n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float g = ng_load_f32(a.dy, a.dtype, base + i);
        if (a.weight) g *= ng_load_f32(a.weight, pt, i);
        float xhat = (ng_load_f32(a.x, a.dtype, base + i) - mean) * rstd;
        ng_store_f32(a.dx, a.dtype, base + i, ng_ln_dx_f32(g, xhat, rstd, ca, cb));
    }
}

/* Chunks of rows for the dweight / dbias sums: a fixed function of rows, so
 * the summation order (and the result) does not depend on the device. */
static int64_t ln_param_chunks(int64_t rows) {
    return NG_MAX((int64_t)1, NG_MIN((int64_t)NG_LN_MAX_CHUNKS, rows / NG_LN_CHUNK_ROWS));
}

/* Block (x, chunk): columns 32x .. 32x + 31 over the chunk's rows. With one
 * chunk it writes dweight / dbias, otherwise fp32 partials to part_w / part_b
 * ([chunks][cols]). */
static __global__ void ln_bwd_params_kernel(ng_layernorm_args a, int64_t chunks, float *part_w,
                                            float *part_b) {
    NG_SHARED(float, sw, [8][33]);
    NG_SHARED(float, sb, [8][33]);
    const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x, chunk = blockIdx.y;
    const int64_t r0 = a.rows * chunk / chunks, r1 = a.rows * (chunk + 1) / chunks;
    float accw = 0.0f, accb = 0.0f;
    if (j < a.cols) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
            const float dy = ng_load_f32(a.dy, a.dtype, r * a.cols + j);
            const float mean = a.rms ? 0.0f : ((const float *)a.mean)[r];
            const float rstd = ((const float *)a.rstd)[r];
            accw += dy * ((ng_load_f32(a.x, a.dtype, r * a.cols + j) - mean) * rstd);
            accb += dy;
        }
    }
    sw[threadIdx.y][threadIdx.x] = accw;
    sb[threadIdx.y][threadIdx.x] = accb;
    __syncthreads();
    if (threadIdx.y == 0 && j < a.cols) {
        float w = 0.0f, b = 0.0f;
        for (int k = 0; k < 8; k++) {
            w += sw[k][threadIdx.x];
            b += sb[k][threadIdx.x];
        }
        if (chunks == 1) {
            if (a.dweight) ng_store_f32(a.dweight, ng_layernorm_param_dtype(&a), j, w);
            if (a.dbias) ng_store_f32(a.dbias, ng_layernorm_param_dtype(&a), j, b);
        } else {
            part_w[chunk * a.cols + j] = w;
            part_b[chunk * a.cols + j] = b;
        }
    }
}

/* Column j's partials, summed in chunk order. */
static __global__ void ln_bwd_params_final_kernel(ng_layernorm_args a, int64_t chunks,
                                                  const float *part_w, const float *part_b) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= a.cols) return;
    float w = 0.0f, b = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        w += part_w[c * a.cols + j];
        b += part_b[c * a.cols + j];
    }
    if (a.dweight) ng_store_f32(a.dweight, ng_layernorm_param_dtype(&a), j, w);
    if (a.dbias) ng_store_f32(a.dbias, ng_layernorm_param_dtype(&a), j, b);
}

static int threads_for(int64_t cols) {
    /* enough threads for ~4 elements each, a multiple of 32, 32..1024 */
    int64_t t = NG_CEIL_DIV(cols, (int64_t)4);
    t = NG_CEIL_DIV(t, (int64_t)32) * 32;
    return (int)NG_MAX((int64_t)32, NG_MIN((int64_t)NG_LN_THREADS * 4, t));
}

static ng_status check(const ng_layernorm_args *a, int backward) {
    NG_TRY(ng_layernorm_check(a, backward));
    return a->dtype == NG_F64 ? NG_ERR_DTYPE : NG_OK;
}

static ng_status launch_status(void) { return ng_cuda_record(cudaSuccess); }

/* Statistics of empty rows (cols == 0): mean 0, rstd of eps; nothing else. */
static __global__ void ln_empty_rows_kernel(ng_layernorm_args a) {
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= a.rows) return;
    if (!a.rms) ((float *)a.mean)[r] = 0.0f;
    ((float *)a.rstd)[r] = ng_ln_rstd_f32(0.0f, (float)a.eps);
}

extern "C" ng_status ng_layernorm_fwd_cuda(const ng_layernorm_args *a, void *stream) {
    NG_TRY(check(a, 0));
    cudaStream_t s = (cudaStream_t)stream;
    if (a->rows == 0) return NG_OK;
    if (a->cols == 0) {
        NG_LAUNCH((ln_empty_rows_kernel), (unsigned)NG_CEIL_DIV(a->rows, (int64_t)256), 256, 0, s,
                  *a);
        return launch_status();
    }
    const int threads = threads_for(a->cols);
    for (int64_t r0 = 0; r0 < a->rows; r0 += NG_LN_MAX_GRID) {
        const unsigned blocks = (unsigned)NG_MIN(a->rows - r0, (int64_t)NG_LN_MAX_GRID);
        NG_LAUNCH((ln_fwd_kernel), blocks, threads, 0, s, *a, r0);
        NG_TRY(launch_status());
    }
    return NG_OK;
}

extern "C" ng_status ng_layernorm_bwd_cuda(const ng_layernorm_args *a, void *stream) {
    return ng_layernorm_bwd_cuda_ws(a, NULL, 0, stream);
}

extern "C" ng_status ng_layernorm_bwd_cuda_ws(const ng_layernorm_args *a, void *workspace,
                                              int64_t workspace_bytes, void *stream) {
    NG_TRY(check(a, 1));
    const int64_t need = ng_layernorm_bwd_cuda_workspace_bytes(a);
    if (workspace && (workspace_bytes < need || ((uintptr_t)workspace & 3u)))
        return NG_ERR_INVALID_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    if (a->cols == 0) return NG_OK;
    if (a->rows > 0 && a->dx) {
        const int threads = threads_for(a->cols);
        for (int64_t r0 = 0; r0 < a->rows; r0 += NG_LN_MAX_GRID) {
            const unsigned blocks = (unsigned)NG_MIN(a->rows - r0, (int64_t)NG_LN_MAX_GRID);
            NG_LAUNCH((ln_bwd_dx_kernel), blocks, threads, 0, s, *a, r0);
            NG_TRY(launch_status());
        }
    }
    if (a->dweight || a->dbias) {
        /* also runs for rows == 0, writing zeros */
        const int64_t chunks = workspace ? ln_param_chunks(a->rows) : 1;
        float *pw = (float *)workspace, *pb = chunks > 1 ? pw + chunks * a->cols : NULL;
        const dim3 grid((unsigned)NG_CEIL_DIV(a->cols, (int64_t)32), (unsigned)chunks);
        NG_LAUNCH((ln_bwd_params_kernel), grid, dim3(32, 8), 0, s, *a, chunks, pw, pb);
        NG_TRY(launch_status());
        if (chunks > 1) {
            NG_LAUNCH((ln_bwd_params_final_kernel), (unsigned)NG_CEIL_DIV(a->cols, (int64_t)256),
                      256, 0, s, *a, chunks, (const float *)pw, (const float *)pb);
            NG_TRY(launch_status());
        }
    }
    return NG_OK;
}

extern "C" int64_t ng_layernorm_bwd_cuda_workspace_bytes(const ng_layernorm_args *a) {
    if (!a || (!a->dweight && !a->dbias) || a->cols <= 0) return 0;
    const int64_t chunks = ln_param_chunks(a->rows);
    return chunks > 1 ? 2 * chunks * a->cols * (int64_t)sizeof(float) : 0;
}
