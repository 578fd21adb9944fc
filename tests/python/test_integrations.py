"""nanguard.integrations: the Trainer callback and the Lightning callback,
each run for real on the CPU in bf16 with a NaN batch injected at one step;
and the framework-independent StepGuard under fp16 with a loss scaler, bf16
and fp32.

Asserted: the NaN step is skipped (no parameter changes at that step, every
other step changes them), the weights stay finite, the report names the
module, the skip count and module reach the framework's logs under the
framework's own number for the step, gradients are clipped once, by
nanguard, and a resume from a checkpoint continues the guard's history.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import nanguard
from nanguard.integrations import StepGuard

VOCAB, SEQ, BATCH, NAN_AT = 64, 8, 4, 2


def test_import_nanguard_imports_no_framework():
    code = ("import sys, nanguard; bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'peft', "
            "'accelerate') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _assert_only_the_nan_step_skipped(changed, model, guard, log, step):
    """Of 5 optimizer steps, the NaN one (the NAN_AT-th, counted from 0) was
    skipped: no parameter moved then, every other step moved them; the guard
    recorded that one skip under the framework's number for it (`step`) with
    the module and pass that produced the NaN, and the framework's log
    (`log`, its logger's text) says so, under the same number. Returns the
    record."""
    assert changed == [i != NAN_AT for i in range(5)], changed
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(guard.skipped) == 1 and guard.skipped[0].step == step, guard.skipped
    rec = guard.skipped[0]
    assert rec.module_class and rec.pass_ == "forward", str(rec)
    assert f"optimizer step {step} skipped" in log and f"({rec.module_class}, forward pass)" in log, log
    assert f"first non-finite value at step {step}," in rec.report, rec.report  # the watcher's report too
    return rec


@contextlib.contextmanager
def _records_of(logger_name):
    """The messages a framework's logger emits (its own handlers may write
    to a stream captured elsewhere)."""
    got = []

    class _H(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    h = _H(logging.WARNING)
    logger = logging.getLogger(logger_name)
    logger.addHandler(h)
    try:
        yield got
    finally:
        logger.removeHandler(h)


# ---- StepGuard, the shared core -----------------------------------------------------------------


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def _grads(model, x, scale=1.0):
    model.zero_grad()
    (model(x).square().mean() * scale).backward()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_guard_skips_without_scaler(dtype):
    model = _tiny()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    g = StepGuard(max_grad_norm=0.5)
    g.attach(model)
    x = torch.randn(5, 8).to(next(model.parameters()).dtype)
    _grads(model, x)
    ref = [p.grad.double().clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(r.square().sum()) for r in ref))
    assert g.guard(model.parameters(), opt)
    # clipped once, to 0.5 (the reference norm is far above it)
    assert norm > 1.0 and abs(g.last_grad_norm - norm) <= 1e-3 * norm
    got = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    assert abs(got - 0.5) <= (2e-2 if dtype == "bf16" else 1e-5)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("nan")
    _grads(model, bad)
    assert not g.guard(model.parameters(), opt)
    opt.step()  # applies nothing: no parameter has a gradient
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p.detach())
    rec = g.skipped[-1]
    # the NaN came in with the batch: the watcher names the model's input
    assert rec.cause == "nan" and rec.module == "" and rec.module_class == "Sequential", str(rec)
    assert rec.pass_ == "forward" and "inputs" in rec.report, rec.report
    assert g.summary()["skipped"] == 1
    g.detach()


def test_step_guard_fp16_with_scaler_skips_and_backs_off():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = StepGuard(max_grad_norm=1.0, watch=False)
    x = torch.randn(5, 8)
    # a finite step: unscaled and clipped once by the guard, then applied
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    assert g.guard(model.parameters(), opt, scaler)
    n = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    assert n <= 1.0 + 1e-5
    w0 = model[0].weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(w0, model[0].weight) and scaler.get_scale() == 1024.0
    # a NaN step: skipped by the scaler, the scale backs off
    model.zero_grad()
    bad = x.clone()
    bad[1, 2] = float("inf")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(bad).float().square().mean()
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in model.parameters()]
    assert not g.guard(model.parameters(), opt, scaler)
    scaler.step(opt)
    scaler.update()
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p.detach())
    assert scaler.get_scale() == 512.0
    rec = g.skipped[-1]
    # the record: the scale the step ran at, the first gradient (model[0].weight) holding the Inf
    assert rec.cause in ("nan", "inf") and rec.scale == 1024.0 and rec.first_bad == 0, rec
    # its state survives JSON (the Trainer's trainer_state.json), all but the report text
    g2 = StepGuard()
    g2.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert g2.steps == 2 and g2.skipped == [dataclasses.replace(rec, report="")]


def test_step_guard_bad_arguments():
    with pytest.raises(ValueError, match="max_grad_norm"):
        StepGuard(max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="max_grad_norm"):
        StepGuard(max_grad_norm="1")
    with pytest.raises(ValueError, match="norm_type"):
        StepGuard(norm_type=1.0)
    with pytest.raises(TypeError, match="model"):
        StepGuard().attach("not a model")
    model = _tiny()
    _grads(model, torch.randn(2, 8))
    with pytest.raises(ValueError, match="optimizer is required"):
        StepGuard().guard(model.parameters(), None, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="watch_kwargs"):
        StepGuard(watch_kwargs=["policy"])
    with pytest.raises(ValueError, match="norm_type"):
        StepGuard.validate_args(norm_type=3.0)
    StepGuard.validate_args(0.0, math.inf, False, {"every": 2})
    if importlib.util.find_spec("transformers") is not None:
        from nanguard.integrations.transformers import NanguardCallback

        with pytest.raises(ValueError, match="max_grad_norm"):
            NanguardCallback(max_grad_norm=-1.0)
    if importlib.util.find_spec("lightning") is not None:
        from nanguard.integrations.lightning import NanguardCallback as LCallback

        with pytest.raises(TypeError, match="watch must be a bool"):
            LCallback(watch="yes")


# ---- transformers.Trainer -------------------------------------------------------------------------


class _ParamSteps:
    """Records, per optimizer step, whether any parameter changed."""

    def __init__(self, model):
        self.model = model
        self.before = None
        self.changed = []

    def pre(self):
        self.before = [p.detach().clone() for p in self.model.parameters()]

    def post(self):
        self.changed.append(any(not torch.equal(a, p.detach()) for a, p in zip(self.before, self.model.parameters())))


def _llama():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return T, T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64))


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class _NaNAtCollator:
    """Stacks rows into a batch; the batch of call ``at`` (default
    ``NAN_AT``; None: none) carries NaN input embeddings instead of token ids
    (a corrupted batch)."""

    def __init__(self, hidden, at=NAN_AT):
        self.calls = 0
        self.hidden = hidden
        self.at = at

    def __call__(self, rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        if self.calls == self.at:
            batch["inputs_embeds"] = torch.full((ids.shape[0], ids.shape[1], self.hidden), float("nan"))
            del batch["input_ids"]
        self.calls += 1
        return batch


def _trainer(T, model, tmp_path, callbacks, collator, **kw):
    """A transformers.Trainer on the CPU in bf16 over tiny-Llama rows, one log line per step."""
    opts = dict(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=5, learning_rate=1e-3,
                logging_steps=1, report_to=[], save_strategy="no", bf16=True, use_cpu=True,
                dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True, seed=0)
    opts.update(kw)
    args = T.TrainingArguments(**opts)
    rows = _Rows(BATCH * args.max_steps * args.gradient_accumulation_steps)
    return T.Trainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=callbacks)


def test_transformers_trainer_bf16_nan_batch_is_skipped(tmp_path, fresh_accelerate_state):
    """Gradient accumulation 2, the NaN in the second micro-batch of the
    NAN_AT-th optimizer step: the Trainer numbers that step NAN_AT + 1 (its
    global_step once done, the step of its log line, where it logs
    grad_norm: nan), and so does every nanguard log of the skip."""
    T, model = _llama()
    from nanguard.integrations.transformers import NanguardCallback

    nanguard.patch(model)
    watch_steps = _ParamSteps(model)

    class Probe(T.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            assert args.max_grad_norm == 0.0  # the Trainer does not clip: nanguard does
            watch_steps.pre()

        def on_optimizer_step(self, args, state, control, **kw):
            watch_steps.post()

    class Reporter(T.TrainerCallback):
        """A reporting callback (TensorBoard's, W&B's) added after the
        Trainer is built: it runs after NanguardCallback and sees its values."""

        seen = {}

        def on_log(self, args, state, control, logs=None, **kw):
            self.seen[state.global_step] = dict(logs)

    cb = NanguardCallback()
    trainer = _trainer(T, model, tmp_path, [cb, Probe()], _NaNAtCollator(32, at=2 * NAN_AT + 1),
                       gradient_accumulation_steps=2)
    trainer.add_callback(Reporter)
    with _records_of("transformers.trainer") as msgs:
        trainer.train()
    err = "\n".join(msgs)
    step = NAN_AT + 1
    rec = _assert_only_the_nan_step_skipped(watch_steps.changed, model, cb.guard, err, step)
    # in the Trainer's logs: its log history too, at the step where the Trainer logs grad_norm nan
    assert "1 of 5 optimizer steps skipped" in err, err
    entries = [e for e in trainer.state.log_history if "nanguard_skipped_step" in e]
    assert len(entries) == 1 and entries[0]["nanguard_first_nonfinite_class"] == rec.module_class
    assert entries[0]["step"] == entries[0]["nanguard_skipped_step"] == step
    nan_norms = [e["step"] for e in trainer.state.log_history if math.isnan(e.get("grad_norm", 0.0))]
    assert nan_norms == [step], trainer.state.log_history
    assert trainer.state.log_history[-2]["nanguard_skipped_steps"] == 1
    seen = Reporter.seen
    assert [seen[i]["nanguard_skipped_steps"] for i in range(1, 6)] == [int(i >= step) for i in range(1, 6)]
    assert math.isnan(seen[step]["nanguard_grad_norm"]) and math.isnan(seen[step]["grad_norm"])
    # clipping done once, by nanguard, at the Trainer's max_grad_norm; the Trainer's own is restored
    assert cb.guard.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 1.0


@pytest.mark.parametrize("restore_callbacks", [False, True])
def test_transformers_resume_keeps_the_guards_history(tmp_path, fresh_accelerate_state, restore_callbacks):
    """4 steps with a NaN batch at the NAN_AT-th, a checkpoint at step 4,
    then a new Trainer resuming from it for steps 5 and 6: the skip of step
    NAN_AT + 1 and the step count carry over (through trainer_state.json),
    with the Trainer's callback restore on or off."""
    T, model = _llama()
    from nanguard.integrations.transformers import NanguardCallback

    cb = NanguardCallback()
    first = _trainer(T, model, tmp_path, [cb], _NaNAtCollator(32), max_steps=4, save_strategy="steps",
                     save_steps=4)
    first.train()
    assert [s.step for s in cb.guard.skipped] == [NAN_AT + 1]
    _, model2 = _llama()
    cb2 = NanguardCallback()
    second = _trainer(T, model2, tmp_path, [cb2], _NaNAtCollator(32, at=None), max_steps=6,
                      restore_callback_states_from_checkpoint=restore_callbacks)
    with _records_of("transformers.trainer") as msgs:
        second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    (resumed,) = [c for c in second.callback_handler.callbacks if isinstance(c, NanguardCallback)]
    assert (resumed is cb2) == (not restore_callbacks)  # the Trainer's restore builds a new callback
    (rec,) = resumed.guard.skipped
    saved = cb.guard.skipped[0]
    assert (rec.step, rec.cause, rec.nan_count, rec.module_class, rec.pass_) == \
        (saved.step, saved.cause, saved.nan_count, saved.module_class, saved.pass_)
    assert resumed.guard.summary()["steps"] == 6
    lines = [e for e in second.state.log_history if e.get("step", 0) > 4 and "loss" in e]
    assert [e["step"] for e in lines] == [5, 6] and all(e["nanguard_skipped_steps"] == 1 for e in lines)
    assert "1 of 6 optimizer steps skipped" in "\n".join(msgs)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state; start and leave it clean."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(True)
    yield
    state.AcceleratorState._reset_state(True)


