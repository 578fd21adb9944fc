"""``safe_sdpa`` and its backward in PyTorch operations.

The composite path of ops/attention.c and kernels/attention.c, with their
numerics (kernels/attention_math.h). For query row i and key j:

    raw = scale * <q_i, k_j>                 fp32 (fp64 for fp64 inputs)
    s   = clamp(raw, -max_score, max_score)  when max_score > 0 (NaN stays NaN)
    s   = softcap * tanh(s / softcap)        when softcap > 0
    s   = s + mask_ij, or -inf where masked  (bool False; additive -inf or
                                              <= finfo(mask dtype).min; j > i
                                              under is_causal, top-left)
    p   = softmax_j(s),  lse = logsumexp_j(s)
    out = sum_j p_ij * keep_ij / (1 - dropout_p) * v_j

The kernel's online softmax becomes a plain one over all keys of a block of
query rows: the rows are processed in chunks, so that one [B, Hq, rows, S]
score block never holds more than ``_BLOCK_ELEMS`` elements (one row per
chunk when a single row is larger). Under is_causal or a mask a chunk is at
most 64 rows, the kernels' tile, and takes only the keys up to the last one
any of its rows sees (``_Attn.keys``: its last row under is_causal; on the
CPU, where reading the mask on the host is free, its last unmasked key): the
keys past it are masked for all of its rows, as in the tiles the C skips
(those above the diagonal, a padded tail), so a causal mask passed as a
tensor gives the bits of is_causal. Everything is computed in the
accumulation dtype and rounded to the input dtype once, at the end: the
backward's dS in particular stays fp32 (an fp16 dS can overflow where every
result is finite).

The rules of the kernels, kept here with ``torch.where`` so that no
intermediate tensor holds a NaN the C does not make:

- a fully masked row (running max -inf) is "empty": its exponentials are
  taken against 0 instead of the max, never as exp(-inf - -inf); it ends
  with l = 0, output 0 (acc times 1/l taken as 0) and lse -inf, and the
  backward gives it P = 0, hence zero gradients;
- NaN is never hidden: the row max propagates NaN (``amax``), clamp keeps
  it, and a row with a NaN score has NaN output and lse. As in the C, a
  probability of exactly 0 contributes 0 to dS whatever dP holds, while the
  products P V, dS K, P^T dO and dS^T Q are plain matrix products: a NaN in
  key, value, query or grad_out meets the zero probabilities of masked
  positions as 0 * NaN = NaN, which the C does in every tile it computes;
- a key that no query of its kv group sees (masked for every row of every
  head of the group, or past the last row under is_causal) is left out: its
  key and value rows count as 0 and its gradients are exactly 0, so that a
  NaN held there, or met there, reaches nothing. The C kernels skip each
  64 x 64 tile whose pairs are all masked (a padding mask's tail), which
  leaves out such keys wherever they fill a whole tile; this rule is the
  same without depending on a tile size;
- dropout is the kernels' Philox4x32-10 stream, bit for bit: element
  e = ((b*Hq + h)*L + i)*S + j is kept when the top 24 bits of word e % 4 of
  the block for counter (e / 4, offset) under key seed, times 2^-24, are
  >= fp32(dropout_p). The 32x32-bit products of the rounds are formed in
  int64, whose wrapping product keeps the low 64 bits of the exact one.

The arguments are validated as ops/attention.c validates them, with its
messages, raised as RuntimeError; there is no head-dim limit here.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ._checks import FLOAT_DTYPES, FP32_ZERO
from ._checks import FLT_MAX as _FLT_MAX
from ._checks import check as _check
from ._checks import dtype_name as _dtype_name
from ._checks import read_free as _read_free

__all__ = ["KERNELS"]

_FWD = "nanguard::safe_sdpa"
_BWD = "nanguard::safe_sdpa_backward"
_FLOAT_DTYPES = FLOAT_DTYPES

#: the most elements of one [B, Hq, rows, S] block of scores (64 MiB in fp32);
#: the backward holds about six such blocks at once, the dropout mask one int64
#: and one int32 block more
_BLOCK_ELEMS = 1 << 24

_NEG_INF = float("-inf")
#: query rows per chunk under is_causal or a mask: the kernels' 64-row tiles
_TILE_ROWS = 64

# Philox4x32-10 (Salmon et al., SC'11): round multipliers and key increments
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


# ---- argument checks (ops/attention.c) -----------------------------------------------


def _check_float(op: str, t: torch.Tensor, name: str) -> None:
    """ng_view: a strided tensor of one of the four float dtypes."""
    _check(isinstance(t, torch.Tensor), op, lambda: f"{name} must be a tensor")
    _check(t.layout == torch.strided, op, lambda: f"{name} must be a strided (dense) tensor")
    _check(
        t.dtype in _FLOAT_DTYPES,
        op,
        lambda: f"{name} must be float16, bfloat16, float32 or float64 (got {_dtype_name(t.dtype)})",
    )


def _check_same(op: str, q: torch.Tensor, t: torch.Tensor, name: str) -> None:
    _check(
        t.device == q.device,
        op,
        lambda: f"{name} is on {t.device} but query is on {q.device}; both must be on the same device",
    )
    _check(
        t.dtype == q.dtype,
        op,
        lambda: f"{name} has dtype {_dtype_name(t.dtype)} but query has dtype {_dtype_name(q.dtype)}; they must match",
    )


def _check_qkv(op: str, t: torch.Tensor, name: str, q: Optional[torch.Tensor]) -> None:
    _check(t.dim() == 4, op, lambda: f"{name} must be 4-d [batch, heads, seq, head_dim], got {t.dim()} dims")
    if q is not None:
        _check_same(op, q, t, name)


def _check_mask(op: str, mask: torch.Tensor) -> None:
    _check(isinstance(mask, torch.Tensor), op, "attn_mask must be a tensor")
    _check(mask.layout == torch.strided, op, "attn_mask must be a strided (dense) tensor")
    _check(
        mask.dtype == torch.bool or mask.dtype in _FLOAT_DTYPES,
        op,
        lambda: f"attn_mask must be bool or float16, bfloat16, float32 or float64 (got {_dtype_name(mask.dtype)})",
    )


def _read_rng(op: str, rng: torch.Tensor) -> Tuple[int, int]:
    """ng_host_int64s: [seed, offset] from a contiguous CPU int64 tensor of 2."""
    _check(isinstance(rng, torch.Tensor), op, "rng must be a tensor")
    _check(rng.layout == torch.strided, op, "rng must be a strided (dense) tensor")
    _check(
        rng.device.type == "cpu",
        op,
        lambda: f"rng must be a CPU tensor (its values are read on the host), got a {rng.device.type} tensor",
    )
    _check(rng.dtype == torch.int64, op, lambda: f"rng must be an int64 tensor, got {_dtype_name(rng.dtype)}")
    _check(rng.numel() == 2, op, lambda: f"rng must have exactly 2 elements, got {rng.numel()}")
    _check(rng.is_contiguous(), op, "rng must be contiguous")
    seed, offset = rng.reshape(2).tolist()
    return seed, offset


def _check_params(op: str, dropout_p: float, scale: float, max_score: float, softcap: float) -> None:
    _check(0.0 <= dropout_p < 1.0, op, lambda: f"dropout_p must be in [0, 1), got {dropout_p:g}")
    _check(math.isfinite(scale), op, lambda: f"scale must be finite, got {scale:g}")
    _check(not math.isnan(max_score), op, "max_score must not be NaN (<= 0 turns the clamp off)")
    # softcap * tanh(s / softcap) is inf * 0 = NaN at +inf: refused, like NaN
    _check(
        not (math.isnan(softcap) or softcap == math.inf),
        op,
        lambda: f"softcap must be finite, got {softcap:g} (<= 0 turns the soft-cap off)",
    )


def _check_fp32_params(op: str, dtype: torch.dtype, scale: float, max_score: float, softcap: float) -> None:
    """check_fp32_params of ops/attention.c: for inputs scored in fp32, no
    scale or soft-cap past FLT_MAX, no clamp or soft-cap that rounds to 0."""
    if dtype == torch.float64:
        return
    dn = _dtype_name(dtype)
    _check(abs(scale) <= _FLT_MAX, op, lambda: f"scale must be at most {_FLT_MAX:g} in magnitude for {dn} inputs "
           f"(their scores are float32), got {scale:g}")
    _check(softcap <= _FLT_MAX, op, lambda: f"softcap must be at most {_FLT_MAX:g} for {dn} inputs "
           f"(their scores are float32), got {softcap:g}")
    _check(not 0.0 < max_score <= FP32_ZERO, op,
           lambda: f"max_score {max_score:g} is 0 in float32 (the scores of {dn} inputs), which turns the clamp off; "
           "use 0 for off")
    _check(not 0.0 < softcap <= FP32_ZERO, op,
           lambda: f"softcap {softcap:g} is 0 in float32 (the scores of {dn} inputs), which turns the soft-cap off; "
           "use 0 for off")


def _check_shapes(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    B, Hq, _, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    _check(
        k.shape[0] == B and v.shape[0] == B,
        op,
        lambda: f"key and value must have the batch size of query ({B}), got {k.shape[0]} and {v.shape[0]}",
    )
    _check(k.shape[3] == E, op, lambda: f"key's head dim ({k.shape[3]}) must equal query's ({E})")
    _check(
        v.shape[1] == Hkv and v.shape[2] == S,
        op,
        lambda: f"value must have key's heads and sequence length ([{Hkv}, {S}]), got [{v.shape[1]}, {v.shape[2]}]",
    )
    _check(Hq >= 1, op, lambda: f"query must have at least one head, got {Hq}")
    _check(Hkv >= 1 and Hq % Hkv == 0, op, lambda: f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    _check(E >= 1 and Ev >= 1, op, lambda: f"head dims must be at least 1, got query/key {E} and value {Ev}")


def _check_mask_shape(op: str, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    _check(mask.dim() == 4, op, lambda: f"attn_mask must be 4-d (broadcastable to [B, H, L, S]), got {mask.dim()} dims")
    _check(
        mask.device == q.device,
        op,
        lambda: f"attn_mask is on {mask.device} but query is on {q.device}; both must be on the same device",
    )
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    for d, dim in enumerate(("batch", "heads", "query length", "key length")):
        _check(
            mask.shape[d] in (want[d], 1),
            op,
            lambda: f"attn_mask's {dim} dim is {mask.shape[d]}; it must be {want[d]} or 1",
        )


# ---- the score pipeline (kernels/attention_math.h) -----------------------------------


class _Attn:
    """One call's inputs in the accumulation dtype, and its scalars as that
    dtype rounds them (the kernels test and apply the rounded values)."""

    def __init__(self, q, k, v, mask, dropout_p, is_causal, scale, max_score, softcap, seed, offset):
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.B, self.Hq, self.L, self.E = q.shape
        self.Hkv, self.S, self.Ev = k.shape[1], k.shape[2], v.shape[3]
        self.mask = mask
        self.is_causal = bool(is_causal)
        self.unseen = _unseen_keys(mask, self.is_causal, self.B, self.Hq, self.Hkv, self.L, self.S, q.device)
        self.q = q.to(self.acc)
        k, v = k.to(self.acc), v.to(self.acc)
        if self.unseen is not None:  # a NaN there reaches nothing
            k = torch.where(self.unseen, 0.0, k)
            v = torch.where(self.unseen, 0.0, v)
        self.kt = k.transpose(-1, -2)  # [B, Hkv, E, S]
        self.v = v
        self.scale = self._round(scale)
        self.max_score = self._round(max_score)
        self.softcap = self._round(softcap)
        self.dropout_p = float(dropout_p)
        self.seed, self.offset = seed, offset
        # rows per chunk: at most _BLOCK_ELEMS scores, one row at the least;
        # under is_causal at most _CAUSAL_ROWS, so that each chunk's keys
        # stop at its last row (keys()) and the masked triangle is not computed
        self.rows = max(1, _BLOCK_ELEMS // max(1, self.B * self.Hq * self.S))
        # a mask is read on the host (which key each chunk sees last) where
        # that waits for no device queue
        self.trim_mask = mask is not None and mask.shape[3] > 1 and _read_free(q.device)
        if self.is_causal or self.trim_mask:
            self.rows = min(self.rows, _TILE_ROWS)
        self._keys: Dict[int, int] = {}

    def keys(self, i0: int, i1: int) -> int:
        """How many keys rows [i0, i1) are given: all, or up to the last one
        any of them sees: [0, i1) under is_causal (top-left: key j > row i is
        masked), and on the CPU up to the mask's last unmasked key of the
        chunk (a NaN there counts as seen). The keys past it are masked for
        every row of the chunk and would add nothing but 0 * NaN."""
        if i0 in self._keys:
            return self._keys[i0]
        j1 = min(self.S, i1) if self.is_causal else self.S
        if self.trim_mask:
            m = self.mask if self.mask.shape[2] == 1 else self.mask[:, :, i0:i1]
            m = m[..., :j1]
            seen = m if m.dtype == torch.bool else ~(m <= torch.finfo(m.dtype).min)
            cols = seen.reshape(-1, j1).any(0)
            # the last key seen, one at the least (a chunk of empty rows)
            j1 = max(1, j1 - int(cols.flip(0).to(torch.uint8).argmax()) if bool(cols.any()) else 1)
        self._keys[i0] = j1
        return j1

    def _round(self, x: float) -> float:
        return torch.tensor(float(x), dtype=self.acc).item()

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hq, n, D] -> [B, Hkv, G*n, D]: query head h is (h // G, h % G)."""
        return x.reshape(self.B, self.Hkv, -1, x.shape[-1])

    def ungrouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B, self.Hq, -1, x.shape[-1])

    def scores(self, i0: int, i1: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(raw, s) of query rows [i0, i1) against keys [0, keys(i0, i1)): the
        scaled dot products, and the clamped / soft-capped, masked scores
        ([B, Hq, i1 - i0, keys(i0, i1)])."""
        j1 = self.keys(i0, i1)
        raw = self.ungrouped(self.grouped(self.q[:, :, i0:i1]) @ self.kt[..., :j1]) * self.scale
        s = raw
        if self.max_score > 0:
            s = torch.clamp(s, -self.max_score, self.max_score)
        if self.softcap > 0:
            s = self.softcap * torch.tanh(s / self.softcap)
        if self.mask is not None:
            m = self.mask if self.mask.shape[2] == 1 else self.mask[:, :, i0:i1]
            m = m if m.shape[3] == j1 else m[..., :j1]
            if m.dtype == torch.bool:
                s = torch.where(m, s, _NEG_INF)
            else:
                # -inf and finfo.min mask; NaN does not, and poisons the score
                dead = m <= torch.finfo(m.dtype).min
                if m.dtype == torch.float64 and self.acc == torch.float32:
                    added = (s.double() + m).float()  # the C adds in fp64, then rounds
                else:
                    added = s + m.to(self.acc)
                s = torch.where(dead, _NEG_INF, added)
        if self.is_causal:
            i = torch.arange(i0, i1, device=s.device).unsqueeze(-1)
            j = torch.arange(j1, device=s.device)
            s = s.masked_fill(j > i, _NEG_INF)
        return raw, s

    def transform_grad(self, raw: torch.Tensor) -> torch.Tensor:
        """d s / d raw through clamp and soft-cap: 0 where clamped, else
        1 - tanh^2(clamp(raw) / softcap)."""
        g = torch.ones_like(raw)
        c = raw
        if self.max_score > 0:
            g = torch.where((raw > self.max_score) | (raw < -self.max_score), 0.0, g)
            c = torch.clamp(raw, -self.max_score, self.max_score)
        if self.softcap > 0:
            t = torch.tanh(c / self.softcap)
            g = g * (1.0 - t * t)
        return g

    def keep_scale(self, i0: int, i1: int) -> torch.Tensor:
        """keep / (1 - p) of rows [i0, i1) ([B, Hq, i1 - i0, keys(i0, i1)]): 1 / (1 - p)
        rounded to the accumulation dtype where kept, 0 where dropped."""
        p = self.dropout_p
        # u = (w >> 8) * 2^-24 >= fp32(p), exactly, as an integer test
        threshold = math.ceil(torch.tensor(p, dtype=torch.float32).item() * 2.0**24)
        words = _dropout_words(self.seed, self.offset, self.B * self.Hq, self.L, self.S, i0, i1, self.q.device)
        keep = (words >= threshold).reshape(self.B, self.Hq, i1 - i0, self.S)[..., : self.keys(i0, i1)]
        return keep.to(self.acc) * self._round(1.0 / (1.0 - p))


def _unseen_keys(mask, is_causal, B, Hq, Hkv, L, S, device) -> Optional[torch.Tensor]:
    """[B, Hkv, S, 1]: True at the keys that no query row of any head of
    the kv group sees (masked for all of them, or past the last row under
    is_causal); None when there can be none."""
    if mask is None and (not is_causal or L >= S):
        return None
    unseen = torch.zeros((B, Hkv, S), dtype=torch.bool, device=device)
    if mask is not None:
        dead = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min
        per_head = dead.all(dim=2).expand(B, Hq, S)
        unseen = per_head.reshape(B, Hkv, Hq // Hkv, S).all(dim=2)
    if is_causal:
        unseen = unseen | (torch.arange(S, device=device) >= L)
    return unseen.unsqueeze(-1)


def _philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> List[torch.Tensor]:
    """Philox4x32-10 of int64 tensors holding 32-bit counter words, which it
    overwrites with the result. In place: a fresh tensor per step made the
    rounds 6x slower on the CPU (allocation, not arithmetic)."""
    p0, p1 = torch.empty_like(c0), torch.empty_like(c0)
    for _ in range(10):
        torch.mul(c0, _PHILOX_M0, out=p0)  # the exact product's low 64 bits
        torch.mul(c2, _PHILOX_M1, out=p1)
        torch.bitwise_right_shift(p1, 32, out=c0)  # c0 = hi(p1) ^ c1 ^ k0
        c0.bitwise_and_(_U32).bitwise_xor_(c1).bitwise_xor_(k0)
        torch.bitwise_right_shift(p0, 32, out=c2)  # c2 = hi(p0) ^ c3 ^ k1
        c2.bitwise_and_(_U32).bitwise_xor_(c3).bitwise_xor_(k1)
        torch.bitwise_and(p1, _U32, out=c1)  # c1 = lo(p1)
        torch.bitwise_and(p0, _U32, out=c3)  # c3 = lo(p0)
        k0 = (k0 + _PHILOX_W0) & _U32
        k1 = (k1 + _PHILOX_W1) & _U32
    return [c0, c1, c2, c3]


def _dropout_words(seed: int, offset: int, BH: int, L: int, S: int, i0: int, i1: int, device) -> torch.Tensor:
    """The top 24 bits (w >> 8) of the draws of rows [i0, i1) of every (batch,
    head), [BH, (i1 - i0) * S] int32. Head bh's elements are the flat range
    [e0, e0 + n), e0 = bh*L*S + i0*S; the Philox blocks from e0 / 4 on are
    drawn once each (4 words a block) and the range starts at word e0 % 4 of
    the first, which repeats with period 4 in bh: four strided copies pick it."""
    n = (i1 - i0) * S
    nblk = (n + 3) // 4 + 1  # a range starting at word 3 spills into one block more
    e0 = torch.arange(BH, dtype=torch.int64, device=device) * (L * S) + i0 * S
    blk = (e0 >> 2).unsqueeze(-1) + torch.arange(nblk, dtype=torch.int64, device=device)
    c2 = torch.full_like(blk, offset & _U32)
    c3 = torch.full_like(blk, (offset >> 32) & _U32)
    w = _philox4x32_10(blk & _U32, (blk >> 32) & _U32, c2, c3, seed & _U32, (seed >> 32) & _U32)
    words = torch.empty((BH, nblk, 4), dtype=torch.int32, device=device)
    for x in range(4):
        words[:, :, x] = w[x].bitwise_right_shift_(8)
    words = words.view(BH, 4 * nblk)
    out = torch.empty((BH, n), dtype=torch.int32, device=device)
    for r in range(min(4, BH)):
        first = (r * L * S + i0 * S) & 3
        out[r::4] = words[r::4, first:first + n]
    return out


# ---- forward -------------------------------------------------------------------------


def _forward(op, query, key, value, attn_mask, dropout_p, is_causal, scale, max_score, softcap, rng):
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_float(op, t, name)
    if attn_mask is not None:
        _check_mask(op, attn_mask)
    seed, offset = _read_rng(op, rng)
    _check_params(op, dropout_p, scale, max_score, softcap)
    _check_qkv(op, query, "query", None)
    _check_qkv(op, key, "key", query)
    _check_qkv(op, value, "value", query)
    _check_fp32_params(op, query.dtype, scale, max_score, softcap)
    _check_shapes(op, query, key, value)
    if attn_mask is not None:
        _check_mask_shape(op, attn_mask, query, key)

    a = _Attn(query, key, value, attn_mask, dropout_p, is_causal, scale, max_score, softcap, seed, offset)
    out = torch.empty((a.B, a.Hq, a.L, a.Ev), dtype=query.dtype, device=query.device)
    lse = torch.empty((a.B, a.Hq, a.L), dtype=a.acc, device=query.device)
    if a.B == 0 or a.L == 0:
        return out, lse
    if a.S == 0:  # no key: every row is empty
        return out.zero_(), lse.fill_(_NEG_INF)
    for i0 in range(0, a.L, a.rows):
        i1 = min(a.L, i0 + a.rows)
        _, s = a.scores(i0, i1)
        m = s.amax(-1, keepdim=True)  # NaN when any score is
        empty = m == _NEG_INF
        p = torch.exp(s - torch.where(empty, 0.0, m))  # empty rows: exp(-inf) = 0
        l = p.sum(-1, keepdim=True)  # noqa: E741  (the kernels' running sum)
        if a.dropout_p > 0:
            p = p * a.keep_scale(i0, i1)  # after the sum: l normalises the undropped P
        acc = a.ungrouped(a.grouped(p) @ a.v[:, :, : p.shape[-1]])
        pos = l > 0
        l_safe = torch.where(pos, l, 1.0)
        inv = torch.where(pos, 1.0 / l_safe, torch.where(l == 0, 0.0, l))  # NaN stays NaN
        out[:, :, i0:i1] = acc * inv
        lse[:, :, i0:i1] = torch.where(pos, m + torch.log(l_safe), torch.where(l == 0, _NEG_INF, l)).squeeze(-1)
    return out, lse


def safe_sdpa(query, key, value, dropout_p, is_causal, scale, max_score, softcap, rng):
    return _forward(_FWD, query, key, value, None, dropout_p, is_causal, scale, max_score, softcap, rng)


def safe_sdpa_masked(query, key, value, attn_mask, dropout_p, is_causal, scale, max_score, softcap, rng):
    return _forward(_FWD, query, key, value, attn_mask, dropout_p, is_causal, scale, max_score, softcap, rng)


# ---- backward ------------------------------------------------------------------------


def _backward(op, grad_out, query, key, value, attn_mask, out, lse, dropout_p, is_causal, scale, max_score,
              softcap, rng):
    for t, name in ((grad_out, "grad_out"), (query, "query"), (key, "key"), (value, "value")):
        _check_float(op, t, name)
    if attn_mask is not None:
        _check_mask(op, attn_mask)
    _check_float(op, out, "out")
    _check_float(op, lse, "lse")
    seed, offset = _read_rng(op, rng)
    _check_params(op, dropout_p, scale, max_score, softcap)
    _check_qkv(op, query, "query", None)
    _check_qkv(op, key, "key", query)
    _check_qkv(op, value, "value", query)
    _check_qkv(op, grad_out, "grad_out", query)
    _check_fp32_params(op, query.dtype, scale, max_score, softcap)
    _check_qkv(op, out, "out", query)
    _check_shapes(op, query, key, value)
    if attn_mask is not None:
        _check_mask_shape(op, attn_mask, query, key)
    osz = (query.shape[0], query.shape[1], query.shape[2], value.shape[3])
    _check(tuple(grad_out.shape) == osz, op, "grad_out must have the shape of out [B, Hq, L, Ev]")
    _check(tuple(out.shape) == osz, op, "out must have shape [B, Hq, L, Ev] (the forward's output)")
    _check(
        lse.device == query.device,
        op,
        lambda: f"lse is on {lse.device} but query is on {query.device}; both must be on the same device",
    )
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    _check(
        lse.dtype == lse_dtype and lse.dim() == 3 and tuple(lse.shape) == osz[:3],
        op,
        lambda: f"lse must be the forward's {_dtype_name(lse_dtype)} logsumexp of shape [B, Hq, L]",
    )

    a = _Attn(query, key, value, attn_mask, dropout_p, is_causal, scale, max_score, softcap, seed, offset)
    dq = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.zeros(key.shape, dtype=a.acc, device=query.device)
    dv = torch.zeros(value.shape, dtype=a.acc, device=query.device)
    guarded = a.max_score > 0 or a.softcap > 0
    if a.B > 0 and a.S > 0:
        for i0 in range(0, a.L, a.rows):
            i1 = min(a.L, i0 + a.rows)
            raw, s = a.scores(i0, i1)
            g = grad_out[:, :, i0:i1].to(a.acc)
            lse_i = lse[:, :, i0:i1].unsqueeze(-1)
            gone = lse_i == _NEG_INF  # a fully masked row: no probability, no gradient
            p = torch.where(gone | (s == _NEG_INF), 0.0, torch.exp(s - torch.where(gone, 0.0, lse_i)))
            j1 = s.shape[-1]
            dp = a.ungrouped(a.grouped(g) @ a.v[:, :, :j1].transpose(-1, -2))
            D = (g * out[:, :, i0:i1].to(a.acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
            if a.dropout_p > 0:
                keep = a.keep_scale(i0, i1)
                pd = p * keep
                ds = p * (dp * keep - D) * a.scale
            else:
                pd = p
                ds = p * (dp - D) * a.scale
            # a zero probability (masked or underflowed) adds nothing, even
            # where dP is NaN
            ds = torch.where(p != 0, ds, 0.0)
            if guarded:
                ds = torch.where(ds != 0, ds * a.transform_grad(raw), ds)
            ds_g, pd_g = a.grouped(ds), a.grouped(pd)
            dq[:, :, i0:i1] = a.ungrouped(ds_g @ a.kt[..., :j1].transpose(-1, -2))
            dk[:, :, :j1] += ds_g.transpose(-1, -2) @ a.grouped(a.q[:, :, i0:i1])
            dv[:, :, :j1] += pd_g.transpose(-1, -2) @ a.grouped(g)
    if a.unseen is not None:  # exactly 0, even where Q or dO hold NaN
        dk = torch.where(a.unseen, 0.0, dk)
        dv = torch.where(a.unseen, 0.0, dv)
    return dq, dk.to(query.dtype), dv.to(query.dtype)


def safe_sdpa_backward(grad_out, query, key, value, out, lse, dropout_p, is_causal, scale, max_score, softcap, rng):
    return _backward(_BWD, grad_out, query, key, value, None, out, lse, dropout_p, is_causal, scale, max_score,
                     softcap, rng)


def safe_sdpa_backward_masked(grad_out, query, key, value, attn_mask, out, lse, dropout_p, is_causal, scale,
                              max_score, softcap, rng):
    return _backward(_BWD, grad_out, query, key, value, attn_mask, out, lse, dropout_p, is_causal, scale,
                     max_score, softcap, rng)


#: overload name -> composite kernel, each taking the schema's arguments in order
KERNELS: Dict[str, Callable] = {
    "safe_sdpa": safe_sdpa,
    "safe_sdpa.masked": safe_sdpa_masked,
    "safe_sdpa_backward": safe_sdpa_backward,
    "safe_sdpa_backward.masked": safe_sdpa_backward_masked,
}
