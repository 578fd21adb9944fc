"""The flight record of one training step: what :func:`nanguard.replay` needs
to run that step again.

A record is one ``torch.save`` file, ``nanguard-step<N>[-rank<R>].pt``,
holding a dict of tensors and plain Python values only, so that
``torch.load(path, weights_only=True)`` reads it and no code is unpickled.
In memory it is a :class:`FlightRecord`, whose fields are the file's keys
(``FlightRecord.to_dict`` / ``from_dict``; ``from_dict`` migrates the
records of earlier versions):

==================  ===========================================================
key                 value
==================  ===========================================================
``format``          ``"nanguard.flight-record"``; ``version``: 2
``step``, ``rank``  the step number; the rank under torch.distributed, else None
``micro_batch``     which forward of the step ``args`` / ``kwargs`` are, 0 the
                    first (version 1 records, which have no such key, held
                    the first)
``args``            the model's positional inputs as they reached its forward
``kwargs``          its keyword inputs (nested dicts / lists / tuples of tensors
                    and plain values; mappings such as ``BatchEncoding`` are
                    saved as dicts)
``rng``             ``{"cpu": ByteTensor, "cuda": [device index, ByteTensor]}``
                    at the step's start (``cuda`` None without CUDA)
``state``           the model's parameters and buffers (``state_dict``; a
                    DTensor as its local shard)
``sharding``        per DTensor entry of ``state``: ``{"placements"`` (their
                    reprs, ``"Shard(dim=0)"``), ``"global_shape"``,
                    ``"mesh_shape"``, ``"mesh_dim_names"}``; empty otherwise
``training``        ``model.training``
``autocast``        ``{"device_type": "cpu", "dtype": "float16"}`` or None
``loss_scale``      the loss scale in force (a GradScaler's), or None
``model``           for a Hugging Face model its class and config:
                    ``{"module", "qualname", "config"}``; otherwise None
                    (``replay`` then needs ``model=``)
``report``          the watch report as text, or None
``history``         the magnitude history rows, or None
``recorded_nonfinite``  whether the recorded step was non-finite
``entry``           the module the record holds, by its name in the watched
                    model ("": the model itself)
``versions``        torch and nanguard versions that wrote the record
==================  ===========================================================

Parameters dominate a record's size: a 7B-parameter model in bf16 is
14 GB of ``state`` (28 GB in fp32); the inputs of one batch are kilobytes to
megabytes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from .._version import __version__
from ._walk import rebuild

FORMAT = "nanguard.flight-record"
VERSION = 2


class RecordError(ValueError):
    """A file is not a nanguard flight record, or not one this version reads."""


@dataclasses.dataclass
class FlightRecord:
    """One recorded step (the keys of the table above, but ``format`` and
    ``version``, which :meth:`to_dict` writes and :meth:`from_dict` checks)."""

    step: int
    rank: Optional[int]
    args: tuple
    kwargs: dict
    rng: dict
    state: dict
    sharding: dict
    training: bool
    autocast: Optional[dict]
    loss_scale: Optional[float]
    model: Optional[dict]
    report: Optional[str]
    history: Optional[list]
    recorded_nonfinite: bool
    entry: str
    versions: dict
    micro_batch: int = 0

    def to_dict(self) -> dict:
        """The record as the file holds it: plain containers and tensors."""
        return {"format": FORMAT, "version": VERSION,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls, d: Any, where: str = "record") -> "FlightRecord":
        """The record a loaded file holds, of this version or migrated from an
        earlier one; ``RecordError`` (naming ``where``) for anything else."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise RecordError(f"{where} is not a nanguard flight record")
        version = d.get("version")
        if version == 1:  # the first forward's inputs: micro_batch is new in version 2
            d = {**d, "micro_batch": 0}
        elif version != VERSION:
            raise RecordError(f"{where} is a flight record of version {version}; this nanguard reads "
                              f"versions 1 to {VERSION}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise RecordError(f"{where} is a flight record of version {version} without "
                              f"{', '.join(missing)}")
        rec = cls(**{n: d[n] for n in names})
        rec.args = tuple(rec.args)
        return rec


def record_name(step: int, rank: Optional[int] = None) -> str:
    """``nanguard-step<N>.pt``, or ``nanguard-step<N>-rank<R>.pt`` under
    torch.distributed."""
    return f"nanguard-step{step}" + ("" if rank is None else f"-rank{rank}") + ".pt"


@dataclasses.dataclass
class StepStart:
    """What a step holds at its start, by reference only (no copy): the RNG
    states in force and the autocast settings. ``capture`` costs one
    ``get_rng_state`` per device (a small CPU tensor)."""

    rng: dict
    autocast: Optional[dict]

    @classmethod
    def capture(cls, device: Optional[torch.device] = None) -> "StepStart":
        cuda = None
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            cuda = [index, torch.cuda.get_rng_state(index)]
        return cls({"cpu": torch.get_rng_state(), "cuda": cuda}, current_autocast(dev))


def current_autocast(device: Optional[torch.device] = None) -> Optional[dict]:
    """The autocast settings in force for ``device``'s type (CPU when None),
    as a plain dict, or None when autocast is off."""
    dev_type = torch.device(device).type if device is not None else "cpu"
    if not torch.is_autocast_enabled(dev_type):
        return None
    dtype = torch.get_autocast_dtype(dev_type)
    return {"device_type": dev_type, "dtype": str(dtype).removeprefix("torch.")}


