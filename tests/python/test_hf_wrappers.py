"""nanguard.patch / unpatch find the model inside the wrappers training code
puts around it: peft (LoRA, unmerged and merged), torch.compile, DDP, FSDP2
(``fully_shard``) and accelerate. Each case checks that the patched code
really runs (or the same numbers as stock in fp32), that LoRA gradients equal
stock's, and that unpatch gives back the same objects and classes.

DDP and FSDP2 run in this process as a one-rank gloo group on the CPU.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn

import nanguard
from nanguard.patching import unwrap

from conftest import TOLERANCES

T = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it for CI)")

TOL_LOGITS = TOLERANCES["hf_logits"][torch.float32]
TOL_GRADS = TOLERANCES["hf_grads"][torch.float32]
VOCAB = 64


def build():
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attention_dropout=0.0))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


def batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (3, 8), generator=g)
    am = torch.ones(3, 8, dtype=torch.long)
    am[1, :3] = 0
    am[2, 6:] = 0
    return ids, am


def _close(a, b, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _snapshot(model):
    return {k: (v, type(v)) for k, v in model.named_modules()}


def _assert_restored(model, snap, impl):
    now = dict(model.named_modules())
    assert list(now) == list(snap)
    for k, (v, cls) in snap.items():
        assert now[k] is v and type(now[k]) is cls, k
    inner, _ = unwrap(model)
    assert inner.config._attn_implementation == impl


def _logits(model, ids, am):
    return model(input_ids=ids, attention_mask=am).logits


# ---- peft -------------------------------------------------------------------------------------------

peft = None


def _peft():
    global peft
    peft = pytest.importorskip("peft", reason="pip install peft (scripts/setup.sh installs it for CI)")
    return peft


def _lora(model):
    p = _peft()
    return p.get_peft_model(model, p.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def test_peft_lora_unmerged_gradients_equal_stock():
    stock = _lora(build())
    # LoRA B starts at zero (so A's gradient would be zero): move it
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ours = copy.deepcopy(stock)
    snap, impl = _snapshot(ours), unwrap(ours)[0].config._attn_implementation
    s = nanguard.patch(ours)
    assert s.wrappers and s.wrappers[0] == "PeftModel", str(s)
    assert s.attn_implementation == (impl, "nanguard") and s.patched["LlamaRMSNorm -> StableLlamaRMSNorm"] == 5
    assert nanguard.patch(ours) is s  # patching again with the same options changes nothing
    ids, am = batch()
    valid = am.bool()
    l0, l1 = _logits(stock, ids, am), _logits(ours, ids, am)
    _close(l1[valid], l0[valid], TOL_LOGITS, "lora logits")
    lora0 = [(n, p) for n, p in stock.named_parameters() if p.requires_grad]
    lora1 = [p for n, p in ours.named_parameters() if p.requires_grad]
    assert lora0 and all("lora_" in n for n, _ in lora0)
    g0 = torch.autograd.grad(l0[valid].square().mean(), [p for _, p in lora0])
    g1 = torch.autograd.grad(l1[valid].square().mean(), lora1)
    for (n, _), a, b in zip(lora0, g0, g1):
        assert a.abs().max() > 0, n
        _close(b, a, TOL_GRADS, f"grad of {n}")
    nanguard.unpatch(ours)
    _assert_restored(ours, snap, impl)


def test_peft_lora_merged_and_unloaded():
    stock = _lora(build())
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)
    stock.merge_adapter()  # merged, still wrapped
    ours = copy.deepcopy(stock)
    snap = _snapshot(ours)
    s = nanguard.patch(ours)
    assert s.patched["LlamaRMSNorm -> StableLlamaRMSNorm"] == 5
    ids, am = batch()
    valid = am.bool()
    _close(_logits(ours, ids, am)[valid], _logits(stock, ids, am)[valid], TOL_LOGITS, "merged logits")
    nanguard.unpatch(ours)
    _assert_restored(ours, snap, "sdpa")
    plain = ours.merge_and_unload()  # back to a LlamaForCausalLM
    s = nanguard.patch(plain)
    assert not s.wrappers and s.attn_implementation is not None
    nanguard.unpatch(plain)


# ---- torch.compile ------------------------------------------------------------------------------------


def test_torch_compile_optimized_module():
    m = build().eval()
    ids, am = batch()
    with torch.no_grad():
        ref = _logits(m, ids, am)
        clamped_model = build().eval()
        nanguard.patch(clamped_model, max_score=1e-3)  # visibly different scores: proves the patched code runs
        clamped = _logits(clamped_model, ids, am)
    assert (clamped - ref).abs().max() > 1e-4
    # dynamo's tracing and guards are what a patch must get through; the
    # "eager" backend skips inductor's code generation (minutes on 2 cores)
    c = torch.compile(m, backend="eager")
    snap = _snapshot(m)
    with torch.no_grad():
        _close(_logits(c, ids, am), ref, TOL_LOGITS, "compiled stock")
        s = nanguard.patch(c, max_score=1e-3)
        assert s.wrappers == ["OptimizedModule"]
        _close(_logits(c, ids, am), clamped, TOL_LOGITS, "compiled patched")
        nanguard.unpatch(c)
        _close(_logits(c, ids, am), ref, TOL_LOGITS, "compiled after unpatch")
    _assert_restored(m, snap, "sdpa")


def test_patched_model_compiles_fullgraph():
    """A patched model traces as one graph (no graph break at the norms'
    or the attention's custom ops), forward and backward: aot_eager runs
    AOTAutograd's joint trace without inductor's code generation."""
    ours = build().train()
    nanguard.patch(ours)
    ids, am = batch()
    valid = am.bool()
    ref = _logits(ours, ids, am)
    ref_grads = torch.autograd.grad(ref[valid].square().mean(), list(ours.parameters()))
    c = torch.compile(ours, backend="aot_eager", fullgraph=True)
    out = _logits(c, ids, am)
    _close(out[valid], ref[valid], TOL_LOGITS, "fullgraph logits")
    grads = torch.autograd.grad(out[valid].square().mean(), list(ours.parameters()))
    for (n, _), a, b in zip(ours.named_parameters(), ref_grads, grads):
        _close(b, a, TOL_GRADS, f"fullgraph grad of {n}")
    nanguard.unpatch(ours)


# ---- DDP and FSDP2 (one rank, gloo, CPU) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def process_group():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = False
    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="nanguard_pg_")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        created = True
    yield dist
    if created:
        dist.destroy_process_group()


def test_ddp(process_group):
    stock = build()
    ours = nn.parallel.DistributedDataParallel(copy.deepcopy(stock))
    snap = _snapshot(ours)
    s = nanguard.patch(ours)
    assert s.wrappers == ["DistributedDataParallel"] and s.attn_implementation is not None
    ids, am = batch()
    valid = am.bool()
    l0, l1 = _logits(stock, ids, am), _logits(ours, ids, am)
    _close(l1[valid], l0[valid], TOL_LOGITS, "ddp logits")
    l0[valid].square().mean().backward()
    l1[valid].square().mean().backward()  # DDP's reducer all-reduces these
    for (n, a), b in zip(stock.named_parameters(), ours.module.parameters()):
        _close(b.grad, a.grad, TOL_GRADS, f"ddp grad of {n}")
    nanguard.unpatch(ours)
    _assert_restored(ours, snap, "sdpa")


def test_fsdp2_fully_shard(process_group):
    from torch.distributed.fsdp import fully_shard

    stock = build()
    ours = copy.deepcopy(stock)
    for layer in ours.model.layers:
        fully_shard(layer)
    fully_shard(ours)
    snap = _snapshot(ours)
    s = nanguard.patch(ours)
    assert s.attn_implementation is not None and s.patched["LlamaRMSNorm -> StableLlamaRMSNorm"] == 5
    assert type(ours.model.layers[0].input_layernorm).__name__ == "StableLlamaRMSNorm"
    ids, am = batch()
    valid = am.bool()
    l0, l1 = _logits(stock, ids, am), _logits(ours, ids, am)
    _close(l1[valid], l0[valid], TOL_LOGITS, "fsdp2 logits")
    l0[valid].square().mean().backward()
    l1[valid].square().mean().backward()
    for (n, a), b in zip(stock.named_parameters(), ours.parameters()):
        got = b.grad.full_tensor() if hasattr(b.grad, "full_tensor") else b.grad
        _close(got, a.grad, TOL_GRADS, f"fsdp2 grad of {n}")
    nanguard.unpatch(ours)
    _assert_restored(ours, snap, "sdpa")


# ---- accelerate ------------------------------------------------------------------------------------------


def test_accelerate_prepared_model_trains_in_bf16():
    accelerate = pytest.importorskip("accelerate", reason="pip install accelerate (scripts/setup.sh installs it)")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one process-wide state: start clean, leave clean
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm, opt = acc.prepare(model, opt)
    snap = _snapshot(pm)
    s = nanguard.patch(pm)
    assert s.attn_implementation is not None and s.patched["LlamaRMSNorm -> StableLlamaRMSNorm"] == 5
    ids, am = batch()
    for _ in range(2):
        out = pm(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
        assert torch.isfinite(out.loss)
        acc.backward(out.loss)
        acc.clip_grad_norm_(pm.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in pm.parameters())
    nanguard.unpatch(pm)
    _assert_restored(pm, snap, "sdpa")
    AcceleratorState._reset_state(True)


def test_unwrap_and_bad_input():
    m = build()
    assert unwrap(m) == (m, [])
    with pytest.raises(TypeError, match="model must be"):
        unwrap("not a model")
    with pytest.raises(TypeError, match="unpatch expects"):
        nanguard.unpatch("not a model")
    with pytest.raises(TypeError, match="attention must be a bool"):
        nanguard.patch(m, attention="yes")


def test_module_of_the_users_holding_a_transformers_model():
    """A module of the user's (a LightningModule, a model with a custom head)
    that holds transformers models: their attention is patched too."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = build()
            self.head = nn.Linear(VOCAB, 2)

        def forward(self, ids, am):
            return self.head(self.lm(input_ids=ids, attention_mask=am).logits)

    stock = Head()
    ours = copy.deepcopy(stock)
    snap = _snapshot(ours)
    s = nanguard.patch(ours)
    assert s.attn_implementation == ("sdpa", "nanguard") and ours.lm.config._attn_implementation == "nanguard"
    assert s.patched["attention (sdpa -> nanguard, safe_sdpa) in lm"] == 2, str(s)
    ids, am = batch()
    valid = am.bool()
    _close(ours(ids, am)[valid], stock(ids, am)[valid], TOL_LOGITS, "head logits")
    nanguard.unpatch(ours)
    now = dict(ours.named_modules())
    assert list(now) == list(snap) and all(now[k] is v and type(now[k]) is c for k, (v, c) in snap.items())
    assert ours.lm.config._attn_implementation == "sdpa"
