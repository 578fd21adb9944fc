"""``python -m nanguard doctor``: audit a Hugging Face model built from a
model type or a config.json (on the meta device: no weights are allocated)."""

from __future__ import annotations

from typing import Optional

import torch

from ._doctor import _depth, doctor, format_findings

__all__ = ["model_from_config", "cli_main"]

#: Sizes that keep a model from any config small enough to build in a second.
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
         "n_embd": 64, "n_head": 4, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16}


def model_from_config(model_type: Optional[str] = None, config_path: Optional[str] = None,
                      layers: Optional[int] = None, small: bool = True):
    """Build a Hugging Face model (on the meta device: no weights are
    allocated) from a model type (small sizes) or a config.json."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("building a model from a config needs Hugging Face transformers: "
                          "pip install transformers") from e
    if config_path is not None:
        import json

        with open(config_path) as f:
            data = json.load(f)
        mt = data.pop("model_type", model_type)
        if mt is None:
            raise ValueError(f"{config_path} has no model_type")
        cfg = transformers.AutoConfig.for_model(mt, **data)
    else:
        if not model_type:
            raise ValueError("give a model type (e.g. llama, bert) or a config path")
        cfg = transformers.AutoConfig.for_model(model_type)
        if small:
            for k, v in SMALL.items():
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
            for k in ("num_hidden_layers", "n_layer", "num_layers"):
                if hasattr(cfg, k):
                    setattr(cfg, k, 2)
    if layers is not None:
        for k in ("num_hidden_layers", "n_layer", "num_layers"):
            if hasattr(cfg, k):
                setattr(cfg, k, layers)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    return model


def cli_main(argv=None) -> int:
    """``python -m nanguard doctor``: audit a model built from a config."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m nanguard doctor",
        description="Audit a Hugging Face model built from a config (small sizes for "
                    "--model-type; no weights are allocated) for the known causes of NaN.")
    p.add_argument("--model-type", help="a Hugging Face model type: llama, bert, gpt2, ...")
    p.add_argument("--config", help="path to a config.json (its sizes are kept)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="the training dtype to audit for (autocast)")
    p.add_argument("--no-scaler", action="store_true",
                   help="the float16 loop has no GradScaler (default: it has one)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16,
                   help="the GradScaler's init_scale (float16)")
    args = p.parse_args(argv)
    if not args.model_type and not args.config:
        p.error("give --model-type or --config")
    try:
        model = model_from_config(args.model_type, args.config, args.layers)
    except ImportError as e:
        print(f"nanguard doctor: {e}")
        return 2
    dt = getattr(torch, args.dtype)
    cfg = model.config
    print(f"model: {type(model).__name__} ({cfg.model_type}, {_depth(model)} layers, "
          f"attn_implementation={getattr(cfg, '_attn_implementation', None)}), training dtype "
          f"{args.dtype}")
    scaler = None
    if dt == torch.float16 and not args.no_scaler:
        import warnings

        with warnings.catch_warnings():  # no CUDA here is fine: it is only inspected
            warnings.simplefilter("ignore")
            scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
    findings = doctor(model, scaler=scaler, autocast_dtype=dt if dt != torch.float32 else None)
    print(format_findings(findings))
    return 1 if any(f.severity == "error" for f in findings) else 0