def test_transformers_callback_fp16_through_accelerates_scaler(tmp_path, fresh_accelerate_state):
    """The Trainer's fp16 path, on the CPU: accelerate's AcceleratedOptimizer
    holding a GradScaler (which accelerate only creates on a GPU), driven
    the way the Trainer drives it: its grad-norm computation unscales first
    (accelerator.clip_grad_norm_ with max_norm=inf), then the callback, then
    optimizer.step(). A NaN step is skipped by the scaler, which backs off."""
    T, model = _llama()
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer
    from nanguard.integrations.transformers import NanguardCallback

    args = T.TrainingArguments(output_dir=str(tmp_path), max_grad_norm=1.0, report_to=[], use_cpu=True)
    _ = args.device  # sets accelerate's state up (and resets it) as the Trainer would, before the accelerator
    accelerate.Accelerator(cpu=True)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    state, control = T.TrainerState(), T.TrainerControl()
    cb = NanguardCallback()
    cb.on_train_begin(args, state, control, model=model)
    coll = _NaNAtCollator(32)
    rows = _Rows(BATCH * 4)
    for step in range(4):
        batch = coll([rows[i] for i in range(step * BATCH, (step + 1) * BATCH)])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        if step % 2:
            scaler.unscale_(inner)  # what the Trainer's grad-norm computation does first
        before = [p.detach().clone() for p in model.parameters()]
        state.global_step = step
        cb.on_pre_optimizer_step(args, state, control, model=model, optimizer=opt)
        if step != NAN_AT:
            n = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
            assert n <= 1.0 + 1e-4  # unscaled and clipped once, by the callback
        opt.step()
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        assert moved == (step != NAN_AT) and opt.step_was_skipped == (step == NAN_AT), step
    assert scaler.get_scale() == 512.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [s.step for s in cb.guard.skipped] == [NAN_AT + 1]  # the Trainer's number: global_step + 1
    cb.on_train_end(args, state, control)
    assert args.max_grad_norm == 1.0


