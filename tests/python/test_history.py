"""The magnitude history and the fp16 early warning: headroom in bits,
warning once per series on low headroom or predicted overflow, no warning
for bf16 / fp32 series, the attention-score bound, and the exports."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch

from conftest import requires_cuda
from nanguard.diagnostics._history import (FP16_MAX, SCORE_PASS, HeadroomWarning, History, Row, ScoreSource,
                                           head_norms, score_bound, score_sources)


def _row(step, value, module="layer", pass_="forward", dtype="float16", nan=0):
    return Row(step, module, pass_, dtype, value, 1e-3, nan=nan)


def _feed(h, values, **kw):
    got = []
    for step, v in enumerate(values):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new = h.add(step, [_row(step, v, **kw)])
        assert [c.message for c in caught] == new  # issued and returned alike
        got += new
    return got


def test_headroom_is_bits_below_the_dtype_maximum():
    h = History(8)
    h.add(0, [_row(0, 2.0**10), _row(0, 2.0**10, module="b", dtype="bfloat16"), _row(0, 1.0, module="c", nan=1)])
    room = h.headroom()
    assert room[("layer", "forward")] == pytest.approx(math.log2(FP16_MAX) - 10)
    assert room[("b", "forward")] == pytest.approx(math.log2(torch.finfo(torch.bfloat16).max) - 10)
    assert room[("c", "forward")] == -math.inf
    assert h.first_nonfinite == 0


def test_growth_is_predicted_steps_before_the_overflow():
    # log2 max|x| grows one bit per step from 8: 16 (fp16's ceiling) at step 8
    h = History(16, warn_bits=1.0, warn_steps=4, window=4, predict_bits=4.5)
    got = _feed(h, [2.0 ** (8 + s) for s in range(8)])
    assert len(got) == 1  # once per series
    w = got[0]
    assert isinstance(w, HeadroomWarning) and issubclass(HeadroomWarning, UserWarning)
    assert w.module == "layer" and w.pass_ == "forward"
    assert w.step == 4 and w.predicted_step == 8  # 4 bits left at 1 bit per step
    assert w.bits_left == pytest.approx(math.log2(FP16_MAX) - 12)
    assert "overflows around step 8" in str(w)
    assert h.warnings == got


def test_low_headroom_warns_without_growth():
    h = History(16, warn_bits=2.0)
    got = _feed(h, [40000.0] * 5)  # flat: 0.7 bits left
    assert [(w.step, w.predicted_step) for w in got] == [(0, None)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_no_fp16_ceiling_no_warning(dtype):
    h = History(16)
    assert _feed(h, [2.0 ** (8 + 2 * s) for s in range(10)], dtype=dtype) == []


def test_slow_or_shrinking_growth_does_not_warn():
    h = History(16, warn_bits=2.0, warn_steps=5)
    assert _feed(h, [2.0 ** (4 + 0.1 * s) for s in range(30)]) == []  # 12 bits of headroom at 0.1 bit/step
    assert _feed(History(16), [2.0 ** (13 - s) for s in range(10)]) == []  # 3 bits left, shrinking


def test_history_keeps_the_last_n_steps_and_merges_repeated_calls():
    h = History(3)
    for s in range(6):
        h.add(s, [_row(s, 1.0 + s), _row(s, 100.0 + s)])  # a module called twice in a step
    rows = h.rows()
    assert [r.step for r in rows] == [3, 4, 5]
    assert [r.max_abs for r in rows] == [103.0, 104.0, 105.0]
    # counts are summed, and the rows given are not changed by the merge
    given = [_row(9, 2.0, nan=1), Row(9, "layer", "forward", "float16", 3.0, 1e-3, nan=2, posinf=1)]
    h.add(9, given)
    (last,) = [r for r in h.rows() if r.step == 9]
    assert (last.max_abs, last.nan, last.posinf) == (3.0, 3, 1)
    assert [(r.max_abs, r.nan, r.posinf) for r in given] == [(2.0, 1, 0), (3.0, 2, 1)]


def test_prediction_waits_for_the_last_predict_bits():
    # the same one-bit-per-step growth: with the default predict_bits (2) the
    # warning comes when 2 bits are left, two steps ahead
    got = _feed(History(16, warn_bits=1.0, warn_steps=4, window=4), [2.0 ** (8 + s) for s in range(8)])
    assert [(w.step, w.predicted_step) for w in got] == [(6, 8)]


def test_gradient_headroom_is_read_at_loss_scale_one():
    # a scaled gradient near 65504 is the GradScaler's to back off from: at
    # loss scale 2^16 it is 16 bits below the ceiling; at scale 1 it warns
    h = History(4, warn_bits=2.0)
    scaled = Row(0, "layer", "backward", "float16", 60000.0, 1e-3, loss_scale=2.0**16)
    assert h.add(0, [scaled]) == []
    with pytest.warns(HeadroomWarning):
        got = h.add(1, [Row(1, "other", "backward", "float16", 60000.0, 1e-3)])
    assert [w.module for w in got] == ["other"]


def test_warnings_of_one_step_come_soonest_predicted_first():
    # "slow" has fewer bits left but grows a quarter bit per step; "fast" grows
    # a bit per step: fast reaches the ceiling first and is named first
    h = History(8, warn_bits=0.5, warn_steps=4, window=4, predict_bits=3.0)
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(4):
            got += h.add(s, [_row(s, 2.0 ** (14.4 + 0.25 * s), module="slow"),
                             _row(s, 2.0 ** (11.5 + 1.0 * s), module="fast")])
    assert [w.module for w in got] == ["fast", "slow"]
    assert got[0].steps_left < got[1].steps_left and got[0].bits_left > got[1].bits_left


def _scores_fp64(q, k, d):
    """Largest |q_i . k_j| per head in fp64 (every pair, masked ones included),
    and the Cauchy-Schwarz bound max_i |q_i| * max_j |k_j| of each head, with
    grouped keys: query head h reads key head h // (H / G)."""
    q = q.double().unflatten(-1, (-1, d)).flatten(0, -3)  # [rows, H, d]
    k = k.double().unflatten(-1, (-1, d)).flatten(0, -3)  # [rows, G, d]
    H, G = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // G, dim=1)
    true = torch.einsum("ihd,jhd->hij", q, k).abs().amax()
    cs = (q.norm(dim=-1).amax(0) * k.norm(dim=-1).amax(0)).amax()
    return float(true), float(cs)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (1, 1)])
