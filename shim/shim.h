/*
 * shim/shim.h - the only code in nanguard that knows PyTorch.
 *
 * PyTorch's stable C ABI headers (torch/csrc/stable/c/shim.h and
 * torch/csrc/inductor/aoti_torch/c/shim.h) are not valid C: they use `using`
 * aliases, C++ includes and C++-only parameter types. The functions behind
 * them are extern "C" and take only pointers, integers and bool, so this
 * header declares, in C, exactly the subset nanguard calls. A C++ test
 * (tests/c/test_shim_abi.cpp) includes PyTorch's headers and this one together
 * and fails to compile on any drift in a signature.
 *
 * Every function declared here exists in PyTorch 2.10; the build follows
 * the 2.11 stable ABI and refuses to register on an older runtime.
 *
 * Below the declarations are nanguard's helpers: a tensor view, a frame that
 * owns the handles of one boxed call (so that an error can release them all
 * before raising), argument readers, output allocation, validation, errors
 * and the parallel-range hook backed by PyTorch's thread pool.
 */
#ifndef NG_SHIM_H
#define NG_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/common.h"
#include "shim/schema.h"
#include "shim/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- stable-ABI declarations (subset) ------------------------------------ */
#ifndef NG_SHIM_NO_DECLS
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef struct StableListOpaque *StableListHandle;
typedef struct DeviceGuardOpaque *DeviceGuardHandle;
typedef struct TorchLibraryOpaque *TorchLibraryHandle;
typedef uint64_t StableIValue;
typedef int32_t AOTITorchError;
typedef void (*ParallelFunc)(int64_t begin, int64_t end, void *ctx);
#endif

/* NG_ABI_FN lets the C++ drift test re-declare each function with the type
 * PyTorch gives it; in C it is a plain declaration. */
#ifndef NG_ABI_FN
#define NG_ABI_FN(ret, name, params) ret name params;
#endif

#define NG_SHIM_FUNCTIONS(X)                                                                       \
    X(uint64_t, aoti_torch_abi_version, (void))                                                    \
    X(int32_t, aoti_torch_device_type_cpu, (void))                                                 \
    X(int32_t, aoti_torch_device_type_cuda, (void))                                                \
    X(int32_t, aoti_torch_dtype_float16, (void))                                                   \
    X(int32_t, aoti_torch_dtype_bfloat16, (void))                                                  \
    X(int32_t, aoti_torch_dtype_float32, (void))                                                   \
    X(int32_t, aoti_torch_dtype_float64, (void))                                                   \
    X(int32_t, aoti_torch_dtype_int64, (void))                                                     \
    X(int32_t, aoti_torch_dtype_bool, (void))                                                      \
    X(int32_t, aoti_torch_layout_strided, (void))                                                  \
    X(AOTITorchError, aoti_torch_delete_tensor_object, (AtenTensorHandle tensor))                  \
    X(AOTITorchError, torch_get_const_data_ptr, (AtenTensorHandle tensor, const void **ret))       \
    X(AOTITorchError, torch_get_mutable_data_ptr, (AtenTensorHandle tensor, void **ret))           \
    X(AOTITorchError, aoti_torch_get_dim, (AtenTensorHandle tensor, int64_t *ret))                 \
    X(AOTITorchError, aoti_torch_get_numel, (AtenTensorHandle tensor, int64_t *ret))               \
    X(AOTITorchError, aoti_torch_get_sizes, (AtenTensorHandle tensor, int64_t **ret))              \
    X(AOTITorchError, aoti_torch_get_strides, (AtenTensorHandle tensor, int64_t **ret))            \
    X(AOTITorchError, aoti_torch_get_dtype, (AtenTensorHandle tensor, int32_t *ret))               \
    X(AOTITorchError, aoti_torch_get_device_type, (AtenTensorHandle tensor, int32_t *ret))         \
    X(AOTITorchError, aoti_torch_get_device_index, (AtenTensorHandle tensor, int32_t *ret))        \
    X(AOTITorchError, aoti_torch_get_layout, (AtenTensorHandle tensor, int32_t *ret))              \
    X(AOTITorchError, aoti_torch_empty_strided,                                                    \
      (int64_t ndim, const int64_t *sizes, const int64_t *strides, int32_t dtype,                  \
       int32_t device_type, int32_t device_index, AtenTensorHandle *ret))                          \
    X(AOTITorchError, aoti_torch_copy_,                                                            \
      (AtenTensorHandle self, AtenTensorHandle src, int32_t non_blocking))                         \
    X(AOTITorchError, aoti_torch_zero_, (AtenTensorHandle self))                                   \
    X(AOTITorchError, aoti_torch_create_device_guard,                                              \
      (int32_t device_index, DeviceGuardHandle *ret))                                              \
    X(AOTITorchError, aoti_torch_delete_device_guard, (DeviceGuardHandle guard))                   \
    X(AOTITorchError, aoti_torch_library_init_def,                                                 \
      (const char *ns, const char *file, uint32_t line, TorchLibraryHandle *ret))                  \
    X(AOTITorchError, aoti_torch_library_init_impl,                                                \
      (const char *ns, const char *k, const char *file, uint32_t line, TorchLibraryHandle *ret))   \
    X(AOTITorchError, aoti_torch_library_def, (TorchLibraryHandle self, const char *schema))       \
    X(AOTITorchError, torch_library_impl,                                                          \
      (TorchLibraryHandle self, const char *name, void (*fn)(StableIValue *, uint64_t, uint64_t),  \
       uint64_t extension_build_version))                                                          \
    X(AOTITorchError, torch_list_size, (StableListHandle list, size_t *size))                      \
    X(AOTITorchError, torch_list_get_item,                                                         \
      (StableListHandle list, size_t index, StableIValue *element))                                \
    X(AOTITorchError, torch_delete_list, (StableListHandle list))                                  \
    X(AOTITorchError, torch_parallel_for,                                                          \
      (int64_t begin, int64_t end, int64_t grain, ParallelFunc fn, void *ctx))                     \
    X(void, aoti_torch_check,                                                                      \
      (bool cond, const char *func, const char *file, uint32_t line, const char *msg))

