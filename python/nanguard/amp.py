"""``nanguard.amp.GradScaler``: :class:`torch.amp.GradScaler` plus a fused
``unscale_and_clip_`` (nanguard's two-pass gradient guard), a ``min_scale``
floor and a record of skipped steps and their causes.

The usual loop stays the usual loop::

    scaler = nanguard.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.unscale_and_clip_(optimizer, max_norm=1.0)
    scaler.step(optimizer)      # skipped when a gradient was NaN / Inf
    scaler.update()

``unscale_and_clip_`` records the optimizer's state exactly as ``unscale_``
does (stage ``UNSCALED`` and one ``found_inf`` flag per device), so ``step``
skips the step on non-finite gradients and never unscales twice, and
``update`` backs the scale off as usual.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, List, Optional

import torch
from . import _scaler_state
from . import grad_guard as _gg

__all__ = ["GradScaler", "SkippedStep"]

_STATE_KEY = "nanguard"  # GradScaler.state_dict()'s one extra key


@dataclasses.dataclass
class SkippedStep:
    """One optimizer step that was skipped because of non-finite gradients.

    Recorded by :class:`GradScaler` (:attr:`GradScaler.skipped_steps`) and by
    the integrations' :class:`~nanguard.integrations.StepGuard` (which also
    names the first non-finite module, from :func:`nanguard.watch`).
    """

    #: the step's number: for :class:`GradScaler`, the number of ``update()``
    #: calls before it; in the integrations, the framework's own number for
    #: the step (the one its logs carry)
    step: int
    nan_count: int
    inf_count: int
    #: index (in the optimizer's parameters that had gradients, in
    #: param_group order) of the first gradient holding a NaN/Inf; -1 when
    #: only the norm overflowed or another rank held the value
    first_bad: int = -1
    #: loss scale in use when the step was skipped; None without a scaler
    scale: Optional[float] = None
    #: the first non-finite module by :func:`nanguard.watch` (qualified name,
    #: "" for the watched model itself); integrations only
    module: str = ""
    module_class: str = ""  #: its class name; "" when unknown
    pass_: str = ""  #: "forward", "backward" or "parameter grad"
    report: str = dataclasses.field(default="", repr=False)  #: the watcher's whole report

    @property
    def cause(self) -> str:
        """"nan", "inf" or "norm overflow" (finite gradients whose norm is not)."""
        if self.nan_count:
            return "nan"
        if self.inf_count:
            return "inf"
        return "norm overflow"

    def __str__(self) -> str:
        where = (f"; first non-finite: {self.module or '<root>'} ({self.module_class}, {self.pass_} pass)"
                 if self.module_class else "")
        return (f"nanguard: optimizer step {self.step} skipped ({self.cause}: {self.nan_count} NaN, "
                f"{self.inf_count} Inf in the gradients){where}")

    def to_state(self) -> dict:
        """The record as plain Python values (JSON- and ``weights_only``-safe),
        without :attr:`report` (the long text stays in the logs)."""
        d = dataclasses.asdict(self)
        del d["report"]
        return d

    @classmethod
    def from_state(cls, d: dict) -> "SkippedStep":
        """Inverse of :meth:`to_state` (keys it does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class GradScaler(torch.amp.GradScaler):
    """:class:`torch.amp.GradScaler` with nanguard's fused unscale + clip.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval,
        enabled: as :class:`torch.amp.GradScaler`.
        min_scale: floor for the loss scale. After ``update()`` the scale is
            never below it; a warning says when the floor was hit, from the
            next ``step()`` (whose one host read of found_inf, the read
            PyTorch's own ``step()`` makes, carries that flag too). ``None``
            (default) keeps PyTorch's behaviour.
        history: how many :class:`SkippedStep` records to keep.

    ``update()`` reads nothing back to the host: the skip records and counts
    are kept on the scale's device and copied to the host only when
    :attr:`skipped_steps` or :meth:`skip_summary` is read.

    :meth:`state_dict` / :meth:`load_state_dict` keep the records, the counts
    and ``min_scale`` across a checkpoint, and stay interchangeable with
    :class:`torch.amp.GradScaler`'s in both directions.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: Optional[float] = None,
        history: int = 1000,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        if min_scale is not None:
            min_scale = float(min_scale)
            if not (min_scale > 0.0) or math.isinf(min_scale):
                raise ValueError(f"min_scale must be a finite number > 0, got {min_scale}")
            if min_scale > init_scale:
                raise ValueError(f"min_scale ({min_scale}) is above init_scale ({init_scale})")
        self._min_scale = min_scale
        self._history_len = int(history)
        self._pending: List[_gg.GuardStats] = []  # this iteration's guard stats
        self._pending_scale: Optional[torch.Tensor] = None
        self._updates = 0
        # on the scale's device, made at the first update that has records:
        self._counts: Optional[torch.Tensor] = None  # int64 [4]: nan, inf, norm overflow steps, floor hits
        self._ring: Optional[torch.Tensor] = None  # float64 [history, 5]: the last skipped steps
        self._ring_n: Optional[torch.Tensor] = None  # int64 []: skipped steps recorded so far
        self._floor_flag: Optional[torch.Tensor] = None  # bool []: the floor was hit since the last step()
        self._floor_update = 0

    # ---- the fused unscale + clip ----------------------------------------------

    def unscale_and_clip_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float = math.inf,
        norm_type: float = 2.0,
        *,
        process_group=None,
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip their global norm, in
        two passes over the gradients and with no host sync.

        Equivalent to ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``, except
        that when any gradient is NaN/Inf (or the norm overflows) the
        gradients are left untouched and the step will be skipped by
        ``step()``. ``max_norm=inf`` unscales and checks only.

        Returns the total norm of the unscaled gradients (0-dim tensor on the
        first gradient's device; NaN/Inf when the step will be skipped).
        """
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not self._enabled:
            return _gg.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]],
                max_norm,
                norm_type,
                process_group=process_group,
            )
        inv_scale, found_inf, state = _scaler_state.begin_unscale(self, optimizer)
        for i, g in enumerate(grads):
            if g.is_sparse:
                raise TypeError(
                    f"gradient {i} is sparse: use unscale_() and torch.nn.utils.clip_grad_norm_"
                )
        # one float32 flag per device holding gradients, as unscale_ makes them
        # (none without gradients: step() then raises as PyTorch's does)
        total, stats, found_inf = _gg.guard_(
            grads, inv_scale, max_norm, norm_type, found_inf=found_inf, process_group=process_group
        )
        _scaler_state.end_unscale(state, found_inf)
        self._pending.append(stats)
        self._pending_scale = self._scale.detach().clone()
        return total

    # ---- update: floor and records ------------------------------------------------

    def update(self, new_scale=None) -> None:
        if not self._enabled:
            return
        pending, self._pending = self._pending, []
        scale_used = self._pending_scale
        super().update(new_scale)
        self._record(pending, scale_used)
        self._updates += 1
        if self._min_scale is not None and self._scale is not None:
            below = self._scale.reshape(()) < self._min_scale
            self._device_state(self._scale.device)
            self._counts[3] += below.long()
            self._scale.clamp_(min=self._min_scale)
            self._floor_flag = below if self._floor_flag is None else self._floor_flag | below
            self._floor_update = self._updates

    def _device_state(self, device: torch.device) -> None:
        if self._counts is None:
            self._counts = torch.zeros(4, dtype=torch.int64, device=device)
            self._ring = torch.zeros(max(self._history_len, 0), 5, dtype=torch.float64, device=device)
            self._ring_n = torch.zeros((), dtype=torch.int64, device=device)
        elif self._counts.device != device:  # restored by load_state_dict, on the CPU
            self._counts, self._ring, self._ring_n = (t.to(device) for t in (self._counts, self._ring, self._ring_n))

    def _record(self, pending: List[_gg.GuardStats], scale_used) -> None:
        """Fold this iteration's guard stats into the device-side records,
        with device operations only (no host read)."""
        if not pending:
            return
        dev = self._scale.device
        self._device_state(dev)
        st = torch.stack([p.tensor.to(dev, torch.float64) for p in pending])  # [n, 4]
        norms = torch.stack([p.total_norm.to(dev, torch.float64).reshape(()) for p in pending])
        nan, inf = st[:, 1].sum(), st[:, 2].sum()
        bad = st[:, 3] >= 0
        first_at = st[:, 3].index_select(0, bad.long().argmax().view(1)).reshape(())
        first = torch.where(bad.any(), first_at, torch.full_like(nan, -1.0))
        has_nan, has_inf = nan > 0, inf > 0
        overflow = ~torch.isfinite(norms).all() & ~has_nan & ~has_inf
        skipped = has_nan | has_inf | overflow
        self._counts[:3] += torch.stack([has_nan, has_inf & ~has_nan, overflow]).long()
        if self._history_len > 0:
            scale = (scale_used if scale_used is not None else torch.full((), math.nan, device=dev))
            row = torch.stack([torch.full((), float(self._updates), dtype=torch.float64, device=dev),
                               nan, inf, first, scale.to(dev, torch.float64).reshape(())]).view(1, 5)
            pos = (self._ring_n % self._history_len).view(1)
            self._ring.index_copy_(0, pos, torch.where(skipped, row, self._ring.index_select(0, pos)))
        self._ring_n += skipped.long()

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # PyTorch's step() reads found_inf of every device here; this reads
        # them, and the floor flag of the last update(), in one transfer.
        found = _scaler_state.found_inf_flags(optimizer_state)
        flags = [v.reshape(()).to(found[0].device, torch.float32) for v in found]
        if self._floor_flag is not None:
            flags.append(self._floor_flag.to(found[0].device, torch.float32))
        host = torch.stack(flags).tolist()
        if self._floor_flag is not None:
            self._floor_flag = None
            if host.pop():
                warnings.warn(
                    f"nanguard.amp.GradScaler: loss scale fell below min_scale={self._min_scale} "
                    f"by update {self._floor_update}; held at the floor. Gradients keep overflowing "
                    "at this scale: look for the layer producing them (nanguard.watch).",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if not sum(host):
            return optimizer.step(*args, **kwargs)
        return None

    # ---- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """:meth:`torch.amp.GradScaler.state_dict` plus one key,
        ``"nanguard"``: the update count, the skip counts of
        :meth:`skip_summary`, the records of :attr:`skipped_steps` and
        ``min_scale``, as plain Python values (``torch.load(weights_only=True)``
        reads them). ``torch.amp.GradScaler.load_state_dict`` ignores the
        extra key, and :meth:`load_state_dict` accepts a state dict of
        ``torch.amp.GradScaler`` (without it). Reads the records to the host.
        """
        sd = super().state_dict()
        if self._enabled:
            sd[_STATE_KEY] = {
                "updates": self._updates,
                "counts": self._counts.tolist() if self._counts is not None else [0, 0, 0, 0],
                "skipped_steps": [r.to_state() for r in self.skipped_steps],
                "min_scale": self._min_scale,
            }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """:meth:`torch.amp.GradScaler.load_state_dict`; a state dict saved by
        this class also restores the skip history and ``min_scale`` (as
        PyTorch restores ``growth_factor`` and the other settings), so that
        :attr:`skipped_steps`, :meth:`skip_summary` and the step numbering
        continue where they were saved. The last ``history`` records are kept."""
        super().load_state_dict(state_dict)
        saved = state_dict.get(_STATE_KEY)
        if not self._enabled or saved is None:
            return
        self._min_scale = None if saved["min_scale"] is None else float(saved["min_scale"])
        self._updates = int(saved["updates"])
        rows = [SkippedStep.from_state(r) for r in saved["skipped_steps"]]
        rows = rows[-self._history_len:] if self._history_len > 0 else []
        ring = torch.zeros(max(self._history_len, 0), 5, dtype=torch.float64)
        for i, r in enumerate(rows):
            ring[i] = torch.tensor([r.step, r.nan_count, r.inf_count, r.first_bad,
                                    math.nan if r.scale is None else r.scale], dtype=torch.float64)
        # on the CPU until the first update() moves them next to the scale
        self._counts = torch.tensor([int(c) for c in saved["counts"]], dtype=torch.int64)
        self._ring, self._ring_n = ring, torch.tensor(len(rows), dtype=torch.int64)
        self._pending, self._pending_scale, self._floor_flag = [], None, None

    # ---- what happened -----------------------------------------------------------

    @property
    def skipped_steps(self) -> List[SkippedStep]:
        """Steps skipped because of non-finite gradients (guarded by
        ``unscale_and_clip_``), oldest first, at most ``history`` of them.
        Reading this copies the records to the host."""
        if self._ring_n is None or self._history_len <= 0:
            return []
        n = int(self._ring_n.item())
        rows = self._ring.tolist()
        if n > self._history_len:
            start = n % self._history_len
            rows = rows[start:] + rows[:start]
        else:
            rows = rows[:n]
        return [SkippedStep(int(r[0]), int(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in rows]

    def skip_summary(self) -> Dict[str, int]:
        """Counts since construction: updates, skipped steps by cause, floor
        hits. Reading this copies the counts to the host."""
        c = self._counts.tolist() if self._counts is not None else [0, 0, 0, 0]
        return {
            "updates": self._updates,
            "skipped": c[0] + c[1] + c[2],
            "nan": c[0],
            "inf": c[1],
            "norm_overflow": c[2],
            "min_scale_hits": c[3],
        }

    @property
    def min_scale(self) -> Optional[float]:
        return self._min_scale
