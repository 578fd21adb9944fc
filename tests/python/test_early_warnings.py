"""nanguard.EarlyWarnings: each signal against an fp64 reference, each
warning on a run that goes wrong and silent on one that does not.

The values are statistics of fp32 tensors computed in fp32 on the device
(row norms, logsumexp, means): compared to fp64 at rtol 1e-5, well above
fp32's 6e-8 unit roundoff times the few hundred terms summed here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard
from nanguard.diagnostics import EarlyWarnings, InstabilityWarning

RTOL = 1e-5


class Attn(nn.Module):
    """q and k from child projections, one head of ``head_dim``: what
    ``score_sources`` finds in a transformers eager attention module."""

    def __init__(self, d=8, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        s = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)


class LM(nn.Module):
    def __init__(self, d=8, vocab=16):
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attn(d)
        self.head = nn.Linear(d, vocab)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(self.attn(x))


def _step(model, x, opt=None, ew=None, y=None, scale=1.0):
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, 1), (y if y is not None else torch.zeros(out.shape[:2], dtype=torch.long))
                           .flatten()) * scale
    if opt is not None:
        opt.zero_grad()
    loss.backward()
    got = ew.step() if ew is not None else []
    if opt is not None:
        opt.step()
    return got


def test_attention_logit_bound_matches_fp64_and_warns_past_1e4():
    model = LM()
    ew = EarlyWarnings(model, emit=False)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    _step(model, x, ew=ew)
    (step, v), = ew.series["attention logit"]
    xd = x.double()
    a = model.attn
    torch.set_grad_enabled(False)
    q = F.linear(xd, a.q_proj.weight.double(), a.q_proj.bias.double()).view(2, 5, 2, 4)
    k = F.linear(xd, a.k_proj.weight.double(), a.k_proj.bias.double()).view(2, 5, 2, 4)
    qn, kn = q.norm(dim=-1).amax(dim=(0, 1)), k.norm(dim=-1).amax(dim=(0, 1))
    ref = float((qn * kn).amax()) / 2.0  # per head, / sqrt(head_dim)
    actual = float((torch.einsum("bihd,bjhd->bhij", q, k) / 2.0).abs().amax())
    torch.set_grad_enabled(True)
    assert v == pytest.approx(ref, rel=RTOL) and v >= actual * (1 - RTOL)
    assert not ew.warnings  # a healthy step
    with torch.no_grad():
        a.q_proj.weight.mul_(300.0)
        a.k_proj.weight.mul_(300.0)
    got = _step(model, x, ew=ew)
    assert [w.signal for w in got] == ["attention logit"] and got[0].value >= 1e4 and got[0].step == 1
    assert "10000" in str(got[0]) and "Wortsman" in str(got[0])
    assert _step(model, x, ew=ew) == []  # once per run


def test_output_log_z_and_logit_match_fp64_and_warn():
    model = LM()
    ew = EarlyWarnings(model, attn_logit=None, emit=False)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    _step(model, x, ew=ew)
    with torch.no_grad():  # the reference, in fp64, without running the hooked head again
        logits = F.linear(model.attn(x).double(), model.head.weight.double(), model.head.bias.double())
    (_, lz), = ew.series["output log Z"]
    (_, lm), = ew.series["output logit"]
    assert lz == pytest.approx(float(torch.logsumexp(logits, -1).mean()), rel=RTOL)
    assert lm == pytest.approx(float(logits.abs().amax()), rel=RTOL)
    assert not ew.warnings
    with torch.no_grad():
        model.head.bias[3] = 40.0  # log Z ~ 40 > log 16 + 20; the largest logit 40 < 50
    got = _step(model, x, ew=ew)
    assert [w.signal for w in got] == ["output log Z"]
    with torch.no_grad():
        model.head.bias[3] = 60.0
    got = _step(model, x, ew=ew)
    assert [w.signal for w in got] == ["output logit"] and got[0].value >= 50


def _adam_run(grad_scale_at=None, factor=1.0, steps=64, eps=1e-8, loss_scale=1.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    ew = EarlyWarnings(model, opt, emit=False)
    g = torch.Generator().manual_seed(3)
    for i in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True)) * loss_scale
        if i == grad_scale_at:
            loss = loss * factor
        opt.zero_grad()
        loss.backward()
        if i == steps - 1:  # the fp64 reference of the last step's values
            ref_upd, ref_low = [], []
            for p in model.parameters():
                st = opt.state[p]
                gd = p.grad.double()
                t = int(st["step"]) + 1
                u = (st["exp_avg_sq"].double() * 0.999 + gd * gd * 0.001) / (1 - 0.999 ** t)
                ref_upd.append(float(torch.sqrt((gd * gd / u).mean())))
                ref_low.append(float(torch.sqrt(u.mean())) / eps)
        ew.step()
        opt.step()
    return ew, max(ref_upd), min(ref_low)


def test_adam_update_rms_matches_fp64_and_warns_on_a_gradient_spike():
    ew, upd, low = _adam_run()
    assert ew.series["Adam update RMS"][-1][1] == pytest.approx(upd, rel=RTOL)
    assert ew.series["gradient RMS at eps"][-1][1] == pytest.approx(low, rel=RTOL)
    assert not ew.warnings  # steady gradients: RMS about 1
    # a 1000x gradient at step 60: g^2 / v_hat nears its ceiling (1 - b2^t) / (1 - b2) = 58
    ew, _, _ = _adam_run(grad_scale_at=60, factor=1e3)
    assert [(w.signal, w.step) for w in ew.warnings] == [("Adam update RMS", 60)]
    assert 5 <= ew.warnings[0].value <= math.sqrt((1 - 0.999 ** 61) / (1 - 0.999)) * (1 + RTOL)


def test_gradient_rms_falling_to_adams_eps_warns():
    ew, _, _ = _adam_run(loss_scale=1e-9)
    assert [w.signal for w in ew.warnings] == ["gradient RMS at eps"] and ew.warnings[0].step == 0
    assert ew.warnings[0].value < 10


def test_loss_scale_collapse_warns_on_backoffs_in_a_row_and_at_the_floor():
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ew = EarlyWarnings(model, opt, scaler, attn_logit=None, logz_excess=None, logit_max=None, emit=False)
    scaler.scale(torch.ones(()))  # makes the scale tensor
    scales = [1024, 512, 1024, 512, 256, 128, 64, 32, 16]
    for s in scales:
        scaler.update(new_scale=float(s))
        ew.step()
    assert [(w.signal, w.step) for w in ew.warnings] == [("loss scale", 7)]  # the 5th backoff in a row
    ew2 = EarlyWarnings(model, opt, scaler, attn_logit=None, logz_excess=None, logit_max=None, backoffs=None,
                        emit=False)
    for s in (8.0, 4.0, 1.0):
        scaler.update(new_scale=s)
        ew2.step()
    assert [(w.signal, w.step) for w in ew2.warnings] == [("loss scale", 2)]


def test_on_the_demo_model_a_diverging_run_warns_and_a_healthy_one_does_not():
    """fp32, AdamW without warmup: at lr 0.05 the run trains and nothing
    warns; at lr 0.5 it diverges (its loss ends far above where it began)
    and its attention logits and log Z pass their thresholds."""
    pytest.importorskip("transformers")
    from nanguard import demo

    def run(lr):
        cfg = demo.Config(lr=lr, steps=12, device="cpu")
        model = demo.build_model(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        ew = EarlyWarnings(model, opt, emit=False)
        data = demo.batches(cfg, demo.corpus())
        losses = []
        for _ in range(cfg.steps):
            ids = next(data)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            ew.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        ew.remove()
        return ew, losses

    ew, losses = run(0.05)
    assert losses[-1] < losses[0] and ew.warnings == []
    assert len(ew.series["attention logit"]) == 12 and len(ew.series["output log Z"]) == 12
    ew, losses = run(0.5)
    assert sum(losses[-4:]) / 4 > losses[0]
    assert {"attention logit", "output log Z"} <= {w.signal for w in ew.warnings}


def test_warnings_are_emitted_and_bad_arguments_name_themselves():
    model = LM()
    with torch.no_grad():
        model.head.bias[0] = 80.0
    ew = EarlyWarnings(model, attn_logit=None, logz_excess=None)
    with pytest.warns(InstabilityWarning, match="output logit"):
        _step(model, torch.randn(1, 3, 8), ew=ew)
    for kw, word in ((dict(attn_logit=0), "attn_logit"), (dict(update_rms=-1.0), "update_rms"),
                     (dict(backoffs=0), "backoffs"), (dict(window=1), "window"), (dict(scale_min=True), "scale_min")):
        with pytest.raises(ValueError, match=word):
            EarlyWarnings(model, **kw)
    with pytest.raises(TypeError, match="model"):
        EarlyWarnings("model")
    with pytest.raises(TypeError, match="optimizer"):
        EarlyWarnings(model, optimizer="sgd")
    with pytest.raises(TypeError, match="scaler"):
        EarlyWarnings(model, scaler=3)
    assert nanguard.EarlyWarnings is EarlyWarnings and nanguard.InstabilityWarning is InstabilityWarning
    ew.remove()
    assert not model.head._forward_hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_signals_on_cuda_equal_the_cpus():
    cpu = LM()
    gpu = LM().cuda()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    series = []
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ew = EarlyWarnings(model, opt, emit=False)
        for _ in range(3):
            _step(model, x.to(dev), opt=opt, ew=ew)
        series.append({k: [v for _, v in d] for k, d in ew.series.items() if d})
    assert series[0].keys() == series[1].keys()
    for k in series[0]:  # same math, another device's reduction order: fp32 rounding
        assert series[1][k] == pytest.approx(series[0][k], rel=1e-4), k


def test_each_signal_turns_off_alone():
    model = LM()
    with torch.no_grad():
        model.head.bias[0] = 80.0  # both the log Z and the logit rules would fire
    for off, left in (("logz_excess", "output logit"), ("logit_max", "output log Z")):
        ew = EarlyWarnings(model, attn_logit=None, emit=False, **{off: None})
        _step(model, torch.randn(1, 3, 8), ew=ew)
        assert [w.signal for w in ew.warnings] == [left]
        ew.remove()
