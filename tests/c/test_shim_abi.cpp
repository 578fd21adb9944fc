// tests/c/test_shim_abi.cpp - shim/shim.h against PyTorch's own headers.
//
// Compiles PyTorch's stable-ABI headers (C++) together with nanguard's C
// declarations and static_asserts that every function nanguard declares has
// exactly the type PyTorch gives it. Any drift in a signature fails the
// build. At run time it checks the few facts the shim relies on.
//
// PyTorch's headers are read as the target stable ABI sees them
// (TORCH_TARGET_VERSION, set from shim/version.h before any of them): a
// function that only a newer PyTorch declares is then undeclared here, and
// the static_asserts below fail to compile instead of passing against the
// newer headers.
#include "shim/version.h"
#ifndef TORCH_TARGET_VERSION
#define TORCH_TARGET_VERSION NG_TORCH_TARGET_VERSION
#endif
#define USE_CUDA 1 // also see the CUDA-only declarations (nothing is called)
#include <torch/csrc/stable/c/shim.h>
#include <torch/headeronly/version.h>

#include <cstdio>
#include <type_traits>

#define NG_SHIM_NO_DECLS
#include "shim/shim.h"

#define NG_ASSERT_SAME(ret, name, params)                                                          \
    static_assert(std::is_same_v<decltype(&::name), ret(*) params>,                                \
                  "shim/shim.h declares " #name " with a type PyTorch does not give it");
NG_SHIM_FUNCTIONS(NG_ASSERT_SAME)

// shim/shim_cuda.c looks this one up with dlsym under this type.
static_assert(std::is_same_v<decltype(&::aoti_torch_get_current_cuda_stream),
                             AOTITorchError (*)(int32_t, void **)>,
              "aoti_torch_get_current_cuda_stream changed type");
static_assert(std::is_same_v<StableIValue, uint64_t>, "StableIValue is not uint64_t");
static_assert(std::is_same_v<AOTITorchError, int32_t>, "AOTITorchError is not int32_t");
static_assert(TORCH_ABI_VERSION >= NG_TORCH_TARGET_VERSION,
              "building against a PyTorch older than the target stable ABI");
static_assert(TORCH_FEATURE_VERSION == NG_TORCH_TARGET_VERSION,
              "PyTorch's headers must be read as the target stable ABI sees them");

// ng_fail is noreturn: a non-void function may end in it without a return
// (-Werror=return-type fails this file otherwise), and the compiler knows
// nothing after it runs.
[[maybe_unused]] static int ng_fail_never_returns() { ng_fail(nullptr, "unreachable"); }

int main() {
    int bad = 0;
    uint64_t v = aoti_torch_abi_version();
    std::printf("runtime stable ABI %llu.%llu, headers %d.%d, target %llu.%llu\n",
                (unsigned long long)(v >> 56), (unsigned long long)((v >> 48) & 0xff),
                TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
                (unsigned long long)(NG_TORCH_TARGET_VERSION >> 56),
                (unsigned long long)((NG_TORCH_TARGET_VERSION >> 48) & 0xff));
    if (v < NG_TORCH_TARGET_VERSION) bad++;
    // element sizes the kernels assume for each dtype nanguard maps
    if (aoti_torch_dtype_element_size(aoti_torch_dtype_float16()) != 2) bad++;
    if (aoti_torch_dtype_element_size(aoti_torch_dtype_bfloat16()) != 2) bad++;
    if (aoti_torch_dtype_element_size(aoti_torch_dtype_float32()) != 4) bad++;
    if (aoti_torch_dtype_element_size(aoti_torch_dtype_float64()) != 8) bad++;
    std::printf("test_shim_abi: %d failed\n", bad);
    return bad ? 1 : 0;
}
