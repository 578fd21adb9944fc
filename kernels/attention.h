/*
 * kernels/attention.h - safe_sdpa kernels: NaN-safe flash-style attention.
 *
 * Forward:  out[b,h,i,:] = sum_j softmax_j(guard(scale * q_i . k_j) + mask_ij)
 *                          * keep_ij / (1 - p) * v_j
 *           lse[b,h,i]   = logsumexp_j(...)   (-inf for a fully masked row)
 * Backward: dq, dk, dv from q, k, v, out, dout and lse, recomputing the scores
 *           tile by tile (FlashAttention-2, Dao 2023); nothing of size L x S
 *           is stored. The per-score math is kernels/attention_math.h.
 *
 * Layout: every tensor is addressed as [B, heads, seq, dim] through int64
 * element strides for the first three dims; the last dim must be contiguous
 * (stride 1). Grouped-query attention: Hq % Hkv == 0 and query head h reads
 * kv head h / (Hq / Hkv); dk / dv sum over the heads of a group.
 * lse is a contiguous [B, Hq, L] buffer of fp32 (fp64 for fp64 inputs).
 */
#ifndef NG_KERNELS_ATTENTION_H
#define NG_KERNELS_ATTENTION_H

#include "kernels/attention_math.h"
#include "kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest head dim (E and Ev) the kernels take. */
#define NG_ATTN_MAX_HEAD_DIM 256

/* The forward takes its decode path (CPU) for L <= NG_ATTN_CPU_DEC_MAX_L
 * query rows against any S >= 1 keys, its decode kernel (CUDA) for
 * L <= NG_ATTN_DEC_MAX_L rows against any S >= 1 keys. On the
 * CPU the tiled path pads a block's queries to 32 columns of the score GEMM
 * from 17 rows on, and the row loops stay ahead of it up to about 22 rows
 * (B 1, S 1024-2048, head dim 128, one Zen 3 thread: 1.1-1.75x at 17-20
 * rows, GQA and MHA, fp32 and bf16; level at 24). */
#define NG_ATTN_CPU_DEC_MAX_L 20
#define NG_ATTN_DEC_MAX_L 16

typedef struct ng_attention_args {
    ng_dtype dtype; /* of q, k, v, out, dout, dq, dk, dv */
    int64_t B, Hq, Hkv, L, S, E, Ev;

    /* forward inputs / outputs: [batch, head, seq] element strides */
    const void *q;
    int64_t q_stride[3];
    const void *k;
    int64_t k_stride[3];
    const void *v;
    int64_t v_stride[3];
    void *out;
    int64_t out_stride[3]; /* written by fwd, read by bwd */
    void *lse;             /* [B, Hq, L], written by fwd, read by bwd */

    /* backward only */
    const void *dout;
    int64_t dout_stride[3];
    void *dq;
    int64_t dq_stride[3];
    void *dk;
    int64_t dk_stride[3];
    void *dv;
    int64_t dv_stride[3];

    /* optional mask broadcastable to [B, Hq, L, S]: strides 0 on broadcast dims */
    const void *mask;
    ng_mask_kind mask_kind;
    ng_dtype mask_dtype; /* additive masks only */
    int64_t mask_stride[4];

    int is_causal;    /* top-left: query i attends keys j <= i */
    double scale;     /* usually 1 / sqrt(E) */
    double max_score; /* <= 0: off */
    double softcap;   /* <= 0: off */
    double dropout_p; /* in [0, 1) */
    uint64_t seed, offset;
} ng_attention_args;

/* Shape, stride and pointer checks shared by every entry point. */
ng_status ng_attention_check(const ng_attention_args *a, int backward);

/* CPU kernels; par == NULL runs serially. ng_attention_fwd takes the
 * decode path below for short query blocks (L <= NG_ATTN_CPU_DEC_MAX_L,
 * S >= 1), the tiled flash path otherwise. */
ng_status ng_attention_fwd(const ng_attention_args *a, ng_parallel_fn par);
ng_status ng_attention_bwd(const ng_attention_args *a, ng_parallel_fn par);

/* The CPU forward's decode path for any shape (tests; ng_attention_fwd
 * picks it on its own): the query heads of a kv head and all their rows
 * share one read of each K / V row, long key ranges are split across tasks
 * and the splits' softmax statistics combined in a fixed order, so the
 * result does not depend on the runner. Same outputs, lse, masking,
 * guards, dropout elements and NaN rule as ng_attention_fwd. */
ng_status ng_attention_fwd_decode(const ng_attention_args *a, ng_parallel_fn par);

/* CUDA launchers (kernels/attention.cu): fp32 / fp16 / bf16 (fp64 gives
 * NG_ERR_DTYPE), lse fp32, stream is a cudaStream_t. None allocates: the
 * backward is two kernels (dk/dv per key block, dq per query block), after
 * a pre-kernel for D when given a workspace (ng_attention_bwd_cuda_ws). The
 * forward takes a decode kernel for the CPU's decode shapes (above): one
 * block reads a kv head once for up to 16 rows of the query heads that
 * share it. */
ng_status ng_attention_fwd_cuda(const ng_attention_args *a, void *stream);
ng_status ng_attention_bwd_cuda(const ng_attention_args *a, void *stream);
/* The forward with a device workspace (4-byte aligned) of at least
 * ng_attention_fwd_cuda_workspace_bytes(a) bytes, which lets the decode
 * kernel split long key ranges over blocks (split-KV) and merge the splits'
 * softmax statistics in a fixed order. Without one (NULL, as
 * ng_attention_fwd_cuda passes) each block reads all the keys. The split
 * sizes depend on the shape alone; the two forms differ only in fp32
 * summation order. A smaller or misaligned workspace is NG_ERR_INVALID_ARG. */
ng_status ng_attention_fwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                   int64_t workspace_bytes, void *stream);
/* 0 unless the shape is a decode shape with keys to split. */
int64_t ng_attention_fwd_cuda_workspace_bytes(const ng_attention_args *a);
/* The backward with a device workspace (4-byte aligned) of at least
 * ng_attention_bwd_cuda_workspace_bytes(a) bytes: a pre-kernel computes
 * D = rowsum(dout . out) of every query row once, in fp32, into it
 * ([B, Hq, L], the layout of lse), and the dk/dv and dq kernels read it.
 * With a padding mask (one that does not depend on the query, mask_stride[2]
 * == 0) a second pre-kernel marks, per kv head, the 64-key blocks that the
 * mask hides from every query head of the group ([B, Hkv, ceil(S / 64)]
 * ints after D), and the dk/dv kernels give those keys dk = dv = 0 without
 * computing them, as the CPU backward does. Without a workspace (NULL, as
 * ng_attention_bwd_cuda passes) the kernels compute D themselves for each
 * query tile they stage and compute every key block. The two forms differ
 * in fp32 summation order, and at the keys of such blocks when q or dout
 * holds a NaN: 0 with the workspace, NaN (0 * NaN inside the tile
 * products) without. A smaller or misaligned workspace is
 * NG_ERR_INVALID_ARG. */
ng_status ng_attention_bwd_cuda_ws(const ng_attention_args *a, void *workspace,
                                   int64_t workspace_bytes, void *stream);
/* 4 B Hq L, plus 4 B Hkv ceil(S / 64) with a padding mask (0 without query
 * rows, and for fp64). */
int64_t ng_attention_bwd_cuda_workspace_bytes(const ng_attention_args *a);

#ifdef __cplusplus
}
#endif

#endif /* NG_KERNELS_ATTENTION_H */
