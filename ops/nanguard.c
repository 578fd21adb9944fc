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
 * records why; a schema or kernel that cannot be registered is recorded the
 * same way. Python reads that through ng_load_error() and raises ImportError.
 * Library handles are never freed: the registrations must live as long as
 * the process.
 *
 * Both libraries export ng_build_id(): the target stable ABI and a
 * fingerprint of every schema string. The boxed kernels read fixed stack
 * slots, so a CUDA library registered against the schemas of another core
 * library would read past the stack; before registering anything the CUDA
 * library finds the loaded core library (dlopen with RTLD_NOLOAD), compares
 * the two ids and refuses, naming both builds, when they differ.
 */
#ifdef NG_BUILD_CUDA
#define _GNU_SOURCE /* dladdr, RTLD_NOLOAD */
#include <dlfcn.h>
#endif
#include <stdio.h>
#include <string.h>

#include "kernels/attention.h"
#include "ops/ops.h"
#ifdef NG_BUILD_CUDA
#include "kernels/cuda_status.h"
#endif

#define NG_EXPORT __attribute__((visibility("default")))

typedef void (*ng_register_fn)(ng_registrar *r);

/* Every op file, in the order their schemas are defined. */
static const ng_register_fn ng_ops[] = {
    ng_register_layernorm,
    ng_register_grad_guard,
    ng_register_attention,
    ng_register_tensor_stats,
};

static char ng_load_err[1024];
static char ng_id[96];
static TorchLibraryHandle ng_lib_def, ng_lib_impl;

NG_EXPORT const char *ng_load_error(void) { return ng_load_err[0] ? ng_load_err : NULL; }

/* "stable-abi-2.11/schemas-<16 hex digits>": equal in two libraries exactly
 * when they target the same ABI and define the same schemas in the same
 * order. */
NG_EXPORT const char *ng_build_id(void) { return ng_id; }

/* The largest head dim the attention kernels take: the Python layer's
 * argument check reads it here rather than restating it. */
NG_EXPORT int ng_attention_max_head_dim(void) { return NG_ATTN_MAX_HEAD_DIM; }

static void make_build_id(void) {
    ng_registrar dry = {.schema_hash = NG_SCHEMA_HASH_INIT}; /* no library: fingerprint only */
    for (size_t i = 0; i < sizeof ng_ops / sizeof ng_ops[0]; i++) ng_ops[i](&dry);
    snprintf(ng_id, sizeof ng_id, "stable-abi-%d.%d/schemas-%016llx",
             (int)(NG_TORCH_TARGET_VERSION >> 56), (int)((NG_TORCH_TARGET_VERSION >> 48) & 0xff),
             (unsigned long long)dry.schema_hash);
}

#ifdef NG_BUILD_CUDA
/* 0 when the loaded libnanguard.so has this library's build id; otherwise
 * writes why into ng_load_err, naming both builds. */
static int check_core_build(void) {
    Dl_info self;
    const char *self_path = dladdr((void *)ng_build_id, &self) && self.dli_fname
                                ? self.dli_fname
                                : "libnanguard_cuda.so";
    void *core = dlopen("libnanguard.so", RTLD_NOW | RTLD_NOLOAD);
    typedef const char *(*id_fn)(void);
    id_fn core_id = core ? (id_fn)dlsym(core, "ng_build_id") : NULL;
    if (!core_id) {
        if (core) dlclose(core);
        snprintf(ng_load_err, sizeof ng_load_err, "%s (build %s) needs libnanguard.so loaded first",
                 self_path, ng_id);
        return 1;
    }
    Dl_info info;
    const char *core_path =
        dladdr((void *)core_id, &info) && info.dli_fname ? info.dli_fname : "libnanguard.so";
    int bad = strcmp(core_id(), ng_id) != 0;
    if (bad)
        snprintf(ng_load_err, sizeof ng_load_err,
                 "%s is build %s but the loaded %s is build %s: the two libraries come from "
                 "different builds (their schemas differ); rebuild or reinstall both together",
                 self_path, ng_id, core_path, core_id());
    dlclose(core); /* drops only the reference RTLD_NOLOAD took */
    return bad;
}
#endif

NG_EXPORT uint64_t ng_target_abi_version(void) { return NG_TORCH_TARGET_VERSION; }

__attribute__((constructor)) static void ng_load(void) {
    make_build_id();
    uint64_t have = aoti_torch_abi_version();
    if (have < NG_TORCH_TARGET_VERSION) {
        snprintf(ng_load_err, sizeof ng_load_err,
                 "nanguard needs PyTorch >= %d.%d (stable ABI); this process runs PyTorch %d.%d",
                 (int)(NG_TORCH_TARGET_VERSION >> 56),
                 (int)((NG_TORCH_TARGET_VERSION >> 48) & 0xff), (int)(have >> 56),
                 (int)((have >> 48) & 0xff));
        return;
    }
    ng_registrar r = {
        .schema_hash = NG_SCHEMA_HASH_INIT, .err = ng_load_err, .errlen = sizeof ng_load_err};
#ifdef NG_BUILD_CUDA
    if (check_core_build() != 0) return;
    if (!ng_cuda_stream_available()) {
        snprintf(
            ng_load_err, sizeof ng_load_err,
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
