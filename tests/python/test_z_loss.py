"""nanguard.z_loss against an fp64 reference, its gradient, its mask, and the
callbacks' z_loss= option.

Tolerance: log Z is accumulated in fp32 from inputs that the fp64 reference
reads as the same (rounded) values: logsumexp over V = 50 terms is within a
few fp32 ulps (6e-8 relative) of fp64, its square and the mean over rows
double that; rtol 1e-5 leaves room. Gradients (2 * coeff * log Z *
softmax / n) are one fp32 softmax and a product: rtol 1e-5, atol 1e-9
(entries of size coeff / n ~ 1e-6 with a few ulps of absolute error); for
fp16 / bf16 logits the gradient is rounded to their dtype: rtol 1e-2 (bf16's
2^-8 = 3.9e-3, with room for the fp32 error before the rounding).
"""

from __future__ import annotations

import math

import pytest
import torch

import nanguard
from nanguard import z_loss

RTOL, ATOL_GRAD = 1e-5, 1e-9


def _ref(logits: torch.Tensor, coeff: float, mask=None) -> torch.Tensor:
    x = logits.detach().double()
    if mask is not None:
        x = x[mask]
    lz = torch.log(torch.exp(x - x.amax(-1, keepdim=True)).sum(-1)) + x.amax(-1)
    return coeff * (lz * lz).sum() / max(lz.numel(), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_value_and_gradient_match_fp64(dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 7, 50, generator=g)).to(dtype).requires_grad_()
    z = z_loss(x, 1e-3)
    assert z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and z.dim() == 0
    assert float(z) == pytest.approx(float(_ref(x, 1e-3)), rel=RTOL)
    z.backward()
    xd = x.detach().double().requires_grad_()
    _ref_grad = torch.autograd.grad(1e-3 * torch.logsumexp(xd, -1).pow(2).mean(), xd)[0]
    torch.testing.assert_close(x.grad.double(), _ref_grad.to(x.grad.dtype).double(),
                               rtol=RTOL if dtype in (torch.float32, torch.float64) else 1e-2, atol=ATOL_GRAD)


def test_gradcheck_fp64():
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True, False]] * 3)
    assert torch.autograd.gradcheck(lambda t: z_loss(t, 0.1), (x,))
    assert torch.autograd.gradcheck(lambda t: z_loss(t, 0.1, mask=mask), (x,))


def test_large_logits_stay_finite_where_the_naive_formula_overflows():
    x = torch.tensor([[1e4, 0.0, -1e4], [60000.0, 65504.0, 0.0]])
    naive = torch.log(torch.exp(x).sum(-1))
    assert torch.isinf(naive).all()
    z = z_loss(x, 1.0)
    assert torch.isfinite(z) and float(z) == pytest.approx(float(_ref(x, 1.0)), rel=RTOL)
    assert torch.isfinite(z_loss(x.half(), 1.0))  # fp16 logits at fp16's top, log Z in fp32


def test_mask_selects_rows_and_a_masked_nan_row_gets_zero_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, generator=g)
    x[1, 3] = math.nan  # a padding row with garbage in it
    x.requires_grad_()
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    z = z_loss(x, 1e-2, mask=mask)
    assert torch.isfinite(z) and float(z) == pytest.approx(float(_ref(x, 1e-2, mask)), rel=RTOL)
    z.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1, 3] == 0).all()
    assert float(z_loss(x, 1e-2, mask=torch.zeros(2, 4, dtype=torch.bool))) == 0.0


def test_nan_logits_give_nan():
    x = torch.randn(2, 5)
    x[0, 1] = math.nan
    assert torch.isnan(z_loss(x))
    x[0, 1] = math.inf
    assert not torch.isfinite(z_loss(x))


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="logits"):
        z_loss(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="logits"):
        z_loss([1.0, 2.0])
    with pytest.raises(ValueError, match="logits"):
        z_loss(torch.ones(()))
    for coeff in (-1.0, math.inf, True, "1e-4"):
        with pytest.raises(ValueError, match="coeff"):
            z_loss(torch.ones(2, 3), coeff)
    with pytest.raises(TypeError, match="mask"):
        z_loss(torch.ones(2, 3), mask=torch.ones(2))
    with pytest.raises(ValueError, match="mask"):
        z_loss(torch.ones(2, 3), mask=torch.ones(3, dtype=torch.bool))
    assert nanguard.functional.z_loss is z_loss


def test_compiles_fullgraph():
    x = torch.randn(2, 3, 11)
    f = torch.compile(lambda t: z_loss(t, 1e-4), fullgraph=True, backend="aot_eager")
    assert float(f(x)) == pytest.approx(float(z_loss(x, 1e-4)), rel=RTOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_fp64():
    x = torch.randn(4, 6, 50, device="cuda", dtype=torch.float16)
    assert float(z_loss(x, 1e-3)) == pytest.approx(float(_ref(x.cpu(), 1e-3)), rel=RTOL)


# ---- the callbacks' z_loss= -------------------------------------------------------------------


def test_z_loss_hook_adds_to_a_transformers_models_loss():
    from test_integrations import _llama
    from nanguard.integrations._guard import ZLoss

    T, model = _llama()
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    plain = model(input_ids=ids, labels=ids, attention_mask=am)
    z = ZLoss(1e-4)
    z.attach(model)
    out = model(input_ids=ids, labels=ids, attention_mask=am)
    want = plain.loss + z_loss(plain.logits, 1e-4, mask=am.bool())
    assert torch.equal(out.loss, want) and float(z.last) > 0
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    z.detach()
    assert torch.equal(model(input_ids=ids, labels=ids, attention_mask=am).loss, plain.loss)
    with pytest.raises(ValueError, match="z_loss"):
        ZLoss(0.0)


def test_trainer_callback_logs_its_z_loss(tmp_path):
    from test_integrations import _llama, _NaNAtCollator, _trainer
    from nanguard.integrations.transformers import NanguardCallback

    pytest.importorskip("accelerate.state").AcceleratorState._reset_state(True)
    T, model = _llama()
    cb = NanguardCallback(z_loss=1e-4)
    trainer = _trainer(T, model, tmp_path, [cb], _NaNAtCollator(32, at=None), max_steps=2)
    trainer.train()
    lines = [e for e in trainer.state.log_history if "loss" in e]
    assert len(lines) == 2 and all(e["nanguard_z_loss"] > 0 for e in lines)
    assert not model._forward_hooks  # detached at the end
    with pytest.raises(ValueError, match="z_loss"):
        NanguardCallback(z_loss=-1)


def test_lightning_callback_logs_its_z_loss():
    L = pytest.importorskip("lightning.pytorch", reason="pip install lightning (scripts/setup.sh installs it)")
    from test_integrations import BATCH, _llama, _lm_module, _NaNAtCollator, _Rows
    from nanguard.integrations.lightning import NanguardCallback

    T, lm = _llama()
    loader = torch.utils.data.DataLoader(_Rows(BATCH * 2), batch_size=BATCH, collate_fn=_NaNAtCollator(32, at=None))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[NanguardCallback(z_loss=1e-4)])
    trainer.fit(_lm_module(L, lm), loader)
    assert trainer.callback_metrics["nanguard/z_loss"].item() > 0
    assert not lm._forward_hooks
