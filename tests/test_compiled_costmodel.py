"""The cost model of the compiled program: the fusion rule, compiled profiles and their cache, compiled pricing,
the search predictor's compiled mode, and the roofline cost function.

No test asserts on timings: profiles are checked for their keys and the cache's behaviour; prices are checked on
hand-made profiles and on the roofline, whose sums are known exactly. Compiles use ``aot_eager`` (Inductor's
C++ compiles take seconds each on this CPU).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compfx
from compfx.planned_module import planned_graph
from compfx.cache import profile_folder
from compfx.costmodel import (CastCost, CompiledPredictor, CompileSpec, KernelCost, OpProfile, OpProfiles, Predictor,
                              Roofline, SearchPredictor, fuse, profile_compiled_ops, roofline_cost, roofline_profiles)
from compfx.costmodel import compiled_profile
from compfx.errors import BadInputError
from compfx.measure import Conditions
from compfx.plan import Assignment
from compfx.vocabulary import Precision, SampleStatus, Stage

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

STEADY = Conditions(reference_s=1e-3)  # fixed conditions: the staleness check has tests of its own
FAST = dict(repeats=1, warmup=0, block_s=1e-4, budget_s=1e-3, conditions=STEADY)
LOW = torch.bfloat16
#: One price for every kernel, eager or fused: 1 us per kernel plus 1 ns per byte it reads or writes.
UNIT = KernelCost({dtype: (1e-9, 1e-6) for dtype in (torch.float32, LOW)})


def chain_model(n_elementwise: int = 4, width: int = 16) -> nn.Module:
    """A linear, a chain of elementwise ops, a linear: the graph a compiler turns into GEMM, one kernel, GEMM."""
    torch.manual_seed(0)
    ops = [nn.ReLU(), nn.GELU(), nn.Tanh(), nn.SiLU(), nn.Sigmoid(), nn.Softsign()][:n_elementwise]
    return nn.Sequential(nn.Linear(width, width), *ops, nn.Linear(width, width))


def _eager_unit_predictor(analysis) -> Predictor:
    """The eager predictor at :data:`UNIT`'s prices: each op is a kernel of its own, priced by its own bytes (GEMMs
    at 0), and each cast a kernel (forward, plus backward when its input needs a gradient)."""
    ops = {}
    for op in analysis.ops:
        fp32 = UNIT.seconds({torch.float32: 4 * sum(_numel(s) for s in (*op.input_shapes, *op.output_shapes))})
        low = UNIT.seconds({LOW: 2 * sum(_numel(s) for s in (*op.input_shapes, *op.output_shapes))})
        ops[op.key] = OpProfile(op.key, 0.0, 0.0) if op.kind == "linear" else OpProfile(op.key, fp32, low)
    per_element = 6e-9  # 4 bytes read and 2 written (or back), at UNIT's 1 ns per byte
    cast_cost = CastCost({(torch.float32, LOW): (per_element, 1e-6), (LOW, torch.float32): (per_element, 1e-6)})
    return Predictor(OpProfiles(ops, LOW, analysis.device), cast_cost, analysis=analysis)


def _compiled_unit_predictor(analysis) -> CompiledPredictor:
    externs = {op.key: OpProfile(op.key, 0.0, 0.0) for op in analysis.ops if op.kind == "linear"}
    return CompiledPredictor(OpProfiles(externs, LOW, analysis.device, compiled=CompileSpec().key()), UNIT,
                             analysis=analysis)


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


# -- the fusion rule ------------------------------------------------------------------------------

def test_compiled_pricing_charges_no_cast_between_two_fused_elementwise_ops_where_eager_pricing_does():
    model = chain_model(2)  # linear, relu, gelu, linear
    a = compfx.analyze(model, torch.randn(8, 16), low_dtype=LOW)
    relu, gelu = a.ops[1].key, a.ops[2].key
    plan = compfx.Plan.fp32(a).with_precisions({relu: Precision.FP32, gelu: Precision.LOW})
    graph = planned_graph(model, plan, a)
    between = [n.name for n in graph.graph.nodes if n.op == "call_method" and n.args and n.args[0].name == "relu"]
    assert len(between) == 1  # relu's output cast to bf16 for gelu: the cast under test

    eager = _eager_unit_predictor(a).breakdown(graph)
    compiled = _compiled_unit_predictor(a).breakdown(graph)
    assert between[0] in {c.node for c in eager.casts} and eager.cast_s > 0
    assert between[0] not in {c.node for c in compiled.casts}
    assert between[0] in {c.node for c in compiled.fused_casts}
    assert compiled.cast_s == 0 and compiled.kernels == 1  # relu, both casts and gelu: one kernel


@pytest.mark.parametrize("case, low, charged, fused, kernels", [
    # a parameter cast is paid once per step however many ops read it: a weight read by two matmuls
    ("tied", "all", {"x": 1, "weight": 1, "matmul_1": 1}, set(), 0),
    # per-use casts of one FP32 GEMM output into two low GEMMs: one kernel (the compiler merges them), not two
    ("fan_out", "left right", {"linear": 1}, set(), 0),
    # casts fed by, and feeding, an elementwise op (through a view) fuse into its kernel
    ("view", "all", {"x": 1, "linear_1": 1}, {"linear", "reshape"}, 1),
])
def test_the_fusion_rule_on_small_graphs(case, low, charged, fused, kernels):
    model, x = _fusion_cases()[case]
    a = compfx.analyze(model, x, low_dtype=LOW)
    lowered = {op.key: Precision.LOW for op in a.ops
               if op.kind in ("linear", "matmul") and (low == "all" or op.key.module in low.split())}
    graph = planned_graph(model, compfx.Plan.fp32(a).with_precisions(lowered), a)
    fusion = fuse(graph)
    sources = {node.name: node.args[0].name for node in graph.graph.nodes if node.op == "call_method"}
    activations = [c for c in fusion.charged_casts if not c.parameter]
    assert {s: [sources[c.node] for c in activations].count(s) for s in charged if s != "weight"} == \
        {s: n for s, n in charged.items() if s != "weight"}
    if "weight" in charged:
        (weight,) = [c for c in fusion.charged_casts if c.parameter]
        readers = [n for n in graph.graph.nodes if any(arg.name == weight.node for arg in n.all_input_nodes)]
        assert len(readers) == 2  # one cast, charged once, read by both matmuls
    assert {sources[c.node] for c in fusion.fused_casts} == fused
    assert len(fusion.kernels) == kernels
    if case == "fan_out":  # the graph holds a cast per use: two of them
        assert [sources[c.node] for c in compfx.passes.casts_in(graph)].count("linear") == 2


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return torch.matmul(torch.matmul(x, self.weight), self.weight)


class _FanOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.left, self.right = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.first(x)
        return torch.cat([self.left(h), self.right(h)], dim=-1)


class _View(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)).reshape(-1, 16))


def _fusion_cases():
    torch.manual_seed(0)
    return {"tied": (_Tied(), torch.randn(8, 16)), "fan_out": (_FanOut(), torch.randn(8, 16)),
            "view": (_View(), torch.randn(2, 4, 16))}


def test_compiled_and_eager_predictions_differ_in_the_direction_fusion_implies():
    """Same prices per kernel and per byte, eager and compiled. A chain of elementwise ops whose precisions alternate
    needs a cast between each pair: eagerly each op and each cast is a kernel, compiled the chain is one kernel and
    its casts are free. So compiled predicts every plan cheaper, and the alternating plan's extra cost over the
    uniform one shrinks."""
    model = chain_model(6)
    a = compfx.analyze(model, torch.randn(64, 16), low_dtype=LOW)
    chain = [op.key for op in a.ops[1:-1]]
    uniform = compfx.Plan.fp32(a)
    alternating = uniform.with_precisions({key: Precision.LOW for key in chain[::2]})
    eager, compiled = _eager_unit_predictor(a), _compiled_unit_predictor(a)
    for plan in (uniform, alternating):
        assert compiled.predict(plan) < eager.predict(plan)
    assert len(eager.breakdown(alternating).casts) >= len(chain) - 1
    assert compiled.breakdown(alternating).cast_s == 0
    eager_extra = eager.predict(alternating) - eager.predict(uniform)
    compiled_extra = compiled.predict(alternating) - compiled.predict(uniform)
    assert eager_extra > 0 and compiled_extra < eager_extra


# -- compiled profiles and their cache --------------------------------------------------------------

class _ConvMlp(nn.Module):
    """A convolution and three linears, two of them of one signature (the last two)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3, padding=1)
        self.fc0, self.fc1, self.fc2 = nn.Linear(256, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = torch.relu(self.fc0(torch.relu(self.conv(x)).flatten(1)))
        return self.fc2(torch.relu(self.fc1(h)))


def test_a_gemms_compiled_profile_is_keyed_by_precision_recipe_and_shape_and_cached(tmp_path, monkeypatch):
    torch.manual_seed(0)
    a = compfx.analyze(_ConvMlp(), torch.randn(16, 4, 4, 4), low_dtype=LOW, fp8=True)
    kinds = [op.kind for op in a.ops]
    assert kinds.count("linear") == 3 and kinds.count("conv2d") == 1
    first = profile_compiled_ops(a, "aot_eager", fp8_recipes=("tensorwise", "rowwise"), cache_dir=tmp_path, **FAST)
    assert {str(k) for k in first} == {"conv:conv2d#0", "fc0:linear#0", "fc1:linear#0", "fc2:linear#0"}
    assert all(not p.skipped and p.fp32_s > 0 and p.low_s > 0 for p in first.values())
    linears = [p for k, p in first.items() if k.kind == "linear"]
    assert all({r for r, s in p.fp8_s if s > 0} == {"tensorwise", "rowwise"} for p in linears)
    assert first[a.ops[0].key].fp8_s == ()  # the convolution has no float8 path
    # conv: fp32 + low; fc0 and fc1: fp32, low, two recipes each; fc2 is fc1's signature: read, not timed
    assert (first.measured, first.reused) == (2 + 4 + 4, 4)
    entries = [json.loads(p.read_text())["key"] for p in profile_folder(tmp_path).glob("*.json")]
    assert len(entries) == 10
    precisions = sorted((e["signature"]["kind"], e["dtype"], e.get("fp8") or "") for e in entries if "compile" in e)
    assert len(set(precisions)) == 6 and len(precisions) == 10  # fc0's and fc1's shapes keep their own entries
    assert all(e["compile"]["inner"] == "aot_eager" for e in entries)

    timed = []
    monkeypatch.setattr(compiled_profile, "time_fastest", lambda *args, **kwargs: timed.append(1) or 1.0)
    second = profile_compiled_ops(a, "aot_eager", fp8_recipes=("tensorwise", "rowwise"), cache_dir=tmp_path, **FAST)
    assert (second.measured, second.reused, len(timed)) == (0, 14, 0)
    assert {k: (p.fp32_s, p.low_s, p.fp8_s) for k, p in second.items()} == \
        {k: (p.fp32_s, p.low_s, p.fp8_s) for k, p in first.items()}
    other = profile_compiled_ops(a, CompileSpec(inner="aot_eager", dynamic=False), fp8_recipes=("tensorwise",),
                                 cache_dir=tmp_path, **FAST)  # other compile options: entries of their own
    assert other.measured == len(timed) == 2 + 3 + 3


def test_profiling_many_ops_compiled_never_hits_dynamos_recompile_limit(tmp_path):
    """Every op is compiled through one wrapper; without resetting its cache the ninth op would run eagerly."""
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16 + i, 17 + i) for i in range(10)])
    a = compfx.analyze(model, torch.randn(4, 16), low_dtype=LOW)
    profiles = profile_compiled_ops(a, "aot_eager", use_cache=False, **FAST)
    assert profiles.measured == 20 and not profiles.skipped
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 20  # each op and precision compiled, none eagerly


