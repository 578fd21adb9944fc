/*
 * ops/nanguard.c - library entry point: checks the running PyTorch, creates
 * the library handles and lets each op file register itself.
 *
 * The same file builds both libraries. In libnanguard.so it defines every
 * schema (a DEF library for namespace "nanguard") and registers the CPU
 * kernels; compiled with NG_BUILD_CUDA into libnanguard_cuda.so it only
 * registers CUDA kernels for schemas the core library defined, so the core
 * library must be loaded first (the Python package does).
 *
 * Registration runs from a constructor when the library is loaded. On a
 * PyTorch older than the stable ABI nanguard targets it registers nothing and
 * records why; Python reads that through ng_load_error() and raises.
 * Library handles are never freed: the registrations must live as long as
 * the process.
 */
#include <stdio.h>

#include "ops/ops.h"
#ifdef NG_BUILD_CUDA
#include "kernels/cuda_status.h"
#endif

#define NG_EXPORT __attribute__((visibility("default")))

typedef void (*ng_register_fn)(const ng_registrar *r);

/* Every op file, in the order their schemas are defined. */
static const ng_register_fn ng_ops[] = {
    ng_register_layernorm,
    ng_register_grad_guard,
    ng_register_attention,
    ng_register_tensor_stats,
};

static char ng_load_err[512];
static TorchLibraryHandle ng_lib_def, ng_lib_impl;

NG_EXPORT const char *ng_load_error(void) { return ng_load_err[0] ? ng_load_err : NULL; }

NG_EXPORT uint64_t ng_target_abi_version(void) { return NG_TORCH_TARGET_VERSION; }

__attribute__((constructor)) static void ng_load(void) {
    uint64_t have = aoti_torch_abi_version();
    if (have < NG_TORCH_TARGET_VERSION) {
        snprintf(ng_load_err, sizeof ng_load_err,
                 "nanguard needs PyTorch >= %d.%d (stable ABI); this process runs PyTorch %d.%d",
                 (int)(NG_TORCH_TARGET_VERSION >> 56), (int)((NG_TORCH_TARGET_VERSION >> 48) & 0xff),
                 (int)(have >> 56), (int)((have >> 48) & 0xff));
        return;
    }
    ng_registrar r = {NULL, NULL, 0};
#ifdef NG_BUILD_CUDA
    if (!ng_cuda_stream_available()) {
        snprintf(ng_load_err, sizeof ng_load_err,
                 "libnanguard_cuda: this PyTorch has no CUDA support (libtorch_cuda.so not loaded)");
        return;
    }
    /* A driver older than the runtime this library was built with would fail
     * every launch with a bare "CUDA error": refuse to load instead. */
    if (ng_cuda_driver_check(ng_load_err, sizeof ng_load_err) != 0) return;
    if (aoti_torch_library_init_impl("nanguard", "CUDA", __FILE__, __LINE__, &ng_lib_impl) != 0) {
        snprintf(ng_load_err, sizeof ng_load_err, "could not open the nanguard CUDA library");
        return;
    }
    r.cuda = 1;
#else
    if (aoti_torch_library_init_def("nanguard", __FILE__, __LINE__, &ng_lib_def) != 0 ||
        aoti_torch_library_init_impl("nanguard", "CPU", __FILE__, __LINE__, &ng_lib_impl) != 0) {
        snprintf(ng_load_err, sizeof ng_load_err,
                 "could not create the torch.ops.nanguard library (is another copy loaded?)");
        return;
    }
#endif
    r.def = ng_lib_def;
    r.impl = ng_lib_impl;
    for (size_t i = 0; i < sizeof ng_ops / sizeof ng_ops[0]; i++) ng_ops[i](&r);
}
