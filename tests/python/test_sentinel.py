"""nanguard.watch(mode="sentinel"): no census on a healthy step, and a
non-finite step replayed at once, in process, to localise it.

The equivalence cases are those of test_replay.py (fp16 attention-score
overflow in a GPT-2, NaN in the batch, log(0) in the user's loss, fp16
gradient overflow at a high loss scale, a hand-written fp16 LayerNorm over
a constant row, an Inf absorbed inside a module): each runs the same step
under eager watching and under sentinel watching, and the module, pass and
step they name must be equal. Sentinel mode must also name the first aten
op (the op checker of nanguard.replay), say that the replay reproduced the
failure, and write the same flight record.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch import nn

import nanguard
from nanguard.diagnostics._flight_record import load_record

from conftest import requires_cuda
from test_replay import CubeTanh, HandLayerNorm, Times, _gpt2, _two_linears


# ---- the cases: (model, one step's forward, loss function for the replay) -------------------


def _score_overflow():
    model = _gpt2()
    with torch.no_grad():  # q . k passes fp16's 65504, each of q and k does not
        model.transformer.h[1].attn.c_attn.weight[:, :64] *= 1000.0
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, dict(kwargs={"input_ids": ids, "labels": ids}, autocast=torch.float16, scale=2.0**16)


def _nan_batch():
    model = _gpt2()
    emb = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(2))
    emb[2, 17, 5] = math.nan
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(3))
    return model, dict(kwargs={"inputs_embeds": emb, "labels": ids})


def _log_zero():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU()), dict(
        args=(torch.randn(4, 8, generator=torch.Generator().manual_seed(4)),),
        loss_fn=lambda out, _: -torch.log(out).mean())


def _grad_overflow(w2):
    def case():
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)) * 0.01
        return _two_linears(w2), dict(args=(x,), loss_fn=lambda out, _: out.float().sum(),
                                      autocast=torch.float16, scale=1024.0)

    return case


def _hand_ln():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), HandLayerNorm(16)).half()
    with torch.no_grad():  # every column equal: var = 0, and eps = 1e-12 is 0 in fp16
        model[0].weight.zero_()
        model[0].bias.fill_(0.5)
    x = torch.randn(4, 16, dtype=torch.float16, generator=torch.Generator().manual_seed(6))
    return model, dict(args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())


def _absorbed():
    x = torch.full((2, 4), 100.0, dtype=torch.float16)
    return nn.Sequential(CubeTanh(), Times(100.0), Times(1000.0)), dict(
        args=(x,), loss_fn=lambda out, _: out.float().sum())


#: case -> (first op the replay names, whether the step is the GradScaler's backoff)
CASES = {
    "score_overflow": (_score_overflow, ("aten::bmm", "aten::mm", "aten::matmul"), False),
    "nan_batch": (_nan_batch, (None,), False),
    "log_zero": (_log_zero, ("aten::log",), False),
    "grad_overflow_2": (_grad_overflow(2.0), (None,), True),
    "grad_overflow_2000": (_grad_overflow(2000.0), (None,), True),
    "hand_ln": (_hand_ln, ("aten::div",), False),
    "absorbed_inf": (_absorbed, ("aten::mul",), False),
}


def _forward(model, spec):
    args, kwargs = spec.get("args", ()), spec.get("kwargs", {})
    dtype = spec.get("autocast")
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(*args, **kwargs)
        loss_fn = spec.get("loss_fn")
        return loss_fn(out, {"args": args, **kwargs}) if loss_fn else out.loss


class _Scale:
    """A stand-in for a GradScaler at a fixed scale (scaler= of watch)."""

    def __init__(self, s):
        self.s = s

    def get_scale(self):
        return self.s


def _run(case, mode, tmp_path, steps=1, bad_at=0, **kw):
    """Run ``steps`` steps of the case under watch(mode=...), the case's
    failure at step ``bad_at`` (healthy weights before: the case's model
    with its sabotage undone is not needed: the failing step is the last).
    Returns (watcher, reports per step, record_dir)."""
    make, _, _ = CASES[case]
    model, spec = make()
    rec = tmp_path / mode
    scale = spec.get("scale")
    w = nanguard.watch(model, mode=mode, record_dir=rec, policy="record", scaler=_Scale(scale) if scale else None,
                       loss_fn=spec.get("loss_fn") if mode == "sentinel" else None, **kw)
    reports = []
    for _ in range(steps):
        loss = _forward(model, spec)
        (loss.float() * (scale or 1.0)).backward()
        reports.append(w.step(loss))
        model.zero_grad(set_to_none=True)
    return w, reports, rec


@pytest.mark.parametrize("case", sorted(CASES))
def test_sentinel_names_what_eager_names(tmp_path, case):
    _, ops, backoff = CASES[case]
    we, [eager], rec_e = _run(case, "eager", tmp_path)
    ws, [sent], rec_s = _run(case, "sentinel", tmp_path)
    assert eager is not None and sent is not None
    assert (sent.module, sent.pass_, sent.step) == (eager.module, eager.pass_, eager.step)
    assert sent.tensor == eager.tensor  # the same census of the same tensor: counts, max, min
    assert sent.reproduced is True and eager.reproduced is None
    assert ws.replays == 1 and we.replays == 0
    assert sent.op in ops
    if backoff:  # the GradScaler's backoff: reported, neither op-checked nor recorded
        assert sent.replay_path is None and eager.replay_path is None
        assert not os.path.exists(rec_s) or os.listdir(rec_s) == []
    else:
        assert sent.replay_path == str(rec_s / "nanguard-step0.pt")
        assert os.listdir(rec_s) == os.listdir(rec_e) == ["nanguard-step0.pt"]
        assert load_record(sent.replay_path).micro_batch == 0
        if sent.op is not None:
            assert f"first op to make it from finite inputs: `{sent.op}`" in str(sent)
    we.remove()
    ws.remove()


def test_sentinel_reports_the_step_index_of_a_later_step(tmp_path):
    model, spec = _hand_ln()
    with torch.no_grad():  # healthy first: distinct columns
        model[0].weight.copy_(torch.eye(16, dtype=torch.float16))
    got = {}
    for mode in ("eager", "sentinel"):
        m = nn.Sequential(nn.Linear(16, 16), HandLayerNorm(16)).half()
        m.load_state_dict(model.state_dict())
        w = nanguard.watch(m, mode=mode, record_dir=tmp_path / mode, policy="record",
                           loss_fn=spec["loss_fn"] if mode == "sentinel" else None)
        reps = []
        for step in range(4):
            if step == 3:
                with torch.no_grad():
                    m[0].weight.zero_()
            loss = _forward(m, spec)
            loss.backward()
            reps.append(w.step(loss))
            m.zero_grad(set_to_none=True)
        assert reps[:3] == [None, None, None]
        got[mode] = (reps[3].module, reps[3].pass_, reps[3].step)
        assert reps[3].replay_path.endswith("nanguard-step3.pt")
        if mode == "sentinel":
            assert w.replays == 1 and reps[3].op == "aten::div"
        w.remove()
    assert got["eager"] == got["sentinel"] == ("1", "forward", 3)


def test_gradient_accumulation_replays_the_micro_batch_that_failed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    loss_fn = lambda out, _: out.sum()  # noqa: E731
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record", loss_fn=loss_fn)
    xs = [torch.randn(4, 8) for _ in range(3)]
    xs[1][2, 3] = math.inf
    for x in xs:  # three micro-batches, one optimizer step
        loss_fn(model(x), None).backward()
    rep = w.step()
    assert rep is not None and rep.reproduced and rep.micro_batch == 1
    assert rep.module == "" and rep.pass_ == "forward" and rep.tensor.which == "input[0]"  # the model's input
    rec = load_record(rep.replay_path)
    assert rec.micro_batch == 1 and torch.equal(rec.args[0], xs[1])
    assert "micro-batch 1" in str(rep)
    w.remove()


def test_a_healthy_step_is_not_replayed_and_a_replay_leaves_the_live_step_alone(tmp_path):
    torch.manual_seed(0)
    # the replay runs on the live model: its gradients, buffers (BatchNorm's
    # running statistics), weights and the RNG must come back as they were
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    poison = [1.0]  # the failing step's loss is NaN, its forward (and BatchNorm's statistics) finite
    loss_fn = lambda out, _: out.sum() * poison[0]  # noqa: E731
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path / "rec", policy="record", loss_fn=loss_fn)
    for _ in range(3):
        loss_fn(model(torch.randn(4, 8)), None).backward()
        assert w.step() is None
        model.zero_grad(set_to_none=True)
    assert w.replays == 0 and not os.path.exists(tmp_path / "rec")
    poison[0] = math.nan
    loss_fn(model(torch.randn(4, 8)), None).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    rep = w.step()
    assert rep is not None and rep.reproduced and w.replays == 1
    for p, g, v in zip(model.parameters(), grads, weights):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(p.detach(), v)
    assert rep.pass_ == "backward"  # the NaN loss's gradient, into the last module's output
    assert all(bool(torch.isfinite(b).all()) for b in buffers)
    for b, saved in zip(model.buffers(), buffers):  # the replay's forward updated them again; put back
        assert torch.equal(b, saved)
    assert torch.equal(torch.get_rng_state(), rng)
    w.remove()


def test_a_forward_only_step_is_checked_through_its_loss(tmp_path):
    model, spec = _hand_ln()
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record", loss_fn=spec["loss_fn"])
    with torch.no_grad():
        loss = _forward(model, spec)
    rep = w.check(loss)
    assert rep is not None and rep.reproduced and (rep.module, rep.pass_) == ("1", "forward")
    assert rep.op == "aten::div"
    w.remove()


def test_a_replay_that_stays_finite_says_so(tmp_path):
    # the loop scales the loss by 1024 itself, and watch is given no scaler:
    # the replay runs at scale 1, where the step is finite
    model = _two_linears(2.0)
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record",
                       loss_fn=lambda out, _: out.float().sum())
    x = torch.randn(1, 64) * 0.01
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    (out.float().sum() * 1024.0).backward()
    rep = w.step()
    assert rep is not None and rep.reproduced is False and rep.pass_ == "parameter grad"
    assert "not reproduced by the in-process replay" in rep.note and "no scaler=" in rep.note
    assert "not reproduced" in str(rep)
    w.remove()


def test_without_a_loss_the_replay_runs_the_forward_only_and_says_why(tmp_path):
    model = _two_linears(2000.0)  # 64 * 2000 overflows fp16 at scale 1
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record")
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(1, 64) * 0.01)
    out.float().sum().backward()
    rep = w.step()
    assert rep is not None and rep.reproduced is False and "loss_fn=" in rep.note
    w.remove()


def test_huge_finite_gradients_are_not_a_failure(tmp_path):
    model = nn.Linear(64, 64)
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record")
    (model(torch.ones(2, 64)).sum() * 1e30).backward()  # grads ~1e30: their norm overflows fp32
    assert w.step() is None and w.replays == 0
    nanguard.clip_grad_norm_(model.parameters(), 1.0)  # the guard's verdict covers them
    assert w.step() is None and w.replays == 0
    w.remove()


def test_the_guards_verdict_stands_for_the_gradients_it_covered(tmp_path, monkeypatch):
    from nanguard.diagnostics import _sentinel

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record",
                       loss_fn=lambda out, _: out.sum())
    read = []
    real = _sentinel.fused_finite
    monkeypatch.setattr(_sentinel, "fused_finite", lambda ts, v=(): read.append((len(ts), len(v))) or real(ts, v))
    model(torch.randn(4, 8)).sum().backward()
    nanguard.clip_grad_norm_(model.parameters(), 1.0)
    assert w.step() is None and read[-1] == (0, 1)  # no gradient read again: the guard's verdict
    model(torch.randn(4, 8)).sum().backward()  # no guard this step: the gradients are read
    assert w.step() is None and read[-1] == (4, 0)
    x = torch.randn(4, 8)
    x[1, 1] = math.nan
    model(x).sum().backward()
    nanguard.clip_grad_norm_(model.parameters(), 1.0)  # leaves non-finite gradients untouched
    rep = w.step()
    assert rep is not None and rep.reproduced and rep.module == "" and rep.pass_ == "forward"
    w.remove()


def test_the_default_mode(tmp_path):
    model = nn.Linear(2, 2)
    for kw, mode in (({}, "eager"), ({"history": 4}, "eager"), ({"record_dir": tmp_path}, "sentinel"),
                     ({"record_dir": tmp_path, "mode": "eager"}, "eager"), ({"mode": "sentinel"}, "sentinel")):
        w = nanguard.watch(model, **kw)
        assert w.mode == mode, kw
        w.remove()


def test_bad_arguments_name_the_argument(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="mode"):
        nanguard.watch(model, mode="lazy")
    with pytest.raises(ValueError, match="loss_fn"):
        nanguard.watch(model, mode="eager", loss_fn=lambda o, i: o.sum())
    with pytest.raises(ValueError, match="loss_fn"):
        nanguard.watch(model, mode="sentinel", loss_fn="sum")
    with pytest.raises(ValueError, match="census_every"):
        nanguard.watch(model, mode="sentinel", census_every=0)
    with pytest.raises(ValueError, match="census_every"):
        nanguard.watch(model, mode="eager", census_every=4)
    with pytest.raises(ValueError, match="every"):
        nanguard.watch(model, mode="sentinel", every=2)
    w = nanguard.watch(model, mode="sentinel")
    with pytest.raises(TypeError, match="loss"):
        w.step(loss=1.0)
    w.remove()


@pytest.mark.parametrize("fp16", [True, False])
def test_sentinel_history_census_every_n_and_fp16_series_every_step(tmp_path, fp16):
    # the full census on steps 0 and 4; between them the score bounds and
    # the q / k projections (the series the fp16 warning can fire on) every
    # step where the projections run in float16, and not in float32
    from nanguard.diagnostics._history import SCORE_PASS

    model = _gpt2()
    w = nanguard.watch(model, mode="sentinel", history=16, census_every=4, record_dir=tmp_path)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.float().backward()
        assert w.step() is None
        model.zero_grad(set_to_none=True)
    rows = w.history.rows()
    light = {f"transformer.h.{i}.attn.c_attn" for i in (0, 1)}  # the q / k projections
    score_steps = {r.step for r in rows if r.pass_ == SCORE_PASS}
    light_steps = {r.step for r in rows if r.module in light and r.pass_ == "forward"}
    census_steps = {r.step for r in rows if r.pass_ != SCORE_PASS and r.module not in light}
    assert census_steps == {0, 4}
    every = set(range(6)) if fp16 else {0, 4}
    assert score_steps == light_steps == every
    for step in every:  # each light series once per step, census step or not
        assert sorted(r.module for r in rows if r.step == step and r.module in light and r.pass_ == "forward") \
            == sorted(light)
    assert {r.module for r in rows if r.pass_ == SCORE_PASS} == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert not w._census_handles  # step 5 is no census step: no census hook is attached
    w.remove()


@pytest.mark.parametrize("growth", [2.0 ** 0.25, 2.0 ** 0.5])
def test_sentinel_early_warning_equals_eager_and_precedes_the_overflow(growth):
    # the q half of one layer's projection grows every step, so its score
    # bound grows by growth**2: sentinel mode records the bound every step,
    # and warns at the step and for the module eager mode does
    got = {}
    for mode in ("eager", "sentinel"):
        model = _gpt2()
        scaler = nanguard.amp.GradScaler("cpu", init_scale=2.0**8)
        w = nanguard.watch(model, mode=mode, history=32, policy="record", scaler=scaler, parameters=False)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        first_bad, caught = None, []
        for step in range(80):
            with torch.no_grad():
                model.transformer.h[1].attn.c_attn.weight[:, :32] *= growth
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                w.step()
            caught += [g.message for g in seen if isinstance(g.message, nanguard.HeadroomWarning)]
            model.zero_grad(set_to_none=True)
            if not math.isfinite(float(loss)):
                first_bad = step
                break
        assert first_bad is not None and caught, mode
        got[mode] = (caught[0].step, caught[0].module, caught[0].pass_, first_bad)
        w.remove()
    assert got["sentinel"] == got["eager"]
    step, module, _, first_bad = got["sentinel"]
    assert module.startswith("transformer.h.1.attn") and step < first_bad  # the layer whose q grows
    if growth < 1.3:  # half a bit per step: the warning comes well ahead
        assert step <= first_bad - 3


def test_demo_stock_run_sentinel_names_what_eager_names(tmp_path):
    from nanguard import demo

    cfg = demo.Config(steps=demo.SURVIVAL_MAX_STEPS)

    def nan_then(k):
        return lambda run: (not math.isfinite(run.losses[-1])
                            and len(run.losses) - next(i for i, x in enumerate(run.losses)
                                                       if not math.isfinite(x)) > k)

    got = {}
    for mode in ("eager", "sentinel"):
        run = demo.train(cfg, patched=False, progress=None, stop=nan_then(1), record_dir=str(tmp_path / mode),
                         watch_mode=mode)
        r = run.report
        assert r is not None and r.replay_path is not None
        got[mode] = (r.module, r.pass_, r.step, [repr(x) for x in run.losses])
        if mode == "sentinel":
            assert r.reproduced and r.op in ("aten::bmm", "aten::mm", "aten::matmul")
    assert got["eager"] == got["sentinel"]


@requires_cuda
def test_sentinel_on_cuda_replays_with_the_cuda_generator(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()).cuda()
    loss_fn = lambda out, _: -torch.log(out).mean()  # noqa: E731  (ReLU's zeros: log(0))
    w = nanguard.watch(model, mode="sentinel", record_dir=tmp_path, policy="record", loss_fn=loss_fn)
    healthy = lambda out, _: out.sum()  # noqa: E731
    healthy(model(torch.randn(4, 8, device="cuda")), None).backward()
    nanguard.clip_grad_norm_(model.parameters(), 1.0)
    assert w.step() is None and w.replays == 0
    model.zero_grad(set_to_none=True)
    loss_fn(model(torch.randn(4, 8, device="cuda")), None).backward()
    rep = w.step()
    assert rep is not None and rep.reproduced and rep.op == "aten::log" and w.replays == 1
    assert load_record(rep.replay_path).rng["cuda"] is not None
    w.remove()
