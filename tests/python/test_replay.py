"""nanguard.replay: a recorded failing step run again under the op-level
checker, and the triage checklist's verdict.

Each case records one real step (inputs, RNG, weights, autocast, loss scale)
with the flight-record writer, replays it from the file, and checks the
first op that made a non-finite value from finite inputs and the verdict:
fp16 attention-score overflow in a GPT-2, NaN in the input batch, log(0) in
the user's loss, fp16 gradient overflow in a linear layer's backward at a
high loss scale (and one that persists at scale 1), and a hand-written fp16
LayerNorm over a constant row.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
import math
import os

import pytest
import torch
from torch import nn

from nanguard.diagnostics._flight_record import (FlightRecord, RecordError, StepStart, load_record, record_name,
                                                 write_record)
from nanguard.diagnostics._replay import replay
from nanguard.diagnostics._triage import MAX_SCORE, TRIAGE_NORM_EPS

from conftest import requires_cuda


def _record(tmp_path, model, *, args=(), kwargs=None, loss_fn=None, autocast=None, loss_scale=None, step=7):
    """Run one step as a training loop would and write its flight record."""
    kwargs = kwargs or {}
    start = StepStart.capture()
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        start.autocast = {"device_type": "cpu", "dtype": str(autocast).removeprefix("torch.")} if autocast else None
        out = model(*args, **kwargs)
        loss = loss_fn(out, {"args": args, **kwargs}) if loss_fn else out.loss
    (loss.float() * (loss_scale or 1.0)).backward()
    bad = not bool(torch.isfinite(loss).all()) or any(
        not bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return write_record(str(tmp_path), model=model, args=args, kwargs=kwargs, start=start, step=step,
                        loss_scale=loss_scale, recorded_nonfinite=bad)


def _gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).train()


def test_fp16_attention_score_overflow(tmp_path):
    model = _gpt2()
    with torch.no_grad():  # large q and k projections: q . k passes fp16's 65504, each of q and k does not
        w = model.transformer.h[1].attn.c_attn.weight
        w[:, :64] *= 1000.0
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    path = _record(tmp_path, model, kwargs={"input_ids": ids, "labels": ids}, autocast=torch.float16,
                   loss_scale=2.0**16)
    assert os.path.basename(path) == record_name(7) == "nanguard-step7.pt"
    res = replay(path, triage=True)  # the model is rebuilt from the record's class and config
    assert res.reproduced and res.recorded_nonfinite and not res.outcome.finite
    assert res.first_op in ("aten::bmm", "aten::mm", "aten::matmul")
    assert res.pass_ == "forward" and res.module == "transformer.h.1.attn"
    assert res.inputs and all(s["dtype"] == "float16" for s in res.inputs)
    assert all(s["max_abs"] < 65504 for s in res.inputs)
    assert res.outcome.first.output["inf"] > 0
    t = res.triage
    for name in ("float32", "bfloat16", "nanguard.patch", "max_score"):
        assert t[name].finite, name
    for name in ("norm eps", "dropout off"):
        assert not t[name].finite, name
    assert res.verdict.startswith("fp16 overflow in attention scores in `transformer.h.1.attn`")
    assert "finite in fp32, in bf16, with nanguard.patch" in res.verdict
    assert f"clamped to ±{MAX_SCORE:g}" in res.verdict
    assert "eps and dropout do not matter" in res.verdict


def test_nan_in_the_batch(tmp_path):
    model = _gpt2()
    emb = torch.randn(3, 20, 32)
    emb[2, 17, 5] = math.nan
    ids = torch.randint(0, 64, (3, 20))
    path = _record(tmp_path, model, kwargs={"inputs_embeds": emb, "labels": ids})
    res = replay(path, triage=True)
    assert res.reproduced
    assert res.first_op is None  # no op made it: it came in with the batch
    assert res.batch == ["`inputs_embeds` holds NaN (first at inputs_embeds[2, 17, 5])"]
    assert res.verdict.startswith("the batch is bad: `inputs_embeds` holds NaN (first at inputs_embeds[2, 17, 5])")
    assert res.verdict.endswith("(no variant is finite)")


def test_log_zero_in_the_users_loss(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def loss_fn(out, inputs):
        return -torch.log(out).mean()  # ReLU's zeros: log(0) = -inf, outside the model

    x = torch.randn(4, 8)
    path = _record(tmp_path, model, args=(x,), loss_fn=loss_fn)
    with pytest.raises(ValueError, match="model"):  # not a Hugging Face model: replay needs it
        replay(path, loss_fn=loss_fn)
    res = replay(path, model=nn.Sequential(nn.Linear(8, 8), nn.ReLU()), loss_fn=loss_fn, triage=True)
    assert res.reproduced
    assert res.first_op == "aten::log" and res.pass_ == "forward" and res.module is None
    assert res.verdict.startswith("the loss function, outside the model, made the first non-finite value: "
                                  "`aten::log` gave Inf from finite inputs")
    assert "no variant is finite" in res.verdict


def _two_linears(w2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight.fill_(w2)
    return model


@pytest.mark.parametrize("w2, persists", [(2.0, False), (2000.0, True)])
def test_fp16_gradient_overflow_at_a_high_loss_scale(tmp_path, w2, persists):
    # the loss gradient reaching the second linear is loss_scale per element
    # (fits fp16); its input gradient sums 64 of them times w2: 1024 * 64 * 2
    # = 131072 overflows fp16, and stays under 65504 from scale 256 down.
    # With w2 = 2000 even scale 1 gives 64 * 2000 = 128000.
    x = torch.randn(1, 64) * 0.01  # one row and small values: the first linear's gradients stay in range
    path = _record(tmp_path, _two_linears(w2), args=(x,), loss_fn=lambda out, _: out.float().sum(),
                   autocast=torch.float16, loss_scale=1024.0)
    res = replay(path, model=_two_linears(0.0), loss_fn=lambda out, _: out.float().sum(), triage=True)
    assert res.reproduced
    assert res.pass_ == "backward" and res.node in ("AddmmBackward0", "MmBackward0")
    assert res.first_op == "aten::mm" and res.module == "1"
    ls = res.triage["loss scale"]
    if persists:
        assert not ls.finite and ls.setting.startswith("loss scale 1 ")
        assert "persists at loss scale 1" in res.verdict
    else:
        assert ls.finite and ls.setting == "loss scale 256 (recorded 1024 / 2^2)"
        assert res.verdict.startswith("gradient overflow in the backward of `1` (first node `AddmmBackward0`")
        assert res.verdict.endswith("The GradScaler's backoff handles this: it skips the step and lowers the scale")


class HandLayerNorm(nn.Module):
    """A LayerNorm written by hand, as users write them."""

    def __init__(self, d, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _hand_ln_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), HandLayerNorm(16)).half()


def test_hand_written_fp16_layernorm_over_a_constant_row(tmp_path):
    model = _hand_ln_model()
    with torch.no_grad():  # the linear's output is the same in every column: var = 0, eps = 1e-12 is 0 in fp16
        model[0].weight.zero_()
        model[0].bias.fill_(0.5)
    x = torch.randn(4, 16, dtype=torch.float16)
    path = _record(tmp_path, model, args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
    res = replay(path, model=_hand_ln_model(), loss_fn=lambda out, _: out.float().pow(2).mean(), triage=True)
    assert res.reproduced
    assert res.first_op == "aten::div" and res.module == "1" and res.pass_ == "forward"  # 0 / sqrt(0 + 0)
    t = res.triage
    assert t["norm eps"].finite and t["float32"].finite and not t["dropout off"].finite
    assert res.verdict.startswith("NaN made from finite inputs (float16) in `1` (first op `aten::div`, forward)")
    assert f"with norm eps raised to {TRIAGE_NORM_EPS:g}" in res.verdict
    assert "dropout does not matter" in res.verdict


def test_a_finite_replay_says_it_is_not_reproduced(tmp_path):
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    start = StepStart.capture()
    path = write_record(str(tmp_path), model=model, args=(x,), kwargs={}, start=start, step=3,
                        recorded_nonfinite=True)
    res = replay(path, model=nn.Linear(4, 4), loss_fn=lambda out, _: out.sum())
    assert not res.reproduced and res.outcome.finite and res.first_op is None
    assert res.verdict.startswith("the replayed step is finite, so the failure is not reproduced here")
    assert any("not deterministic" in n for n in res.notes)


def test_record_round_trip_restores_rng_and_inputs(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(3, 4)
    torch.manual_seed(11)
    start = StepStart.capture()
    expect = model(x)  # dropout draws from the RNG captured above
    path = write_record(str(tmp_path), model=model, args=(x,), kwargs={"extra": {"k": [1, 2.5, None]}},
                        start=start, step=5, rank=2)
    assert os.path.basename(path) == "nanguard-step5-rank2.pt"
    rec = load_record(path)  # weights_only: tensors and plain values only
    assert rec.step == 5 and rec.rank == 2 and rec.kwargs == {"extra": {"k": [1, 2.5, None]}}
    assert torch.equal(rec.args[0], x)
    from nanguard.diagnostics._flight_record import restore_rng

    torch.manual_seed(999)
    restore_rng(rec.rng)
    assert torch.equal(model(x), expect)


def _v1_record(model: nn.Module, x: torch.Tensor, rng: dict) -> dict:
    """A flight record exactly as version 1 wrote it: these 18 keys, no micro_batch."""
    return {
        "format": "nanguard.flight-record", "version": 1, "step": 7, "rank": None, "args": (x,), "kwargs": {},
        "rng": rng, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "sharding": {},
        "training": True, "autocast": None, "loss_scale": None, "model": None, "report": "report v1",
        "history": None, "recorded_nonfinite": True, "entry": "", "versions": {"torch": "2.11.0", "nanguard": "0.1.0"},
    }


def test_a_version_1_record_is_migrated_and_replays(tmp_path):
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x = torch.full((4, 3), 2e38)  # finite inputs whose products' sum overflows fp32
    path = tmp_path / "nanguard-step7.pt"
    torch.save(_v1_record(model, x, StepStart.capture().rng), path)
    rec = load_record(str(path))
    assert isinstance(rec, FlightRecord) and rec.micro_batch == 0  # version 1 kept the first forward's inputs
    assert rec.step == 7 and rec.report == "report v1" and torch.equal(rec.args[0], x)
    res = replay(str(path), model=nn.Linear(3, 2), loss_fn=lambda out, _: out.sum())
    assert res.reproduced and res.step == 7 and res.first_op in ("aten::addmm", "aten::mm"), res


def test_a_version_2_record_round_trips_losslessly(tmp_path):
    model = nn.Linear(3, 2)
    x = torch.randn(2, 3)
    start = StepStart.capture()
    path = write_record(str(tmp_path), model=model, args=(x,), kwargs={"mask": torch.ones(2), "n": [1, (2.5,)]},
                        start=start, step=4, rank=1, loss_scale=512, report="r", history=[{"a": 1}],
                        entry="lm", micro_batch=3)
    raw = torch.load(path, weights_only=True)  # the file: plain containers and tensors
    assert type(raw) is dict and raw["format"] == "nanguard.flight-record" and raw["version"] == 2
    rec = load_record(path)
    assert rec.micro_batch == 3 and rec.rank == 1 and rec.loss_scale == 512.0 and rec.entry == "lm"
    again = FlightRecord.from_dict(rec.to_dict())
    assert again.to_dict().keys() == raw.keys()
    for f in dataclasses.fields(FlightRecord):  # every field as written, tensors bit for bit
        a, b = getattr(again, f.name), raw[f.name]
        if f.name in ("args", "state"):
            items = zip(a, b) if f.name == "args" else ((a[k], b[k]) for k in b)
            assert all(torch.equal(u, v) for u, v in items), f.name
        elif f.name == "rng":
            assert torch.equal(a["cpu"], b["cpu"]) and a["cuda"] == b["cuda"]
        elif f.name == "kwargs":
            assert torch.equal(a["mask"], b["mask"]) and a["n"] == b["n"] == [1, (2.5,)]
        else:
            assert a == b, f.name


def test_records_of_an_unknown_version_or_incomplete_are_refused(tmp_path):
    rec = _v1_record(nn.Linear(2, 2), torch.ones(1, 2), StepStart.capture().rng)
    with pytest.raises(RecordError, match="version 3; this nanguard reads versions 1 to 2"):
        FlightRecord.from_dict({**rec, "version": 3})
    del rec["state"]
    with pytest.raises(RecordError, match="record is a flight record of version 1 without state"):
        FlightRecord.from_dict(rec)
    with pytest.raises(RecordError, match="not a nanguard flight record"):
        FlightRecord.from_dict(["format"])


def test_bad_records_and_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="path"):
        replay(str(tmp_path / "missing.pt"))
    junk = tmp_path / "junk.pt"
    torch.save({"format": "something else"}, junk)
    with pytest.raises(RecordError, match="not a nanguard flight record"):
        replay(str(junk))
    old = tmp_path / "old.pt"
    torch.save({"format": "nanguard.flight-record", "version": 99}, old)
    with pytest.raises(RecordError, match="version 99"):
        replay(str(old))
    text = tmp_path / "text.pt"
    text.write_text("not a pickle")
    with pytest.raises(RecordError, match="not a readable"):
        replay(str(text))
    with pytest.raises(TypeError, match="a flight record holds tensors and plain values; kwargs\\['f'\\]"):
        write_record(str(tmp_path), model=nn.Linear(2, 2), args=(), kwargs={"f": object()},
                     start=StepStart.capture(), step=1)
    model = nn.Linear(2, 2)
    path = write_record(str(tmp_path), model=model, args=(torch.ones(1, 2),), kwargs={},
                        start=StepStart.capture(), step=1)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        replay(path, model=model, loss_fn=3)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        replay(path, model="linear")
    with pytest.raises(ValueError, match="model: its parameters and buffers do not match"):
        replay(path, model=nn.Linear(3, 3), loss_fn=lambda o, _: o.sum())
    with pytest.raises(ValueError, match="loss_fn: the model's output has no .loss"):
        replay(path, model=nn.Linear(2, 2))


def test_result_serialises_to_json(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    loss_fn = lambda out, _: -torch.log(out).mean()  # noqa: E731
    path = _record(tmp_path, model, args=(torch.randn(4, 8),), loss_fn=loss_fn)
    res = replay(path, model=nn.Sequential(nn.Linear(8, 8), nn.ReLU()), loss_fn=loss_fn, triage=True)
    d = json.loads(res.to_json())
    assert d["first_op"] == "aten::log" and d["verdict"] == res.verdict
    assert set(d["triage"]) >= {"float32", "nanguard.patch", "norm eps", "dropout off"}
    text = str(res)
    assert "first non-finite: `aten::log` (forward) outside the model" in text
    assert text.splitlines()[-1] == "verdict: " + res.verdict


def test_flight_recorder_writes_the_first_nonfinite_step_only(tmp_path):
    from nanguard.diagnostics._flight_recorder import FlightRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = FlightRecorder(model, tmp_path / "rec")
    loss_fn = lambda out, _: out.float().mean()  # noqa: E731
    seen = []
    for step in range(6):
        x = torch.randn(4, 8)
        if step in (3, 4):
            x[1, 2] = math.inf  # an Inf in the batch: the step's loss is non-finite
        out = model(x)
        assert rec.batches[0].args[0] is x  # held by reference, not copied
        loss = loss_fn(out, None)
        opt.zero_grad()
        loss.backward()
        bad = not bool(torch.isfinite(loss))
        before = [p.detach().clone() for p in model.parameters()]
        path = rec.step_done(step=step, nonfinite=bad, report="report text" if bad else None)
        seen.append(path)
        if not bad:
            opt.step()
        assert rec.batches == []  # references dropped at the step's end
        if step == 3:
            params_at_failure = before
    assert seen[:3] == [None] * 3 and seen[4:] == [None, None]  # the first non-finite step only
    assert seen[3] == str(tmp_path / "rec" / "nanguard-step3.pt") == rec.path
    assert os.listdir(tmp_path / "rec") == ["nanguard-step3.pt"]
    saved = load_record(seen[3])
    assert saved.report == "report text" and saved.training is True
    for p, q in zip(saved.state.values(), params_at_failure):
        assert torch.equal(p, q)
    rec.remove()
    res = replay(seen[3], model=nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1)), loss_fn=loss_fn)
    assert res.reproduced and res.batch == ["`args[0]` holds Inf (first at args[0][1, 2])"]


def test_flight_recorder_restores_the_steps_dropout(tmp_path):
    from nanguard.diagnostics._flight_recorder import FlightRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    rec = FlightRecorder(model, tmp_path)
    torch.manual_seed(5)
    x = torch.randn(3, 8)
    out = model(x)
    path = rec.step_done(step=0, nonfinite=True)
    step_model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    from nanguard.diagnostics._flight_record import build_model, restore_rng

    saved = load_record(path)
    build_model(saved, step_model)
    restore_rng(saved.rng)
    assert torch.equal(step_model(saved.args[0]), out)  # the same dropout mask


class _AutocastWrapped(nn.Module):
    """A model whose forward a wrapper runs under fp16 autocast, as
    accelerate (and so the Trainer) wraps it: after the entry's pre-hook."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        inner = self.forward
        self.forward = lambda x: _under_fp16(inner, x)

    def forward(self, x):
        return self.lin(x)


