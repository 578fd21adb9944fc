"""nanguard.warmup and nanguard.rescale_residual_init: the two stability
levers that are helpers rather than ops (exact arithmetic: the tests compare
with ==)."""

from __future__ import annotations

import math

import pytest
import torch

import nanguard


def test_warmup_ramps_linearly_then_holds():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.4)
    sched = nanguard.warmup(opt, 4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4], rel=1e-12)
    with pytest.raises(ValueError, match="steps"):
        nanguard.warmup(opt, 0)
    with pytest.raises(TypeError, match="optimizer"):
        nanguard.warmup("sgd", 3)


def test_rescale_residual_init_scales_the_residual_projections_only():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, max_position_embeddings=32)
    model = T.LlamaForCausalLM(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert nanguard.rescale_residual_init(model) == 6  # o_proj and down_proj of 3 layers
    f = 1.0 / math.sqrt(6)
    for k, v in model.state_dict().items():
        want = before[k] * f if k.endswith(("o_proj.weight", "down_proj.weight")) else before[k]
        assert torch.equal(v, want), k
    assert nanguard.rescale_residual_init(model, n_layers=1) == 6
    with pytest.raises(ValueError, match="no residual output projection"):
        nanguard.rescale_residual_init(torch.nn.Linear(2, 2), n_layers=2)
    with pytest.raises(ValueError, match="n_layers"):
        nanguard.rescale_residual_init(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="n_layers"):
        nanguard.rescale_residual_init(model, n_layers=0)
