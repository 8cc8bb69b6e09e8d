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
from compfx.planned_module import PlannedModule, apply

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


def _train(model, step_model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (step_model(**x) if isinstance(x, dict) else step_model(x)).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_the_backend_trains_as_autocast(model_class, x):
    """Two seeded copies of ``model_class`` train on ``x``: one eagerly under bf16 autocast, one compiled with
    ``backend="compfx"`` (no cached plan: it runs ``Plan.amp``); their losses agree to bf16's rounding."""
    torch.manual_seed(0)
    eager, compiled_model = model_class(), model_class()
    compiled_model.load_state_dict(eager.state_dict())

    def under_autocast(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return eager(*args, **kwargs)

    expected = _train(eager, under_autocast, x)
    got = _train(compiled_model, torch.compile(compiled_model, backend="compfx"), x)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)


# ---------------------------------------------------------------------------
# constants read from a tensor's dtype


class FinfoMaskedAttention(nn.Module):
    """Eager attention masked the way many implementations do: ``masked_fill(~mask, torch.finfo(s.dtype).min)``.

    With left padding, a padded query sees no key at all: its row is all ``min``, whose softmax is uniform;
    an infinite mask there gives NaN.
    """

    def __init__(self, dim: int = 16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, keep):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~(causal & keep[:, None, :]), torch.finfo(scores.dtype).min)
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


def _padded(batch: int, length: int, seed: int = 0) -> dict:
    """Inputs of :class:`FinfoMaskedAttention`: the last sequence left-padded by three tokens."""
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[-1, :3] = False
    return {"x": _x(batch, length, 16, seed=seed), "keep": keep}


def test_finfo_masking_under_a_bf16_plan_is_autocast():
    torch.manual_seed(0)
    model, kwargs = FinfoMaskedAttention(), _padded(2, 8)
    analysis = _amp_matches_autocast(model, kwargs)
    planned = PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)
    assert_bitwise(seeded_grads(model, kwargs, autocast_dtype=torch.bfloat16), seeded_grads(planned, kwargs))
    longer = _padded(2, 12, seed=1)  # a new input signature: captured again, the same rule
    assert_bitwise(seeded_grads(model, longer, autocast_dtype=torch.bfloat16), seeded_grads(planned, longer))


def test_finfo_masking_under_the_compile_backend_is_autocast():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, kwargs = FinfoMaskedAttention(), _padded(2, 8)
    analysis = compfx.analyze(model, kwargs)
    try:
        compiled = torch.compile(model, backend=compfx.backend(compfx.Plan.amp(analysis), inner="aot_eager"))
        out, grads = seeded_grads(model, kwargs, autocast_dtype=torch.bfloat16)
        assert_bitwise((out.float(), grads), seeded_grads(compiled, kwargs))  # the backend returns FP32 outputs
    finally:
        torch._dynamo.reset()


def test_finfo_masking_trains_under_inductor(fresh_dynamo):
    """Inductor turned the FP32 limit into bf16 -inf (NaN losses); now it trains as autocast does."""
    _assert_the_backend_trains_as_autocast(FinfoMaskedAttention, _padded(2, 8))


def test_a_search_that_rewards_low_precision_finds_low_plans_for_finfo_masking():
    """Every low candidate used to fail on the FP32 literal, and the search fell back to FP32."""
    from compfx import SearchConfig, optimize
    from tests.helpers import fp32_op_count

    torch.manual_seed(0)
    model = FinfoMaskedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [_padded(4, 8, seed=i) for i in range(3)]
    result = optimize(model, loader, optimizer=opt, loss_fn=lambda out, batch: out.float().square().mean(),
                      config=SearchConfig(cost_fn=fp32_op_count, predictor=False, progress=False, warmup=0,
                                          repeats=1, stage2_check_batches=1, cache_plan=False))
    failed = [r for r in result.log.samples() if str(r.status) == "error"]
    assert not failed, failed[0].reason
    assert list(result.plan.values()).count("low") >= 4  # the four projections and the two matmuls


class FinfoClamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.clamp(h, min=torch.finfo(h.dtype).min, max=torch.finfo(h.dtype).max) * 2


def test_the_cost_model_prices_an_op_that_takes_a_finfo_limit_at_low_precision():
    from compfx.costmodel.profile import profile_ops

    analysis = compfx.analyze(FinfoClamp(), (_x(4, 8),))
    clamp = next(op.key for op in analysis.ops if op.kind == "clamp")
    profile = profile_ops(analysis, keys=[clamp], use_cache=False, repeats=1, warmup=0).ops[clamp]
    assert not profile.skipped and profile.low_s > 0


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


