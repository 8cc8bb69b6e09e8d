"""Cost model: per-op profiles, the profile cache, the cast-cost fit and the predictor arithmetic.

No test asserts on timings (machines are noisy): the profiler is checked for
coverage and cache behaviour, and the predictor on hand-made profiles whose
sums are known exactly.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import compfx
from compfx.costmodel import (CastCost, OpProfile, OpProfiles, Predictor, _fit_line, _OpBench, find_casts,
                              fit_cast_cost, median_abs_percentage_error, profile_cache_dir, profile_ops,
                              rank_by_prediction, rewrite_with_insert_casts, should_skip, skip_message)
from compfx.opkey import KEY_META
from tests.zoo import make

FAST = dict(repeats=1, warmup=0, block_s=1e-4, budget_s=1e-3)
LOW = torch.bfloat16


@functools.lru_cache(maxsize=None)
def _analysis(name: str):
    """Shared per model: the tests read the analysis and rewrite copies of its graph."""
    model, inputs = make(name)
    return compfx.analyze(model, inputs, low_dtype=LOW)


def _cast_to(graph: fx.Graph, node: fx.Node, arg: fx.Node, dtype: torch.dtype) -> None:
    with graph.inserting_before(node):
        cast = graph.call_method("to", (arg, dtype))
    node.replace_input_with(arg, cast)


def rewrite_for_test(analysis, plan) -> fx.GraphModule:
    """A stand-in for the cast pass: cast every floating input of a low/fp32 op to its dtype.

    Norm ops cast only their activation. Casts whose input already has the
    dtype are no-ops, and the cost model must not count them.
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(analysis.graph_module.graph, {}))
    for node in list(graph.nodes):
        key = node.meta.get(KEY_META)
        if key is None or plan[key] == "follow":
            continue
        dtype = plan.low_dtype if plan[key] == "low" else torch.float32
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr" or key.kind not in _NORMS]
        if key.kind in _NORMS:
            inputs = inputs[:1]
        for arg in inputs:
            value = arg.meta.get("val")
            if arg.op == "get_attr" or (isinstance(value, torch.Tensor) and value.is_floating_point()):
                _cast_to(graph, node, arg, dtype)
    return fx.GraphModule(analysis.graph_module, graph)


_NORMS = {"batch_norm", "layer_norm", "group_norm"}


def _real_casts(gm: fx.GraphModule, inputs) -> list[tuple[torch.dtype, torch.dtype, int]]:
    """Casts seen by running the graph on real tensors (independent of the FakeTensor propagation)."""
    seen: list[tuple[torch.dtype, torch.dtype, int]] = []

    class Recorder(fx.Interpreter):
        def call_method(self, target, args, kwargs):
            out = super().call_method(target, args, kwargs)
            if target == "to" and args[0].dtype != out.dtype:
                seen.append((args[0].dtype, out.dtype, out.numel()))
            return out

    Recorder(gm).run(*inputs)
    return seen


# -- profiler ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_matmul", "embed_gru"])
def test_profiles_cover_every_op_at_both_dtypes(name, tmp_path):
    a = _analysis(name)
    profiles = profile_ops(a, cache_dir=tmp_path, **FAST)
    assert set(profiles) == set(a.keys)
    assert profiles.skipped == {}
    assert all(p.fp32_s > 0 and p.low_s > 0 for p in profiles.values())
    # identical calls (the encoder's two dropouts) are measured once and then read from the cache
    assert profiles.measured + profiles.reused == 2 * len(a.ops)
    assert profiles.reused == (2 if name == "encoder_matmul" else 0)


def test_second_profiling_measures_nothing_and_leaves_the_cache_as_it_was(tmp_path):
    a = _analysis("cnn")
    first = profile_ops(a, cache_dir=tmp_path, **FAST)
    files = {p.name: p.read_text() for p in profile_cache_dir(tmp_path).iterdir()}
    # fp32 and low entry per op signature; the two relu (and pool) calls differ in shape, so no sharing
    assert len(files) == 2 * len(a.ops)
    assert all(json.loads(text)["format"] == "compfx-op-profile" for text in files.values())

    model, inputs = make("cnn")
    second = profile_ops(compfx.analyze(model, inputs, low_dtype=LOW), cache_dir=tmp_path, **FAST)  # a new capture
    assert (second.measured, second.reused) == (0, 2 * len(a.ops))
    assert {p.name: p.read_text() for p in profile_cache_dir(tmp_path).iterdir()} == files
    assert dict(second) == dict(first)


