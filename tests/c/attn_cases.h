/*
 * tests/c/attn_cases.h - the attention cases and their tensor, mask and
 * argument builders, shared by test_attention.c (CPU kernels against an fp64
 * reference) and test_cuda_attention.c (CUDA launchers against the CPU
 * kernels).
 *
 * A case (acase) is one table row: sizes, layouts, mask, score guards,
 * dropout. Its tensors (atensor) are [B, H, N, D] views into a host buffer
 * (and, in the CUDA test, a device buffer laid out the same way); its mask
 * (amask) is stored broadcast, strides 0 on the broadcast dimensions, with
 * the generator's own flags beside it (1: masked), so a reference need not
 * read the kernel's mask convention.
 */
#ifndef NG_TEST_ATTN_CASES_H
#define NG_TEST_ATTN_CASES_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "tests/c/ng_test.h"
#include "tests/c/tolerance.h"

/* Tensor layouts. LAY_PAD: [B, H, N, D] with rows D + PAD_EXTRA apart;
 * LAY_SHIFT: [B, H, N, D] starting one element into its buffer (rows not
 * 16-byte aligned). */
enum { LAY_BHSD, LAY_BSHD, LAY_PAD, LAY_SHIFT };
#define PAD_EXTRA 5
/* Mask kinds: none, bool (true attends), additive with -inf or with the
 * dtype's lowest finite value at the masked positions. */
enum { AM_NONE, AM_BOOL, AM_NEG_INF, AM_LOWEST };
/* mask shape: [B, Hq, L, S], [B, 1, 1, S], [L, S], [B, Hq, 1, S] (padding per head) */
enum { MS_FULL, MS_PAD, MS_LS, MS_PAD_H };
/* Special inputs (the CUDA test's; see test_cuda_attention.c). */
enum { SP_NONE, SP_LARGE, SP_NAN, SP_NAN_DOUT, SP_PAD_TAIL, SP_PAD_HEAD, SP_RISING };

typedef struct acase {
    const char *name;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    int lay, out_lay; /* inputs (q, k, v, dout), outputs (out, dq, dk, dv) */
    int mask, mshape, full_rows, causal;
    double max_score, softcap, dropout, mag;
    int mask_f32;    /* additive mask stored as fp32 whatever the data dtype */
    int special;     /* SP_LARGE: q.k far beyond fp16's range (forward only: its
                        softmax is one-hot, so its gradients are rounding noise);
                        SP_NAN: one NaN in q; SP_NAN_DOUT: one NaN in dout;
                        SP_PAD_TAIL: batch 0's keys past S / 3 masked too
                        (with MS_PAD_H in head 0 only);
                        SP_PAD_HEAD: batch 0's keys below S - S / 8 masked
                        too, key 0 included (left padding);
                        SP_RISING (CPU test): keys 64..127 scaled by 3 and
                        128..191 by 40, so that the scores' max moves from
                        one key tile to the next by about the CPU forward's
                        lazy margin (8), then far beyond exp's range */
    uint64_t offset; /* dropout counter offset */
    int64_t tail;    /* with a mask: the last `tail` keys are masked in every row */
} acase;

/* ---- tensors ----------------------------------------------------------------- */

typedef struct atensor {
    int64_t B, H, N, D, st[3], shift, span; /* span: elements of the buffer, view at `shift` */
    size_t es;
    void *h, *d; /* the host buffer, the device buffer (CUDA test only) */
} atensor;

/* A zeroed host buffer for a [B, H, N, D] view in layout lay. */
static inline atensor at_new(ng_dtype t, int64_t B, int64_t H, int64_t N, int64_t D, int lay) {
    atensor x;
    memset(&x, 0, sizeof x);
    x.B = B, x.H = H, x.N = N, x.D = D;
    x.es = ng_dtype_size(t);
    if (lay == LAY_BSHD) { /* [B, N, H, D] memory, addressed as [B, H, N, D] */
        x.st[0] = N * H * D, x.st[1] = D, x.st[2] = H * D;
        x.span = B * N * H * D;
    } else {
        const int64_t rs = lay == LAY_PAD ? D + PAD_EXTRA : D;
        x.st[0] = H * N * rs, x.st[1] = N * rs, x.st[2] = rs;
        x.span = B * H * N * rs;
    }
    if (lay == LAY_SHIFT && x.span) x.shift = 1, x.span += 1;
    x.h = calloc((size_t)(x.span ? x.span : 1), x.es);
    return x;
}

