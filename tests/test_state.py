"""In-place state updates inside ``forward`` replayed exactly: ``Plan.fp32`` trains bitwise like eager, buffers included.

A buffer counter, an EMA buffer updated under ``no_grad``, a weight rescaled in
place under ``no_grad``, BatchNorm's ``num_batches_tracked`` and running
statistics, and BatchNorm with ``momentum=None`` (a cumulative average, whose
factor ``1 / num_batches_tracked`` is a Python float read at run time): three
SGD steps through the planned module and through an eager copy must give the
same outputs and the same parameters and buffers, bit for bit.
"""

import copy

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.analysis import analyze_graph
from compfx.planned_module import PlannedModule
from compfx.graph_capture import capture
from compfx.errors import CaptureError

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


class Counter(nn.Module):
    """Counts its calls and keeps an EMA of its output mean: two buffers written in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.seen.add_(1)
        y = self.fc(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y + self.ema


class Rescale(nn.Module):
    """Shrinks its own weight in place before using it (weight decay done by hand)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.mul_(0.99)
        return self.fc(x)


class AugmentedCounter(nn.Module):
    """Counts its calls with ``+=``: in place in eager, a new tensor for a proxy."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += 1
        return self.fc(x) * self.seen


def spectral_norm():
    """Power iteration on buffers in forward: ``self._u = F.normalize(..., out=self._u)``, an in-place
    write that a proxy turns into a reassignment."""
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 4))


def batch_norm(momentum):
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Linear(8, 2))


MODELS = {"counter": Counter, "rescale": Rescale, "batch_norm": lambda: batch_norm(0.1),
          "batch_norm_momentum_none": lambda: batch_norm(None), "augmented_counter": AugmentedCounter,
          "spectral_norm": spectral_norm}
#: (model, method): methods that cannot capture the model, with what the error must say
CANNOT = {("batch_norm_momentum_none", "record"): "__float__", ("batch_norm_momentum_none", "dynamo"): "dynamo",
          ("augmented_counter", "symbolic"): "assigns new tensors to seen",
          ("spectral_norm", "symbolic"): "assigns new tensors to 0.parametrizations.weight.0._u"}


def _train_side_by_side(planned: nn.Module, model: nn.Module, eager: nn.Module, steps: int = 3, sizes=(8, 8, 8)):
    """``steps`` SGD steps on both; asserts equal outputs at every step, returns nothing."""
    opt_planned = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(sizes[step], 4, generator=g)
        outputs = []
        for module, opt in ((planned, opt_planned), (eager, opt_eager)):
            opt.zero_grad()
            out = module(x)
            out.square().mean().backward()
            opt.step()
            outputs.append(out.detach())
        assert torch.equal(*outputs), f"outputs differ at step {step}"


def _assert_same_state(model: nn.Module, eager: nn.Module):
    got, want = model.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{name} differs"


@pytest.mark.parametrize("method", ["auto", "symbolic", "record", "dynamo"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_plan_trains_bitwise_like_eager_buffers_included(name, method):
    torch.manual_seed(0)
    model = MODELS[name]()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 4)
    if (name, method) in CANNOT:
        with pytest.raises(CaptureError, match=CANNOT[(name, method)]):
            capture(model, x, method=method)
        _assert_same_state(model, eager)  # the failed trace left none of its proxies in the model
        assert all(type(t) in (torch.Tensor, nn.Parameter) for t in model.state_dict(keep_vars=True).values())
        return
    analysis = analyze_graph(capture(model, x, method=method), device=torch.device("cpu"), low_dtype=torch.bfloat16)
    before = copy.deepcopy(model.state_dict())
    planned = compfx.apply(model, compfx.Plan.fp32(analysis), analysis=analysis)
    _assert_same_state(model, eager)  # capturing and applying ran nothing on the model's tensors
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    _train_side_by_side(planned, model, eager)
    _assert_same_state(model, eager)
    if name in ("counter", "augmented_counter"):
        assert int(model.seen) == 3
    if name.startswith("batch_norm"):
        assert int(model[1].num_batches_tracked) == 3


def test_momentum_none_batch_norm_is_one_op_with_the_traced_batch_norms_key():
    model = batch_norm(None)
    gm = capture(model, torch.randn(8, 4))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["1"]
    assert str(compfx.graph_capture.op_nodes(gm)[1].meta["compfx_key"]) == "1:batch_norm#0"
    assert [str(k) for k in compfx.analyze(batch_norm(0.1), torch.randn(8, 4)).keys] == [
        str(n.meta["compfx_key"]) for n in compfx.graph_capture.op_nodes(gm)]
    model.eval()  # in eval mode it reads no buffer into Python: traced through like any batch norm
    assert not [n for n in capture(model, torch.randn(8, 4)).graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_planned_module_replays_state_across_batch_sizes(name):
    """Through PlannedModule a new batch size captures the model again; capturing must not step the counters."""
    torch.manual_seed(0)
    model = MODELS[name]()
    eager = copy.deepcopy(model)
    analysis = compfx.analyze(model, torch.randn(8, 4))
    planned = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    _train_side_by_side(planned, model, eager, sizes=(8, 5, 3))
    _assert_same_state(model, eager)
    assert len(planned.specializations) == 2


def test_optimize_keeps_buffer_updates_and_restores_them_between_samples():
    """The search trains samples from one state: buffers written in forward are part of it."""
    torch.manual_seed(0)
    model = Counter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    loader.append((torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)))  # a ragged last batch
    result = compfx.optimize(model, loader, optimizer=opt,
                             loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[-1]),
                             config=compfx.SearchConfig(progress=False, repeats=1, warmup=0, cache_plan=False,
                                                        keep_search_training=False))
    assert int(model.seen) == 0 and torch.equal(model.ema, torch.zeros(4)), "restored to the state before the search"
    result.module(torch.randn(6, 4))
    assert int(model.seen) == 1


class KeepsLastHidden(nn.Module):
    """Stores an activation on itself in forward, as feature-extraction code does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.last_hidden = self.fc(x).relu()
        return self.last_hidden.sum(-1)