def test_cache_is_keyed_by_shape(tmp_path):
    a = _analysis("mlp")
    profile_ops(a, cache_dir=tmp_path, **FAST)
    model, _ = make("mlp")
    bigger = compfx.analyze(model, torch.randn(32, 16), low_dtype=LOW)
    again = profile_ops(bigger, cache_dir=tmp_path, **FAST)
    assert again.measured == 2 * len(bigger.ops)
    assert len(list(profile_cache_dir(tmp_path).iterdir())) == 4 * len(a.ops)


def test_damaged_cache_entry_is_measured_again(tmp_path):
    a = _analysis("mlp")
    profile_ops(a, cache_dir=tmp_path, **FAST)
    victim = sorted(profile_cache_dir(tmp_path).iterdir())[0]
    victim.write_text('{"format": "compfx-op-pro')  # truncated write
    again = profile_ops(a, cache_dir=tmp_path, **FAST)
    assert (again.measured, again.reused) == (1, 2 * len(a.ops) - 1)
    assert json.loads(victim.read_text())["format"] == "compfx-op-profile"


def _relu_without_low_kernel(x, inplace=False):
    if x.dtype != torch.float32:
        raise NotImplementedError(f"relu has no {x.dtype} kernel here")
    return torch.relu(x)


def test_op_that_cannot_run_at_a_dtype_is_skipped_with_the_reason(tmp_path):
    a = _analysis("mlp")
    graph = fx.Graph()
    graph.output(graph.graph_copy(a.graph_module.graph, {}))
    relu = next(n for n in graph.nodes if n.meta.get(KEY_META) == a.ops[1].key)
    relu.target = _relu_without_low_kernel
    broken = compfx.Analysis(a.ops, a.device, a.low_dtype, fx.GraphModule(a.graph_module, graph))
    profiles = profile_ops(broken, cache_dir=tmp_path, **FAST)
    assert list(profiles.skipped) == [a.ops[1].key]
    assert "no torch.bfloat16 kernel" in profiles.skipped[a.ops[1].key]
    assert profiles[a.ops[1].key].fp32_s == profiles[a.ops[1].key].low_s == 0.0  # half a profile is no profile
    assert all(profiles[op.key].low_s > 0 for op in (a.ops[0], a.ops[2]))


class _InPlaceAndLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.leaf = nn.Linear(8, 4)

    def forward(self, x):
        return self.leaf(F.relu(self.fc(x), inplace=True))


def test_in_place_ops_and_leaf_modules_are_profiled(tmp_path):
    model = _InPlaceAndLeaf()
    a = compfx.analyze(model, torch.randn(4, 8), low_dtype=LOW, leaf_modules=["leaf"])
    profiles = profile_ops(a, cache_dir=tmp_path, **FAST)
    assert profiles.skipped == {}
    assert {k.kind for k in profiles} == {"linear", "relu"} and len(profiles) == 3
    modes = {json.loads(f.read_text())["key"]["signature"]["low_mode"] for f in profile_cache_dir(tmp_path).iterdir()}
    assert modes == {"cast", "autocast"}  # the leaf module's low variant runs under torch.autocast


@pytest.mark.parametrize("name, kind, casts", [
    ("cnn", "batch_norm", {0}),           # activation only; weight, bias, running stats stay fp32
    ("encoder_matmul", "layer_norm", {0}),
    ("cnn", "conv2d", {0, 1, 2}),          # input, weight, bias
    ("embed_gru", "embedding", {1}),       # ids are integers: only the weight is cast
])
def test_low_profile_casts_what_the_rewriter_casts(name, kind, casts):
    a = _analysis(name)
    node = next(n for n in compfx.op_nodes(a.graph_module) if n.meta[KEY_META].kind == kind)
    assert _OpBench(a.graph_module, node, a.device).cast_positions() == casts


# -- cast cost -----------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(alpha=st.floats(1e-12, 1e-8), beta=st.floats(1e-7, 1e-4),
       sizes=st.lists(st.integers(1, 1 << 22), min_size=2, max_size=6, unique=True))
def test_line_fit_recovers_exact_coefficients(alpha, beta, sizes):
    fitted_alpha, fitted_beta = _fit_line(sizes, [alpha * n + beta for n in sizes])
    assert fitted_alpha == pytest.approx(alpha, rel=1e-4, abs=1e-15)
    assert fitted_beta == pytest.approx(beta, rel=1e-4)


def test_cast_cost_fit_is_cached_and_round_trips(tmp_path):
    pairs = ((torch.float32, LOW), (LOW, torch.float32))
    cost = fit_cast_cost("cpu", pairs, sizes=(256, 4096, 65536), cache_dir=tmp_path)
    assert set(cost.coefficients) == set(pairs)
    assert all(alpha >= 0 and beta >= 0 for alpha, beta in cost.coefficients.values())
    assert len(list(profile_cache_dir(tmp_path).iterdir())) == 2
    assert fit_cast_cost("cpu", pairs, sizes=(256, 4096, 65536), cache_dir=tmp_path) == cost
    assert CastCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_cast_cost_refuses_an_unfitted_pair():
    with pytest.raises(compfx.SearchError, match="float16->float32"):
        CastCost({(torch.float32, LOW): (1e-9, 1e-6)}).seconds(torch.float16, torch.float32, 10)


