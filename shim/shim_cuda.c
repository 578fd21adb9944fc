/*
 * shim/shim_cuda.c - the CUDA half of the shim, compiled into
 * libnanguard_cuda.so only.
 *
 * aoti_torch_get_current_cuda_stream lives in libtorch_cuda.so, which a
 * CPU-only PyTorch does not have, so nothing links against it. The CUDA
 * library is loaded only after `import torch` has loaded libtorch_cuda.so;
 * the function is looked up there with dlopen(RTLD_NOLOAD) + dlsym, once.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>

#include "shim/shim.h"

typedef AOTITorchError (*get_stream_fn)(int32_t device_index, void **ret_stream);

/* Threads may race on the first lookup; each finds the same function, and
 * the atomic makes that race well defined. */
static get_stream_fn lookup_get_stream(void) {
    static _Atomic(get_stream_fn) cached = NULL;
    get_stream_fn fn = atomic_load_explicit(&cached, memory_order_relaxed);
    if (fn) return fn;
    void *lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (lib) {
        fn = (get_stream_fn)dlsym(lib, "aoti_torch_get_current_cuda_stream");
        dlclose(lib); /* drops only the reference RTLD_NOLOAD took */
    }
    if (!fn) fn = (get_stream_fn)dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    atomic_store_explicit(&cached, fn, memory_order_relaxed);
    return fn;
}

void *ng_cuda_current_stream(ng_frame *f, int32_t device_index) {
    get_stream_fn fn = lookup_get_stream();
    if (!fn)
        ng_fail(f, "aoti_torch_get_current_cuda_stream not found: libtorch_cuda.so is not loaded");
    void *stream = NULL;
    NG_SHIM_CHECK(f, fn(device_index, &stream));
    return stream;
}

int ng_cuda_stream_available(void) { return lookup_get_stream() != NULL; }