/* Offset in the buffer (the view's own offset plus its shift). */
static inline int64_t at_off(const atensor *x, int64_t b, int64_t h, int64_t n, int64_t d) {
    return x->shift + b * x->st[0] + h * x->st[1] + n * x->st[2] + d;
}

/* The view's first element in buf (x->h or x->d): what the kernels get. */
static inline void *at_view(const atensor *x, void *buf) {
    return buf ? (char *)buf + (size_t)x->shift * x->es : NULL;
}

static inline size_t at_bytes(const atensor *x) { return (size_t)x->span * x->es; }

/* Element (b, h, n, d) of the host buffer. */
static inline double at_get(const atensor *x, ng_dtype t, int64_t b, int64_t h, int64_t n,
                            int64_t d) {
    return ng_load_f64(x->h, t, at_off(x, b, h, n, d));
}

/* Dense [B, H, N, D] fp64 copy of a buffer laid out like x. */
static inline double *at_dense(const atensor *x, ng_dtype t, const void *buf) {
    double *o = malloc(sizeof(double) * (size_t)(x->B * x->H * x->N * x->D + 1));
    int64_t k = 0;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t n = 0; n < x->N; n++)
                for (int64_t d = 0; d < x->D; d++)
                    o[k++] = ng_load_f64(buf, t, at_off(x, b, h, n, d));
    return o;
}

/* The inputs and outputs of one case. */
typedef struct aio {
    atensor q, k, v, dout, o, dq, dk, dv;
} aio;

/* ---- masks ------------------------------------------------------------------- */

typedef struct amask {
    void *p;       /* the stored mask: bool or additive of `dtype` */
    uint8_t *flag; /* 1 where the generator masked the element of p */
    size_t bytes;
    ng_dtype dtype;
    int64_t n, st[4]; /* elements of p; strides over [B, Hq, L, S] */
} amask;

static inline double at_urand(ng_rng *r) { /* uniform in [0, 1) */
    return 0.5 * (ng_rng_unif(r) + 1.0);
}

static inline double at_lowest(ng_dtype t) { /* the dtype's lowest finite value */
    return t == NG_F64   ? -DBL_MAX
           : t == NG_F32 ? -(double)FLT_MAX
           : t == NG_F16 ? -65504.0
                         : -3.3895313892515355e38; /* bf16 */
}

/* The case's mask in dtype mdt (additive masks), random with rng: about 30%
 * masked; with full_rows every query row i % 5 == 2 fully masked (or every
 * other batch row of a [B, 1, 1, S] padding mask), otherwise key 0 always
 * attended; then the case's padded tails. */
static inline amask amask_new(const acase *c, ng_dtype mdt, ng_rng *rng) {
    amask m;
    memset(&m, 0, sizeof m);
    m.dtype = mdt;
    if (c->mask == AM_NONE) return m;
    const int64_t S = c->S, mB = c->mshape == MS_LS ? 1 : c->B,
                  mH = c->mshape == MS_FULL || c->mshape == MS_PAD_H ? c->Hq : 1,
                  mL = c->mshape == MS_PAD || c->mshape == MS_PAD_H ? 1 : c->L;
    m.n = mB * mH * mL * S;
    m.st[0] = mB > 1 ? mH * mL * S : 0;
    m.st[1] = mH > 1 ? mL * S : 0;
    m.st[2] = mL > 1 ? S : 0;
    m.st[3] = 1;
    const size_t es = c->mask == AM_BOOL ? 1 : ng_dtype_size(mdt);
    m.bytes = (size_t)m.n * es;
    m.p = calloc((size_t)m.n + 1, es);
    m.flag = calloc((size_t)m.n + 1, 1);
    for (int64_t x = 0; x < m.n; x++) {
        const int64_t row = x / S, i = row % mL, j = x % S;
        int f = at_urand(rng) < 0.3;
        if (c->full_rows && mL > 1 && i % 5 == 2) f = 1;    /* fully masked query rows */
        if (c->full_rows && mL == 1 && row % 2 == 1) f = 1; /* a fully padded batch */
        if (j == 0 && !c->full_rows) f = 0;                 /* otherwise no row is empty */
        if (j >= S - c->tail) f = 1;                        /* a padded tail (whole key splits) */
        if (c->special == SP_PAD_TAIL && row == 0 && j >= S / 3) f = 1;
        if (c->special == SP_PAD_HEAD && row == 0 && j < S - S / 8) f = 1;
        m.flag[x] = (uint8_t)f;
        if (c->mask == AM_BOOL)
            ((uint8_t *)m.p)[x] = (uint8_t)!f;
        else
            ng_store_f64(m.p, mdt, x,
                         f ? (c->mask == AM_NEG_INF ? -INFINITY : at_lowest(mdt))
                           : -1.5 * at_urand(rng));
    }
    return m;
}

