"""nanguard.study: its statistics on constructed inputs (exact), and the
study end to end on a tiny grid, resumed."""

from __future__ import annotations

import json
import math
import os

import pytest

import nanguard
from nanguard import _study
from nanguard._study import StudyConfig, divergence_step, lr_sensitivity, roc_auc, seed_decomposition


def test_divergence_step():
    assert divergence_step([5.0, 4.0, math.nan, 3.0]) == 2
    assert divergence_step([5.0] + [4.0] * 20) is None
    assert divergence_step([5.0] + [9.0] * 20) == 0  # never came back below the first loss
    # 8-step means from step 0: 3.25, 3.0, 3.75, 4.5, 5.25, ...: the last one at or below 5 starts at step 3
    assert divergence_step([5.0] + [3.0] * 8 + [9.0] * 12) == 4
    assert divergence_step([5.0, 6.0]) is None  # too short to say


def test_roc_auc_is_the_mann_whitney_probability():
    assert roc_auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert roc_auc([1.0], [2.0]) == 0.0
    assert roc_auc([1.0, 3.0], [2.0, 2.0]) == 0.5
    assert roc_auc([2.0], [2.0]) == 0.5  # a tie counts half
    assert roc_auc([], [1.0]) is None


def test_seed_decomposition_attributes_pure_effects_exactly():
    init_only = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    d = seed_decomposition(init_only, boot=200)
    assert (d["init"], d["data"], d["rest"]) == pytest.approx((1.0, 0.0, 0.0))
    data_only = [list(r) for r in zip(*init_only)]
    d = seed_decomposition(data_only, boot=200)
    assert (d["init"], d["data"], d["rest"]) == pytest.approx((0.0, 1.0, 0.0))
    inter = [[1.0, 0.0], [0.0, 1.0]]  # neither alone: all interaction
    d = seed_decomposition(inter, boot=200)
    assert (d["init"], d["data"], d["rest"]) == pytest.approx((0.0, 0.0, 1.0))
    lo, hi = d["rest_90"]
    assert 0.0 <= lo <= hi <= 1.0


def test_lr_sensitivity_is_wortsmans_definition():
    # E[min(final, initial)] - min final; a NaN counts as the initial loss
    assert lr_sensitivity({0.1: 3.0, 0.3: 4.0, 1.0: math.nan}, 5.0) == pytest.approx((3 + 4 + 5) / 3 - 3)
    assert lr_sensitivity({0.1: 3.0, 0.3: 9.0}, 5.0) == pytest.approx(1.0)
    assert lr_sensitivity({}, 5.0) is None


def test_tiny_study_end_to_end_and_resumed(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    cfg = StudyConfig(init_seeds=2, data_seeds=2, steps=10, lr=0.3, lrs=(0.01, 0.3),
                      fixes=("baseline", "qk_norm"), ks=(2, 4), sweep_seeds=2)
    s = nanguard.study(cfg, str(tmp_path), workers=1, progress=False)
    for f in ("runs.jsonl", "study.json", "study.md", "divergence_grid.png", "predictors.png",
              "lr_sensitivity.png"):
        assert (tmp_path / f).exists(), f
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 4 + 2 * 2 * 2
    assert s["runs"] == 4 and len(s["divergence_steps"]) == 2
    assert set(s["lr_sensitivity"]) == {"baseline", "qk_norm"}
    for v in s["lr_sensitivity"].values():  # the mean of the seeds' sensitivities
        assert len(v["per_seed"]) == 2 and v["sensitivity"] == pytest.approx(sum(v["per_seed"]) / 2)
        assert all(x >= 0 for x in v["per_seed"])
        assert all(math.isfinite(x) for x in v["clipped_loss"].values())  # a NaN run counts as the initial loss
    grid = [r for r in runs if r["key"].startswith("grid/")]
    for r in grid:  # a run stopped by its first rewind has the blame of its probe
        assert (r["blame"] is None) == (r["blamed_step"] is None)
        if r["blame"] is not None:
            assert r["diverged_at"] == r["blamed_step"]
    assert s["summary"] in (tmp_path / "study.md").read_text() and s["machine"]["cpu"]
    assert s["same_batch_pairs"]["same"] <= s["same_batch_pairs"]["pairs"]
    doc = json.loads((tmp_path / "study.json").read_text())
    assert doc["summary"] == s["summary"] and len(doc["runs_detail"]) == 12

    def no_run(*a, **k):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(_study, "run_one", no_run)
    again = nanguard.study(cfg, str(tmp_path), workers=1, progress=False)
    assert again["summary"] == s["summary"]


def test_bad_configs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="fixes"):
        nanguard.study(StudyConfig(fixes=("dropout",)), str(tmp_path))
    with pytest.raises(ValueError, match="init_seeds"):
        nanguard.study(StudyConfig(init_seeds=0), str(tmp_path))
    with pytest.raises(ValueError, match="lrs"):
        nanguard.study(StudyConfig(lrs=(0.0,)), str(tmp_path))
    with pytest.raises(ValueError, match="model"):
        nanguard.study(StudyConfig(model="bert"), str(tmp_path))
    with pytest.raises(TypeError, match="cfg"):
        nanguard.study({"init_seeds": 2}, str(tmp_path))
    assert not os.listdir(tmp_path)


