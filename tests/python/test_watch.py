"""nanguard.watch: the watcher names the first non-finite module exactly
(forward, backward-only, parameter gradient, several NaNs -> first in
execution order), reads its buffer only at check() (no sync per module),
policies, sampling, filters, buffer growth, a forgotten step() (warned once,
memory bounded), in-place models and a Hugging Face model. The census op
itself is tested in test_tensor_stats.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanguard
from nanguard.diagnostics import BACKWARD, FORWARD, PARAM_GRAD, NonFiniteError

from conftest import requires_cuda, requires_kernels


# ---- watch: models ------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class NaNAfter(nn.Module):
    """Identity until armed, then writes NaN into its output."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        y = x * 1.0
        if self.armed:
            y = y.clone()
            y[..., 0] = math.nan
        return y


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * math.nan


class NaNInBackward(nn.Module):
    """Finite forward; its backward turns a finite gradient into NaN."""

    def forward(self, x):
        return _NaNGrad.apply(x)


def loss_of(model, x):
    return model(x).pow(2).mean()


def train_step(model, x, w=None):
    model.zero_grad(set_to_none=True)
    loss_of(model, x).backward()
    return w.check() if w is not None else None


def test_clean_model_reports_nothing():
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(5, 8)
    with nanguard.watch(m) as w:
        for _ in range(3):
            train_step(m, x)
            assert w.num_recorded > 0
            assert w.step() is None


def test_forward_nan_named_exactly():
    torch.manual_seed(0)
    m = Net()
    m.layers[2].act = NaNAfter()
    x = torch.randn(5, 8)
    w = nanguard.watch(m)
    train_step(m, x)
    assert w.step() is None
    m.layers[2].act.armed = True
    train_step(m, x)
    with pytest.raises(NonFiniteError) as ei:
        w.step()
    r = ei.value.report
    assert r.module == "layers.2.act"
    assert r.cls == "NaNAfter"
    assert r.pass_ == FORWARD
    assert r.step == 1
    assert r.tensor.nan == 5 and r.tensor.which == "output"
    assert [s.which for s in r.inputs] == ["input[0]"]
    assert r.inputs[0].finite
    assert "layers.2.act" in str(ei.value)
    w.remove()


def test_backward_only_nan_named_exactly():
    torch.manual_seed(0)
    m = Net()
    m.layers[1].fc = nn.Sequential(nn.Linear(16, 16), NaNInBackward())
    x = torch.randn(5, 8)
    w = nanguard.watch(m, policy="record")
    model_out = m(x)
    assert torch.isfinite(model_out).all()
    model_out.pow(2).mean().backward()
    r = w.check()
    assert r is not None
    assert r.module == "layers.1.fc.1"
    assert r.cls == "NaNInBackward"
    assert r.pass_ == BACKWARD
    assert r.tensor.nan > 0
    assert r.inputs and all(s.finite for s in r.inputs)  # its output gradient was finite
    assert w.records == [r]
    w.remove()


def test_first_in_execution_order_not_definition_order():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = NaNAfter()  # defined first, runs second
            self.b = NaNAfter()

        def forward(self, x):
            return self.a(self.b(x) + 1.0)

    m = Two()
    m.a.armed = m.b.armed = True
    with pytest.raises(NonFiniteError) as ei:
        with nanguard.watch(m):
            m(torch.randn(3, 4, requires_grad=True)).sum().backward()
    r = ei.value.report
    assert r.module == "b" and r.pass_ == FORWARD
    assert r.n_nonfinite > 1


def test_parameter_grad_only():
    class _BadWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, (g.t() @ x) * math.inf

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return _BadWeightGrad.apply(x, self.weight)

    m = nn.Sequential(nn.Linear(4, 4), Lin(), nn.Tanh())
    w = nanguard.watch(m, policy="record")
    m(torch.randn(2, 4)).sum().backward()
    r = w.check()
    assert r is not None and r.module == "1" and r.pass_ == PARAM_GRAD
    assert r.tensor.which == "weight.grad"
    w.remove()


