"""nanguard.patch by rule on every family in :data:`SPECS`: each built tiny
from its config class in the installed transformers (random weights, norm
weights moved away from their init so a wrong convention shows), then, patched
against stock in fp32:

- logits at real positions and the gradient of every parameter, with left
  and right padding (and the causal mask of decoders);
- greedy generation with a KV cache (decoders): the same tokens and the same
  per-step logits;
- the round trip through ``unpatch``: the same module objects and classes,
  the same attention implementation, bit-identical logits.

The table in docs/hf.md is generated from this list (``python
tests/python/test_hf_families.py`` prints it) and a test checks that the
page holds exactly that table.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys
from typing import Dict, Optional

import pytest
import torch
from torch import nn

import nanguard

from conftest import TOLERANCES

T = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it for CI)")
if int(T.__version__.split(".")[0]) < 5:
    pytest.skip("the family table is for transformers 5 (where these families use AttentionInterface)",
                allow_module_level=True)

TOL_LOGITS = TOLERANCES["hf_logits"][torch.float32]
TOL_GRADS = TOLERANCES["hf_grads"][torch.float32]
VOCAB, SEQ, BATCH = 64, 8, 3

_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, dropout=0.0, residual_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)


@dataclasses.dataclass
class Spec:
    model_type: str
    name: str  #: the family's name in the docs table
    causal: bool = True
    config: Dict = dataclasses.field(default_factory=dict)
    #: None: attention goes through safe_sdpa; else a word the reason must contain
    attention_untouched: Optional[str] = None
    note: str = ""
    #: a transformers class to build instead of the causal-LM / masked-LM auto
    #: class; its output's last_hidden_state stands in for logits
    model_class: Optional[str] = None


SPECS = [
    Spec("llama", "Llama"),
    Spec("mistral", "Mistral", config=dict(sliding_window=None)),
    Spec("mixtral", "Mixtral (MoE)", config=_MOE),
    Spec("qwen2", "Qwen2"),
    Spec("qwen2_moe", "Qwen2-MoE", config=_MOE),
    Spec("qwen3", "Qwen3", config=dict(head_dim=8)),
    Spec("qwen3_moe", "Qwen3-MoE", config=dict(head_dim=8, **_MOE)),
    Spec("gemma", "Gemma", config=dict(head_dim=8)),
    Spec("gemma2", "Gemma-2", config=dict(head_dim=8, sliding_window=4, attn_logit_softcapping=1.5,
                                          final_logit_softcapping=None),
         note="soft-cap 1.5 and a sliding window of 4 in the test"),
    Spec("gemma3_text", "Gemma-3", config=dict(head_dim=8, sliding_window=4),
         note="sliding window of 4 in the test"),
    Spec("phi", "Phi"),
    Spec("phi3", "Phi-3"),
    Spec("olmo", "OLMo"),
    Spec("olmo2", "OLMo-2"),
    Spec("olmoe", "OLMoE", config=_MOE),
    Spec("granite", "Granite"),
    Spec("granitemoe", "Granite-MoE", config=_MOE),
    Spec("cohere", "Cohere"),
    Spec("cohere2", "Cohere-2", config=dict(sliding_window=4)),
    Spec("stablelm", "StableLM"),
    Spec("gpt_neox", "GPT-NeoX"),
    Spec("starcoder2", "Starcoder2"),
    Spec("opt", "OPT", config=dict(ffn_dim=64, word_embed_proj_dim=32)),
    Spec("gpt2", "GPT-2"),
    Spec("gpt_bigcode", "GPT-BigCode"),
    Spec("biogpt", "BioGPT"),
    Spec("smollm3", "SmolLM3"),
    Spec("glm", "GLM"),
    Spec("glm4", "GLM-4"),
    Spec("nemotron", "Nemotron"),
    Spec("persimmon", "Persimmon"),
    Spec("exaone4", "EXAONE-4"),
    Spec("arcee", "Arcee"),
    Spec("seed_oss", "Seed-OSS"),
    Spec("ernie4_5", "ERNIE-4.5"),
    Spec("apertus", "Apertus"),
    Spec("phimoe", "Phi-MoE", config=_MOE),
    Spec("jetmoe", "JetMoE", config=_MOE),
    Spec("gpt_oss", "GPT-OSS", config=_MOE, attention_untouched="s_aux"),
    Spec("bloom", "BLOOM", attention_untouched="AttentionInterface"),
    Spec("falcon", "Falcon"),
    Spec("bert", "BERT", causal=False),
    Spec("roberta", "RoBERTa", causal=False),
    Spec("xlm-roberta", "XLM-RoBERTa", causal=False),
    Spec("electra", "ELECTRA", causal=False),
    Spec("camembert", "CamemBERT", causal=False),
    Spec("distilbert", "DistilBERT", causal=False, config=dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4)),
    Spec("albert", "ALBERT", causal=False, config=dict(embedding_size=16)),
    Spec("modernbert", "ModernBERT", causal=False, config=dict(cls_token_id=3, sep_token_id=4)),
    Spec("roberta-prelayernorm", "RoBERTa-PreLayerNorm", causal=False),
    Spec("ernie", "ERNIE", causal=False),
    Spec("t5", "T5 encoder", causal=False, model_class="T5EncoderModel",
         config=dict(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                     dropout_rate=0.0), attention_untouched="position_bias"),
]


def build_family(spec: Spec) -> nn.Module:
    kw = dict(_BASE)
    kw.update(spec.config)
    cfg = T.AutoConfig.for_model(spec.model_type, **kw)
    torch.manual_seed(0)
    if spec.model_class:
        m = getattr(T, spec.model_class)(cfg)
    else:
        auto = T.AutoModelForCausalLM if spec.causal else T.AutoModelForMaskedLM
        m = auto.from_config(cfg)
    # norm weights away from their init (ones / zeros) so a wrong convention shows
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if "norm" in type(mod).__name__.lower():
                for p in mod.parameters(recurse=False):
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


def batch(kind: str):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    am = torch.ones(BATCH, SEQ, dtype=torch.long)
    if kind == "left_pad":
        am[1, :3] = 0
        am[2, :1] = 0
        ids = ids.masked_fill(am == 0, 0)
    elif kind == "right_pad":
        am[1, 5:] = 0
        am[2, 7:] = 0
        ids = ids.masked_fill(am == 0, 0)
    return ids, am


def _close(a, b, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _logits_loss(model, ids, am):
    torch.manual_seed(3)  # the same draws on both sides (PhiMoE's router samples in training)
    out = model(input_ids=ids, attention_mask=am)
    valid = am.bool()
    if not hasattr(out, "logits"):  # an encoder without a head: a loss on its hidden states
        hidden = out.last_hidden_state
        return hidden, hidden[valid].float().square().mean(), valid
    logits = out.logits
    labels = ids.masked_fill(~valid, -100)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=-100)
    return logits, loss, valid


def _check_summary(spec: Spec, s) -> None:
    norms = sum(n for k, n in s.patched.items() if "Norm" in k)
    assert norms > 0, str(s)
    if spec.attention_untouched is None:
        assert s.attn_implementation is not None and s.attn_implementation[1] == "nanguard", str(s)
        assert "attention" not in s.skipped
    else:
        assert s.attn_implementation is None, str(s)
        assert spec.attention_untouched in s.skipped["attention"], str(s)
    # every norm-like module of the family is recognised: nothing else is listed
    assert set(s.skipped) <= {"attention"}, str(s)


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the calls of nanguard's attention function through
    transformers' registry: a patched family must really run it."""
    from transformers import AttentionInterface

    from nanguard.patching import _hf_attention

    _hf_attention._register()
    calls = []
    registered = AttentionInterface._global_mapping[_hf_attention.ATTN_IMPLEMENTATION]

    def counting(*args, **kwargs):
        calls.append(1)
        return registered(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, _hf_attention.ATTN_IMPLEMENTATION, counting)
    return calls