def test_kernel_cost_fit_is_cached_and_keyed_by_the_compile_options(tmp_path, monkeypatch):
    first = compiled_profile.fit_kernel_cost("aot_eager", dtypes=(torch.float32, LOW), sizes=(256, 4096), repeats=1,
                                             cache_dir=tmp_path, conditions=STEADY)
    assert set(first.coefficients) == {torch.float32, LOW} and first.non_negative()
    monkeypatch.setattr(compiled_profile, "_time_chain", lambda *a, **k: pytest.fail("a cached fit was timed"))
    again = compiled_profile.fit_kernel_cost("aot_eager", dtypes=(torch.float32, LOW), sizes=(256, 4096), repeats=1,
                                             cache_dir=tmp_path, conditions=STEADY)
    assert again.coefficients == first.coefficients
    with pytest.raises(pytest.fail.Exception):
        compiled_profile.fit_kernel_cost("eager", dtypes=(torch.float32,), sizes=(256, 4096), repeats=1,
                                         cache_dir=tmp_path, conditions=STEADY)


@pytest.mark.parametrize("options, inner", [
    (None, None), (True, "inductor"), ("aot_eager", "aot_eager"), ({"inner": "eager", "dynamic": False}, "eager"),
])
def test_compile_spec_takes_the_searchs_compile_options_in_any_form(options, inner):
    spec = CompileSpec.of(options)
    assert (spec.inner if spec is not None else None) == inner

    class SearchCompileOptions:  # what a search's own settings object may look like
        def __init__(self):
            self.inner, self.inductor_options, self.dynamic = "inductor", {"max_autotune": True}, None

    assert CompileSpec.of(SearchCompileOptions()).key()["inductor_options"] == {"max_autotune": True}
    with pytest.raises(BadInputError, match="only with inner='inductor'"):
        CompileSpec(inner="aot_eager", inductor_options={"max_autotune": True})