# ---- Lightning -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("package, precision", [("lightning.pytorch", "bf16-mixed"), ("lightning.pytorch", "16-mixed"),
                                                ("lightning.pytorch", "32-true"), ("pytorch_lightning", "bf16-mixed")])
def test_lightning_trainer_nan_batch_is_skipped(package, precision):
    """bf16 as Lightning runs it on the CPU; 16-mixed through Lightning's own
    MixedPrecision plugin and GradScaler (on the CPU, which Lightning's
    precision flag would turn into bf16: the plugin is passed directly)."""
    L = pytest.importorskip(package, reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations import lightning as ng_lightning

    NanguardCallback = ng_lightning.NanguardCallback if package == "lightning.pytorch" \
        else ng_lightning.PLNanguardCallback

    T, lm = _llama()
    steps = _ParamSteps(lm)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def training_step(self, batch, i):
            return self.lm(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            assert trainer.gradient_clip_val is None  # Lightning does not clip: nanguard did
            steps.pre()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.post()

    rows = _Rows(BATCH * 5)
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, collate_fn=_NaNAtCollator(32))
    cb = NanguardCallback()
    kw = dict(precision=precision)
    scaler = None
    if precision == "16-mixed":
        MixedPrecision = L.plugins.precision.MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        kw = dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb, Probe()], **kw)
    module = Module()
    s = nanguard.patch(module)  # the LightningModule: the transformers model inside it is found
    assert s.attn_implementation is not None and lm.config._attn_implementation == "nanguard", str(s)
    with _records_of(f"{package}.callbacks.nanguard") as msgs:
        trainer.fit(module, loader)
    err = "\n".join(msgs)
    # Lightning's loggers log the NAN_AT-th step's metrics under step NAN_AT
    _assert_only_the_nan_step_skipped(steps.changed, lm, cb.guard, err, NAN_AT)
    # Lightning's logs: the logged metrics too
    assert trainer.callback_metrics["nanguard/skipped_steps"].item() == 1.0
    if scaler is not None:
        assert scaler.get_scale() == 512.0  # the scaler's own skip backed the scale off once
    # clipping done once, by nanguard, at the Trainer's gradient_clip_val, which is restored
    assert cb.guard.max_grad_norm == 1.0 and trainer.gradient_clip_val == 1.0