@pytest.mark.parametrize("spec", SPECS, ids=[s.model_type for s in SPECS])
def test_family_fp32_logits_grads_generation_round_trip(spec, attention_calls):
    stock = build_family(spec).train()
    ours = copy.deepcopy(stock)
    mods = dict(ours.named_modules())
    classes = {k: type(v) for k, v in mods.items()}
    impl = ours.config._attn_implementation
    s = nanguard.patch(ours)
    _check_summary(spec, s)
    for kind in ("left_pad", "right_pad"):
        ids, am = batch(kind)
        l0, loss0, valid = _logits_loss(stock, ids, am)
        l1, loss1, _ = _logits_loss(ours, ids, am)
        # padded positions are not compared: with left padding a padded query
        # has no key at all, where eager attention averages every key and
        # SDPA and nanguard give 0; nothing reads those rows
        _close(l1[valid], l0[valid], TOL_LOGITS, f"{spec.model_type}/{kind} logits")
        assert bool(attention_calls) == (spec.attention_untouched is None), len(attention_calls)
        params0, params1 = list(stock.parameters()), list(ours.parameters())
        g0 = torch.autograd.grad(loss0, params0, allow_unused=True)
        g1 = torch.autograd.grad(loss1, params1, allow_unused=True)
        for (n, _), a, b in zip(stock.named_parameters(), g0, g1):
            if a is None:
                assert b is None, n
                continue
            _close(b, a, TOL_GRADS, f"{spec.model_type}/{kind} grad of {n}")
    if spec.causal:
        stock.eval()
        ours.eval()
        ids, am = batch("left_pad")
        kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0)
        with torch.no_grad():
            r0 = stock.generate(input_ids=ids, attention_mask=am, **kw)
            r1 = ours.generate(input_ids=ids, attention_mask=am, **kw)
        assert torch.equal(r1.sequences, r0.sequences), spec.model_type
        for step, (a, b) in enumerate(zip(r0.logits, r1.logits)):
            _close(b, a, TOL_LOGITS, f"{spec.model_type} generation step {step} logits")
    nanguard.unpatch(ours)
    assert ours.config._attn_implementation == impl
    after = dict(ours.named_modules())
    assert list(after) == list(mods)
    for k, v in after.items():
        assert v is mods[k] and type(v) is classes[k], k
    stock.eval()
    ours.eval()
    ids, am = batch("right_pad")
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids, attention_mask=am)[0], stock(input_ids=ids, attention_mask=am)[0])