# -- predictor -------------------------------------------------------------------

ALPHA, BETA = 1e-6, 1e-3


def _fake_predictor(a) -> Predictor:
    """Profiles with known times: op i costs i+1 in fp32 and 100*(i+1) in the low dtype."""
    ops = {op.key: OpProfile(op.key, float(i + 1), 100.0 * (i + 1)) for i, op in enumerate(a.ops)}
    cost = CastCost({(torch.float32, LOW): (ALPHA, BETA), (LOW, torch.float32): (2 * ALPHA, 2 * BETA)})
    return Predictor(OpProfiles(ops, LOW, a.device), cost, analysis=a,
                     rewrite=lambda plan: rewrite_for_test(a, plan))


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_matmul"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_prediction_sums_op_costs_and_the_graphs_casts(name, data):
    a = _analysis(name)
    bits = data.draw(st.text("01", min_size=len(a.ops), max_size=len(a.ops)))
    plan = compfx.Plan.from_bitstring(a, bits)
    predictor = _fake_predictor(a)
    result = predictor.breakdown(bits)

    low_keys = {op.key for op, bit in zip(a.ops, bits) if bit == "0"}
    assert set(result.low_ops) == low_keys
    expected_compute = sum((100.0 if op.key in low_keys else 1.0) * (i + 1) for i, op in enumerate(a.ops))
    assert result.compute_s == pytest.approx(expected_compute)

    _, inputs = make(name)
    seen = sorted((str(s), str(d), n) for s, d, n in _real_casts(rewrite_for_test(a, plan), inputs))
    assert sorted((str(c.src), str(c.dst), c.numel) for c in result.casts) == seen
    forward = sum(predictor.cast_cost.seconds(c.src, c.dst, c.numel) for c in result.casts)
    backward = sum(predictor.cast_cost.seconds(c.dst, c.src, c.numel) for c in result.casts if c.backward)
    assert result.cast_s == pytest.approx(forward + backward)
    assert result.seconds == pytest.approx(result.compute_s + result.cast_s)