def test_score_bound_is_cauchy_schwarz_per_head(heads, kv_heads):
    d = 16
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = (torch.randn(2, 12, heads * d, generator=g) * 3).half()
    k = (torch.randn(2, 12, kv_heads * d, generator=g) * 5).half()
    true, cs = _scores_fp64(q, k, d)
    got = float(score_bound(head_norms(q, d), head_norms(k, d)))
    # fp32 row norms of fp16 values: a relative 1e-5 covers 16 rounded squares
    assert got == pytest.approx(cs, rel=1e-5)
    assert got >= true * (1 - 1e-5)
    assert got <= d * float(q.abs().max()) * float(k.abs().max())  # never looser than d max|q| max|k|
    # aligned rows (how attention logits grow): the bound is the true maximum
    k2 = q[..., : kv_heads * d].clone() if heads == kv_heads else None
    if k2 is not None:
        true2, _ = _scores_fp64(q, k2, d)
        assert float(score_bound(head_norms(q, d), head_norms(k2, d))) == pytest.approx(true2, rel=1e-5)


def test_watch_records_the_score_bound_of_eager_attention():
    transformers = pytest.importorskip("transformers")
    import nanguard

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    seen = {}

    def keep(name):
        def hook(_m, _a, out):
            seen[name] = out.detach()
        return hook

    for i in range(2):
        model.transformer.h[i].attn.c_attn.register_forward_hook(keep(i))
    w = nanguard.watch(model, history=4, parameters=False)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids, labels=ids).loss.backward()
    w.step()
    bound = {r.module: r for r in w.history.rows() if r.pass_ == SCORE_PASS}
    assert set(bound) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    for i in range(2):
        out = seen[i]
        true, cs = _scores_fp64(out[..., :32], out[..., 32:64], 8)
        r = bound[f"transformer.h.{i}.attn"]
        assert r.dtype == "float16" and r.nonfinite == 0
        assert r.max_abs == pytest.approx(cs, rel=1e-5) and r.max_abs >= true * (1 - 1e-5)
    w.remove()


def test_watch_score_bound_with_grouped_query_attention():
    transformers = pytest.importorskip("transformers")
    import nanguard

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out.detach()))
    attn.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out.detach()))
    w = nanguard.watch(model, history=4, parameters=False, backward=False)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)))
    w.step()
    (r,) = [r for r in w.history.rows() if r.pass_ == SCORE_PASS]
    _, cs = _scores_fp64(seen["q"], seen["k"], 8)
    assert r.module == "model.layers.0.self_attn" and r.dtype == "float32"
    assert r.max_abs == pytest.approx(cs, rel=1e-5)
    w.remove()