@pytest.mark.parametrize("method", ["symbolic", "record", "dynamo"])
def test_no_tracer_value_stays_in_the_model(method):
    """A tensor forward assigns to an attribute is the tracer's proxy or FakeTensor while tracing; capture takes
    it back (the next eager forward, or pickling the model, would meet it otherwise)."""
    model = KeepsLastHidden()
    with pytest.warns(UserWarning, match="stores tensors in last_hidden"):
        capture(model, torch.randn(3, 4), method=method)
    assert "last_hidden" not in vars(model)
    model.last_hidden = kept = torch.zeros(1)
    with pytest.warns(UserWarning, match="stores tensors in last_hidden"):
        capture(model, torch.randn(3, 4), method=method)
    assert model.last_hidden is kept


class KeepsAuxLoss(nn.Module):
    """Keeps an auxiliary loss on a submodule, for the training loop to add (as mixture-of-experts layers do)."""

    def __init__(self):
        super().__init__()
        self.router, self.fc = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        self.router.aux = (self.router(x).softmax(-1) ** 2).mean()
        return self.fc(x)


def test_capture_warns_that_a_stored_tensor_is_not_stored_by_the_graph():
    """The planned module computes the aux loss but never stores it: a loop reading ``router.aux`` would add a stale
    value each step. Capture says so, naming the attribute."""
    model = KeepsAuxLoss()
    with pytest.warns(UserWarning, match=r"stores tensors in router\.aux.*stale"):
        analysis = compfx.analyze(model, torch.randn(3, 4))
    before = model.router.aux  # the capture check's eager run stored one
    PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)(torch.randn(3, 4))
    assert model.router.aux is before


def test_capture_warns_that_a_submodules_hooks_will_not_run_and_spectral_norm_is_quiet(recwarn):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    with pytest.warns(UserWarning, match=r"module\(s\) 0 of Sequential have forward or backward hooks"):
        analysis = compfx.analyze(model, torch.randn(3, 4))
    calls = len(seen)
    PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)(torch.randn(3, 4))
    assert len(seen) == calls  # what the warning is about: the planned module runs no hook
    recwarn.clear()
    compfx.analyze(nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.ReLU()), torch.randn(3, 4))
    assert not [w for w in recwarn if "hooks" in str(w.message) or "stores tensors" in str(w.message)]


def test_a_leaf_modules_hooks_run_and_are_not_warned_about(recwarn):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    gm = capture(model, torch.randn(3, 4), method="symbolic", leaf_modules=["0"])
    assert not [w for w in recwarn if "hooks" in str(w.message)]
    calls = len(seen)
    gm(torch.randn(3, 4))
    assert len(seen) == calls + 1


class RenormedLookup(nn.Module):
    """An embedding with ``max_norm``: each lookup renormalises the rows it reads, in place, in the parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4, max_norm=1.0)
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # every row longer than max_norm

    def forward(self, ids):
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("method", ["symbolic", "record", "dynamo"])
def test_an_embedding_with_max_norm_renorms_the_parameter_itself(method):
    """The renorm writes the weight: a plan never hands the lookup a cast copy (the parameter would keep its long
    rows), and the capture check puts the rows it renormalised back."""
    torch.manual_seed(0)
    model = RenormedLookup()
    eager = copy.deepcopy(model)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    analysis = compfx.analyze(model, ids, method=method)
    _assert_same_state(model, eager)  # the check's eager run renormalised rows 0-5, and put them back
    low = compfx.Plan.from_bitstring(analysis, "0" * len(analysis.keys))
    PlannedModule(model, low, analysis=analysis)(ids)
    eager(ids)
    assert torch.equal(model.emb.weight, eager.emb.weight)
    assert model.emb.weight[:6].norm(dim=1).max() <= 1.0