def output_loss(output: Any) -> Optional[torch.Tensor]:
    """A model output's ``.loss`` (or ``["loss"]``), as Hugging Face models
    return it; None when it has none."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        index, state = rng["cuda"]
        torch.cuda.set_rng_state(state, index)


def _plain_leaf(obj: Any, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, bool) or obj is None:
        return obj
    for plain in (int, float, str):  # subclasses (torch's TorchVersion, numpy scalars) as the plain type
        if isinstance(obj, plain):
            return plain(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    raise TypeError(f"a flight record holds tensors and plain values; {where} is a {type(obj).__name__}")


def _plain(obj: Any, where: str) -> Any:
    """``obj`` as tensors and plain containers that ``weights_only`` loading
    accepts; anything else is refused, naming where it sits."""
    try:
        return rebuild(obj, where, _plain_leaf)
    except ValueError as e:
        raise TypeError(f"a flight record holds tensors and plain values; {e}") from None


def _model_source(model: torch.nn.Module) -> Optional[dict]:
    """A Hugging Face model's class and config (no code is pickled), else None."""
    cls = type(model)
    config = getattr(model, "config", None)
    if not cls.__module__.startswith("transformers.") or not hasattr(config, "to_dict"):
        return None
    return {"module": cls.__module__, "qualname": cls.__qualname__, "config": _plain(config.to_dict(), "config"),
            "attn_implementation": getattr(config, "_attn_implementation", None)}


def _state(model: torch.nn.Module) -> tuple[dict, dict]:
    from .. import distributed as _dist

    state, sharding = {}, {}
    for k, v in model.state_dict(keep_vars=False).items():
        if _dist.is_dtensor(v):  # its local shard, and what places it in the whole
            mesh = v.device_mesh
            sharding[k] = {"placements": [repr(p) for p in v.placements], "global_shape": list(v.shape),
                           "mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.mesh_dim_names or ())}
            v = v.to_local()
        state[k] = v.detach()
    return state, sharding


def write_record(directory: str, *, model: torch.nn.Module, args: tuple, kwargs: dict, start: StepStart,
                 step: int, rank: Optional[int] = None, loss_scale: Optional[float] = None,
                 report: Optional[str] = None, history: Optional[list] = None,
                 recorded_nonfinite: bool = True, entry: str = "", micro_batch: int = 0) -> str:
    """Write one flight record into ``directory`` (created if needed) and
    return its path."""
    os.makedirs(directory, exist_ok=True)
    state, sharding = _state(model)
    rec = FlightRecord(
        step=int(step), rank=rank, args=_plain(tuple(args), "args"), kwargs=_plain(dict(kwargs), "kwargs"),
        rng=start.rng, state=state, sharding=sharding, training=bool(model.training), autocast=start.autocast,
        loss_scale=None if loss_scale is None else float(loss_scale), model=_model_source(model), report=report,
        history=history, recorded_nonfinite=bool(recorded_nonfinite), entry=entry,
        versions={"torch": str(torch.__version__), "nanguard": str(__version__)}, micro_batch=int(micro_batch))
    path = os.path.join(directory, record_name(step, rank))
    tmp = path + ".tmp"
    torch.save(rec.to_dict(), tmp)
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def load_record(path: str) -> FlightRecord:
    """Read a flight record (``weights_only``: no code is unpickled)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no flight record at {path!r}")
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError...
        raise RecordError(f"path: {path!r} is not a readable nanguard flight record ({e})") from e
    return FlightRecord.from_dict(d, f"path: {path!r}")


def build_model(rec: FlightRecord, model: Optional[torch.nn.Module]) -> torch.nn.Module:
    """The model to replay: ``model`` with the record's state loaded, or the
    Hugging Face class and config the record names, rebuilt."""
    if model is None:
        src = rec.model
        if src is None:
            raise ValueError("model: this record holds no Hugging Face class and config to rebuild the "
                             "model from; pass model= (an instance of the recorded model's class)")
        model = _rebuild_hf(src)
    if rec.sharding:
        raise NotImplementedError(
            "model: this record holds DTensor shards; replay it on each rank with the sharded model")
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    for name, t in named.items():  # the recorded dtypes (a model.half() stays half); ties kept
        saved = rec.state.get(name)
        if saved is not None and saved.dtype != t.dtype:
            t.data = t.data.to(saved.dtype)
    try:
        model.load_state_dict(rec.state)
    except RuntimeError as e:
        raise ValueError(f"model: its parameters and buffers do not match the record's: {e}") from e
    return model.train(rec.training)


def _rebuild_hf(src: dict) -> torch.nn.Module:
    import importlib

    if not src["module"].startswith("transformers."):
        raise ValueError(f"model: a record may only name transformers classes, not {src['module']}")
    mod = importlib.import_module(src["module"])
    cls = mod
    for part in src["qualname"].split("."):
        cls = getattr(cls, part)
    config = cls.config_class.from_dict(dict(src["config"]))
    if src.get("attn_implementation"):
        config._attn_implementation = src["attn_implementation"]  # eager and sdpa round differently
    return cls(config)
