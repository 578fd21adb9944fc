"""The Trainer callback's ``record_dir=``: the step of a NaN batch is saved by
the watcher it attaches, with the batch as it reached the model, the
autocast the Trainer ran it under and the model's config, and
``nanguard.replay`` rebuilds it from the file alone and finds the NaN in
the batch. (The Lightning callback's is in test_integrations.py.)"""

from __future__ import annotations

import os

import pytest
import torch

import nanguard
from test_integrations import NAN_AT, _llama, _NaNAtCollator, _trainer, fresh_accelerate_state  # noqa: F401


def test_transformers_callback_record_dir_saves_the_failing_step(tmp_path, fresh_accelerate_state):  # noqa: F811
    T, model = _llama()
    from nanguard.diagnostics._flight_record import load_record
    from nanguard.integrations.transformers import NanguardCallback

    cb = NanguardCallback(record_dir=tmp_path / "rec")
    trainer = _trainer(T, model, tmp_path / "out", [cb], _NaNAtCollator(32))
    trainer.train()
    assert len(cb.guard.skipped) == 1
    # the watcher counts the guarded steps from 0: the NaN batch is the NAN_AT-th
    assert os.listdir(tmp_path / "rec") == [f"nanguard-step{NAN_AT}.pt"]
    path = str(tmp_path / "rec" / f"nanguard-step{NAN_AT}.pt")
    rec = load_record(path)
    assert rec.entry == "" and rec.recorded_nonfinite
    assert rec.model["qualname"] == "LlamaForCausalLM"
    assert rec.autocast == {"device_type": "cpu", "dtype": "bfloat16"}  # the Trainer's bf16=True
    assert torch.isnan(rec.kwargs["inputs_embeds"]).all() and "input_ids" not in rec.kwargs
    res = nanguard.replay(path)
    assert res.reproduced and res.batch and res.batch[0].startswith("`inputs_embeds` holds NaN")
    with pytest.raises(ValueError, match="record_dir needs watch=True"):
        NanguardCallback(watch=False, record_dir=tmp_path)
    with pytest.raises(TypeError, match="record_dir must be a path"):
        NanguardCallback(record_dir=3)