static inline void amask_free(amask *m) {
    free(m->p);
    free(m->flag);
}

/* ---- arguments --------------------------------------------------------------- */

/* One [B, heads, seq] stride triple for all eight tensors of a. */
static inline void attn_same_strides(ng_attention_args *a, const int64_t st[3]) {
    int64_t *const all[] = {a->q_stride,    a->k_stride,  a->v_stride,  a->out_stride,
                            a->dout_stride, a->dq_stride, a->dk_stride, a->dv_stride};
    for (size_t x = 0; x < sizeof all / sizeof all[0]; x++) memcpy(all[x], st, 3 * sizeof *st);
}

/* The kernel arguments of a case: the views of io's host buffers (device:
 * 0) or device buffers (device: 1), lse, the stored mask at mask_buf (m's
 * host or device copy). */
static inline ng_attention_args attn_args(const acase *c, ng_dtype t, const aio *io, int device,
                                          void *lse, const amask *m, const void *mask_buf,
                                          double scale) {
#define NG_AT_BUF(x) at_view(&io->x, device ? io->x.d : io->x.h)
    ng_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = t;
    a.B = c->B, a.Hq = c->Hq, a.Hkv = c->Hkv, a.L = c->L, a.S = c->S, a.E = c->E, a.Ev = c->Ev;
    a.q = NG_AT_BUF(q), memcpy(a.q_stride, io->q.st, sizeof io->q.st);
    a.k = NG_AT_BUF(k), memcpy(a.k_stride, io->k.st, sizeof io->k.st);
    a.v = NG_AT_BUF(v), memcpy(a.v_stride, io->v.st, sizeof io->v.st);
    a.out = NG_AT_BUF(o), memcpy(a.out_stride, io->o.st, sizeof io->o.st);
    a.lse = lse;
    a.dout = NG_AT_BUF(dout), memcpy(a.dout_stride, io->dout.st, sizeof io->dout.st);
    a.dq = NG_AT_BUF(dq), memcpy(a.dq_stride, io->dq.st, sizeof io->dq.st);
    a.dk = NG_AT_BUF(dk), memcpy(a.dk_stride, io->dk.st, sizeof io->dk.st);
    a.dv = NG_AT_BUF(dv), memcpy(a.dv_stride, io->dv.st, sizeof io->dv.st);
#undef NG_AT_BUF
    if (c->mask != AM_NONE) {
        a.mask = mask_buf;
        a.mask_kind = c->mask == AM_BOOL ? NG_MASK_BOOL : NG_MASK_ADD;
        a.mask_dtype = m->dtype;
        memcpy(a.mask_stride, m->st, sizeof m->st);
    }
    a.is_causal = c->causal;
    a.scale = scale;
    a.max_score = c->max_score;
    a.softcap = c->softcap;
    a.dropout_p = c->dropout;
    a.seed = 0x1234567887654321ull;
    a.offset = c->offset;
    return a;
}

#endif /* NG_TEST_ATTN_CASES_H */
