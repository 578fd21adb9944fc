/*
 * tests/c/test_cuda_errors.c - runtime errors inside a launcher (emulator
 * only; the fixture's rules: cuda_fixture.h).
 *
 * A runtime call that fails inside a launcher: the launcher returns
 * NG_ERR_CUDA with the runtime's error name and message recorded for the op's
 * message (ng_cuda_error_string), or takes its fallback, and in both cases
 * leaves no error behind for the next, unrelated launch. The emulator injects
 * the failures (ng_emu_inject); a GPU cannot be made to fail on demand. Also
 * the load-time check of the driver's version (ng_cuda_driver_check).
 */
#ifdef NG_CUDA_EMU
#include <stdint.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/cuda_status.h"
#include "kernels/layernorm.h"
#include "tests/c/cuda_fixture.h" /* before attn_cases.h: it includes ng_test.h */
#include "tests/c/attn_cases.h"

static ng_attention_args err_attn_args(void *buf, void *lse, int64_t E) {
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = NG_F32;
    a.B = 1, a.Hq = 1, a.Hkv = 1, a.L = 1, a.S = 1, a.E = E, a.Ev = E;
    const int64_t st[3] = {E, E, E};
    a.q = a.k = a.v = a.dout = buf;
    a.out = a.dq = a.dk = a.dv = (char *)buf + E * 4;
    attn_same_strides(&a, st);
    a.lse = lse;
    a.scale = 0.0625;
    return a;
}

static void err_failed_smem_attribute(float *buf, float *lse, const ng_layernorm_args *ln) {
    if (!case_begin("errors     %-34s %s", "failed_smem_attribute", "float32")) return;
    /* the SIMT forward (more query rows than the decode kernel takes) at
     * head dim 256 needs 64 KiB of dynamic shared memory: an attribute call.
     * Not the decode kernel, whose own grant the next case checks: granted
     * here, it would ask for nothing there. */
    const int64_t L = NG_ATTN_DEC_MAX_L + 1, E = 256;
    float *q = dmalloc(sizeof(float) * (size_t)(L * E)),
          *o = dmalloc(sizeof(float) * (size_t)(L * E)), *ol = dmalloc(sizeof(float) * (size_t)L);
    CU(cudaMemsetAsync(q, 0, sizeof(float) * (size_t)(L * E), g_stream));
    ng_attention_args a = err_attn_args(buf, lse, E);
    a.L = L;
    a.q = q, a.out = o, a.lse = ol;
    ng_emu_inject("cudaFuncSetAttribute", cudaErrorInvalidValue);
    ng_status s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_ERR_CUDA, "a failed cudaFuncSetAttribute: launcher returned %s",
          ng_status_str(s));
    CHECK(strstr(ng_cuda_error_string(), "cudaErrorInvalidValue: invalid argument") != NULL,
          "the recorded error is \"%s\"", ng_cuda_error_string());
    s = ng_layernorm_fwd_cuda(ln, g_stream);
    CHECK(s == NG_OK, "the next, unrelated launch returned %s", ng_status_str(s));
    s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_OK, "the same call again returned %s", ng_status_str(s));
    CU(cudaStreamSynchronize(g_stream));
    dfree(q);
    dfree(o);
    dfree(ol);
    case_end();
}

static void err_failed_smem_attribute_decode(float *buf, float *lse) {
    if (!case_begin("errors     %-34s %s", "failed_smem_attribute_decode", "float32")) return;
    /* the decode kernel at head dim 256 asks for 49 KiB: the failure is
     * returned, and the same call then succeeds */
    const int64_t S = 64, E = 256;
    float *kv = dmalloc(sizeof(float) * (size_t)(S * E));
    CU(cudaMemsetAsync(kv, 0, sizeof(float) * (size_t)(S * E), g_stream));
    ng_attention_args a = err_attn_args(buf, lse, E);
    a.S = S;
    a.k = a.v = kv;
    a.k_stride[0] = a.k_stride[1] = a.v_stride[0] = a.v_stride[1] = S * E;
    ng_emu_inject("cudaFuncSetAttribute", cudaErrorInvalidValue);
    ng_status s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_ERR_CUDA, "a failed cudaFuncSetAttribute: launcher returned %s",
          ng_status_str(s));
    s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_OK, "the same call again returned %s", ng_status_str(s));
    CU(cudaStreamSynchronize(g_stream));
    dfree(kv);
    case_end();
}

