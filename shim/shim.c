/*
 * shim/shim.c - nanguard's helpers over PyTorch's stable C ABI (see shim.h).
 *
 * Errors: aoti_torch_check(false, ...) raises a c10::Error that PyTorch turns
 * into a Python RuntimeError; it unwinds through these C frames (the library
 * is compiled with -fexceptions), so every owned handle is released first.
 * The message is formatted into a thread-local buffer that outlives the
 * throw, since PyTorch copies it when it builds the exception.
 */
#include "shim/shim.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#ifdef NG_BUILD_CUDA
#include "kernels/cuda_status.h"
const char *ng_kernel_error_detail(void) { return ng_cuda_error_string(); }
#else
const char *ng_kernel_error_detail(void) { return ""; }
#endif

_Static_assert(NG_SCHEMA_MAX_ARGS <= NG_FRAME_INLINE,
               "ng_take_args keeps every Tensor argument in the frame's inline slots");

static _Thread_local bool ng_par_failed;

bool ng_parallel_failed(void) { return ng_par_failed; }

void ng_frame_init(ng_frame *f, const char *op) {
    f->op = op;
    f->n = 0;
    f->cap = NG_FRAME_INLINE;
    f->owned = f->inline_owned;
    f->mem = NULL;
    f->nmem = f->capmem = 0;
    f->guard = NULL;
    f->schema = NULL;
    f->stack = NULL;
    memset(f->arg, 0, sizeof f->arg);
    f->list = NULL;
    f->list_len = 0;
    ng_par_failed = false;
}

/* Room for `extra` more handles; false when out of memory. */
static bool frame_reserve(ng_frame *f, size_t extra) {
    if ((size_t)f->n + extra <= (size_t)f->cap) return true;
    size_t cap = (size_t)f->cap;
    while (cap < (size_t)f->n + extra) cap *= 2;
    if (cap > (size_t)INT32_MAX) return false;
    AtenTensorHandle *p = (AtenTensorHandle *)malloc(cap * sizeof *p);
    if (!p) return false;
    memcpy(p, f->owned, (size_t)f->n * sizeof *p);
    if (f->owned != f->inline_owned) free(f->owned);
    f->owned = p;
    f->cap = (int)cap;
    return true;
}

AtenTensorHandle ng_frame_own(ng_frame *f, AtenTensorHandle h) {
    if (!frame_reserve(f, 1)) {
        aoti_torch_delete_tensor_object(h);
        ng_fail(f, "out of host memory");
    }
    f->owned[f->n++] = h;
    return h;
}

/* Make a malloc'd block part of the frame's scratch (freed with it). */
static void *frame_adopt(ng_frame *f, void *p) {
    if (f->nmem == f->capmem) {
        int cap = f->capmem ? 2 * f->capmem : 4;
        void **m = (void **)realloc(f->mem, (size_t)cap * sizeof *m);
        if (!m) {
            free(p);
            ng_fail(f, "out of host memory");
        }
        f->mem = m;
        f->capmem = cap;
    }
    f->mem[f->nmem++] = p;
    return p;
}

void *ng_frame_calloc(ng_frame *f, size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) ng_fail(f, "out of host memory (%zu x %zu bytes)", count, size);
    return frame_adopt(f, p);
}

void ng_frame_release(ng_frame *f) {
    for (int i = 0; i < f->n; i++)
        if (f->owned[i]) aoti_torch_delete_tensor_object(f->owned[i]);
    f->n = 0;
    if (f->owned != f->inline_owned) free(f->owned);
    f->owned = f->inline_owned;
    f->cap = NG_FRAME_INLINE;
    for (int i = 0; i < f->nmem; i++) free(f->mem[i]);
    free(f->mem);
    f->mem = NULL;
    f->nmem = f->capmem = 0;
    if (f->guard) {
        aoti_torch_delete_device_guard(f->guard);
        f->guard = NULL;
    }
}

