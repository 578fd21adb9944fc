"""check_batch and doctor: findings on crafted and stock inputs (Hugging Face
BERT / Llama from small configs, nn.TransformerEncoderLayer with norm_first
True / False), and no findings on clean ones."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard.diagnostics import BadBatchError, Finding, format_findings


def codes(findings):
    return {f.code for f in findings}


# ---- check_batch --------------------------------------------------------------------------


def clean_batch():
    ids = torch.randint(0, 100, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 6:] = 0  # padding
    labels = ids.clone()
    labels[1, 6:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "pixel_values": torch.randn(3, 4)}


def test_clean_batch_has_no_findings():
    assert nanguard.check_batch(clean_batch(), vocab_size=100) == []
    # nested lists / tuples, and a -inf additive mask that masks part of each row
    add_mask = torch.zeros(3, 1, 8, 8)
    add_mask.masked_fill_(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), -math.inf)
    assert nanguard.check_batch([clean_batch(), (clean_batch(), {"attention_mask": add_mask})],
                                vocab_size=100) == []


def test_hf_batch_encoding():
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding(clean_batch())
    assert nanguard.check_batch(enc, vocab_size=100) == []
    b = clean_batch()
    b["input_ids"][0, 0] = 100
    f = nanguard.check_batch(transformers.BatchEncoding(b), vocab_size=100)
    assert [(x.path, x.problem, x.count) for x in f] == [
        ("batch['input_ids']", "token ids outside [0, vocab_size)", 1)]


def test_crafted_problems():
    b = clean_batch()
    b["pixel_values"][0, 0] = math.nan
    b["pixel_values"][1, 1] = math.inf
    b["pixel_values"][2, 2] = -math.inf
    b["input_ids"][2, 3] = -1
    b["attention_mask"][0] = 0
    b["labels"][2] = -100
    b["labels"][0, 0] = 500
    got = {(f.path, f.problem): f.count for f in nanguard.check_batch(b, vocab_size=100)}
    assert got == {
        ("batch['pixel_values']", "NaN values"): 1,
        ("batch['pixel_values']", "+Inf values"): 1,
        ("batch['pixel_values']", "-Inf values"): 1,
        ("batch['input_ids']", "token ids outside [0, vocab_size)"): 1,
        ("batch['attention_mask']", "attention mask rows that attend to nothing"): 1,
        ("batch['labels']", "rows whose labels are all ignore_index"): 1,
        ("batch['labels']", "labels outside [0, vocab_size)"): 1,
    }


def test_all_labels_ignored_and_masks():
    f = nanguard.check_batch({"labels": torch.full((2, 5), -100)})
    assert [x.problem for x in f] == ["all labels are ignore_index"]
    assert nanguard.check_batch({"labels": torch.full((2, 5), 7)}, ignore_index=7)[0].problem == \
        "all labels are ignore_index"
    bool_mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    bool_mask[1, 0, 2] = False
    f = nanguard.check_batch({"attention_mask": bool_mask})
    assert [(x.problem, x.count) for x in f] == [("attention mask rows that attend to nothing", 1)]
    add = torch.zeros(1, 1, 3, 3)
    add[0, 0, 0] = torch.finfo(torch.float32).min
    f = nanguard.check_batch({"encoder_attention_mask": add})
    assert [x.count for x in f] == [1]


def test_check_batch_raises_on_request():
    b = {"input_ids": torch.tensor([[1, 2, 300]])}
    with pytest.raises(BadBatchError, match="token ids outside") as ei:
        nanguard.check_batch(b, vocab_size=100, raise_on_problem=True)
    assert len(ei.value.findings) == 1
    assert nanguard.check_batch(torch.randn(3)) == []  # a bare tensor



def test_tensors_in_a_list_under_a_key_are_checked_as_that_key():
    # an uncollated batch: one tensor per sequence
    b = {"input_ids": [torch.tensor([1, 2]), torch.tensor([3, 100])],
         "labels": (torch.tensor([1, 2]), torch.full((2,), -100)),
         "attention_mask": [torch.ones(2, 3), torch.ones(2, 3)]}
    got = [(f.path, f.problem, f.count) for f in nanguard.check_batch(b, vocab_size=100)]
    assert got == [("batch['input_ids'][1]", "token ids outside [0, vocab_size)", 1),
                   ("batch['labels'][1]", "all labels are ignore_index", 2)]
    b["attention_mask"][0][1] = 0
    f = nanguard.check_batch(b, vocab_size=101)
    assert [(x.path, x.problem) for x in f] == [
        ("batch['labels'][1]", "all labels are ignore_index"),
        ("batch['attention_mask'][0]", "attention mask rows that attend to nothing")]

# ---- doctor: plain PyTorch ----------------------------------------------------------------


def encoder(norm_first, layers=2, d=16):
    layer = nn.TransformerEncoderLayer(d, 2, 32, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def test_transformer_encoder_post_ln_and_pre_ln():
    assert codes(nanguard.doctor(encoder(True))) == set()
    f = nanguard.doctor(encoder(False))
    assert codes(f) == {"post-ln"} and f[0].severity == "info"
    assert "layers.0" in f[0].where
    f = nanguard.doctor(encoder(False, layers=12))
    assert f[0].code == "post-ln" and f[0].severity == "warning"
    assert "12 Post-LN" in f[0].evidence


def test_fp16_without_scaler_and_fp16_params():
    m = encoder(True)
    f = nanguard.doctor(m, autocast_dtype=torch.float16)
    assert codes(f) == {"fp16-no-scaler", "attention-fp16-mask"}
    assert f[0].severity == "error"  # most severe first
    assert "fp16-no-scaler" not in codes(
        nanguard.doctor(m, autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu")))
    f = nanguard.doctor(encoder(True).half())
    assert {"fp16-params", "fp16-no-scaler"} <= codes(f)
    with torch.autocast("cpu", dtype=torch.float16):
        assert "fp16-no-scaler" in codes(nanguard.doctor(encoder(True)))
    # bfloat16 needs no scaler and has no fp16 masking problem
    assert codes(nanguard.doctor(m, autocast_dtype=torch.bfloat16)) == set()


def test_scaler_init_scale():
    m = encoder(True)
    high = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    f = nanguard.doctor(m, autocast_dtype=torch.float16, scaler=high)
    assert "scaler-init-scale" in codes(f)
    ok = torch.amp.GradScaler("cpu")
    f = nanguard.doctor(m, autocast_dtype=torch.float16, scaler=ok)
    assert "scaler-init-scale" not in codes(f)


def test_norm_eps_for_fp16_only():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-6), nn.RMSNorm(4, eps=1e-8))
    f = [x for x in nanguard.doctor(m, autocast_dtype=torch.float16,
                                    scaler=torch.amp.GradScaler("cpu"))]
    assert codes(f) == {"norm-eps"}
    assert "'1'" in f[0].where and "'2'" in f[0].where and "1e-06" in f[0].evidence
    assert nanguard.doctor(m) == []
    assert nanguard.doctor(nn.Sequential(nn.LayerNorm(4)), autocast_dtype=torch.float16,
                           scaler=torch.amp.GradScaler("cpu")) == []


def test_warmup_and_clipping():
    m = encoder(True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    L = torch.optim.lr_scheduler
    no_warm = [L.StepLR(opt, 10), L.LambdaLR(opt, lambda s: 1.0), L.CosineAnnealingLR(opt, 100)]
    warm = [L.LinearLR(opt, start_factor=0.01, total_iters=10),
            L.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100)),
            L.SequentialLR(opt, [L.LinearLR(opt, 0.1, total_iters=5), L.CosineAnnealingLR(opt, 50)],
                           milestones=[5]),
            L.OneCycleLR(opt, max_lr=1e-3, total_steps=100)]
    for s in no_warm:
        assert "no-warmup" in codes(nanguard.doctor(m, opt, scheduler=s, max_grad_norm=1.0)), s
    for s in warm:
        assert codes(nanguard.doctor(m, opt, scheduler=s, max_grad_norm=1.0)) == set(), s
    f = nanguard.doctor(m, opt)
    assert codes(f) == {"no-grad-clipping"} and f[0].severity == "info"
    assert codes(nanguard.doctor(m, opt, scaler=nanguard.amp.GradScaler("cpu"))) == set()


def test_large_embedding():
    m = nn.Sequential(nn.Embedding(70000, 4), nn.Linear(4, 4))
    f = nanguard.doctor(m)
    assert codes(f) == {"large-embedding"} and f[0].severity == "info"
    assert "70000" in f[0].evidence
    assert nanguard.doctor(nn.Embedding(1000, 4)) == []


def test_bad_model_argument_and_format():
    with pytest.raises(TypeError, match="nn.Module"):
        nanguard.doctor("bert")
    assert format_findings([]) == "nanguard doctor: no findings"
    f = Finding("warning", "x", "y", "because", "do this")
    assert "evidence: because" in format_findings([f]) and "fix: do this" in str(f)



# ---- doctor: each rule alone, on a context built by hand ------------------------------------


def test_rule_fp16_no_scaler_alone():
    from nanguard.diagnostics._doctor import _AuditContext, _rule_fp16_no_scaler

    m = nn.Linear(2, 2)
    assert _rule_fp16_no_scaler(_AuditContext(m, tdtype=torch.bfloat16)) == []
    assert _rule_fp16_no_scaler(_AuditContext(m, tdtype=torch.float16,
                                              scaler=torch.amp.GradScaler("cpu"))) == []
    [f] = _rule_fp16_no_scaler(_AuditContext(m, tdtype=torch.float16, from_autocast=True))
    assert (f.severity, f.code, f.where) == ("error", "fp16-no-scaler", "scaler")
    assert f.evidence.startswith("training in autocast(float16) with no GradScaler")
    off = torch.amp.GradScaler("cpu", enabled=False)
    [f] = _rule_fp16_no_scaler(_AuditContext(m, tdtype=torch.float16, scaler=off))
    assert f.evidence.startswith("training in float16 parameters with a disabled GradScaler")


def test_rule_post_ln_alone_reads_the_config():
    from types import SimpleNamespace

    from nanguard.diagnostics._doctor import DEEP_STACK, _AuditContext, _rule_post_ln

    m = nn.Linear(2, 2)
    assert _rule_post_ln(_AuditContext(m)) == []
    assert _rule_post_ln(_AuditContext(m, cfg=SimpleNamespace(model_type="llama"))) == []
    [f] = _rule_post_ln(_AuditContext(m, depth=DEEP_STACK, cfg=SimpleNamespace(model_type="bert")))
    assert (f.severity, f.where) == ("warning", "model (bert)")
    assert "as in every 'bert' model" in f.evidence
    # an explicit flag wins over the model type
    cfg = SimpleNamespace(model_type="bert", do_layer_norm_before=True)
    assert _rule_post_ln(_AuditContext(m, depth=DEEP_STACK, cfg=cfg)) == []
    cfg = SimpleNamespace(model_type="opt", do_layer_norm_before=False)
    [f] = _rule_post_ln(_AuditContext(m, depth=DEEP_STACK - 1, cfg=cfg))
    assert f.severity == "info" and f"at {DEEP_STACK - 1} blocks" in f.evidence


def test_rule_norm_eps_alone_names_the_patch_for_hf_models_only():
    from nanguard.diagnostics._doctor import _AuditContext, _rule_norm_eps

    m = nn.Sequential(nn.LayerNorm(4, eps=1e-6), nn.LayerNorm(4))
    assert _rule_norm_eps(_AuditContext(m, tdtype=torch.float32)) == []
    [f] = _rule_norm_eps(_AuditContext(m, tdtype=torch.float16))
    assert f.where == "'0'" and "1 LayerNorm/RMSNorm module(s) use eps 1e-06" in f.evidence
    assert f.fix.startswith("eps >= 1e-05 for float16")  # nanguard.layernorm.EPS_FLOOR[float16]
    [f] = _rule_norm_eps(_AuditContext(m, tdtype=torch.float16, hf=True))
    assert f.fix.startswith("nanguard.patch(model)")


def test_rule_no_warmup_alone():
    from types import SimpleNamespace

    from nanguard.diagnostics._doctor import _AuditContext, _rule_no_warmup

    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    L = torch.optim.lr_scheduler
    assert _rule_no_warmup(_AuditContext(m)) == []
    [f] = _rule_no_warmup(_AuditContext(m, scheduler=L.StepLR(opt, 10)))
    assert (f.where, f.evidence.split(" ")[0]) == ("scheduler", "StepLR")
    # a scheduler that cannot be inspected is not reported, and wins over training_args
    no_warm_args = SimpleNamespace(warmup_steps=0, warmup_ratio=0.0)
    assert _rule_no_warmup(_AuditContext(m, scheduler=object(), training_args=no_warm_args)) == []
    [f] = _rule_no_warmup(_AuditContext(m, training_args=no_warm_args))
    assert f.where == "training_args"
    warm_args = SimpleNamespace(warmup_steps=0, warmup_ratio=0.03)
    assert _rule_no_warmup(_AuditContext(m, training_args=warm_args)) == []


def test_every_rule_is_registered():
    from nanguard.diagnostics import _doctor

    defined = {v for k, v in vars(_doctor).items() if k.startswith("_rule_") and callable(v)}
    assert len(defined) == 9 and set(_doctor._RULES) == defined
    assert len(_doctor._RULES) == len(defined)

# ---- doctor: Hugging Face -----------------------------------------------------------------


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def small_llama(transformers, **kw):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, **kw)
    return transformers.LlamaForCausalLM(cfg)


def small_bert(transformers, layers=2):
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=layers, num_attention_heads=4)
    return transformers.BertModel(cfg)


def test_llama_well_configured_has_no_findings(transformers):
    m = small_llama(transformers)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sched = transformers.get_linear_schedule_with_warmup(opt, 10, 100)
    assert nanguard.doctor(m, opt, scheduler=sched, max_grad_norm=1.0) == []
    assert nanguard.doctor(m, opt, scheduler=sched, max_grad_norm=1.0,
                           autocast_dtype=torch.bfloat16) == []
    assert nanguard.doctor(m, opt, scheduler=sched, max_grad_norm=1.0,
                           autocast_dtype=torch.float16, dtype=None,
                           scaler=torch.amp.GradScaler("cpu")) != []  # eps 1e-6 + sdpa in fp16
    const = transformers.get_constant_schedule(opt)
    assert codes(nanguard.doctor(m, opt, scheduler=const, max_grad_norm=1.0)) == {"no-warmup"}


def test_llama_fp16_findings(transformers):
    m = small_llama(transformers)
    f = nanguard.doctor(m, autocast_dtype=torch.float16)
    assert codes(f) == {"fp16-no-scaler", "norm-eps", "attention-fp16-mask"}
    eps = next(x for x in f if x.code == "norm-eps")
    assert "model.layers.0.input_layernorm" in eps.where and "1e-06" in eps.evidence
    assert "post-ln" not in codes(f)  # Llama is Pre-LN


def test_bert_is_post_ln(transformers):
    f = nanguard.doctor(small_bert(transformers))
    assert codes(f) == {"post-ln"} and f[0].severity == "info" and "bert" in f[0].evidence
    f = nanguard.doctor(small_bert(transformers, layers=12))
    assert f[0].code == "post-ln" and f[0].severity == "warning"
    f = nanguard.doctor(small_bert(transformers), autocast_dtype=torch.float16,
                        scaler=torch.amp.GradScaler("cpu"))
    assert codes(f) == {"post-ln", "norm-eps", "attention-fp16-mask"}
    assert "1e-12" in next(x for x in f if x.code == "norm-eps").evidence


def test_training_args(transformers):
    # read duck-typed (TrainingArguments itself needs `accelerate` to construct)
    from types import SimpleNamespace

    m = small_llama(transformers)
    args = SimpleNamespace(fp16=False, bf16=False, warmup_steps=0, warmup_ratio=0.0,
                           max_grad_norm=1.0)
    assert codes(nanguard.doctor(m, training_args=args)) == {"no-warmup"}
    args = SimpleNamespace(fp16=False, bf16=True, warmup_steps=10, warmup_ratio=0.0,
                           max_grad_norm=1.0)
    assert nanguard.doctor(m, training_args=args) == []
    args = SimpleNamespace(fp16=True, bf16=False, warmup_steps=0, warmup_ratio=0.03,
                           max_grad_norm=0.0)
    assert {"fp16-no-scaler", "norm-eps"} <= codes(nanguard.doctor(m, torch.optim.SGD(
        m.parameters(), 0.1), training_args=args)) - {"no-warmup"}


def test_cli(transformers, capsys):
    from nanguard.__main__ import main

    assert main(["doctor", "--model-type", "llama"]) == 0
    out = capsys.readouterr().out
    assert "LlamaModel" in out and "no findings" in out
    assert main(["doctor", "--model-type", "bert"]) == 0
    assert "post-ln" in capsys.readouterr().out
    assert main(["doctor", "--model-type", "llama", "--dtype", "float16", "--no-scaler"]) == 1
    assert "fp16-no-scaler" in capsys.readouterr().out


def test_cli_config_path(transformers, tmp_path, capsys):
    import json

    from nanguard.__main__ import main

    cfg = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 24,
           "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert main(["doctor", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "[warning] post-ln" in out and "24 Post-LN" in out


def test_hf_model_fix_lines_recommend_patch(transformers):
    m = small_llama(transformers)
    f = {x.code: x for x in nanguard.doctor(m, autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))}
    assert set(f) == {"norm-eps", "attention-fp16-mask"}
    for x in f.values():
        assert x.fix.startswith("nanguard.patch(model)"), x.fix
    # after the patch there is nothing left for it to fix
    nanguard.patch(m)
    assert nanguard.doctor(m, autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu")) == []
    nanguard.unpatch(m)
    # a model that is not a transformers one keeps the module-level fixes
    plain = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-6))
    f = nanguard.doctor(plain, autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    assert codes(f) == {"norm-eps"} and "nanguard.patch" not in f[0].fix


def test_cli_help_lists_options(capsys):
    from nanguard.__main__ import main

    for cmd, opts in (("doctor", ("--model-type", "--config", "--layers", "--dtype", "--no-scaler", "--init-scale")),
                      ("demo", ("--steps", "--lr", "--device", "--seed", "--out", "--no-watch", "--ops"))):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert f"python -m nanguard {cmd}" in out
        for o in opts:
            assert o in out, (cmd, o, out)


def test_cli_help_as_a_process():
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ)
    root = pathlib.Path(nanguard.__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "nanguard", "doctor", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "--model-type" in r.stdout, r.stdout + r.stderr


def test_norm_eps_read_under_every_attribute_name_norm_classes_use():
    from nanguard.diagnostics._doctor import _norm_eps
    from nanguard.layernorm import NORM_EPS_ATTRS

    for attr in NORM_EPS_ATTRS:  # the one list patching and triage use too
        cls = type("MyRMSNorm", (nn.Module,), {})
        m = cls()
        setattr(m, attr, 1e-7)
        assert _norm_eps(m) == 1e-7, attr
