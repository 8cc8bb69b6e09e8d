"""Model patterns whose meaning capture and the passes must keep (docs/fidelity.md).

Each model is the smallest that shows one pattern: a constant read from a
tensor's dtype, complex-valued ops, calls kept for their side effects, a block
the model's author pinned to FP32, a result that is its own input at capture.
Each test compares a plan with what the user would otherwise run: eager
``torch.autocast`` for ``Plan.amp``, the eager model for the FP32 plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.apply import PlannedModule, apply

from tests.helpers import assert_bitwise, seeded_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _amp_matches_autocast(model, kwargs, low_dtype=torch.bfloat16, method="auto"):
    """Plan.amp through apply() gives autocast's output and grads, bit for bit."""
    analysis = compfx.analyze(model, kwargs, low_dtype=low_dtype, method=method)
    reference = seeded_grads(model, kwargs, autocast_dtype=low_dtype)
    planned = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)
    assert_bitwise(reference, seeded_grads(planned, kwargs))
    return analysis


# ---------------------------------------------------------------------------
# complex-valued ops are ops like any other


class SpectralMix(nn.Module):
    """An FFT layer (FNO / FNet style): rfft, a complex weight, irfft, between two linears."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.weight = nn.Parameter(torch.randn(dim // 2 + 1, 2) * 0.1)

    def forward(self, x):
        h = self.inp(x)
        spectrum = torch.fft.rfft(h, dim=-1) * torch.view_as_complex(self.weight)
        return self.out(torch.fft.irfft(spectrum, n=h.shape[-1], dim=-1) + h)


def test_complex_valued_ops_are_keyed_and_classified():
    analysis = compfx.analyze(SpectralMix(), (_x(2, 8, 16),))
    kinds = {op.kind: str(op.category) for op in analysis.ops}
    assert kinds["fft_rfft"] == kinds["fft_irfft"] == kinds["view_as_complex"] == "blacklist"  # CPU autocast: FP32
    assert kinds["mul"] == "other"  # the complex product follows what reaches it


def test_fft_layer_under_amp_plan_is_autocast():
    torch.manual_seed(0)
    _amp_matches_autocast(SpectralMix(), {"x": _x(2, 8, 16)})


# ---------------------------------------------------------------------------
# a result that is its own input at capture


class NormTypeAs(nn.Module):
    """Gemma's RMSNorm: computes on ``x.float()`` and returns ``output.type_as(x)``.

    Capturing in FP32, ``x.float()`` is ``x`` itself; under autocast ``x`` (a linear's output) is bf16 and the
    two differ, so the graph must keep reading ``x`` where the model reads ``x``.
    """

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = self.fc(x)
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head((normed * self.weight).type_as(h) + x)


def test_a_call_that_returns_its_input_stays_apart_from_it():
    """The recording tracer finds a tensor's node by the object; Hugging Face models are recorded."""
    torch.manual_seed(0)
    _amp_matches_autocast(NormTypeAs(), {"x": _x(2, 8, 16)}, method="record")


# ---------------------------------------------------------------------------
# calls kept for their side effects


class VmapScan(nn.Module):
    """A selective-scan-like layer: a decayed cumulative sum, batched with torch.vmap."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, 4)
        self.decay = nn.Parameter(torch.rand(dim))

    def forward(self, x):
        h = self.inp(x)
        scanned = torch.vmap(lambda seq: torch.cumsum(seq * torch.sigmoid(self.decay), dim=0))(h)
        return self.out(scanned)


def _train(model, step_model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step_model(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_vmap_model_trains_under_the_compfx_backend(tmp_path, monkeypatch):
    """Dead-code elimination used to drop ``_vmap_decrement_nesting`` (its result is unused)."""
    from compfx.cache import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))  # no cached plan: the backend runs Plan.amp
    torch._dynamo.reset()
    x = _x(3, 5, 8)
    torch.manual_seed(0)
    eager = VmapScan()
    compiled_model = VmapScan()
    compiled_model.load_state_dict(eager.state_dict())

    def under_autocast(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return eager(batch)

    try:
        expected = _train(eager, under_autocast, x)
        got = _train(compiled_model, torch.compile(compiled_model, backend="compfx"), x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)


def test_passes_keep_functorch_levels_random_draws_and_writes():
    from compfx.capture import has_side_effects

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    kept = [graph.call_function(torch._functorch.predispatch._vmap_increment_nesting, (2, "error")),
            graph.call_function(torch._functorch.predispatch._vmap_decrement_nesting, ()),
            graph.call_method("bernoulli", (x,)),
            graph.call_function(F.dropout, (x, 0.5, True)),
            graph.call_method("add_", (x, 1.0)),
            graph.call_function(torch.rand, (3,))]
    dropped = graph.call_function(torch.sin, (x,))
    assert all(has_side_effects(node) for node in kept) and not has_side_effects(dropped)


class UnusedDraw(nn.Module):
    """A draw whose result nothing reads still advances the RNG: the next dropout's mask depends on it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        F.dropout(x, 0.5, training=True)
        return F.dropout(self.fc(x), 0.5, training=True)


def test_an_unused_random_draw_is_kept():
    model, x = UnusedDraw(), _x(4, 8)
    analysis = compfx.analyze(model, (x,))
    planned = PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    torch.manual_seed(5)
    expected = model(x)
    torch.manual_seed(5)
    assert torch.equal(planned(x), expected)