def test_lightning_manual_optimization():
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.automatic_optimization = False

        def training_step(self, batch, i):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.lm(**batch).loss)
            opt.step()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(_Rows(BATCH * 5), batch_size=BATCH, collate_fn=_NaNAtCollator(32))
    cb = NanguardCallback(max_grad_norm=1.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    trainer.fit(Module(), loader)
    assert [s.step for s in cb.guard.skipped] == [NAN_AT] and cb.guard.steps == 5
    assert all(torch.isfinite(p).all() for p in lm.parameters())


def test_lightning_skips_carry_the_loggers_step(tmp_path):
    """Manual optimization with two optimizers (trainer.global_step counts
    both: 2 per batch): the NaN batch's two skipped steps carry the step
    Lightning's logger records that batch's metrics under, where its NaN loss
    is in the CSV log, not a global_step."""
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.automatic_optimization = False

        def training_step(self, batch, i):
            opts = self.optimizers()
            for o in opts:
                o.zero_grad()
            loss = self.lm(**batch).loss
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            self.manual_backward(loss)
            for o in opts:
                o.step()

        def configure_optimizers(self):
            params = list(self.parameters())
            half = len(params) // 2
            return torch.optim.AdamW(params[:half], lr=1e-3), torch.optim.AdamW(params[half:], lr=1e-3)

    loader = torch.utils.data.DataLoader(_Rows(BATCH * 5), batch_size=BATCH, collate_fn=_NaNAtCollator(32))
    cb = NanguardCallback(max_grad_norm=1.0)
    logger = L.loggers.CSVLogger(str(tmp_path), name="run")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=10, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])
    with _records_of("lightning.pytorch.callbacks.nanguard") as msgs:
        trainer.fit(Module(), loader)
    assert trainer.global_step == 10 and cb.guard.steps == 10
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    nan_steps = [int(r["step"]) for r in rows if math.isnan(float(r["train_loss"]))]
    assert nan_steps == [NAN_AT], rows
    assert [s.step for s in cb.guard.skipped] == [NAN_AT, NAN_AT]
    assert f"optimizer step {NAN_AT} skipped" in "\n".join(msgs)