def test_cli_help():
    with pytest.raises(SystemExit) as e:
        _study.main(["--help"])
    assert e.value.code == 0


def tiny_gpt2(seed):
    """A model factory of the user's (module-level: the study's processes import it)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                n_layer=1, n_head=2))


def tiny_data(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 32, (2, 16), generator=g)


def test_a_model_and_data_of_the_users(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    cfg = StudyConfig(model=tiny_gpt2, data=tiny_data, init_seeds=2, data_seeds=1, steps=8, lrs=(0.01,),
                      fixes=("baseline",), ks=(2,), sweep_seeds=1)
    s = nanguard.study(cfg, str(tmp_path / "callable"), workers=1, progress=False)
    assert s["config"]["model"].endswith("tiny_gpt2") and s["config"]["data"].endswith("tiny_data")
    assert s["runs"] == 2 and json.loads((tmp_path / "callable" / "study.json").read_text())["config"]["model"]
    conf = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    s = nanguard.study(StudyConfig(model=conf, init_seeds=1, data_seeds=1, steps=6, lrs=(0.01,),
                                   fixes=("baseline",), ks=(2,), sweep_seeds=1),
                       str(tmp_path / "config"), workers=1, progress=False)
    assert s["config"]["model"].startswith("GPT2Config")
    with pytest.raises(TypeError, match="data"):
        nanguard.study(StudyConfig(data=3), str(tmp_path / "bad"))
    with pytest.raises(TypeError, match="model"):
        nanguard.study(StudyConfig(model=3), str(tmp_path / "bad"))


def test_ranks_deal_the_runs_out(tmp_path):
    """Under torchrun (RANK / WORLD_SIZE), each rank runs its share of the
    runs into its own file and rank 0 reports once all are in."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    code = ("import sys, nanguard; from nanguard._study import StudyConfig; "
            "cfg = StudyConfig(init_seeds=2, data_seeds=1, steps=6, lrs=(0.01,), fixes=('baseline',), ks=(2,), "
            "sweep_seeds=1); s = nanguard.study(cfg, sys.argv[1], workers=1, progress=False); "
            "print('REPORT' if s else 'DONE')")
    env = dict(os.environ, WORLD_SIZE="2", PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0].strip().endswith("REPORT") and outs[1].strip().endswith("DONE")
    lines = [(tmp_path / f"runs.rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert sorted(len(x) for x in lines) == [1, 2]  # 3 runs: 2 grid + 1 sweep, dealt out
    assert json.loads((tmp_path / "study.json").read_text())["runs"] == 2


def test_cli_takes_a_config_and_functions_of_the_users(tmp_path, capsys):
    pytest.importorskip("transformers")
    import transformers

    conf = tmp_path / "conf"
    transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2).save_pretrained(conf)
    tiny = ["--init-seeds", "1", "--data-seeds", "1", "--steps", "4", "--lrs", "0.01", "--fixes", "baseline",
            "--workers", "1"]
    # a folder holding config.json, the file itself, and a model factory, each with the user's data
    models = (("folder", str(conf)), ("file", str(conf / "config.json")), ("factory", "test_study:tiny_gpt2"))
    for name, model in models:
        assert _study.main(["--model", model, "--data", "test_study:tiny_data", "--out", str(tmp_path / name),
                            *tiny]) == 0
        c = json.loads((tmp_path / name / "study.json").read_text())["config"]
        assert c["data"] == "test_study.tiny_data"
        assert c["model"] == ("test_study.tiny_gpt2" if name == "factory" else "GPT2Config (gpt2)")
    capsys.readouterr()
    for args, flag, says in ((["--model", str(tmp_path / "nowhere")], "--model", "no such file or folder"),
                             (["--model", str(tmp_path)], "--model", "is not a transformers config"),
                             (["--model", "no_such_module_here:f"], "--model", "cannot import"),
                             (["--data", "test_study:nothing_here"], "--data", "has no 'nothing_here'"),
                             (["--data", "test_study"], "--data", "expected module:function"),
                             (["--data", "test_study:json"], "--data", "is a module, not a function")):
        with pytest.raises(SystemExit) as e:
            _study.main([*args, "--out", str(tmp_path / "bad")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag}: " in err and says in err, err
    assert not (tmp_path / "bad").exists()