static _Thread_local char ng_msg[1024];

void ng_fail(ng_frame *f, const char *fmt, ...) {
    int k = snprintf(ng_msg, sizeof ng_msg, "%s: ", f ? f->op : "nanguard");
    if (k < 0) k = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ng_msg + k, sizeof ng_msg - (size_t)k, fmt, ap);
    va_end(ap);
    if (f) ng_frame_release(f);
    aoti_torch_check(false, "nanguard", __FILE__, __LINE__, ng_msg);
    /* aoti_torch_check(false, ...) always throws. Were it ever to return, the
     * caller would go on with a released frame (use after free, a second
     * delete of each handle): stopping here is the only safe thing left. */
    abort();
}

/* ---- stack ------------------------------------------------------------------ */

void ng_take_args(ng_frame *f, const char *name, const StableIValue *stack, uint64_t num_args,
                  uint64_t num_outputs) {
    const ng_schema *sc = ng_schema_find(name);
    if (!sc) ng_fail(f, "no schema was registered for %s", name);
    const size_t nk = (size_t)sc->num_args;
    if (num_args != nk || num_outputs != (uint64_t)sc->num_returns)
        ng_fail(f,
                "called with %llu arguments and %llu outputs but this library's schema has %zu "
                "and %d: the loaded nanguard libraries come from different builds",
                (unsigned long long)num_args, (unsigned long long)num_outputs, nk, sc->num_returns);
    f->schema = sc;
    f->stack = stack;
    int list_at = -1;
    /* Every Tensor first: at most NG_SCHEMA_MAX_ARGS (<= NG_FRAME_INLINE) of
     * them, all in the frame's inline slots, so nothing can fail until the
     * frame owns them all. */
    for (size_t i = 0; i < nk; i++) {
        if (sc->args[i].kind == NG_ARG_TENSOR) {
            f->arg[i] = (AtenTensorHandle)(uintptr_t)stack[i];
            f->owned[f->n++] = f->arg[i];
        } else if (sc->args[i].kind == NG_ARG_TENSOR_LIST) {
            list_at = (int)i;
        }
    }
    if (list_at < 0) return;
    StableListHandle list = (StableListHandle)(uintptr_t)stack[list_at];
    size_t len = 0;
    if (torch_list_size(list, &len) != 0) {
        torch_delete_list(list);
        ng_fail(f, "could not read a Tensor[] argument");
    }
    /* Elements are owning handles. Make room for all of them first, so that
     * nothing can fail between reading an element and the frame owning it. */
    AtenTensorHandle *h = (AtenTensorHandle *)calloc(len ? len : 1, sizeof *h);
    bool room = h && frame_reserve(f, len);
    for (size_t k = 0; k < len; k++) {
        StableIValue v = 0;
        if (torch_list_get_item(list, k, &v) != 0) v = 0;
        AtenTensorHandle e = (AtenTensorHandle)(uintptr_t)v;
        if (room) {
            h[k] = e;
            if (e) f->owned[f->n++] = e;
        } else if (e) {
            aoti_torch_delete_tensor_object(e);
        }
    }
    torch_delete_list(list);
    if (!room) {
        free(h);
        ng_fail(f, "out of host memory reading a Tensor[] of %zu tensors", len);
    }
    frame_adopt(f, h);
    f->list = h;
    f->list_len = len;
    for (size_t k = 0; k < len; k++)
        if (!h[k]) ng_fail(f, "could not read element %zu of a Tensor[] argument", k);
}

static const char *kind_name(ng_arg_kind k) {
    switch (k) {
    case NG_ARG_TENSOR: return "Tensor";
    case NG_ARG_TENSOR_LIST: return "Tensor[]";
    case NG_ARG_INT: return "int";
    case NG_ARG_FLOAT: return "float";
    case NG_ARG_BOOL: return "bool";
    }
    return "?";
}