def _under_fp16(f, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return f(x)


@pytest.mark.parametrize("wrapped", [False, True])
def test_flight_recorder_hooks_the_children_only_while_a_wrapper_needs_it(tmp_path, wrapped):
    from nanguard.diagnostics._flight_recorder import FlightRecorder

    model = _AutocastWrapped() if wrapped else nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    rec = FlightRecorder(model, tmp_path)
    assert len(rec._hooked) == len(list(model.modules()))  # every module until the entry is known
    for step in range(3):
        # step 1 also enters fp16 autocast outside the model: the entry's pre-hook
        # sees what its children see, and a wrapper seen before must still count
        with torch.autocast("cpu", dtype=torch.float16, enabled=wrapped and step == 1):
            model(torch.randn(2, 4))
        assert rec.batches[0].start.autocast == ({"device_type": "cpu", "dtype": "float16"} if wrapped else None)
        # no wrapper: the entry alone keeps a pre-hook; a wrapper: its children too, every step
        assert len(rec._hooked) == (2 if wrapped else 1)
        rec.drop()
    rec.remove()
    assert rec._hooked == {} and all(not m._forward_pre_hooks for m in model.modules())


def test_flight_recorder_bad_arguments(tmp_path):
    from nanguard.diagnostics._flight_recorder import FlightRecorder

    with pytest.raises(TypeError, match="record_dir must be a path"):
        FlightRecorder(nn.Linear(2, 2), 3)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        FlightRecorder("model", tmp_path)


def test_cli_prints_the_report_or_json(tmp_path, capsys):
    from nanguard.diagnostics._replay import cli

    model = _gpt2()
    emb = torch.randn(2, 8, 32)
    emb[1, 3, 0] = math.nan
    path = _record(tmp_path, model, kwargs={"inputs_embeds": emb, "labels": torch.zeros(2, 8, dtype=torch.long)})
    assert cli([path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        "verdict: the batch is bad: `inputs_embeds` holds NaN (first at inputs_embeds[1, 3, 0])")
    assert cli([path, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["reproduced"] is True and d["step"] == 7 and d["triage"] is None
    assert cli([str(tmp_path / "nope.pt")]) == 2
    assert "no flight record" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["eager", "sentinel"])
def test_watch_records_the_failing_step_and_names_it(tmp_path, mode):
    import nanguard

    model = _gpt2()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[:, :64] *= 1000.0
    scaler = nanguard.amp.GradScaler("cpu", init_scale=2.0**12)
    w = nanguard.watch(model, record_dir=tmp_path / "rec", history=8, scaler=scaler, parameters=False, mode=mode)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    with pytest.raises(nanguard.NonFiniteError) as err:
        w.step()
    path = str(tmp_path / "rec" / "nanguard-step0.pt")
    assert err.value.replay_path == path and err.value.report.replay_path == path
    assert f"python -m nanguard replay {path} --triage" in str(err.value)
    rec = load_record(path)
    assert rec.loss_scale == 2.0**12 and rec.autocast == {"device_type": "cpu", "dtype": "float16"}
    assert rec.kwargs["input_ids"] is not None and torch.equal(rec.kwargs["input_ids"], ids)
    assert rec.history and {"module", "pass", "max_abs"} <= set(rec.history[0])
    assert "first non-finite value at step 0" in rec.report
    assert w.history is not None and w.history.first_nonfinite == 0
    w.remove()
    res = nanguard.replay(path)
    assert res.reproduced and res.module == "transformer.h.1.attn" and res.pass_ == "forward"


def test_watch_history_warns_before_fp16_overflow():
    import nanguard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).half()
    with torch.no_grad():
        model[1].weight.mul_(100.0)
    w = nanguard.watch(model, history=16, policy="record", backward=False, parameters=False)
    assert w.warnings == [] and w.history is not None
    caught, sizes = [], []
    for _ in range(12):
        with torch.no_grad():
            model[1].weight.mul_(2.0)  # the output's magnitude doubles every step
            out = model(torch.ones(2, 8, dtype=torch.float16))
        sizes.append(float(out.abs().max()))
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            w.step()
        caught += [g.message for g in got if isinstance(g.message, nanguard.HeadroomWarning)]
    overflow = next(i for i, v in enumerate(sizes) if not math.isfinite(v))
    assert caught and caught == w.warnings
    first = caught[0]
    assert first.module in ("1", "") and first.pass_ == "forward"
    assert first.step <= overflow - 2 and first.predicted_step is not None
    room = w.history.headroom()
    assert room[("0", "forward")] > 8  # the first layer keeps its room
    w.remove()


@requires_cuda
def test_replay_on_cuda_restores_the_cuda_generator(tmp_path):
    from nanguard.diagnostics._flight_recorder import FlightRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()).cuda()
    rec = FlightRecorder(model, tmp_path)
    loss_fn = lambda out, _: -torch.log(out).mean()  # noqa: E731
    x = torch.randn(4, 8, device="cuda")
    out = model(x)
    path = rec.step_done(step=0, nonfinite=not bool(torch.isfinite(loss_fn(out, None))))
    saved = load_record(path)
    assert saved.rng["cuda"] is not None and saved.args[0].device.type == "cpu"
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()).cuda()
    res = replay(path, model=fresh, loss_fn=loss_fn)
    assert res.reproduced and res.first_op == "aten::log" and res.module is None