def test_loss_nan_reports_root_output_gradient():
    m = Net()
    w = nanguard.watch(m, policy="record")
    out = m(torch.randn(3, 8))
    (out.sum() * math.nan).backward()
    r = w.check()
    # the model's output is the output of `out` (innermost first) and of the root
    assert r.module == "out" and r.pass_ == BACKWARD
    assert r.tensor.which == "grad of output"
    assert "outside the watched modules" in r.note
    w.remove()


def test_dict_and_model_output_outputs():
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return {"hidden": y, "aux": (y * 2, None), "logits": y.log()}  # log of negatives: NaN

    m = DictOut()
    with pytest.raises(NonFiniteError) as ei:
        with nanguard.watch(m, backward=False):
            torch.manual_seed(0)
            m(torch.randn(8, 4))
    r = ei.value.report
    assert r.module == "" and r.tensor.which == "output['logits']"


def test_external_neg_inf_mask_is_not_an_offence_but_nan_input_is():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    mask = nn.Transformer.generate_square_subsequent_mask(5)  # -inf above the diagonal
    with nanguard.watch(mha) as w:
        mha(x, x, x, attn_mask=mask)[0].sum().backward()
        assert w.check() is None
    x2 = x.clone()
    x2[0, 0, 0] = math.nan
    w = nanguard.watch(mha, policy="record")
    mha(x2, x2, x2, attn_mask=mask)
    r = w.check()
    assert r.pass_ == FORWARD and r.tensor.which.startswith("input") and "check_batch" in r.note
    w.remove()


def test_inplace_modules_keep_working():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))

    class AddInplace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            y.add_(1.0)
            return y

    m2 = nn.Sequential(AddInplace(), nn.Linear(4, 1))
    for model in (m, m2):
        with nanguard.watch(model) as w:
            model(torch.randn(3, 4)).sum().backward()
            assert w.check() is None


def test_inference_mode_and_no_grad():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), NaNAfter())
    w = nanguard.watch(m, policy="record")
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            m(torch.randn(2, 4))
        assert w.check() is None
    m[2].armed = True
    with torch.inference_mode():
        m(torch.randn(2, 4))
    assert w.check().module == "2"
    w.remove()


# ---- no sync per module ------------------------------------------------------------------