/* The stack position of argument `name`, which must be of kind k. A miss is
 * a mismatch between an op's code and its schema: raised on its first call. */
static uint64_t arg_at(ng_frame *f, const char *name, ng_arg_kind k) {
    const int i = f->schema ? ng_schema_arg_index(f->schema, name) : -1;
    if (i < 0)
        ng_fail(f, "internal error: the schema of %s has no argument %s",
                f->schema ? f->schema->name : "(not taken)", name);
    if (f->schema->args[i].kind != k)
        ng_fail(f, "internal error: argument %s of %s is a %s, read as a %s", name, f->schema->name,
                kind_name(f->schema->args[i].kind), kind_name(k));
    return (uint64_t)i;
}

bool ng_has_arg(const ng_frame *f, const char *name) {
    return f->schema && ng_schema_arg_index(f->schema, name) >= 0;
}

AtenTensorHandle ng_arg_tensor(ng_frame *f, const char *name) {
    return f->arg[arg_at(f, name, NG_ARG_TENSOR)];
}

size_t ng_arg_list(const ng_frame *f, AtenTensorHandle **out) {
    *out = f->list;
    return f->list_len;
}

double ng_arg_float(ng_frame *f, const char *name) {
    double d;
    memcpy(&d, &f->stack[arg_at(f, name, NG_ARG_FLOAT)], sizeof d);
    return d;
}

int64_t ng_arg_int(ng_frame *f, const char *name) {
    return (int64_t)f->stack[arg_at(f, name, NG_ARG_INT)];
}

bool ng_arg_bool(ng_frame *f, const char *name) {
    return (f->stack[arg_at(f, name, NG_ARG_BOOL)] & 0xff) != 0;
}

void ng_ret_tensor(ng_frame *f, StableIValue *stack, uint64_t i, AtenTensorHandle h) {
    for (int k = 0; k < f->n; k++) {
        if (f->owned[k] == h) {
            f->owned[k] = NULL;
            break;
        }
    }
    stack[i] = (StableIValue)(uintptr_t)h;
}

/* ---- dtypes and devices ----------------------------------------------------- */

int ng_dtype_from_torch(int32_t d) {
    if (d == aoti_torch_dtype_float32()) return NG_F32;
    if (d == aoti_torch_dtype_float64()) return NG_F64;
    if (d == aoti_torch_dtype_float16()) return NG_F16;
    if (d == aoti_torch_dtype_bfloat16()) return NG_BF16;
    return -1;
}

int32_t ng_dtype_to_torch(ng_dtype t) {
    switch (t) {
    case NG_F32: return aoti_torch_dtype_float32();
    case NG_F64: return aoti_torch_dtype_float64();
    case NG_F16: return aoti_torch_dtype_float16();
    case NG_BF16: return aoti_torch_dtype_bfloat16();
    }
    return aoti_torch_dtype_float32();
}

int32_t ng_device_cpu(void) { return aoti_torch_device_type_cpu(); }
int32_t ng_device_cuda(void) { return aoti_torch_device_type_cuda(); }

const char *ng_torch_dtype_name(int32_t d) {
    if (d == aoti_torch_dtype_float32()) return "float32";
    if (d == aoti_torch_dtype_float64()) return "float64";
    if (d == aoti_torch_dtype_float16()) return "float16";
    if (d == aoti_torch_dtype_bfloat16()) return "bfloat16";
    if (d == aoti_torch_dtype_int64()) return "int64";
    if (d == aoti_torch_dtype_bool()) return "bool";
    return "another dtype";
}

static const char *device_name(int32_t type) {
    if (type == ng_device_cpu()) return "cpu";
    if (type == ng_device_cuda()) return "cuda";
    return "another device";
}