def test_a_nonfinite_projection_is_reported_not_its_score_bound():
    transformers = pytest.importorskip("transformers")
    import nanguard

    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.bias[0] = float("nan")
    w = nanguard.watch(model, history=4, policy="record", backward=False, parameters=False)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    rep = w.step()
    assert rep is not None and rep.module == "transformer.h.0.attn.c_attn" and rep.pass_ == "forward"
    (r,) = [r for r in w.history.rows() if r.pass_ == SCORE_PASS]
    assert r.nan == 1  # the bound of a NaN projection is NaN, kept in the history
    w.remove()


def test_score_sources_of_eager_attention_only():
    transformers = pytest.importorskip("transformers")
    import nanguard

    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    assert score_sources(model) == {f"transformer.h.{i}.attn": ScoreSource(
        f"transformer.h.{i}.attn.c_attn", f"transformer.h.{i}.attn.c_attn", 8, 32) for i in range(2)}
    nanguard.patch(model)  # safe_sdpa: scores in fp32, no fp16 bound to watch
    assert score_sources(model) == {}
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(cfg)
    assert score_sources(llama) == {"model.layers.0.self_attn": ScoreSource(
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", 8)}


def test_score_sources_skip_qk_norm_and_cross_attention():
    class Attn(torch.nn.Module):
        def __init__(self, qk_norm=False, cross=False):
            super().__init__()
            self.head_dim = 4
            self.q_proj, self.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            if qk_norm:
                self.q_norm, self.k_norm = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
            self.is_cross_attention = cross

    m = torch.nn.ModuleDict({"plain": Attn(), "normed": Attn(qk_norm=True), "cross": Attn(cross=True)})
    assert list(score_sources(m)) == ["plain"]


def test_exports(tmp_path):
    h = History(8)
    for s in range(4):
        h.add(s, [_row(s, 2.0**s), _row(s, 1.0, module="other", pass_="backward", nan=int(s == 3))])
    h.to_csv(tmp_path / "h.csv")
    with open(tmp_path / "h.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and rows[0]["module"] == "layer" and rows[0]["pass"] == "forward"
    assert float(rows[-2]["max_abs"]) == 8.0 and rows[-1]["nan"] == "1"
    pytest.importorskip("matplotlib")
    h.plot(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000


@pytest.mark.parametrize("kw", [{"steps": 0}, {"steps": 2.5}, {"window": 1}, {"warn_bits": -1},
                                {"warn_steps": -1}, {"warn_bits": True}])
def test_bad_arguments(kw):
    args = {"steps": 4, **kw}
    with pytest.raises(ValueError, match="must be"):
        History(args.pop("steps"), **args)


def test_warnings_of_one_step_come_most_urgent_first():
    h = History(4, warn_bits=2.0)
    with pytest.warns(HeadroomWarning) as caught:
        got = h.add(0, [_row(0, 20000.0, module="a"), _row(0, 60000.0, module="b"), _row(0, 40000.0, module="c")])
    assert [w.module for w in got] == ["b", "c", "a"]
    assert [c.message.module for c in caught] == ["b", "c", "a"]


@requires_cuda
def test_score_bound_on_cuda_without_a_sync():
    transformers = pytest.importorskip("transformers")
    import nanguard

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).cuda()
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.q_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out.detach()))
    attn.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out.detach()))
    w = nanguard.watch(model, history=4, parameters=False)
    ids = torch.randint(0, 32, (2, 8), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    w.step()
    torch.cuda.set_sync_debug_mode("error")  # the bound is computed and recorded without a host sync
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    w.step()
    (r,) = [r for r in w.history.rows() if r.pass_ == SCORE_PASS and r.step == 1]
    _, cs = _scores_fp64(seen["q"].cpu(), seen["k"].cpu(), 8)
    assert r.dtype == "float16" and r.max_abs == pytest.approx(cs, rel=1e-5)
    w.remove()


def test_a_q_without_its_k_does_not_pair_across_steps():
    import nanguard

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim = 4
            self.q_proj, self.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.which = "q"

        def forward(self, x):
            return (self.q_proj if self.which == "q" else self.k_proj)(x)

    m = Attn()
    w = nanguard.watch(m, history=4, backward=False, parameters=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        m(x)  # step 0: q only
        w.step()
        m.which = "k"
        m(x)  # step 1: k only
        w.step()
        m(x)
        m.which = "q"
        m(x)  # step 2: both
        w.step()
    assert [r.step for r in w.history.rows() if r.pass_ == SCORE_PASS] == [2]
    w.remove()