class ReadCounter:
    """Counts Python-level host reads of tensors (item, tolist, cpu, numpy,
    bool, float, int) while active."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "to")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapped(*a, __orig=orig, **k):
                self.n += 1
                return __orig(*a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


@requires_kernels  # the composite LayerNorm reads one flag per call on the CPU, by design
def test_cpu_buffer_read_only_at_check(monkeypatch):
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(5, 8)
    w = nanguard.watch(m)
    train_step(m, x)  # warm: the buffer grows in the first step
    w.step()
    counter = ReadCounter(monkeypatch)
    cap = dict(w.capacity)
    bufs = {d: b[0].data_ptr() for d, b in w._bufs.items()}
    for _ in range(2):
        m.zero_grad()
        loss_of(m, x).backward()
        assert counter.n == 0, "a tensor was read during forward/backward"
        assert w.num_recorded > 50
        w.step()
        assert counter.n >= 1  # the one read of the step
        counter.n = 0
    assert w.capacity == cap and {d: b[0].data_ptr() for d, b in w._bufs.items()} == bufs
    w.remove()


@requires_cuda
def test_cuda_no_sync_until_check():
    torch.manual_seed(0)
    m = Net().cuda()
    x = torch.randn(5, 8, device="cuda")
    w = nanguard.watch(m)
    train_step(m, x)
    w.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.zero_grad()
        loss_of(m, x).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert w.step() is None
    m.layers[0].fc.weight.data[0, 0] = math.inf
    train_step(m, x)
    with pytest.raises(NonFiniteError) as ei:
        w.step()
    assert ei.value.report.module == "layers.0.fc"
    w.remove()




def test_policies():
    m = nn.Sequential(nn.Linear(4, 4), NaNAfter())
    m[1].armed = True
    x = torch.randn(2, 4)
    w = nanguard.watch(m, policy="warn")
    m(x)
    with pytest.warns(RuntimeWarning, match="first non-finite value"):
        r = w.check()
    assert r.module == "1"
    w.remove()
    w = nanguard.watch(m, policy="record", max_records=2)
    for _ in range(4):
        m(x)
        w.step()
    assert len(w.records) == 2 and [r.step for r in w.records] == [0, 1]
    w.remove()
    with pytest.raises(ValueError, match="policy"):
        nanguard.watch(m, policy="explode")
    with pytest.raises(ValueError, match="every"):
        nanguard.watch(m, every=0)
    with pytest.raises(TypeError, match="nn.Module"):
        nanguard.watch(lambda x: x)


def test_every_n_steps():
    m = Net()
    x = torch.randn(2, 8)
    w = nanguard.watch(m, every=3, policy="record")
    seen = []
    for _ in range(7):
        train_step(m, x)
        seen.append(w.num_recorded > 0)
        w.step()
    assert seen == [True, False, False, True, False, False, True]
    w.remove()


def test_module_filters():
    m = Net()
    w = nanguard.watch(m, modules=["layers.*.fc"])
    assert w.watched == [f"layers.{i}.fc" for i in range(4)]
    w.remove()
    w = nanguard.watch(m, modules=nn.LayerNorm)
    assert w.watched == [f"layers.{i}.norm" for i in range(4)]
    w.remove()
    m.layers[3].act = NaNAfter()
    m.layers[3].act.armed = True
    w = nanguard.watch(m, modules=[nn.Linear, "layers.3.norm"], policy="record")
    m(torch.randn(2, 8))
    r = w.check()
    assert r.module == "layers.3.norm"  # the first watched module that saw it
    w.remove()


def test_buffer_grows_geometrically_then_stays():
    m = Net()
    x = torch.randn(2, 8)
    w = nanguard.watch(m, capacity=4)
    train_step(m, x)
    n = w.num_recorded
    cap = w.capacity[torch.device("cpu")]
    assert cap >= n and cap < 2 * n and cap & (cap - 1) == 0
    w.step()
    for _ in range(3):
        train_step(m, x)
        w.step()
    assert w.capacity[torch.device("cpu")] == cap
    w.remove()


def test_remove_and_context_manager():
    m = Net()
    w = nanguard.watch(m)
    assert any(mod._forward_hooks for mod in m.modules())
    w.remove()
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
    m.layers[0].act = NaNAfter()
    m.layers[0].act.armed = True
    m(torch.randn(2, 8))  # no watcher: nothing raised
    with pytest.raises(NonFiniteError):
        with nanguard.watch(m):
            m(torch.randn(2, 8))
    assert not any(mod._forward_hooks for mod in m.modules())
    # an exception inside the block is not masked by the watcher
    with pytest.raises(KeyError):
        with nanguard.watch(m):
            m(torch.randn(2, 8))
            raise KeyError("user error")


def test_optimizer_step_checks_first():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = nanguard.watch(m, optimizer=opt)
    train_step(m, torch.randn(2, 8))
    opt.step()
    assert w.step_index == 1
    m.layers[1].act = NaNAfter()
    m.layers[1].act.armed = True
    before = m.out.weight.detach().clone()
    train_step(m, torch.randn(2, 8))
    with pytest.raises(NonFiniteError):
        opt.step()
    assert torch.equal(m.out.weight, before)  # the poisoned step was not applied
    w.remove()
    w = nanguard.watch(m, optimizer=opt, policy="record")
    train_step(m, torch.randn(2, 8))
    opt.step()  # recorded, not raised
    assert len(w.records) == 1 and w.records[0].module == "layers.1.act"
    w.remove()


def _sgd_steps(m, opt, n, x, w=None):
    """n training steps; w.step() after each when w is given."""
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss_of(m, x).backward()
        if w is not None:
            w.step()
        opt.step()


def test_forgotten_step_warns_once_and_memory_stays_bounded(recwarn):
    """Training with no w.step() at all: one warning, at the second forward
    after an optimizer step, naming what to call; the records and the
    buffer stay at about one step's (they grew with every step)."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    w = nanguard.watch(m, capacity=4)  # the buffer doubles as records come
    _sgd_steps(m, opt, 1, x)
    one_step = w.num_recorded
    assert one_step > 50
    assert not [r for r in recwarn if "w.step()" in str(r.message)]
    _sgd_steps(m, opt, 30, x)
    forgot = [r for r in recwarn if "w.step()" in str(r.message)]
    assert len(forgot) == 1 and issubclass(forgot[0].category, RuntimeWarning)
    assert "once per training step" in str(forgot[0].message)
    assert w.num_recorded == one_step  # the current step's records only
    assert w.capacity[torch.device("cpu")] < 2 * one_step
    assert w.check() is None  # every step was finite
    w.remove()