static int32_t view_raw(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out,
                        bool mut) {
    int32_t dt = 0, layout = 0;
    out->h = h;
    NG_SHIM_CHECK(f, aoti_torch_get_layout(h, &layout));
    if (layout != aoti_torch_layout_strided())
        ng_fail(f, "%s must be a strided (dense) tensor", name);
    NG_SHIM_CHECK(f, aoti_torch_get_dtype(h, &dt));
    int t = ng_dtype_from_torch(dt);
    out->dtype = t < 0 ? NG_F32 : (ng_dtype)t;
    int64_t *sizes = NULL, *strides = NULL;
    NG_SHIM_CHECK(f, aoti_torch_get_dim(h, &out->ndim));
    NG_SHIM_CHECK(f, aoti_torch_get_sizes(h, &sizes));
    NG_SHIM_CHECK(f, aoti_torch_get_strides(h, &strides));
    NG_SHIM_CHECK(f, aoti_torch_get_numel(h, &out->numel));
    NG_SHIM_CHECK(f, aoti_torch_get_device_type(h, &out->device_type));
    NG_SHIM_CHECK(f, aoti_torch_get_device_index(h, &out->device_index));
    /* Inputs are only read: the const pointer leaves a copy-on-write tensor
     * shared, where the mutable one would materialise a copy. */
    out->mut = NULL;
    if (mut) {
        NG_SHIM_CHECK(f, torch_get_mutable_data_ptr(h, &out->mut));
        out->data = out->mut;
    } else {
        NG_SHIM_CHECK(f, torch_get_const_data_ptr(h, &out->data));
    }
    out->sizes = sizes;
    out->strides = strides;
    return dt;
}

int32_t ng_view_raw(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out) {
    return view_raw(f, h, name, out, false);
}

int32_t ng_view_raw_mut(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out) {
    return view_raw(f, h, name, out, true);
}

static void check_float(ng_frame *f, int32_t dt, const char *name) {
    if (ng_dtype_from_torch(dt) < 0)
        ng_fail(f, "%s must be float16, bfloat16, float32 or float64 (got %s)", name,
                ng_torch_dtype_name(dt));
}

void ng_view(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out) {
    check_float(f, view_raw(f, h, name, out, false), name);
}

void ng_view_mut(ng_frame *f, AtenTensorHandle h, const char *name, ng_tensor *out) {
    check_float(f, view_raw(f, h, name, out, true), name);
}

void ng_check_same_device(ng_frame *f, const ng_tensor *a, const char *an, const ng_tensor *b,
                          const char *bn) {
    if (a->device_type != b->device_type || a->device_index != b->device_index)
        ng_fail(f, "%s is on %s:%d but %s is on %s:%d; both must be on the same device", bn,
                device_name(b->device_type), (int)b->device_index, an, device_name(a->device_type),
                (int)a->device_index);
}

void ng_check_same_dtype(ng_frame *f, const ng_tensor *a, const char *an, const ng_tensor *b,
                         const char *bn) {
    if (a->dtype != b->dtype)
        ng_fail(f, "%s has dtype %s but %s has dtype %s; they must match", bn,
                ng_dtype_name(b->dtype), an, ng_dtype_name(a->dtype));
}

void ng_check_device_dtype(ng_frame *f, const ng_tensor *t, const char *name) {
#ifdef NG_BUILD_CUDA
    if (t->device_type != ng_device_cuda())
        ng_fail(f, "%s must be a CUDA tensor here (got %s)", name, device_name(t->device_type));
    if (t->dtype == NG_F64)
        ng_fail(f,
                "%s: float64 is supported on the CPU only (use float32, float16 or bfloat16 "
                "on CUDA)",
                name);
#else
    if (t->device_type != ng_device_cpu())
        ng_fail(f, "%s must be a CPU tensor here (got %s)", name, device_name(t->device_type));
#endif
}

bool ng_is_contiguous(const ng_tensor *t) {
    if (t->numel == 0) return true; /* PyTorch's rule: no element, any strides */
    int64_t expected = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        if (t->sizes[d] != 1 && t->strides[d] != expected) return false;
        expected *= t->sizes[d];
    }
    return true;
}