# -- the search's predictor, compiled ---------------------------------------------------------------

def test_the_search_predictor_switches_to_compiled_pricing_with_one_argument():
    a = compfx.analyze(chain_model(2), torch.randn(16, 16), low_dtype=LOW)
    eager = SearchPredictor.build(a, use_cache=False, **{k: v for k, v in FAST.items() if k != "conditions"})
    compiled = SearchPredictor.build(a, compiled="aot_eager", use_cache=False,
                                     **{k: v for k, v in FAST.items() if k != "conditions"})
    assert type(eager.predictor) is Predictor and eager.profiles.compiled is None
    assert isinstance(compiled.predictor, CompiledPredictor) and compiled.profiles.compiled["inner"] == "aot_eager"
    assert set(compiled.profiles) == {op.key for op in a.ops if op.kind == "linear"}  # the chain is priced fused


def _fp8_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_search_predictors_bounds_never_exceed_its_compiled_predictions_with_fp8(data):
    """The roofline as compiled profiles (FP8 cheaper than FP32 and bf16 on the large GEMMs): every bound the search
    may skip a plan on stays at or below the plan's prediction, with FP8 ops in the plan and in its reference."""
    a = _fp8_analysis()
    predictor = SearchPredictor(CompiledPredictor(roofline_profiles(a), Roofline().kernel_cost(), analysis=a))
    fp32 = Assignment.parse("1" * len(a.ops))
    predictor.observe(Stage.STAGE1, fp32, SampleStatus.ACCEPTED, seconds=4e-3, batches=4)
    levels = [(Precision.FP32, Precision.LOW, Precision.FP8) if op.fp8_eligible else (Precision.FP32, Precision.LOW)
              for op in a.ops]
    drawn = [Assignment(data.draw(st.sampled_from(level)) for level in levels) for _ in range(2)]
    all_fp8 = Assignment(level[-1] for level in levels)
    for plan, reference in [drawn, (all_fp8, drawn[1]), (drawn[0], all_fp8)]:
        predicted = predictor.epoch_seconds(plan)
        assert predictor.lower_bound_seconds(plan) <= predicted * (1 + 1e-9)
        assert predictor.lower_bound_against(plan, reference) <= predicted * (1 + 1e-9)