def test_forgotten_step_keeps_the_first_report_for_check():
    """The automatic checks of a forgotten step() lose nothing: the first
    non-finite tensor (step 3 of 8) is reported at the next check, with the
    count of every non-finite tensor since."""
    torch.manual_seed(0)
    m = Net()
    m.layers[2].act = NaNAfter()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # lr 0: NaN grads leave the weights finite
    x = torch.randn(4, 8)
    w = nanguard.watch(m, policy="record")
    with pytest.warns(RuntimeWarning, match="w.step"):
        _sgd_steps(m, opt, 3, x)
        m.layers[2].act.armed = True
        _sgd_steps(m, opt, 1, x)
        m.layers[2].act.armed = False
        with torch.no_grad():  # a parameter update without a step(): the detection
            m.out.bias.add_(0.0)
        _sgd_steps(m, opt, 4, x)
    assert w.num_recorded < 200
    r = w.check()
    assert r is not None and r.module == "layers.2.act" and r.pass_ == FORWARD
    assert r.n_nonfinite > 1
    assert w.check() is None
    w.remove()


def test_gradient_accumulation_and_eval_do_not_warn(recwarn):
    """Many forwards per step without a parameter change (gradient
    accumulation, an evaluation loop under no_grad) are no forgotten step:
    no warning; the records of a long evaluation loop are checked by the
    watcher itself, so they stay bounded too."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    w = nanguard.watch(m, optimizer=opt)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(8):  # 8 micro-batches per optimizer step
            loss_of(m, x).backward()
        opt.step()  # calls w.step() first
    per_forward = 0
    with torch.no_grad():
        for i in range(300):
            m(x)
            if i == 0:
                per_forward = w.num_recorded
            assert w.num_recorded <= 70 * per_forward
    assert not [r for r in recwarn if "w.step()" in str(r.message)]
    assert w.step() is None
    w.remove()


# ---- Hugging Face -------------------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_clean_and_named_layer():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 10))
    w = nanguard.watch(model)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert w.step() is None
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(NonFiniteError) as ei:
        w.step()
    r = ei.value.report
    assert r.module == "model.layers.1.mlp.down_proj" and r.pass_ == FORWARD
    assert r.cls == "Linear"
    w.remove()


def test_paused_watcher_records_nothing_and_counts_no_forward():
    """Watch.paused(): the model runs outside the step (an evaluation, or
    Rewind's test) and the step's records are untouched: a NaN computed
    inside is not reported, the forward count does not move."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    w = nanguard.watch(model)
    model(torch.randn(2, 4)).sum().backward()
    n = w._forwards
    with w.paused():
        model(torch.full((2, 4), float("nan"))).sum().backward()
    assert w._forwards == n
    assert w.step() is None  # the NaN forward inside paused() left no record
    model(torch.full((2, 4), float("nan"))).sum().backward()
    with pytest.raises(nanguard.NonFiniteError):
        w.step()  # and watching goes on after it
    w.remove()