void ng_host_int64s(ng_frame *f, AtenTensorHandle h, const char *name, int64_t n, int64_t *out) {
    ng_tensor t;
    const int32_t dt = ng_view_raw(f, h, name, &t);
    if (t.device_type != ng_device_cpu())
        ng_fail(f, "%s must be a CPU tensor (its values are read on the host), got a %s tensor",
                name, device_name(t.device_type));
    if (dt != aoti_torch_dtype_int64())
        ng_fail(f, "%s must be an int64 tensor, got %s", name, ng_torch_dtype_name(dt));
    if (t.numel != n)
        ng_fail(f, "%s must have exactly %lld elements, got %lld", name, (long long)n,
                (long long)t.numel);
    if (!ng_is_contiguous(&t)) ng_fail(f, "%s must be contiguous", name);
    if (n > 0) memcpy(out, t.data, (size_t)n * sizeof *out);
}

/* ---- allocation --------------------------------------------------------------- */

AtenTensorHandle ng_empty(ng_frame *f, int64_t ndim, const int64_t *sizes, ng_dtype dtype,
                          int32_t device_type, int32_t device_index) {
    int64_t inline_strides[16];
    int64_t *strides = inline_strides;
    if (ndim > 16) strides = (int64_t *)ng_frame_calloc(f, (size_t)ndim, sizeof *strides);
    int64_t s = 1;
    for (int64_t d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        s *= sizes[d] > 0 ? sizes[d] : 1;
    }
    AtenTensorHandle h = NULL;
    NG_SHIM_CHECK(f, aoti_torch_empty_strided(ndim, sizes, strides, ng_dtype_to_torch(dtype),
                                              device_type, device_index, &h));
    return ng_frame_own(f, h);
}

AtenTensorHandle ng_empty_like(ng_frame *f, const ng_tensor *t) {
    return ng_empty(f, t->ndim, t->sizes, t->dtype, t->device_type, t->device_index);
}

void *ng_scratch(ng_frame *f, int64_t bytes, const ng_tensor *like) {
    if (bytes <= 0) return NULL;
    const int64_t n = NG_CEIL_DIV(bytes, (int64_t)sizeof(float));
    ng_tensor v;
    ng_view_mut(f, ng_empty(f, 1, &n, NG_F32, like->device_type, like->device_index), "scratch",
                &v);
    return v.mut;
}

void ng_make_contiguous(ng_frame *f, ng_tensor *t) {
    if (ng_is_contiguous(t)) return;
    AtenTensorHandle c = ng_empty_like(f, t);
    NG_SHIM_CHECK(f, aoti_torch_copy_(c, t->h, 0));
    ng_view(f, c, "tensor", t);
}

void ng_device_guard(ng_frame *f, const ng_tensor *t) {
    if (t->device_type != ng_device_cuda() || f->guard) return;
    NG_SHIM_CHECK(f, aoti_torch_create_device_guard(t->device_index, &f->guard));
}

/* ---- threads ---------------------------------------------------------------- */

typedef struct par_ctx {
    ng_range_fn fn;
    void *ctx;
} par_ctx;

static void par_trampoline(int64_t begin, int64_t end, void *ctx) {
    par_ctx *p = (par_ctx *)ctx;
    p->fn(begin, end, p->ctx);
}

/* torch_parallel_for turns an exception inside the pool into an error code,
 * possibly after other chunks of the range have run. Re-running the range
 * would apply an in-place kernel (gradient scaling, accumulation) twice, so
 * the failure is recorded instead and NG_KERNEL_CHECK raises it once the
 * kernel returns. The flag is per thread: the op's own thread calls this;
 * a nested call inside the pool runs serially and cannot fail this way. */