def test_lightning_resume_keeps_the_guards_history(tmp_path):
    """4 steps with a NaN batch at the NAN_AT-th, Lightning's checkpoint,
    then a new Trainer and callback resuming from it for 2 more steps: the
    skip record and the step count carry over (Callback.state_dict)."""
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    def run(max_steps, collator, ckpt_path=None):
        T, lm = _llama()

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.lm = lm

            def training_step(self, batch, i):
                return self.lm(**batch).loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        cb = NanguardCallback(max_grad_norm=1.0)
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=max_steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[cb])
        loader = torch.utils.data.DataLoader(_Rows(BATCH * 6), batch_size=BATCH, collate_fn=collator)
        with _records_of("lightning.pytorch.callbacks.nanguard") as msgs:
            trainer.fit(Module(), loader, ckpt_path=ckpt_path)
        return trainer, cb, "\n".join(msgs)

    trainer, cb, _ = run(4, _NaNAtCollator(32))
    assert [s.step for s in cb.guard.skipped] == [NAN_AT]
    path = str(tmp_path / "four.ckpt")
    trainer.save_checkpoint(path)
    trainer2, cb2, log = run(6, _NaNAtCollator(32, at=None), ckpt_path=path)
    assert trainer2.global_step == 6
    (rec,) = cb2.guard.skipped
    saved = cb.guard.skipped[0]
    assert (rec.step, rec.cause, rec.nan_count, rec.module_class, rec.pass_) == \
        (saved.step, saved.cause, saved.nan_count, saved.module_class, saved.pass_)
    assert cb2.guard.summary()["steps"] == 6 and "1 of 6 optimizer steps skipped" in log, log
    assert trainer2.callback_metrics["nanguard/skipped_steps"].item() == 1.0


def _lm_module(L, lm, scheduler: bool = False):
    """A LightningModule training the transformers model ``lm`` with AdamW
    (and a constant LambdaLR schedule, with ``scheduler``)."""

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def training_step(self, batch, i):
            return self.lm(**batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            if not scheduler:
                return opt
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)}

    return Module()


def test_lightning_record_dir_saves_the_failing_step_for_replay(tmp_path):
    """NanguardCallback(record_dir=...): the NaN batch's step is saved with
    the module training_step called (the transformers model inside the
    LightningModule), which replay rebuilds from its config."""
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()
    loader = torch.utils.data.DataLoader(_Rows(BATCH * 5), batch_size=BATCH, collate_fn=_NaNAtCollator(32))
    cb = NanguardCallback(record_dir=tmp_path / "rec")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with _records_of("lightning.pytorch.callbacks.nanguard"):
        trainer.fit(_lm_module(L, lm), loader)
    files = sorted(os.listdir(tmp_path / "rec"))
    assert len(files) == 1 and files[0].startswith("nanguard-step")
    from nanguard.diagnostics._flight_record import load_record

    path = str(tmp_path / "rec" / files[0])
    assert load_record(path).entry == "lm"
    res = nanguard.replay(path)
    assert res.reproduced and res.batch and res.batch[0].startswith("`inputs_embeds` holds NaN")
    with pytest.raises(ValueError, match="record_dir needs watch=True"):
        NanguardCallback(watch=False, record_dir=tmp_path)
    with pytest.raises(TypeError, match="record_dir must be a path"):
        NanguardCallback(record_dir=3)