#ifndef NG_SHIM_NO_DECLS
NG_SHIM_FUNCTIONS(NG_ABI_FN)
#endif

/* ---- helpers ------------------------------------------------------------------ */

/* A borrowed view of a tensor's metadata. Sizes and strides point into
 * PyTorch's storage and stay valid while the handle lives. `data` is read
 * through PyTorch's const data pointer, so viewing an input never
 * materialises a copy-on-write tensor; `mut` is set (to the same address)
 * only by the _mut views, for outputs and tensors an op writes in place. */
typedef struct ng_tensor {
    AtenTensorHandle h;
    const void *data;
    void *mut;
    ng_dtype dtype;
    int32_t device_type;
    int32_t device_index;
    int64_t ndim;
    const int64_t *sizes;
    const int64_t *strides;
    int64_t numel;
} ng_tensor;

/* What one boxed call owns: tensor handles and scratch memory. ng_fail and
 * ng_frame_release release all of it. ng_take_args makes the frame own every
 * Tensor and Tensor[] argument before the first check, so no error path can
 * leak an argument. The first NG_FRAME_INLINE handles live in the frame; more
 * go to the heap. A frame refers to itself: never copy one. */
#define NG_FRAME_INLINE 16
typedef struct ng_frame {
    const char *op; /* "nanguard::stable_layernorm", for messages */
    int n, cap;
    AtenTensorHandle *owned;
    AtenTensorHandle inline_owned[NG_FRAME_INLINE];
    void **mem; /* scratch blocks from ng_frame_calloc */
    int nmem, capmem;
    DeviceGuardHandle guard;
    /* set by ng_take_args: the op's parsed schema and its boxed stack;
     * arg[i] for a Tensor at stack[i]; the elements of the (at most one)
     * Tensor[] argument */
    const ng_schema *schema;
    const StableIValue *stack;
    AtenTensorHandle arg[NG_SCHEMA_MAX_ARGS];
    AtenTensorHandle *list;
    size_t list_len;
} ng_frame;

void ng_frame_init(ng_frame *f, const char *op);
/* Take ownership of h (released by ng_frame_release / ng_fail). */
AtenTensorHandle ng_frame_own(ng_frame *f, AtenTensorHandle h);
void ng_frame_release(ng_frame *f);
/* Zeroed scratch memory freed with the frame; raises when out of memory. */
void *ng_frame_calloc(ng_frame *f, size_t count, size_t size);