void ng_torch_parallel(int64_t n, int64_t grain, ng_range_fn fn, void *ctx) {
    par_ctx p = {.fn = fn, .ctx = ctx};
    if (torch_parallel_for(0, n, grain < 1 ? 1 : grain, par_trampoline, &p) != 0)
        ng_par_failed = true;
}

/* Self-test of the failure path above, for the Python test suite
 * (tests/python/test_hostile.py); never called by the ops. The range function
 * adds 1 to each element it is given and, on its first call only, then fails
 * the way a throwing callback fails inside PyTorch's pool. Returns the largest
 * number of times any element was processed (1 when nothing ran twice), or -1
 * when the failure went unreported. */
#define NG_SELFTEST_N 64
typedef struct selftest_ctx {
    atomic_int calls;
    atomic_int hits[NG_SELFTEST_N];
} selftest_ctx;

static void selftest_range(int64_t begin, int64_t end, void *ctx) {
    selftest_ctx *c = (selftest_ctx *)ctx;
    for (int64_t i = begin; i < end; i++) atomic_fetch_add(&c->hits[i], 1);
    if (atomic_fetch_add(&c->calls, 1) == 0)
        aoti_torch_check(false, "nanguard", __FILE__, __LINE__, "self-test: a failing range");
}

__attribute__((visibility("default"))) int ng_selftest_parallel_failure(void) {
    selftest_ctx c;
    atomic_init(&c.calls, 0);
    for (int i = 0; i < NG_SELFTEST_N; i++) atomic_init(&c.hits[i], 0);
    ng_par_failed = false;
    ng_torch_parallel(NG_SELFTEST_N, 1, selftest_range, &c);
    int most = 0;
    for (int i = 0; i < NG_SELFTEST_N; i++) {
        int h = atomic_load(&c.hits[i]);
        if (h > most) most = h;
    }
    const bool reported = ng_par_failed;
    ng_par_failed = false;
    return reported || most > 1 ? most : -1;
}

/* ---- registration ----------------------------------------------------------- */

static void record_failure(ng_registrar *r, const char *what, const char *name) {
    if (r->err && r->errlen && !r->err[0])
        snprintf(r->err, r->errlen, "could not %s %s%s", what, name, r->cuda ? " for CUDA" : "");
}

void ng_def(ng_registrar *r, const char *schema) {
    /* FNV-1a, 64-bit: the fingerprint of every schema, in order, that the
     * two libraries compare to be sure they read the same stack layouts. */
    for (const unsigned char *c = (const unsigned char *)schema; *c; c++)
        r->schema_hash = (r->schema_hash ^ *c) * 0x100000001b3ULL;
    r->schema_hash = (r->schema_hash ^ 0xff) * 0x100000001b3ULL; /* separator */
    ng_schema parsed;
    size_t at = 0;
    ng_schema_status st = ng_schema_parse(schema, &parsed, &at);
    if (st == NG_SCHEMA_OK) st = ng_schema_add(&parsed);
    if (st != NG_SCHEMA_OK) {
        if (r->err && r->errlen && !r->err[0])
            snprintf(r->err, r->errlen, "could not read the schema \"%s\" at character %zu: %s",
                     schema, at, ng_schema_status_str(st));
        return;
    }
    if (!r->def) return;
    if (aoti_torch_library_def(r->def, schema) != 0) record_failure(r, "define the schema", schema);
}

void ng_impl(ng_registrar *r, const char *name, ng_boxed_fn fn) {
    if (!r->impl) return;
    /* The build version passed is the ABI whose stack conventions the boxed
     * kernels follow (2.11), not the headers' version that PyTorch's C++
     * wrapper passes: nanguard reads the stack with its own C code, written
     * to the 2.11 conventions, so a newer runtime must convert to those. */
    if (torch_library_impl(r->impl, name, fn, NG_TORCH_TARGET_VERSION) != 0)
        record_failure(r, "register a kernel for", name);
}
