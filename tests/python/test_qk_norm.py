"""nanguard.patch(model, qk_norm=True): per-head RMSNorm of q and k before
the scores, calibrated on the first forward.

Tolerances: the norm is nanguard's rms_norm (fp32 statistics) of fp32 rows
of head_dim 8-16; against an fp64 reference of the same formula rtol 1e-5
(a mean of 16 squares, a rsqrt and a product, each a few fp32 ulps). The
calibration's property (every dimension keeps its mean square over the
calibration batch) is a ratio of two fp32 means over a few hundred rows:
rtol 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nanguard
from nanguard.patching._qk_norm import EPS, QKNorm

RTOL = 1e-5


def _ref_norm(x: torch.Tensor, w: torch.Tensor, d: int) -> torch.Tensor:
    r = x.double().unflatten(-1, (-1, d))
    return (r / torch.sqrt(r.square().mean(-1, keepdim=True) + EPS) * w.double()).flatten(-2)


def test_qk_norm_module_matches_fp64_with_its_gradients():
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, 4 * 8, generator=g)).requires_grad_()
    n = QKNorm(8)
    y = n(x)
    assert bool(n.calibrated)
    torch.testing.assert_close(y.double(), _ref_norm(x.detach(), n.weight.detach(), 8), rtol=RTOL, atol=1e-6)
    # calibration: each dimension's mean square over the batch's rows (tokens and heads) is kept
    ms_in = x.detach().double().unflatten(-1, (-1, 8)).square().reshape(-1, 8).mean(0)
    ms_out = y.detach().double().unflatten(-1, (-1, 8)).square().reshape(-1, 8).mean(0)
    torch.testing.assert_close(ms_out, ms_in, rtol=1e-4, atol=0)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    xd = x.detach().double().requires_grad_()
    wd = n.weight.detach().double().requires_grad_()
    _ref_norm(xd, wd, 8).backward(gy.double())
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(n.weight.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)
    w = n.weight.detach().clone()
    n(5 * x.detach())  # calibrated once: a second batch does not move the weight
    assert torch.equal(n.weight.detach(), w)


def _llama(layers=2):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return T.LlamaForCausalLM(cfg)


def test_patch_adds_calibrated_norms_and_unpatch_removes_them():
    model = _llama()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).logits.detach()
    plain_model = copy.deepcopy(model)
    keys = set(model.state_dict())
    s = nanguard.patch(model, attention=False, norm=False, activation=False, qk_norm=True)
    assert s.patched == {"attention: qk-norm added (q_norm, k_norm)": 2}, str(s)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, QKNorm) and attn.q_norm.head_dim == 8 and attn.k_norm.head_dim == 8
    new = set(model.state_dict()) - keys
    assert new == {f"model.layers.{i}.self_attn.{n}_norm.{p}" for i in range(2) for n in "qk"
                   for p in ("weight", "calibrated")}
    out = model(input_ids=ids)
    assert torch.isfinite(out.logits).all() and bool(attn.q_norm.calibrated)
    # the calibrated weight changes the attention's output less than a weight of ones would
    ones = copy.deepcopy(model)
    for m in ones.modules():
        if isinstance(m, QKNorm):
            m.weight.data.fill_(1.0)

    def attn_out(m, plain=None):
        got = {}
        h = m.model.layers[1].self_attn.register_forward_hook(lambda mod, a, o: got.setdefault("o", o[0].detach()))
        m(input_ids=ids)
        h.remove()
        return got["o"]

    base = attn_out(plain_model)
    calibrated_change = (attn_out(model) - base).norm() / base.norm()
    ones_change = (attn_out(ones) - base).norm() / base.norm()
    assert calibrated_change < ones_change, (calibrated_change, ones_change)
    out.logits.sum().backward()
    assert attn.q_norm.weight.grad is not None and torch.isfinite(attn.q_norm.weight.grad).all()
    nanguard.unpatch(model)
    assert "q_norm" not in dict(model.model.layers[0].self_attn.named_children())
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_gpt2_fused_projection_and_with_the_attention_patch():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                           attn_implementation="eager")).eval()  # no dropout
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    ref = model(input_ids=ids).logits.detach()
    s = nanguard.patch(model, qk_norm=True)
    assert s.patched["attention: qk-norm added (q_norm, k_norm)"] == 2 and s.attn_implementation
    attn = model.transformer.h[0].attn
    # the hook's output: q and k normalised per head, v as it was
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        raw = torch.nn.functional.linear(x, attn.c_attn.weight.t(), attn.c_attn.bias)
        got = attn.c_attn(x)  # calibrates the norms on this batch
    torch.testing.assert_close(got[..., :32].double(), _ref_norm(raw[..., :32], attn.q_norm.weight, 8),
                               rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(got[..., 32:64].double(), _ref_norm(raw[..., 32:64], attn.k_norm.weight, 8),
                               rtol=RTOL, atol=1e-6)
    assert torch.equal(got[..., 64:], raw[..., 64:])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    nanguard.unpatch(model)
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)


def test_qk_norm_refusals_and_models_without_projections():
    with pytest.raises(TypeError, match="qk_norm"):
        nanguard.patch(torch.nn.Linear(2, 2), qk_norm=1)
    s = nanguard.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)), qk_norm=True)
    assert "qk_norm" in s.skipped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qk_norm_on_cuda_matches_fp64():
    x = torch.randn(2, 5, 32, device="cuda")
    n = QKNorm(8, device="cuda")
    y = n(x)
    torch.testing.assert_close(y.double().cpu(), _ref_norm(x.cpu(), n.weight.detach().cpu(), 8),
                               rtol=RTOL, atol=1e-6)
