"""The demo's model, data and configuration, shared by the demo and
``nanguard.study``: a GPT-2 byte-level language model (random init,
transformers' eager attention) and batches of bytes of a text that ships
with Python (the standard library's ``argparse.py``). Nothing of nanguard's
is imported here."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Config:
    steps: int = 40
    lr: float = 0.2
    batch: int = 8
    seq: int = 32
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 1  # one head of 64: the raw score is a sum of 64 products
    max_norm: float = 1.0
    seed: int = 0
    rewind_every: int = 5  #: snapshot interval of the run with rewind
    device: str = "cuda" if torch.cuda.is_available() else "cpu"


def corpus() -> torch.Tensor:
    """Bytes of a text that ships with every Python: the standard library's
    ``argparse.py`` (about 100 KB of English and code)."""
    import argparse as _ap

    with open(_ap.__file__, "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(cfg: Config, data: torch.Tensor):
    g = torch.Generator().manual_seed(cfg.seed + 1)
    while True:
        start = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=g)
        yield torch.stack([data[s : s + cfg.seq] for s in start.tolist()])


def build_model(cfg: Config):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    config = GPT2Config(
        vocab_size=256, n_positions=cfg.seq, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(config).to(cfg.device)