_ANALYSES: dict = {}


def _fp8_analysis():
    if "fp8" not in _ANALYSES:
        with torch.device("meta"):  # large GEMMs, where FP8 is the cheapest precision, and a small one
            model = nn.Sequential(nn.Linear(8192, 8192), nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 64))
        _ANALYSES["fp8"] = compfx.analyze(model, torch.empty(8192, 8192, device="meta"), low_dtype=LOW, fp8=True,
                                          verify=False)
    return _ANALYSES["fp8"]


# -- the roofline ---------------------------------------------------------------------------------

def _linear_analysis(n: int):
    """LayerNorm, an n x n linear on n rows, GELU: the linear's input and output cast within fused kernels."""
    with torch.device("meta"):
        model = nn.Sequential(nn.LayerNorm(n), nn.Linear(n, n), nn.GELU())
    return compfx.analyze(model, torch.empty(n, n, device="meta"), low_dtype=LOW, fp8=True, verify=False)


@pytest.mark.parametrize("n, fp8_wins", [(4096, True), (64, False)])
def test_fp8_beats_bf16_on_a_4096_cubed_linear_and_loses_on_a_64_cubed_one_on_the_roofline(n, fp8_wins):
    a = _linear_analysis(n)
    linear = a.ops[1].key
    cost = roofline_cost(a)
    bf16 = compfx.Plan.amp(a)
    fp8 = compfx.Plan.from_assignment(a, [Precision.FP8 if k == linear else bf16[k] for k in a.keys],
                                      fp8_recipe="tensorwise")
    assert (cost(fp8, 1.0) < cost(bf16, 1.0)) is fp8_wins
    assert cost.breakdown(fp8).fp8_ops == (linear,) and cost.breakdown(bf16).low_ops == (linear,)
    op = Roofline().linear_seconds
    assert (op(n, n, n, "fp8", recipe="tensorwise") < op(n, n, n, "low")) is fp8_wins


