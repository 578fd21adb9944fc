"""The magnitude history and the fp16 early warning: headroom in bits,
warning once per series on low headroom or predicted overflow, no warning
for bf16 / fp32 series, the attention-score bound, and the exports."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch

from nanguard.diagnostics._history import FP16_MAX, SCORE_PASS, HeadroomWarning, History, Row, score_sources


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
    h = History(16, warn_bits=1.0, warn_steps=4, window=4)
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


def test_score_bound_from_the_projections():
    h = History(8, warn_bits=1.0, warn_steps=0, scores={"attn": (["attn.q_proj", "attn.k_proj"], 64)})
    rows = [_row(0, 20.0, module="attn.q_proj"), _row(0, 30.0, module="attn.k_proj")]
    with pytest.warns(HeadroomWarning, match=r"scores \(bound\) of `attn`"):
        h.add(0, rows)  # |q.k| <= 64 * 20 * 30 = 38400: 0.77 bits left
    bound = [r for r in h.rows() if r.pass_ == SCORE_PASS]
    assert [(r.module, r.max_abs, r.dtype) for r in bound] == [("attn", 38400.0, "float16")]


def test_score_sources_of_eager_attention_only():
    transformers = pytest.importorskip("transformers")
    import nanguard

    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    assert score_sources(model) == {f"transformer.h.{i}.attn": ([f"transformer.h.{i}.attn.c_attn"], 8)
                                    for i in range(2)}
    nanguard.patch(model)  # safe_sdpa: scores in fp32, no fp16 bound to watch
    assert score_sources(model) == {}
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(cfg)
    assert score_sources(llama) == {"model.layers.0.self_attn": (
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"], 8)}


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
