/*
 * ops/tensor_stats.c - torch.ops.nanguard.tensor_stats_: the non-finite
 * census of one tensor, written into one slot of a preallocated buffer
 * (kernels/tensor_stats.h).
 *
 * Schema (ops/ops.h, NG_TENSOR_STATS_SCHEMAS):
 *   tensor_stats_(Tensor x, Tensor(a!) counts, Tensor(b!) values, int slot) -> ()
 *
 * Buffer layout (nanguard.watch owns one pair per device and grows it):
 *   counts: int64   [S, 3], contiguous: NaN, +Inf, -Inf            (exact)
 *   values: float64 [S, 2], contiguous: max |x| over finite values
 *                                       (0 when none), min non-zero |x| over
 *                                       finite values (+inf when none)
 * Row `slot` (0 <= slot < S) of both is overwritten; nothing else is touched,
 * nothing is allocated and nothing is synchronised with the host.
 *
 * x may be any float16 / bfloat16 / float32 / float64 tensor, any layout: a
 * view is read in place through its strides when it has at most
 * NG_TS_MAX_DIMS dimensions after merging contiguous ones, and is copied to a
 * contiguous tensor only beyond that. float64 is accepted on CUDA too (this
 * op only reads it).
 */
#include "kernels/tensor_stats.h"
#include "ops/ops.h"

#define TS_OP "nanguard::tensor_stats_"

static void ts_boxed(StableIValue *stack, uint64_t na, uint64_t no) {
    ng_frame f;
    ng_frame_init(&f, TS_OP);
    ng_take_args(&f, "tensor_stats_", stack, na, no);
    ng_tensor x, counts, values;
    ng_view(&f, ng_arg_tensor(&f, "x"), "x", &x);
    /* counts is int64: the view without ng_view's floating-dtype check */
    const int32_t counts_dtype =
        ng_view_raw_mut(&f, ng_arg_tensor(&f, "counts"), "counts", &counts);
    ng_view_mut(&f, ng_arg_tensor(&f, "values"), "values", &values);
    const int64_t slot = ng_arg_int(&f, "slot");

    /* x: this library's device; float64 is fine on CUDA for a read-only op. */
    ng_tensor probe = x;
    if (probe.dtype == NG_F64) probe.dtype = NG_F32;
    ng_check_device_dtype(&f, &probe, "x");
    ng_check_same_device(&f, &x, "x", &values, "values");
    ng_check_same_device(&f, &x, "x", &counts, "counts");
    if (values.dtype != NG_F64 || values.ndim != 2 || values.sizes[1] != NG_TS_NVALUES ||
        !ng_is_contiguous(&values))
        ng_fail(&f, "values must be a contiguous float64 tensor of shape [slots, %d]",
                (int)NG_TS_NVALUES);
    if (counts_dtype != aoti_torch_dtype_int64() || counts.ndim != 2 ||
        counts.sizes[1] != NG_TS_NCOUNTS || !ng_is_contiguous(&counts))
        ng_fail(&f, "counts must be a contiguous int64 tensor of shape [slots, %d]",
                (int)NG_TS_NCOUNTS);
    if (counts.sizes[0] != values.sizes[0])
        ng_fail(&f, "counts has %lld slots but values has %lld; they must match",
                (long long)counts.sizes[0], (long long)values.sizes[0]);
    if (slot < 0 || slot >= counts.sizes[0])
        ng_fail(&f, "slot %lld is out of range for a buffer of %lld slots", (long long)slot,
                (long long)counts.sizes[0]);

    /* Merge contiguous dimensions; copy only what the kernel cannot walk. */
    ng_tensor_stats_args a;
    memset(&a, 0, sizeof a);
    int64_t sizes[64], strides[64];
    int64_t nd = x.ndim;
    if (nd <= 64) {
        for (int64_t d = 0; d < nd; d++) sizes[d] = x.sizes[d], strides[d] = x.strides[d];
        nd = ng_ts_coalesce(nd, sizes, strides);
    }
    if (nd > NG_TS_MAX_DIMS) {
        ng_make_contiguous(&f, &x);
        nd = 1;
        sizes[0] = x.numel;
        strides[0] = 1;
    }
    a.dtype = x.dtype;
    a.x = x.data;
    a.ndim = nd;
    for (int64_t d = 0; d < nd; d++) a.sizes[d] = sizes[d], a.strides[d] = strides[d];
    a.counts = (int64_t *)counts.mut + slot * NG_TS_NCOUNTS;
    a.values = (double *)values.mut + slot * NG_TS_NVALUES;
    ng_device_guard(&f, &x);
#ifdef NG_BUILD_CUDA
    NG_KERNEL_CHECK(&f, ng_tensor_stats_cuda(&a, ng_cuda_current_stream(&f, x.device_index)));
#else
    NG_KERNEL_CHECK(&f, ng_tensor_stats(&a, ng_torch_parallel));
#endif
    ng_frame_release(&f);
}

void ng_register_tensor_stats(ng_registrar *r) {
    NG_TENSOR_STATS_SCHEMAS(NG_DEF_EACH)
    ng_impl(r, "tensor_stats_", ts_boxed);
}