def test_the_fp8_crossover_moves_with_the_recipe():
    roofline = Roofline()
    sizes = range(512, 16385, 256)

    def crossover(recipe):
        return next(n for n in sizes if roofline.linear_seconds(n, n, n, "fp8", recipe=recipe)
                    < roofline.linear_seconds(n, n, n, "low"))

    tensorwise, rowwise = crossover("tensorwise"), crossover("rowwise")
    assert tensorwise < rowwise  # rowwise scaling moves more bytes: it pays only on larger GEMMs
    assert tensorwise <= 4096 < rowwise


def test_the_roofline_prices_fp32_at_its_own_peak_or_tf32s():
    a = _linear_analysis(1024)
    fp32 = compfx.Plan.fp32(a)
    full, tf32 = roofline_cost(a)(fp32, 0.0), roofline_cost(a, tf32=True)(fp32, 0.0)
    assert tf32 < full and roofline_cost(a)(compfx.Plan.amp(a), 0.0) < full


def test_roofline_cost_refuses_unknown_devices_and_plans_of_other_models():
    a = _linear_analysis(64)
    with pytest.raises(BadInputError, match="not known"):
        roofline_cost(a, device="tpu")
    other = compfx.analyze(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8))
    with pytest.raises(BadInputError, match="another|built for"):
        roofline_cost(a)(compfx.Plan.fp32(other), 1.0)


def test_a_search_ranks_plans_by_the_roofline_cost(tmp_path):
    """Injected as SearchConfig(cost_fn=...): every sample's logged cost is the roofline's price of its plan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)) for _ in range(2)]
    a = compfx.analyze(model, loader[0][0])
    cost = roofline_cost(a)
    result = compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                             loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[-1]),
                             config=compfx.SearchConfig(cost_fn=cost, progress=False, warmup=0, repeats=1, rounds=0,
                                                        stage2_check_batches=0, cache_plan=False, predictor="off"))
    samples = [r for r in result.log.samples(Stage.STAGE1) if r.status is SampleStatus.ACCEPTED and r.cost]
    assert samples
    for record in samples:
        assert record.cost == pytest.approx(cost(compfx.Plan.from_bitstring(a, record.plan), 0.0))
    chosen = cost(result.plan, 0.0)
    assert all(chosen <= record.cost * (1 + 1e-9) for record in samples)