def test_vmap_model_trains_under_the_compfx_backend(fresh_dynamo):
    """Dead-code elimination used to drop ``_vmap_decrement_nesting`` (its result is unused)."""
    _assert_the_backend_trains_as_autocast(VmapScan, _x(3, 5, 8))


def test_passes_keep_functorch_levels_random_draws_and_writes():
    from compfx.graph_capture import has_side_effects

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


# ---------------------------------------------------------------------------
# blocks the model's author pinned to FP32


class PinnedRotary(nn.Module):
    """Rotary angles computed in an ``autocast(enabled=False)`` block, as many LLMs do: half precision cannot
    hold ``position * frequency`` exactly at large positions. The matmul inside is on autocast's lower list."""

    def __init__(self, dim: int = 16, device_type: str | None = None):
        super().__init__()
        self.q, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.device_type = device_type  # None: the input's, as model code writes it

    def forward(self, x, positions):
        q = self.q(x)
        with torch.autocast(self.device_type or x.device.type, enabled=False):
            angles = positions[:, :, None].float() @ self.inv_freq[None, None, :].float()
            emb = torch.cat([angles, angles], dim=-1)
            cos, sin = emb.cos(), emb.sin()
        rotated = torch.cat([-q[..., q.shape[-1] // 2:], q[..., : q.shape[-1] // 2]], dim=-1)
        return self.out(q * cos + rotated * sin)


def _rotary_inputs(batch=2, length=8, seed=0):
    return {"x": _x(batch, length, 16, seed=seed), "positions": (torch.arange(length) * 997.0)[None].expand(batch, -1)}


def _pinned_kinds(analysis):
    return sorted(op.kind for op in analysis.ops if op.pinned)


def test_ops_in_an_autocast_disabled_block_are_pinned_and_amp_keeps_them_fp32():
    torch.manual_seed(0)
    analysis = _amp_matches_autocast(PinnedRotary(), _rotary_inputs())
    assert _pinned_kinds(analysis) == ["cos", "matmul", "sin"]
    plan = compfx.Plan.amp(analysis)
    assert {str(plan[op.key]) for op in analysis.ops if op.pinned} == {"fp32"}
    assert "3 pinned to FP32" in analysis.summary() and "whitelist, pinned" in analysis.table()


class PinnedHead(nn.Module):
    """A head pinned to FP32 with a literal device type, which the symbolic tracer follows."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())


def test_the_symbolic_tracer_keeps_the_block_too():
    torch.manual_seed(0)
    analysis = _amp_matches_autocast(PinnedHead(), {"x": _x(4, 16)}, method="symbolic")
    assert analysis.capture_method == "symbolic" and [str(op.key) for op in analysis.ops if op.pinned] == ["head:linear#0"]


class AutocastInsideALeaf(nn.Module):
    """A leaf module (kept as one call) that opens an autocast block of its own, inside its forward."""

    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc(x)

    def __init__(self):
        super().__init__()
        self.leaf, self.head = self.Leaf(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.leaf(x).float())


def test_a_leaf_modules_own_autocast_block_stays_inside_the_leaf():
    # The symbolic tracer runs a leaf on FakeTensors for its example value; the block it opens there is the leaf's
    # own business, run as autocast (its value is bf16), not a block of the graph's around nothing after the leaf.
    gm = compfx.capture(AutocastInsideALeaf(), ((_x(4, 8),), {}), leaf_modules=[AutocastInsideALeaf.Leaf],
                        method="symbolic")
    blocks = {torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast}
    assert [n.target for n in gm.graph.nodes if n.target in blocks] == []
    (leaf,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert leaf.target == "leaf" and leaf.meta["val"].dtype == torch.bfloat16


def test_a_block_for_another_device_type_pins_nothing():
    """``autocast("cuda", enabled=False)`` leaves CPU autocast on, and the CPU ops as they are."""
    analysis = compfx.analyze(PinnedRotary(device_type="cuda"), _rotary_inputs())  # the model runs on the CPU
    assert _pinned_kinds(analysis) == []


def test_the_planned_graph_opens_the_models_block_around_the_pinned_ops():
    model = PinnedRotary()
    analysis = compfx.analyze(model, _rotary_inputs())
    planned = apply(model, compfx.Plan.amp(analysis), analysis=analysis).graph_module
    nodes = list(planned.graph.nodes)
    (enter,) = [n for n in nodes if n.target is torch.amp.autocast_mode._enter_autocast]
    (leave,) = [n for n in nodes if n.target is torch.amp.autocast_mode._exit_autocast]
    assert enter.args[:3] == ("cpu", None, False) and leave.args == (enter,)
    inside = nodes[nodes.index(enter) + 1:nodes.index(leave)]
    assert {str(n.meta["compfx_key"].kind) for n in inside if "compfx_key" in n.meta} == {"matmul", "cos", "sin"}


def _search(model, loader, log=None, **config):
    from compfx import SearchConfig, optimize
    from tests.helpers import fp32_op_count

    return optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), log=log,
                    loss_fn=lambda out, batch: out.float().square().mean(),
                    config=SearchConfig(cost_fn=fp32_op_count, predictor=False, progress=False, warmup=0, repeats=1,
                                        stage2_check_batches=1, cache_plan=False, **config))


def test_a_search_that_rewards_low_precision_leaves_pinned_ops_fp32_and_the_report_marks_them(tmp_path):
    from compfx.report import render_log_report

    torch.manual_seed(0)
    loader = [_rotary_inputs(seed=i) for i in range(2)]
    result = _search(PinnedRotary(), loader, log=tmp_path / "search.jsonl", threshold=100.0)
    pinned = [op.key for op in result.analysis.ops if op.pinned]
    assert pinned and all(result.plan[key] == "fp32" for key in pinned)
    assert "low" in result.plan.values()  # the rest did go low: the cost rewards it
    for report in (result.report(), render_log_report(tmp_path / "search.jsonl")):
        marked = [line.split()[1] for line in report.splitlines() if ", pinned" in line]
        assert marked == [str(key) for key in pinned]
        why = [line for line in report.splitlines() if "pinned by the model's autocast(enabled=False)" in line]
        assert [line.split()[1] for line in why] == [str(key) for key in pinned]  # the evidence column says why


def test_search_pinned_lets_the_search_lower_pinned_ops():
    torch.manual_seed(0)
    loader = [_rotary_inputs(seed=i) for i in range(2)]
    result = _search(PinnedRotary(), loader, threshold=100.0, search_pinned=True)
    matmul = next(op.key for op in result.analysis.ops if op.pinned and op.kind == "matmul")
    assert result.plan[matmul] == "low"


def test_the_compile_backend_keeps_pinned_ops_fp32():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, kwargs = PinnedRotary(), _rotary_inputs()
    try:
        backend = compfx.backend(inner="aot_eager")
        torch.compile(model, backend=backend)(**kwargs)
        (record,) = backend.records
    finally:
        torch._dynamo.reset()
    matmul = next(key for key in record.precisions if key.kind == "matmul")
    assert record.precisions[matmul] == "fp32" and record.compute_dtypes[matmul] == torch.float32


class MaybeAutocastRotary(PinnedRotary):
    """Hugging Face's ``maybe_autocast``: the block opens only when autocast is on (transformers 5.2x)."""

    def forward(self, x, positions):
        from transformers.utils.generic import maybe_autocast

        q = self.q(x)
        with maybe_autocast(x.device.type, enabled=False):
            angles = positions[:, :, None].float() @ self.inv_freq[None, None, :].float()
            cos = torch.cat([angles, angles], dim=-1).cos()
        return self.out(q * cos)


def test_a_block_that_opens_only_under_autocast_is_pinned():
    pytest.importorskip("transformers.utils.generic", exc_type=ImportError)
    from transformers.utils import generic

    if not hasattr(generic, "maybe_autocast"):
        pytest.skip("this transformers opens its blocks with torch.autocast itself")
    torch.manual_seed(0)
    analysis = _amp_matches_autocast(MaybeAutocastRotary(), _rotary_inputs())
    assert _pinned_kinds(analysis) == ["cos", "matmul"]


class HalfPrecisionBlock(nn.Module):
    """A model that holds a bf16 layer: capture's FP32 autocast would cast its inputs, so it is captured without."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8).bfloat16()

    def forward(self, x):
        return self.b(self.a(x).bfloat16()).float()


def test_a_model_with_half_precision_layers_is_captured_as_it_runs():
    model, x = HalfPrecisionBlock(), _x(2, 8)
    gm = compfx.capture(model, (x,))
    dtypes = {str(n.meta["compfx_key"]): n.meta["val"].dtype for n in compfx.graph_capture.op_nodes(gm)}
    assert dtypes == {"a:linear#0": torch.float32, "b:linear#0": torch.bfloat16}
    assert torch.equal(gm(x), model(x))
