"""Catch the inputs that make a loss NaN, before the step runs.

:func:`check_batch` looks at a batch's tensors (nested dicts / lists / tuples
/ Hugging Face ``BatchEncoding``): NaN / Inf in floating tensors, token ids
outside ``[0, vocab_size)``, labels that are all ``ignore_index`` (a mean loss
of 0/0), and attention-mask rows that attend to nothing.

It reads tensors back to the host: run it once before training (or on a
suspicious batch), not every step; :func:`nanguard.watch` is the per-step tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ._walk import tensor_leaves

__all__ = ["check_batch", "BatchFinding", "BadBatchError"]


@dataclass
class BatchFinding:
    path: str  #: where in the batch, e.g. ``batch['labels']``
    problem: str  #: short description
    count: int  #: how many elements (or rows) have it
    detail: str = ""

    def __str__(self) -> str:
        d = f" ({self.detail})" if self.detail else ""
        return f"{self.path}: {self.problem}: {self.count}{d}"


class BadBatchError(ValueError):
    """Raised by :func:`check_batch` with ``raise_on_problem=True``;
    ``.findings`` holds the list."""

    def __init__(self, findings: List[BatchFinding]):
        self.findings = findings
        super().__init__("problems in the batch:\n" + "\n".join(f"  {f}" for f in findings))


def _is_ids(key: str) -> bool:
    return key.endswith("input_ids")


def _is_labels(key: str) -> bool:
    return key in ("labels", "label_ids", "label", "target", "targets")


def _is_mask(key: str) -> bool:
    return "attention_mask" in key or key.endswith("mask")


def _mask_empty_rows(m: torch.Tensor) -> Tuple[int, str]:
    """Rows of an attention mask that let a query attend to nothing."""
    if m.dim() == 2:  # [batch, keys]: 1/True = attend
        return int((m != 0).sum(-1).eq(0).sum()), "sequences with no token to attend to"
    if m.dtype == torch.bool:  # [..., queries, keys], True = attend
        return int((~m.any(-1)).sum()), "query rows with every key masked"
    if m.is_floating_point():  # additive: -inf / finfo.min = masked
        thresh = torch.finfo(m.dtype).min / 2 if m.dtype != torch.float64 else -1e300
        masked = (m <= thresh) | torch.isneginf(m)
        return int(masked.all(-1).sum()), "query rows with every key masked (additive mask)"
    return int((m != 0).sum(-1).eq(0).sum()), "rows with no key to attend to"


def _non_finite(path: str, key: str, t: torch.Tensor) -> List[BatchFinding]:
    out: List[BatchFinding] = []
    nan = int(torch.isnan(t).sum())
    if nan:
        out.append(BatchFinding(path, "NaN values", nan))
    pinf = int(torch.isposinf(t).sum()) if not t.is_complex() else 0
    if pinf:
        out.append(BatchFinding(path, "+Inf values", pinf))
    if not _is_mask(key):  # -inf is how additive masks say "masked"
        ninf = int(torch.isneginf(t).sum()) if not t.is_complex() else 0
        if ninf:
            out.append(BatchFinding(path, "-Inf values", ninf))
    return out


def _bad_ids(path: str, t: torch.Tensor, vocab_size: Optional[int]) -> List[BatchFinding]:
    bad = int((t < 0).sum())
    if vocab_size is not None:
        bad += int((t >= vocab_size).sum())
    if not bad:
        return []
    return [BatchFinding(path, "token ids outside [0, vocab_size)", bad,
                         f"min {int(t.min())}, max {int(t.max())}, vocab_size {vocab_size}")]


def _bad_labels(path: str, t: torch.Tensor, vocab_size: Optional[int],
                ignore_index: int) -> List[BatchFinding]:
    valid = t != ignore_index
    if not bool(valid.any()):
        return [BatchFinding(path, "all labels are ignore_index", t.numel(),
                             f"ignore_index={ignore_index}: a mean loss over no tokens is "
                             "0/0 = NaN")]
    out: List[BatchFinding] = []
    if t.dim() >= 2:
        rows = int((~valid.reshape(valid.shape[0], -1).any(-1)).sum())
        if rows:
            out.append(BatchFinding(path, "rows whose labels are all ignore_index", rows,
                                    "per-sequence losses of these rows are 0/0"))
    if vocab_size is not None and t.dim() >= 2:
        bad = int((valid & ((t < 0) | (t >= vocab_size))).sum())
        if bad:
            out.append(BatchFinding(path, "labels outside [0, vocab_size)", bad,
                                    f"vocab_size {vocab_size}, ignore_index {ignore_index}"))
    return out


def check_batch(batch, vocab_size: Optional[int] = None, ignore_index: int = -100,
                raise_on_problem: bool = False) -> List[BatchFinding]:
    """Look for the inputs that make a loss NaN.

    Args:
        batch: a tensor, or nested dicts / lists / tuples / ``BatchEncoding``
            of tensors. Keys decide the checks: ``*input_ids`` are token ids,
            ``labels`` are targets, ``*attention_mask`` / ``*mask`` are masks;
            the tensors of a list or tuple under a key are checked as that
            key's.
        vocab_size: when given, token ids and token-level labels must lie in
            ``[0, vocab_size)`` (labels may also be ``ignore_index``).
        ignore_index: the label value the loss skips.
        raise_on_problem: raise :class:`BadBatchError` instead of returning.

    Returns the list of :class:`BatchFinding` (empty for a clean batch).
    """
    out: List[BatchFinding] = []
    for path, key, t in tensor_leaves(batch, "batch"):
        if t.is_floating_point() or t.is_complex():
            out += _non_finite(path, key, t)
        if _is_mask(key) and t.numel() and t.dim() >= 2:
            n, what = _mask_empty_rows(t)
            if n:
                out.append(BatchFinding(path, "attention mask rows that attend to nothing", n,
                                        what + ": softmax over no keys gives 0/0"))
        if t.is_floating_point() or t.dtype == torch.bool or t.numel() == 0:
            continue
        if _is_ids(key):
            out += _bad_ids(path, t, vocab_size)
        elif _is_labels(key):
            out += _bad_labels(path, t, vocab_size, ignore_index)
    if out and raise_on_problem:
        raise BadBatchError(out)
    return out
