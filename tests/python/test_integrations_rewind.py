"""The callbacks' ``rewind=``: nanguard.Rewind driven by the Trainer's and
Lightning's hooks. A NaN batch: the run rewinds to a snapshot, the batch
fails again from there and is blamed on the data, the window's batches are
left behind, and training goes on finite with the framework's next batches.
(The policy itself is tested in test_rewind.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_integrations import (BATCH, _llama, _lm_module, _NaNAtCollator, _Rows, _records_of,  # noqa: F401
                               _trainer, fresh_accelerate_state)


def _finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_callback_rewinds_past_a_nan_batch(tmp_path, fresh_accelerate_state):  # noqa: F811
    T, model = _llama()
    from nanguard.integrations.transformers import NanguardCallback

    log = tmp_path / "rewind.json"
    cb = NanguardCallback(rewind={"every": 2, "log_path": str(log)})
    trainer = _trainer(T, model, tmp_path / "out", [cb], _NaNAtCollator(32, at=3), max_steps=6)
    with _records_of("transformers.trainer") as msgs:
        trainer.train()
    rw = cb.rewind
    # the 4th batch (the Trainer's step 4) has NaN inputs: non-finite loss, data blamed
    assert rw.rewinds == 1, rw.events
    ev = rw.events[0]
    assert ev.trigger.kind == "non-finite loss" and ev.trigger.batches == [4]
    assert ev.restored_step == 2 and ev.blame == "data" and ev.probes[0].failed
    # the window's batches (steps 3 and 4) are left behind; the Trainer ran on to its 6 steps
    assert {d["batch"]: d["blame"] for d in rw.skipped_batches} == {3: "window", 4: "data"}
    assert trainer.state.global_step == 6 and rw.global_step == 4
    assert [r.batch for r in rw.history] == [1, 2, 5, 6]
    assert all(math.isfinite(r.loss) for r in rw.history) and _finite(model)
    err = "\n".join(msgs)
    assert "nanguard.Rewind: non-finite loss at step 3" in err and "data blamed" in err, err
    entries = [e for e in trainer.state.log_history if "nanguard_rewind" in e]
    assert len(entries) == 1 and entries[0]["nanguard_blame"] == "data" and entries[0]["step"] == 4
    doc = json.loads(log.read_text())
    assert [d["batch"] for d in doc["skipped_batches"]] == [3, 4]
    assert trainer.callback_handler.callbacks  # and the hooks are gone
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_callbacks_refuse_bad_rewind_arguments():
    pytest.importorskip("transformers")
    from nanguard.integrations.transformers import NanguardCallback

    with pytest.raises(ValueError, match="unknown nanguard.Rewind argument"):
        NanguardCallback(rewind={"skip_batches": [3]})
    with pytest.raises(TypeError, match="rewind must be a bool or a dict"):
        NanguardCallback(rewind="yes")
    with pytest.raises(ValueError, match="every"):
        NanguardCallback(rewind={"every": 0})
    assert NanguardCallback(rewind=False)._rewind_kw is None


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lightning_callback_rewinds_past_a_nan_batch(precision):
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()
    rows = _Rows(BATCH * 6)
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, collate_fn=_NaNAtCollator(32, at=3))
    cb = NanguardCallback(rewind={"every": 2})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision=precision, callbacks=[cb])
    with _records_of("lightning.pytorch.callbacks.nanguard") as msgs:
        trainer.fit(_lm_module(L, lm, scheduler=True), loader)
    rw = cb.rewind
    assert rw.rewinds == 1, rw.events
    ev = rw.events[0]
    # Lightning numbers the 4th batch's step 3 (global_step before it ran)
    assert ev.trigger.kind == "non-finite loss" and ev.trigger.batches == [3]
    assert ev.restored_step == 2 and ev.blame == "data" and ev.probes[0].failed
    assert {d["batch"]: d["blame"] for d in rw.skipped_batches} == {2: "window", 3: "data"}
    assert [r.batch for r in rw.history] == [0, 1, 4, 5]
    assert all(math.isfinite(r.loss) for r in rw.history) and _finite(lm)
    assert "data blamed" in "\n".join(msgs)
    assert trainer.callback_metrics["nanguard/rewinds"].item() == 1.0


def test_lightning_rewind_refuses_gradient_accumulation():
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()
    loader = torch.utils.data.DataLoader(_Rows(BATCH * 4), batch_size=BATCH, collate_fn=_NaNAtCollator(32, at=None))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, accumulate_grad_batches=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[NanguardCallback(rewind=True)])
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        trainer.fit(_lm_module(L, lm), loader)