def test_at_least_thirty_families():
    patched_whole = [s for s in SPECS if s.attention_untouched is None]
    assert len(SPECS) >= 30 and len(patched_whole) >= 30
    assert len({s.model_type for s in SPECS}) == len(SPECS)


# ---- the docs table ---------------------------------------------------------------------------------


def _cell(keys):
    return ", ".join(f"`{k}`" for k in keys) if keys else "-"


def family_table() -> str:
    """The Markdown table of docs/hf.md, from patching every family in SPECS."""
    rows = ["| family (`model_type`) | attention | norms | activations | left untouched, and why |",
            "|---|---|---|---|---|"]
    for spec in SPECS:
        m = build_family(spec)
        s = nanguard.patch(m)
        norms = [k for k in s.patched if "Norm" in k]
        acts = [k for k in s.patched if "Norm" not in k and not k.startswith("attention")]
        attn = "safe_sdpa" if s.attn_implementation else "as is"
        why = s.skipped.get("attention", "-")
        if spec.note:
            attn += f" ({spec.note})"
        rows.append(f"| {spec.name} (`{spec.model_type}`) | {attn} | {_cell(norms)} | {_cell(acts)} | {why} |")
        nanguard.unpatch(m)
    return "\n".join(rows) + "\n"


_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hf.md"
_BEGIN, _END = "<!-- family table: begin -->\n", "<!-- family table: end -->\n"


def test_docs_table_is_the_generated_one():
    text = _DOC.read_text()
    assert _BEGIN in text and _END in text
    doc_table = text.split(_BEGIN, 1)[1].split(_END, 1)[0]
    assert doc_table == family_table(), "regenerate: python tests/python/test_hf_families.py --write"


if __name__ == "__main__":
    table = family_table()
    if "--write" in sys.argv:
        text = _DOC.read_text()
        head, rest = text.split(_BEGIN, 1)
        _, tail = rest.split(_END, 1)
        _DOC.write_text(head + _BEGIN + table + _END + tail)
    else:
        sys.stdout.write(table)