/* Release the frame and raise RuntimeError("<op>: <message>"). Unwinds
 * through the caller: it never returns. */
__attribute__((noreturn)) void ng_fail(ng_frame *f, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The CUDA runtime's own message for the last NG_ERR_CUDA of this thread
 * (kernels/cuda_status.h); "" in the CPU library. */
const char *ng_kernel_error_detail(void);
/* True when PyTorch's thread pool failed during an ng_torch_parallel call on
 * this thread since the frame was initialised: the kernel's work is then
 * incomplete, and it is reported rather than re-run (an in-place kernel run
 * twice would apply twice). */
bool ng_parallel_failed(void);
/* Raise on a failed stable-ABI call or kernel status. */
#define NG_SHIM_CHECK(f, call)                                                                     \
    do {                                                                                           \
        if ((call) != 0)                                                                           \
            ng_fail((f), "PyTorch call failed: %s (%s:%d)", #call, __FILE__, __LINE__);            \
    } while (0)
#define NG_KERNEL_CHECK(f, call)                                                                   \
    do {                                                                                           \
        ng_status ng_ks_ = (call);                                                                 \
        if (ng_ks_ != NG_OK)                                                                       \
            ng_fail((f), "kernel failed: %s%s%s (%s) at %s:%d", ng_status_str(ng_ks_),             \
                    ng_ks_ == NG_ERR_CUDA ? ": " : "",                                             \
                    ng_ks_ == NG_ERR_CUDA ? ng_kernel_error_detail() : "", #call, __FILE__,        \
                    __LINE__);                                                                     \
        if (ng_parallel_failed())                                                                  \
            ng_fail((f),                                                                           \
                    "PyTorch's thread pool failed while running %s; its outputs are "              \
                    "incomplete (nothing was re-run)",                                             \
                    #call);                                                                        \
    } while (0)

/* Reading the boxed stack.
 *
 * ng_take_args is the first thing every boxed kernel does. `name` is the
 * op's name as its schema gives it ("safe_sdpa.masked"); the kinds and
 * names of its arguments come from that schema, parsed by ng_def. It
 * raises, touching nothing, unless num_args and num_outputs are the
 * schema's (a kernel registered against a schema of another nanguard
 * build); then the frame takes every Tensor (inline slots: this cannot
 * fail) and then the list's elements (whose only failure, out of host
 * memory, releases everything already taken).
 *
 * The readers below find an argument by its schema name and raise when the
 * schema has no argument of that name and kind. Read every argument before
 * the first ng_ret_tensor: outputs are written over the stack. */
void ng_take_args(ng_frame *f, const char *name, const StableIValue *stack, uint64_t num_args,
                  uint64_t num_outputs);
/* Whether the op's schema has an argument `name` (an overload's extra one). */
bool ng_has_arg(const ng_frame *f, const char *name);
AtenTensorHandle ng_arg_tensor(ng_frame *f, const char *name);
double ng_arg_float(ng_frame *f, const char *name);
int64_t ng_arg_int(ng_frame *f, const char *name);
bool ng_arg_bool(ng_frame *f, const char *name);
/* The Tensor[] argument's elements (frame scratch, stable for the call). */
size_t ng_arg_list(const ng_frame *f, AtenTensorHandle **out);
/* A Tensor argument that carries a few int64 values for the host (a dropout
 * [seed, offset] pair): it must be a contiguous CPU int64 tensor of exactly n
 * elements, whatever device the op runs on, so that a CUDA op can read it
 * before launching. The values are copied to out. Raises naming `name`
 * otherwise. */
void ng_host_int64s(ng_frame *f, AtenTensorHandle h, const char *name, int64_t n, int64_t *out);
/* Put an owned output on the stack; the frame gives up ownership. */
void ng_ret_tensor(ng_frame *f, StableIValue *stack, uint64_t i, AtenTensorHandle h);

/* Fill a read-only view of h (out->mut is NULL). Raises, naming `name`,
 * unless h is a strided tensor of a floating dtype nanguard handles (fp16,
 * bf16, fp32, fp64). */
void ng_view(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out);
/* The same for a tensor the op writes (an output, or an in-place argument):
 * out->mut is PyTorch's mutable data pointer. */
void ng_view_mut(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out);
/* ng_view / ng_view_mut for a strided tensor of any dtype (bool masks, int64
 * counters): returns PyTorch's dtype code; out->dtype is meaningful only for
 * the four floating dtypes. */
int32_t ng_view_raw(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out);
int32_t ng_view_raw_mut(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out);
/* "float32", "int64", ... for a PyTorch dtype code (for messages). */
const char *ng_torch_dtype_name(int32_t torch_dtype);
/* Map a PyTorch dtype code to ng_dtype; returns -1 when there is none. */
int ng_dtype_from_torch(int32_t torch_dtype);
int32_t ng_dtype_to_torch(ng_dtype t);

/* Validation shared by every op (each raises naming the arguments). */
void ng_check_same_device(ng_frame *f, const ng_tensor *a, const char *an, const ng_tensor *b,
                          const char *bn);
void ng_check_same_dtype(ng_frame *f, const ng_tensor *a, const char *an, const ng_tensor *b,
                         const char *bn);
/* Raise unless t is on the device this library serves (CPU in the core
 * library, CUDA in the CUDA one); fp64 is accepted on the CPU only. */
void ng_check_device_dtype(ng_frame *f, const ng_tensor *t, const char *name);
bool ng_is_contiguous(const ng_tensor *t);

/* New contiguous tensor, owned by f. */
AtenTensorHandle ng_empty(ng_frame *f, int64_t ndim, const int64_t *sizes, ng_dtype dtype,
                          int32_t device_type, int32_t device_index);
AtenTensorHandle ng_empty_like(ng_frame *f, const ng_tensor *t);
/* A kernel's scratch of at least `bytes` bytes (4-byte aligned) on like's
 * device, owned by f: from PyTorch's caching allocator, so on CUDA it is
 * freed with the frame after the launches that use it are queued
 * (stream-ordered reuse). NULL for bytes <= 0. */
void *ng_scratch(ng_frame *f, int64_t bytes, const ng_tensor *like);
/* t itself when contiguous, else a contiguous copy (owned by f); the view is
 * refreshed (read-only) either way. For inputs only: a copy of an in-place
 * argument would not write back. */
void ng_make_contiguous(ng_frame *f, ng_tensor *t);

/* Set the current device to t's for the rest of the call (CUDA tensors). */
void ng_device_guard(ng_frame *f, const ng_tensor *t);

/* The kernels' parallel hook, backed by torch_parallel_for. */
void ng_torch_parallel(int64_t n, int64_t grain, ng_range_fn fn, void *ctx);

/* Device codes, read once from PyTorch. */
int32_t ng_device_cpu(void);
int32_t ng_device_cuda(void);

/* ---- registration ------------------------------------------------------------ */
typedef void (*ng_boxed_fn)(StableIValue *stack, uint64_t num_args, uint64_t num_outputs);

typedef struct ng_registrar {
    TorchLibraryHandle def;  /* NULL in the CUDA library: schemas live in the core one */
    TorchLibraryHandle impl; /* CPU or CUDA; NULL: only fingerprint the schemas */
    int cuda;                /* 1 when registering CUDA implementations */
    uint64_t schema_hash;    /* FNV-1a over every schema string, in order */
    char *err;               /* the first registration failure is written here */
    size_t errlen;
} ng_registrar;

/* Define a schema (core library only) and register a kernel for it. Both
 * add the schema to r->schema_hash (also when r->def is NULL, so the CUDA
 * library computes the core's fingerprint) and record the first failure in
 * r->err, which makes the Python import fail. ng_def also parses the schema
 * into the table ng_take_args reads (in both libraries); a schema outside
 * shim/schema.h's grammar is such a failure, and is not defined. */
void ng_def(ng_registrar *r, const char *schema);
void ng_impl(ng_registrar *r, const char *name, ng_boxed_fn fn);
/* FNV-1a 64-bit offset basis: the initial schema_hash. */
#define NG_SCHEMA_HASH_INIT 0xcbf29ce484222325ULL

/* Exported for the Python test suite only (see shim.c). */
int ng_selftest_parallel_failure(void);

/* In the CUDA library: the current CUDA stream of a device, and whether the
 * function that gives it could be found in the running PyTorch. */
void *ng_cuda_current_stream(ng_frame *f, int32_t device_index);
int ng_cuda_stream_available(void);

#ifdef __cplusplus
}
#endif

#endif /* NG_SHIM_H */