static void err_failed_device_query(float *buf, float *lse, const ng_layernorm_args *ln) {
    if (!case_begin("errors     %-34s %s", "failed_device_query", "float16")) return;
    /* the compute-capability query fails: the SIMT kernels run instead */
    ng_attention_args a = err_attn_args(buf, lse, 64);
    a.dtype = NG_F16;
    ng_emu_inject("cudaGetDevice", cudaErrorInvalidDevice);
    ng_status s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_OK, "a failed device query: launcher returned %s (%s)", ng_status_str(s),
          ng_cuda_error_string());
    s = ng_layernorm_fwd_cuda(ln, g_stream);
    CHECK(s == NG_OK, "the next, unrelated launch returned %s", ng_status_str(s));
    CU(cudaStreamSynchronize(g_stream));
    case_end();
}

static void err_attributes_cached_per_device(float *buf, float *lse) {
    if (!case_begin("errors     %-34s %s", "attributes_cached_per_device", "float32")) return;
    /* the second launch queries nothing: capability and granted shared
     * memory are cached per device */
    ng_attention_args a = err_attn_args(buf, lse, 256);
    ng_status s = ng_attention_fwd_cuda(&a, g_stream);
    const long long set0 = ng_emu_calls("cudaFuncSetAttribute");
    const long long get0 = ng_emu_calls("cudaDeviceGetAttribute");
    s = s == NG_OK ? ng_attention_fwd_cuda(&a, g_stream) : s;
    a.dtype = NG_F16, a.E = a.Ev = 64;
    for (int k = 0; k < 2 && s == NG_OK; k++) s = ng_attention_fwd_cuda(&a, g_stream);
    CHECK(s == NG_OK, "launch: %s", ng_status_str(s));
    CHECK(ng_emu_calls("cudaFuncSetAttribute") == set0,
          "cudaFuncSetAttribute called again (%lld times)",
          ng_emu_calls("cudaFuncSetAttribute") - set0);
    CHECK(ng_emu_calls("cudaDeviceGetAttribute") <= get0 + 1,
          "cudaDeviceGetAttribute called %lld times",
          ng_emu_calls("cudaDeviceGetAttribute") - get0);
    CU(cudaStreamSynchronize(g_stream));
    case_end();
}

static void err_driver_older_than_runtime(void) {
    if (!case_begin("errors     %-34s %s", "driver_older_than_runtime", "")) return;
    /* what libnanguard_cuda says at load when the driver is too old */
    char msg[512] = "";
    ng_emu_set_driver_version(12040);
    const int bad = ng_cuda_driver_check(msg, sizeof msg);
    ng_emu_set_driver_version(CUDART_VERSION);
    CHECK(bad && strstr(msg, "runtime 13.0") && strstr(msg, "CUDA 12.4"),
          "an older driver: check %d, message \"%s\"", bad, msg);
    CHECK(ng_cuda_driver_check(msg, sizeof msg) == 0, "a matching driver is refused: %s", msg);
    case_end();
}

void test_cuda_errors(void) {
    float *buf = dmalloc(2 * 256 * sizeof(float)), *lse = dmalloc(sizeof(float)),
          *ln = dmalloc(64 * sizeof(float));
    dpoison(buf, 512 * sizeof(float));
    CU(cudaMemsetAsync(buf, 0, 256 * sizeof(float), g_stream));
    ng_layernorm_args l;
    memset(&l, 0, sizeof l);
    l.dtype = NG_F32, l.rows = 2, l.cols = 8, l.eps = 1e-5;
    l.x = ln, l.y = ln + 16, l.mean = ln + 32, l.rstd = ln + 40;
    CU(cudaMemsetAsync(ln, 0, 16 * sizeof(float), g_stream));

    err_failed_smem_attribute(buf, lse, &l);
    err_failed_smem_attribute_decode(buf, lse);
    err_failed_device_query(buf, lse, &l);
    err_attributes_cached_per_device(buf, lse);
    err_driver_older_than_runtime();
    dfree(buf), dfree(lse), dfree(ln);
}
#endif /* NG_CUDA_EMU */
