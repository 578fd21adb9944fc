"""``nanguard.patch`` called again, and deploying a patched model.

- Patching a patched model with the same options changes nothing and
  returns the same summary (re-running a notebook cell); with other options
  it re-patches as if ``unpatch`` had been called first, so one ``unpatch``
  restores the original. Both hold for a bare model, inside peft, inside
  ``torch.compile``'s ``OptimizedModule`` and inside ``nn.DataParallel``
  (the ``.module`` wrappers: DDP, FSDP1), and for a model class.
- A ``torch.export``-ed patched model holds nanguard's ops: it loads in a
  process that imported nanguard and in no other; exported after
  ``unpatch`` it loads anywhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import nanguard
from nanguard.patching import _apply, _hf_attention, unwrap

VOCAB = 64


def _transformers():
    return pytest.importorskip("transformers", reason="pip install transformers (scripts/setup.sh installs it for CI)")


def build():
    T = _transformers()
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attention_dropout=0.0)).eval()


def _ids():
    return torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))


def _peft(m):
    p = pytest.importorskip("peft")
    return p.get_peft_model(m, p.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


#: how training code wraps a model; unwrap finds it inside each
WRAPPERS = {
    "bare": lambda m: m,
    "peft": _peft,
    "compile": lambda m: torch.compile(m, backend="eager"),  # never called: no compilation
    "data_parallel": nn.DataParallel,
}


def _state(model):
    """What a patch changes: each module's class and instance attributes,
    forward pre-hooks, the attention implementation and options."""
    inner, _ = unwrap(model)
    mods = {q: (type(m), sorted(m.__dict__), len(m._forward_pre_hooks), m.__dict__.get(_hf_attention._OPTS_ATTR))
            for q, m in inner.named_modules()}
    return mods, inner.config._attn_implementation


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_patch_again_with_the_same_options_is_a_noop(wrap):
    w = WRAPPERS[wrap](build())
    stock = _state(w)
    s1 = nanguard.patch(w, max_score=30.0)
    record, patched = getattr(unwrap(w)[0], _apply._PATCH_ATTR), _state(w)
    assert s1.total > 0 and patched != stock
    assert nanguard.patch(w, max_score=30) is s1  # 30 == 30.0: the same options
    assert getattr(unwrap(w)[0], _apply._PATCH_ATTR) is record and _state(w) == patched
    nanguard.unpatch(w)
    assert _state(w) == stock


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_patch_again_with_other_options_repatches(wrap):
    w = WRAPPERS[wrap](build())
    inner, ids = unwrap(w)[0], _ids()
    stock = _state(w)
    with torch.no_grad():
        nanguard.patch(w)
        plain = inner(input_ids=ids).logits
        s = nanguard.patch(w, max_score=1e-3)  # scores clamped to ~0: visibly different
        clamped = inner(input_ids=ids).logits
        assert s.attn_implementation == ("sdpa", "nanguard"), str(s)  # as if unpatched first
        assert (clamped - plain).abs().max() > 1e-4
        ref = build()
        nanguard.patch(ref, max_score=1e-3)
        torch.testing.assert_close(clamped, ref(input_ids=ids).logits, atol=0, rtol=0)
        s = nanguard.patch(w, norm=False)  # the norms get their own class back, the clamp goes
        assert not any("Norm" in k for k in s.patched) and s.total > 0
        assert type(inner.model.norm).__name__ == "LlamaRMSNorm"
        torch.testing.assert_close(inner(input_ids=ids).logits, plain, atol=1e-5, rtol=1e-4)
    nanguard.unpatch(w)  # once is enough
    assert _state(w) == stock


def test_multihead_attention_repatched_with_another_max_score():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    stock = [(type(m), len(m._forward_pre_hooks)) for m in enc.modules()]
    s = nanguard.patch(enc, max_score=5.0)
    assert nanguard.patch(enc, max_score=5.0) is s
    nanguard.patch(enc, max_score=7.0)
    attn = enc.layers[0].self_attn
    assert type(attn).__name__ == "SafeMultiheadAttention" and attn.max_score == 7.0
    assert len(attn._forward_pre_hooks) == 1  # the fast-path hook, not one per patch
    nanguard.unpatch(enc)
    assert [(type(m), len(m._forward_pre_hooks)) for m in enc.modules()] == stock
    assert "max_score" not in attn.__dict__


def test_class_patch_again():
    cls = _transformers().LlamaForCausalLM
    orig = cls.post_init
    try:
        s = nanguard.patch(cls)
        assert nanguard.patch(cls) is s
        nanguard.patch(cls, max_score=1e-3)
        m = build()
        attn = m.model.layers[0].self_attn
        assert getattr(attn, _hf_attention._OPTS_ATTR) == {"max_score": 1e-3, "softcap": None}
        assert cls.post_init.__wrapped__ is orig  # one wrapper, not two
    finally:
        nanguard.unpatch(cls)
    assert "post_init" not in cls.__dict__


# ---- torch.export ---------------------------------------------------------------------------------

_CHILD = """
import json, sys, torch

def load(name):
    try:
        ep = torch.export.load(sys.argv[1] + "/" + name + ".pt2")
    except Exception as e:
        return "error: " + type(e).__name__
    x = torch.load(sys.argv[1] + "/x.pt")
    return torch.equal(ep.module()(x), torch.load(sys.argv[1] + "/" + name + "_y.pt"))

out = {"nanguard imported": "nanguard" in sys.modules}
out["without nanguard"] = {name: load(name) for name in ("patched", "unpatched")}
import nanguard
out["with nanguard"] = {name: load(name) for name in ("patched", "unpatched")}
print(json.dumps(out))
"""


def test_exported_patched_model_needs_nanguard_unpatched_does_not(tmp_path):
    """docs/integrations.md "Deployment": a patched model exported with torch.export
    loads where nanguard is imported; unpatched before export, anywhere. One
    fresh process loads both exports before and after ``import nanguard``."""
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    torch.save(x, tmp_path / "x.pt")
    nanguard.patch(m)
    ep = torch.export.export(m, (x,))
    assert any("nanguard" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "patched.pt2")
    torch.save(m(x), tmp_path / "patched_y.pt")
    nanguard.unpatch(m)
    ep = torch.export.export(m, (x,))
    assert not any("nanguard" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "unpatched.pt2")
    torch.save(m(x), tmp_path / "unpatched_y.pt")

    env = dict(os.environ)
    root = pathlib.Path(nanguard.__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    if env.get("NANGUARD_LIB_DIR"):
        env["NANGUARD_LIB_DIR"] = str(pathlib.Path(env["NANGUARD_LIB_DIR"]).resolve())
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["nanguard imported"] is False
    assert got["without nanguard"]["unpatched"] is True, got
    assert str(got["without nanguard"]["patched"]).startswith("error"), got
    assert "torch.ops.nanguard" in r.stderr  # torch.export.load's warning names the op it could not resolve
    assert got["with nanguard"] == {"patched": True, "unpatched": True}, got