class CubeTanh(nn.Module):
    """tanh(x^3), as GPT-2's gelu_new computes its inner term: in fp16 the
    cube of 100 is Inf, and tanh turns it into 1: finite output."""

    def forward(self, x):
        return torch.tanh(x ** 3)


class Times(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = nn.Parameter(torch.tensor(k, dtype=torch.float16))

    def forward(self, x):
        return x * self.k


def test_an_inf_absorbed_inside_a_module_is_not_the_first_op(tmp_path):
    # the cube's Inf never leaves module 0 (its output is finite); the real
    # overflow is module 2's product: 100 * 1000 > 65504 in fp16
    def model():
        return nn.Sequential(CubeTanh(), Times(100.0), Times(1000.0))

    x = torch.full((2, 4), 100.0, dtype=torch.float16)
    loss_fn = lambda out, _: out.float().sum()  # noqa: E731
    path = _record(tmp_path, model(), args=(x,), loss_fn=loss_fn)
    res = replay(path, model=model(), loss_fn=loss_fn)
    assert res.reproduced
    assert res.first_op == "aten::mul" and res.module == "2" and res.pass_ == "forward"


@pytest.mark.parametrize("mode", ["eager", "sentinel"])
def test_watch_does_not_record_the_scalers_backoff_steps(tmp_path, mode):
    # with scaler=, a step non-finite in its gradients only at a loss scale
    # above 1 is the GradScaler's ordinary backoff: reported, not recorded;
    # the first step non-finite in its forward is (in either mode: sentinel
    # mode's replay needs the loss, which the output does not carry)
    import nanguard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    scaler = nanguard.amp.GradScaler("cpu", init_scale=2.0**16)
    loss_fn = (lambda out, _: out.float().sum()) if mode == "sentinel" else None
    w = nanguard.watch(model, record_dir=tmp_path / "rec", history=4, scaler=scaler, policy="record", mode=mode,
                       loss_fn=loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(1, 64) * 0.01
    reports = []
    for step in range(2):
        if step == 1:
            x = x.clone()
            x[0, 0] = math.nan
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(out.float().sum()).backward()
        reports.append(w.step())
        opt.zero_grad(set_to_none=True)
    assert reports[0] is not None and reports[0].pass_ == "backward"  # 2^16 * 64 * 2 overflows fp16
    assert getattr(reports[0], "replay_path", None) is None
    assert reports[1] is not None and reports[1].pass_ == "forward"
    assert reports[1].replay_path == str(tmp_path / "rec" / "nanguard-step1.pt")
    assert os.listdir(tmp_path / "rec") == ["nanguard-step1.pt"]
    w.remove()