@pytest.mark.parametrize("name", ["cnn", "encoder_sdpa", "mha", "embed_gru"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_cast_pass_metadata_prices_a_plan_as_propagating_fake_tensors_does(name, data):
    a = _analysis(name)
    bits = "".join(data.draw(st.sampled_from("01f" if op.category == "other" else "01")) for op in a.ops)
    plan = compfx.Plan.from_bitstring(a, bits)
    predictor = _fake_predictor(a)
    from_meta = predictor.breakdown(rewrite_with_insert_casts(a, plan))  # trusts the pass's meta["val"]
    unflagged = rewrite_with_insert_casts(a, plan)
    unflagged.meta.clear()  # what any other graph gets: dtypes recomputed on FakeTensors
    propagated = predictor.breakdown(unflagged)
    assert from_meta.casts == propagated.casts and from_meta.low_ops == propagated.low_ops
    assert from_meta.seconds == propagated.seconds


def test_cast_pass_graph_is_priced_without_propagating_fake_tensors_again(monkeypatch):
    import compfx.costmodel as costmodel

    a = _analysis("cnn")
    gm = rewrite_with_insert_casts(a, compfx.Plan.from_bitstring(a, "0" * len(a.ops)))
    monkeypatch.setattr(costmodel._FakeValues, "run", lambda *args, **kwargs: pytest.fail("propagated again"))
    assert _fake_predictor(a).breakdown(gm).casts


def test_input_cast_has_no_backward_cast_but_weight_casts_do():
    a = _analysis("mlp")
    casts = _fake_predictor(a).breakdown("000").casts
    by_source = {c.numel: c.backward for c in casts}
    assert by_source[4 * 16] is False           # the model input needs no gradient
    assert by_source[32 * 16] is True           # fc1's weight does
    assert len(casts) == 5                      # x, fc1 weight+bias, fc2 weight+bias (relu output is already low)


def test_fp32_plan_has_no_casts_and_all_ops_at_fp32():
    a = _analysis("cnn")
    result = _fake_predictor(a).breakdown(compfx.Plan.fp32(a))
    assert result.casts == () and result.low_ops == ()
    assert result.compute_s == pytest.approx(sum(range(1, len(a.ops) + 1)))


def test_follow_ops_are_priced_at_the_dtype_that_reaches_them():
    a = _analysis("mlp")  # fc1, relu, fc2
    predictor = _fake_predictor(a)
    assert set(predictor.breakdown("0f1").low_ops) == {a.ops[0].key, a.ops[1].key}
    assert set(predictor.breakdown("1f0").low_ops) == {a.ops[2].key}


def test_calibration_makes_fp32_exact_and_shifts_every_plan_equally():
    a = _analysis("cnn")
    predictor = _fake_predictor(a)
    bits = "0" * len(a.ops)
    before = predictor.predict(bits)
    predictor.calibrate(1000.0)
    assert predictor.predict(a.graph_module) == pytest.approx(1000.0)
    assert predictor.predict(compfx.Plan.fp32(a)) == pytest.approx(1000.0)
    assert predictor.predict(bits) - before == pytest.approx(predictor.overhead)


def test_predictor_errors_say_what_to_do():
    a = _analysis("mlp")
    bare = Predictor(OpProfiles({}, LOW, a.device), CastCost({}))
    with pytest.raises(compfx.SearchError, match="rewrite"):
        bare.predict("000")
    with pytest.raises(compfx.SearchError, match="analysis"):
        bare.calibrate(1.0)
    with pytest.raises(compfx.BadInputError, match="positive"):
        _fake_predictor(a).calibrate(0.0)


def test_real_profiles_predict_a_graph():
    a = _analysis("mlp")
    predictor = Predictor.build(a, use_cache=False, rewrite=lambda plan: rewrite_for_test(a, plan), **FAST)
    fp32, low = predictor.predict("111"), predictor.predict("000")
    assert fp32 > 0 and low > 0
    assert predictor.breakdown("000").cast_s > 0


def test_find_casts_ignores_same_dtype_conversions():
    a = _analysis("mlp")
    fp32_rewrite = rewrite_for_test(a, compfx.Plan.fp32(a))  # inserts .to(float32) on fp32 tensors
    assert sum(n.target == "to" for n in fp32_rewrite.graph.nodes) > 0
    assert _fake_predictor(a).breakdown(fp32_rewrite).casts == ()
    assert find_casts(fp32_rewrite) == []


# -- search hook -------------------------------------------------------------------

def test_ranking_and_skipping_follow_the_prediction():
    a = _analysis("mlp")
    ranked = rank_by_prediction(_fake_predictor(a), ["000", "111", "011", "110"])
    assert [bits for bits, _ in ranked][0] == "111" and [bits for bits, _ in ranked][-1] == "000"
    assert [s for _, s in ranked] == sorted(s for _, s in ranked)
    assert should_skip(1.26, 1.0) and not should_skip(1.25, 1.0) and not should_skip(5.0, None)
    assert should_skip(1.6, 1.0, margin=1.5) and not should_skip(1.4, 1.0, margin=1.5)
    with pytest.raises(compfx.BadInputError):
        should_skip(1.0, 1.0, margin=0.5)
    assert skip_message(0.5, 0.25) == "skipped (predicted 0.5 s vs best 0.25 s)"


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=1, max_size=9))
def test_median_abs_percentage_error_matches_its_definition(pairs):
    predicted, measured = zip(*pairs)
    errors = sorted(abs(p - m) / m * 100 for p, m in pairs)
    middle = len(errors) // 2
    expected = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    assert median_abs_percentage_error(predicted, measured) == pytest.approx(expected, rel=1e-6)


# -- with the real cast pass -----------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_sdpa"])
def test_default_rewrite_is_the_cast_pass_and_casts_match_its_report(name):
    from compfx.apply import apply
    from compfx.passes import count_casts

    a = _analysis(name)
    model, _ = make(name)
    fake = _fake_predictor(a)
    predictor = Predictor(fake.profiles, fake.cast_cost, analysis=a)  # default rewrite: the cast pass
    for plan in (compfx.Plan.amp(a), compfx.Plan.uniform(a, "low"), compfx.Plan.fp32(a)):
        result = predictor.breakdown(plan)
        assert result.n_casts == count_casts(apply(a.graph_module, plan, analysis=a))
        assert set(result.low_ops) >= {k for k, p in plan.items() if p == "low"}


def test_ops_run_under_autocast_are_priced_low():
    a = _analysis("mha")  # multi_head_attention runs under torch.autocast for "low"
    fake = _fake_predictor(a)
    predictor = Predictor(fake.profiles, fake.cast_cost, analysis=a)  # default rewrite: the cast pass
    mha = a.ops[0].key
    assert mha.kind == "multi_head_attention"
    assert mha in predictor.breakdown("00").low_ops
    assert mha not in predictor.breakdown("11").low_ops
