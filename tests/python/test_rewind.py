"""nanguard.Rewind: snapshots, triggers, the data-versus-state test, recovery.

The equalities here are exact (``torch.equal``): the CPU runs are
deterministic, a snapshot restores every state tensor and generator bit for
bit, so a rewound run that skipped a batch is the same computation as a run
that never saw it.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import nanguard
from nanguard.rewind import Rewind, RewindError

N_FEAT = 8


def make_model(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(N_FEAT, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, 1))


def make_data(n: int, poison=None, poison_value=float("nan"), label=False):
    """``n`` regression batches; batch ``poison`` gets one bad input (or
    target, with ``label``)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        x = torch.randn(4, N_FEAT, generator=g)
        y = x.sum(1, keepdim=True)
        if i == poison:
            x, y = x.clone(), y.clone()
            (y if label else x)[0, 0] = poison_value
        out.append((x, y))
    return out


def train(data, steps, *, lr=1e-2, opt="adamw", device="cpu", clip=True, scheduler=False, **kw):
    """The plain loop under Rewind; returns (model, rewind, losses of the steps that stood)."""
    model = make_model().to(device)
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s)) if scheduler else None
    kw.setdefault("every", 5)
    kw.setdefault("keep", 3)
    rw = Rewind(model, optimizer, scheduler=sched, **kw)
    for _, (x, y) in rw.loop(data, steps):
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gn = nanguard.clip_grad_norm_(model.parameters(), 1.0 if clip else math.inf)
        optimizer.step()
        if sched is not None:
            sched.step()
        rw.step(loss, gn)
    return model, rw


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


# ---- the targets of the issue ------------------------------------------------------------


def test_demo_stock_config_with_rewind_trains_to_the_end():
    """The demo's stock configuration, unpatched (fp16 autocast, eager
    attention, AdamW lr 0.2, no warmup), goes NaN without help; with Rewind
    it finishes its 40 steps finite, with a falling loss, and says how."""
    pytest.importorskip("transformers")
    from nanguard import demo

    cfg = demo.Config()
    run = demo.train(cfg, patched=False, use_watch=False, rewind=True, progress=None)
    rw = run.rewind
    assert len(run.losses) == cfg.steps
    assert all(math.isfinite(x) for x in run.losses)
    assert sum(run.losses[-8:]) / 8 < sum(run.losses[:8]) / 8
    assert rw.rewinds >= 1  # the stock run does go non-finite
    assert any(e.blame == "state" for e in rw.events)
    assert rw.lr_scale < 1.0
    assert rw.current_lr() == [pytest.approx(cfg.lr * rw.lr_scale)]
    assert f"x{rw.lr_scale:g}" in rw.summary()
    assert [r.step for r in rw.history] == list(range(cfg.steps))


@pytest.mark.parametrize("poison_value, trigger", [(float("nan"), "non-finite loss"), (1e3, "loss spike")])
def test_poisoned_batch_is_skipped_blamed_on_data_and_leaves_no_trace(poison_value, trigger):
    """A NaN input (or a huge target making a loss spike) in batch 12 of a healthy
    run: the run rewinds, the batch fails again from the earlier snapshot,
    it is blamed on the data and skipped, and the final weights are those of
    the same run with that batch removed from the data, bit for bit (dropout
    included: the generators are part of the snapshot)."""
    data = make_data(40, poison=12, poison_value=poison_value, label=trigger == "loss spike")
    kw = dict(min_history=8) if trigger == "loss spike" else {}
    m1, rw1 = train(data, 30, **kw)
    assert rw1.rewinds == 1
    ev = rw1.events[0]
    assert ev.trigger.kind == trigger and ev.trigger.step == 12 and ev.trigger.batches == [12]
    assert ev.restored_step == 10 and ev.blame == "data" and ev.skipped_batches == [12]
    assert [p.batch for p in ev.probes] == [12] and ev.probes[0].failed
    assert rw1.lr_scale == 1.0
    assert rw1.skipped_batches == [{"step": 12, "batch": 12, "blame": "data", "trigger": trigger}]
    assert [r.batch for r in rw1.history] == [i for i in range(31) if i != 12]
    m2, rw2 = train([b for i, b in enumerate(data) if i != 12], 30, **kw)
    assert rw2.rewinds == 0
    assert same_params(m1, m2)
    assert [r.loss for r in rw1.history] == [r.loss for r in rw2.history]


def _train_fp16(data, steps):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = nanguard.amp.GradScaler("cpu", init_scale=2.0**10)
    rw = Rewind(model, opt, scaler=scaler, every=5, keep=2)
    for _, (x, y) in rw.loop(data, steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        gn = scaler.unscale_and_clip_(opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        rw.step(loss, gn)
    return model, rw, scaler


def test_poisoned_batch_under_fp16_and_the_guarded_scaler():
    """The same with fp16 autocast and nanguard's GradScaler: the scaler's
    state (its scale, and its skipped-step records) is rewound too, so the
    run equals the one without the batch, scale included."""
    data = make_data(40, poison=12)
    m1, rw1, s1 = _train_fp16(data, 30)
    assert rw1.events[0].blame == "data" and rw1.skipped_batches[0]["batch"] == 12
    m2, rw2, s2 = _train_fp16([b for i, b in enumerate(data) if i != 12], 30)
    assert rw2.rewinds == 0
    assert same_params(m1, m2)
    assert s1.get_scale() == s2.get_scale() and s1.skip_summary() == s2.skip_summary()


def test_diverging_learning_rate_is_blamed_on_the_state_and_lowered():
    """SGD at a learning rate that diverges on any batch: the batch that
    spiked is fine from the earlier state, so the state is blamed, the
    learning rate is halved, and the run finishes with the lower rate."""
    data = make_data(200)
    model, rw = train(data, 60, lr=0.3, opt="sgd", clip=False, min_history=5)
    assert rw.rewinds >= 1
    assert all(e.blame == "state" for e in rw.events)
    assert rw.lr_scale == 0.5 ** rw.rewinds
    assert rw.current_lr() == [pytest.approx(0.3 * rw.lr_scale)]
    assert not rw.skipped_batches
    assert "state blamed" in str(rw.events[0]) and "learning rate x0.5" in str(rw.events[0])
    assert len(rw.history) == 60 and all(math.isfinite(r.loss) for r in rw.history)
    # the run without Rewind at the same rate really does blow up
    stock = make_model()
    opt = torch.optim.SGD(stock.parameters(), lr=0.3)
    losses = []
    for x, y in data[:60]:
        loss = F.mse_loss(stock(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert not all(math.isfinite(v) and v < 100 for v in losses)


# ---- the log, resuming, storage ------------------------------------------------------------


def test_log_file_and_resumed_run_skip_the_same_batches(tmp_path):
    data = make_data(40, poison=7)
    log = tmp_path / "rewind.json"
    m1, rw1 = train(data, 25, log_path=log)
    doc = json.loads(log.read_text())
    assert doc["skipped_batches"] == [{"step": 7, "batch": 7, "blame": "data", "trigger": "non-finite loss"}]
    assert len(doc["rewinds"]) == 1 and doc["rewinds"][0]["blame"] == "data"
    assert doc["rewinds"][0]["probes"][0]["loss"] == "nan"  # JSON has no NaN
    assert doc["global_step"] == 25
    m2, rw2 = train(data, 25, skip_batches=log)  # the resumed run never trains on batch 7
    assert rw2.rewinds == 0 and same_params(m1, m2)
    assert rw2.skipped_batches[0]["blame"] == "earlier run"
    m3, rw3 = train(data, 25, skip_batches=[7])
    assert same_params(m1, m3)


def test_snapshots_on_disk_equal_snapshots_in_memory(tmp_path):
    data = make_data(40, poison=12)
    m1, rw1 = train(data, 30)
    d = tmp_path / "snaps"
    m2, rw2 = train(data, 30, directory=d)
    assert same_params(m1, m2)
    files = sorted(os.listdir(d))
    assert len(files) == rw2.keep and all(f.startswith("rewind-step") for f in files)
    rw2.close()
    assert os.listdir(d) == []


def test_scheduler_base_lrs_are_lowered_and_stay_lowered():
    data = make_data(200)
    model, rw = train(data, 60, lr=0.3, opt="sgd", clip=False, min_history=5, scheduler=True)
    assert rw.rewinds >= 1
    sched_lr = 0.3 * rw.lr_scale / (1 + 0.01 * 60)
    assert rw.current_lr() == [pytest.approx(sched_lr)]


def test_action_skip_skips_the_window_and_keeps_the_rate():
    data = make_data(40, poison=12)
    _, rw = train(data, 30, action="skip")
    assert rw.rewinds == 1 and rw.lr_scale == 1.0
    blames = {d["batch"]: d["blame"] for d in rw.skipped_batches}
    assert blames == {10: "window", 11: "window", 12: "data"}
    assert [r.batch for r in rw.history][9:11] == [9, 13]


def test_action_lower_lr_lowers_even_when_the_data_is_blamed():
    data = make_data(40, poison=12)
    _, rw = train(data, 30, action="lower_lr")
    assert rw.events[0].blame == "data" and rw.skipped_batches[0]["batch"] == 12
    assert rw.lr_scale == 0.5


# ---- triggers ------------------------------------------------------------------------------


def _manual(rw, losses, skipped=None):
    """Drive rw.loop with given losses (and skipped flags); the steps it yielded."""
    seen = []
    it = iter(losses)
    flags = iter(skipped) if skipped is not None else None
    for step, batch in rw.loop(range(1000), steps=len(losses)):
        seen.append((step, batch))
        try:
            v = next(it)
        except StopIteration:
            break
        rw.step(torch.tensor(v), skipped=next(flags) if flags is not None else None)
    return seen


def test_scaler_backoff_is_ordinary_until_patience_steps_in_a_row():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    rw = Rewind(model, opt, scaler=scaler, every=4, patience=3, loss_spike=None)
    losses = [1.0] * 12
    flags = [False, True, True, False, True, True, True, False, False, False, False, False]
    _manual(rw, losses, flags)
    assert rw.rewinds == 1
    ev = rw.events[0]
    assert ev.trigger.kind == "non-finite gradients" and ev.trigger.step == 6
    assert ev.trigger.batches == [4, 5, 6] and "3 skipped steps in a row" in ev.trigger.detail
    assert ev.restored_step == 4


def test_nonfinite_gradients_without_a_scaler_trigger_at_once():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = Rewind(model, opt, every=4, loss_spike=None)
    _manual(rw, [1.0] * 6, [False, False, True, False, False, False])
    assert rw.events[0].trigger.kind == "non-finite gradients" and rw.events[0].trigger.step == 2
    assert "no loss scaler" in rw.events[0].trigger.detail


def test_grad_norm_spike_rule_is_off_by_default_and_fires_when_on():
    def run(**kw):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rw = Rewind(model, opt, every=50, loss_spike=None, min_history=5, **kw)
        norms = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 50.0, 1.0]
        for _, gn in zip(rw.loop(range(100), steps=len(norms)), norms):
            rw.step(1.0, grad_norm=gn)
        return rw
    assert run().rewinds == 0
    rw = run(grad_spike=7.0)
    assert rw.events[0].trigger.kind == "grad-norm spike" and rw.events[0].trigger.step == 6


def test_spike_rule_counts_only_upward_moves():
    from nanguard.rewind._triggers import SpikeRule

    rule = SpikeRule("loss", 7.0, 10, 5)
    for v in [5.0, 5.1, 4.9, 5.05, 4.95]:
        assert rule.check(v) is None
        rule.push(v)
    assert rule.check(0.0) is None  # a fall
    why = rule.check(9.0)
    assert why is not None and "sigma above the mean" in why


# ---- never loops ---------------------------------------------------------------------------


def test_failure_at_the_first_step_is_skipped_untested():
    """Nothing is older than step 0 to test from: the batch is skipped,
    and the record says it was not tested."""
    data = make_data(40, poison=0)
    _, rw = train(data, 10)
    assert rw.events[0].blame == "untested" and rw.events[0].probes == []
    assert rw.skipped_batches == [{"step": 0, "batch": 0, "blame": "untested", "trigger": "non-finite loss"}]
    assert len(rw.history) == 10


def test_failure_that_comes_back_with_no_older_snapshot_stops_with_a_clear_error():
    """action="skip" can only go back in time: when the failure comes back
    and the ring holds nothing older, the run stops, it does not loop."""
    data = make_data(40)
    for i in (6, 7):
        data[i] = (torch.full_like(data[i][0], float("nan")), data[i][1])
    with pytest.raises(RewindError, match="came back after rewinding to step 5") as ei:
        train(data, 20, action="skip", keep=1)
    assert len(ei.value.events) == 1 and ei.value.events[0].blame == "data"


def test_max_rewinds_bounds_the_run():
    data = make_data(200)
    with pytest.raises(RewindError, match="max_rewinds=1"):
        train(data, 60, lr=2.0, opt="sgd", clip=False, min_history=5, max_rewinds=1)


# ---- misuse -------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, exc, word", [
    (dict(every=0), ValueError, "every"),
    (dict(keep=True), ValueError, "keep"),
    (dict(action="rewind"), ValueError, "action"),
    (dict(lr_factor=1.5), ValueError, "lr_factor"),
    (dict(loss_spike=-1), ValueError, "loss_spike"),
    (dict(window=10, min_history=20), ValueError, "min_history"),
    (dict(scaler=object()), TypeError, "scaler"),
    (dict(scheduler=object()), TypeError, "scheduler"),
    (dict(directory=3), TypeError, "directory"),
    (dict(skip_batches=[-1]), ValueError, "skip_batches"),
])
def test_bad_arguments_name_themselves(kw, exc, word):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(exc, match=word):
        Rewind(model, opt, **kw)


def test_bad_model_optimizer_and_loss():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model"):
        Rewind("model", opt)
    with pytest.raises(TypeError, match="optimizer"):
        Rewind(model, "opt")
    rw = Rewind(model, opt)
    with pytest.raises(RuntimeError, match="once per batch"):
        rw.step(1.0)  # outside the loop
    loop = rw.loop(range(10), steps=3)
    next(loop)
    with pytest.raises(TypeError, match="loss"):
        rw.step("1.0")
    rw2 = Rewind(model, opt)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        for _ in rw2.loop(range(10), steps=3):
            rw2.step(torch.ones(3))
    rw3 = Rewind(model, opt)
    with pytest.raises(RuntimeError, match="call rewind.step"):
        for _ in rw3.loop(range(10), steps=3):
            pass


def test_loop_ends_when_the_data_runs_out():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = Rewind(model, opt, every=2)
    n = 0
    for _ in rw.loop(range(5), steps=100):
        rw.step(1.0)
        n += 1
    assert n == 5 and rw.global_step == 5


def test_top_level_names():
    assert nanguard.Rewind is Rewind and nanguard.RewindError is RewindError


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_poisoned_batch_on_cuda():
    data = make_data(40, poison=12)
    m1, rw1 = train(data, 30, device="cuda")
    assert rw1.events[0].blame == "data"
    m2, _ = train([b for i, b in enumerate(data) if i != 12], 30, device="cuda")
    assert same_params(m1, m2)


def test_snapshot_reuses_an_evicted_snapshots_memory_and_copies_exactly():
    from nanguard.rewind import _snapshot

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_data(1)[0]
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        opt.step()
    first = _snapshot.capture(model, opt)
    ptrs = [t.data_ptr() for t in first["model"].values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = _snapshot.capture(model, opt, into=first)
    assert [t.data_ptr() for t in second["model"].values()] == ptrs  # the same host memory, refilled
    assert all(torch.equal(a, b) for a, b in zip(second["model"].values(), model.state_dict().values()))
    moments = opt.state_dict()["state"]
    assert all(torch.equal(second["optimizer"]["state"][k]["exp_avg"], v["exp_avg"]) for k, v in moments.items())
    assert _snapshot.nbytes(second) >= 12 * sum(p.numel() for p in model.parameters())
