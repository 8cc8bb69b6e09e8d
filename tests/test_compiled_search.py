"""The compiled search: every plan measured as the program compfx.compile_with_plan trains, and plans that say so.

The compiled programs compile through ``"compfx_counting"``, AOT autograd around the graphs as they are (what
``"aot_eager"`` does), which counts what it compiles and what it runs: each program is told apart by the dtypes of
its matmuls (the plan's precisions). Timed windows are seen by wrapping compfx's one synchronised timer
(``measure.timed``). No timing is asserted: costs come from ``cost_fn``.
"""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import compfx
from compfx import CompileOptions, SearchConfig
from compfx import cache, measure
from compfx import optimization
from compfx.compile_backend import compile_with_plan, registered_backend
from compfx.compile_regions import RegionCache, RegionallyCompiled, region_plan
from compfx.errors import BadInputError, PlanFileError, SearchError
from compfx.search import sampling
from compfx.search.compiled import CompiledRunner
from compfx.search.config import decision_settings
from tests.helpers import batches, ce, fp32_op_count
from tests.quick import quick_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = dict(warmup=1, repeats=2, stage2_check_batches=2, predictor=False, cache_plan=False)  # over tests.quick's
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class Counting:
    """A ``torch.compile`` backend that compiles as ``"aot_eager"`` does and counts: compiles (forward and
    backward graphs, each noted with whether a timed window was open), and every run of a compiled forward, named
    by its program's tag (the dtypes of its matmuls), into the timed window open then."""

    def __init__(self):
        self.compiles: list[tuple[str, bool, bool]] = []  # (tag, in a timed window, dynamic shapes)
        self.window: list | None = None  # the forward runs of the timed window open now
        self.windows: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        dynamic = any(isinstance(value, torch.SymInt) for value in example_inputs)

        def forward(graph, inputs):
            tag = "/".join(str(node.meta["val"].dtype).removeprefix("torch.") for node in graph.graph.nodes
                           if node.target in MATMULS)
            self.compiles.append((tag, self.window is not None, dynamic))
            compiled = make_boxed_func(graph.forward)

            def run(args):
                if self.window is not None:
                    self.window.append(tag)
                return compiled(args)

            run._boxed_call = True
            return run

        def backward(graph, inputs):
            self.compiles.append(("backward", self.window is not None, dynamic))
            return make_boxed_func(graph.forward)

        return aot_autograd(fw_compiler=forward, bw_compiler=backward)(gm, example_inputs)

    def timed(self, real):
        """``measure.timed``, noting the compiled forwards each timed call runs."""
        def timed(fn, device):
            self.window = []
            try:
                return real(fn, device)
            finally:
                self.windows.append(self.window)
                self.window = None

        return timed


_counter: list[Counting] = []  # the counting backend of the test running now


@torch._dynamo.register_backend(name="compfx_counting")
def compfx_counting(gm, example_inputs):
    """The registered name of the running test's :class:`Counting` (a name registers once per process)."""
    return _counter[-1](gm, example_inputs)


@pytest.fixture
def counting(monkeypatch):
    """A fresh counting backend behind ``"compfx_counting"``, and compfx's timer wrapped to see timed windows."""
    counter = Counting()
    _counter.append(counter)
    timed = counter.timed(measure.timed)
    monkeypatch.setattr(measure, "timed", timed)
    monkeypatch.setattr(sampling, "timed", timed)
    yield counter
    _counter.remove(counter)
    torch._dynamo.reset()  # the programs compiled here hold the counting backend


COUNTED = CompileOptions(inner="compfx_counting")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def tag_of(plan: str) -> str:
    """The counting backend's tag of ``mlp``'s program under a plan string over its three ops."""
    return "/".join("bfloat16" if code == "0" else "float32" for code in (plan[0], plan[2]))


def search(model, loader, **config):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return compfx.optimize(model, loader, optimizer=opt, loss_fn=ce, config=quick_config(**{**FAST, **config}))


# -- every plan measured as the compiled program ------------------------------------------------------------------

def test_every_timed_step_of_every_plan_runs_its_compiled_program_and_nothing_compiles_in_a_timed_window(
        counting, monkeypatch):
    stepped = []
    step_only = sampling.FairSampler.step_only
    monkeypatch.setattr(sampling.FairSampler, "step_only",
                        lambda self, module, *rest: stepped.append(type(module)) or step_only(self, module, *rest))
    result = search(mlp(), batches(4, (16, 8)), compile=COUNTED,
                    cost_fn=lambda plan, seconds: float(sum(p == "fp32" for p in plan.values())))
    measured = {r.plan for r in result.log.samples() if r.status != "skipped"} | set(result.step_comparison.plans.values())
    assert len(measured) >= 3  # FP32's, AMP's and at least one candidate
    assert counting.windows and all(len(window) == 1 for window in counting.windows)  # one compiled forward each
    assert {window[0] for window in counting.windows} == {tag_of(plan) for plan in measured}
    assert counting.compiles and not any(in_window for _, in_window, _ in counting.compiles)
    assert set(stepped) == {CompiledRunner}  # warm-ups, epochs, duels, the loss check: all compiled
    assert "compile" in result.cost_breakdown and "compiled search" in result.report()
    assert result.plan.compile_options == COUNTED and result.module.compfx_backend.records


def test_each_program_compiles_as_in_a_process_of_its_own_when_a_ragged_batch_makes_shapes_dynamic(counting):
    loader = batches(3, (16, 8)) + batches(1, (5, 8), seed=1)  # a ragged last batch: dynamo recompiles dynamic
    search(mlp(), loader, compile=COUNTED, cost_fn=lambda plan, seconds: float(sum(p == "low" for p in plan.values())))
    forwards = [(tag, dynamic) for tag, _, dynamic in counting.compiles if tag != "backward"]
    first = {}
    for tag, dynamic in forwards:
        first.setdefault(tag, dynamic)
    assert len(first) >= 2 and not any(first.values())  # each program's first compile is static, the later ones'
    assert any(dynamic for _, dynamic in forwards)  # its recompile at the ragged batch is dynamic


def test_the_dynamo_settings_are_the_users_after_a_search_that_compiles_past_their_limits(counting):
    with torch._dynamo.config.patch(accumulated_recompile_limit=2):
        before = torch._dynamo.config.get_config_copy()
        result = search(mlp(), batches(3, (16, 8)), compile=COUNTED,
                        cost_fn=lambda plan, seconds: float(sum(p == "fp32" for p in plan.values())))
        assert torch._dynamo.config.get_config_copy() == before
    assert len({tag for tag, _, _ in counting.compiles if tag != "backward"}) >= 3  # past the user's cap of 2
    assert all(len(window) == 1 for window in counting.windows)  # and no program ran eagerly
    assert result.plan.compile_options == COUNTED


def test_a_program_that_would_recompile_past_the_users_limit_stops_the_search_saying_why(counting):
    loader = batches(2, (16, 8)) + batches(1, (5, 8), seed=1)
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(SearchError, match="recompile_limit"):
            search(mlp(), loader, compile=COUNTED)


# -- by regions: each block plan compiled once in the whole search -------------------------------------------------

def tiny_hf_gpt2(layers: int = 2):
    """A Hugging Face GPT-2 from a tiny config (no download): its blocks are ``transformer.h``'s."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16, attn_pdrop=0.0, embd_pdrop=0.0,
        resid_pdrop=0.0, use_cache=False))


def test_a_compiled_search_by_regions_compiles_each_block_plan_once_and_nothing_in_a_timed_window(counting,
                                                                                                   monkeypatch):
    caches = []  # the search's shared regions
    monkeypatch.setattr(optimization, "RegionCache", lambda: caches.append(RegionCache()) or caches[-1])
    model = tiny_hf_gpt2()
    g = torch.Generator().manual_seed(0)
    loader = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (2, 16), generator=g) for _ in "ab")]
    options = CompileOptions(inner="compfx_counting", regions="auto")
    config = {**FAST, "predictor": False, "stage1_budget": 6, "stage2_budget": 2, "stage2_check_batches": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # GPT2Model's own add runs eagerly between regions: it says so
        result = compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                 config=quick_config(**config, compile=options, cost_fn=fp32_op_count))
    assert result.plan.compile_options == options and isinstance(result.module, RegionallyCompiled)
    assert counting.compiles and not any(in_window for _, in_window, _ in counting.compiles)
    assert counting.windows and all(counting.windows)  # every timed step ran compiled graphs
    programs = {r.plan for r in result.log.samples() if r.status != "skipped"} | set(result.step_comparison.plans.values())
    blocks = ("transformer.h.0", "transformer.h.1")
    block_plans = {frozenset(region_plan(compfx.Plan.from_bitstring(result.analysis, bits), path).items())
                   for bits in programs for path in blocks}
    (shared,) = caches
    compiled_blocks = [(plan, backend) for module_type, plan, backend in shared.entries()
                       if module_type.__name__ == "GPT2Block"]
    assert len(programs) >= 4 and len(block_plans) >= 3  # FP32's, AMP's and candidates that change a block
    assert {frozenset(plan.items()) for plan, _ in compiled_blocks} == block_plans
    assert len(compiled_blocks) == len(block_plans) < 2 * len(programs)  # each block plan compiled once, not per program
    assert all(len(backend.records) == 1 for _, backend in compiled_blocks)  # one graph each, never recompiled
    assert shared.reuses > 0


# -- the compiled ranking decides --------------------------------------------------------------------------------

def fused_casts_device(plan, seconds) -> float:
    """A device where eagerly every low op costs its casts more than it saves, and compiled fusion removes the
    casts, so low precision pays: the eager and the compiled rankings of FP32's and AMP's plans differ."""
    precision = "fp32" if plan.compile_options is None else "low"
    return float(sum(p == precision for p in plan.values()))


def test_the_compiled_search_picks_the_compiled_winner_where_the_eager_ranking_differs(counting):
    loader = batches(3, (16, 8))
    eager = search(mlp(), loader, cost_fn=fused_casts_device)
    compiled = search(mlp(), loader, cost_fn=fused_casts_device, compile=COUNTED)
    a = eager.analysis
    assert eager.plan.bitstring(a) == "0f0" and eager.plan.compile_options is None
    assert compiled.plan.bitstring(a) == "111" and compiled.plan.compile_options == COUNTED


# -- the plan records it, and runs under it -----------------------------------------------------------------------

def test_the_plan_file_and_the_plan_cache_record_how_the_plan_was_searched(counting, tmp_path):
    model = mlp()
    result = search(model, batches(3, (16, 8)), compile=COUNTED, cache_plan=True, cache_dir=tmp_path)
    again = compile_with_plan(model)  # no plan given: the one this process searched for the model, as searched
    again(torch.randn(16, 8))
    assert again.compfx_backend.records[-1].origin == "searched"
    assert again.compfx_backend.records[-1].compiled_with["inner"] == "compfx_counting"
    written = json.loads(result.plan_path.read_text())
    assert written["compile"] == COUNTED.to_dict()
    found = cache.find_cached(result.plan.fingerprint, low_dtype=result.plan.low_dtype, cache_dir=tmp_path)
    assert found.plan.compile_options == COUNTED
    result.plan.save(tmp_path / "plan.json")
    assert compfx.Plan.load(tmp_path / "plan.json").compile_options == COUNTED
    assert pickle.loads(pickle.dumps(result.plan)).compile_options == COUNTED


def cached_plan_of(model, x, options, tmp_path, monkeypatch):
    """``model``'s AMP plan, recorded as searched under ``options``, in a plan cache of its own."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis).with_compile_options(options)
    cache.save_plan(plan)
    return plan


def test_backend_compfx_runs_a_cached_plan_with_the_options_it_was_searched_with(counting, tmp_path, monkeypatch):
    model, x = mlp(), torch.randn(16, 8)
    cached_plan_of(model, x, COUNTED, tmp_path, monkeypatch)
    torch._dynamo.reset()
    compiled_before = len(counting.compiles)
    F.cross_entropy(torch.compile(model, backend="compfx")(x), torch.zeros(16, dtype=torch.long)).backward()
    record = registered_backend().records[-1]
    assert record.origin == "cache" and record.compiled_with["inner"] == "compfx_counting"
    assert [tag for tag, _, _ in counting.compiles[compiled_before:]] == [tag_of("0f0"), "backward"]


def test_compile_with_plan_runs_a_loaded_plan_with_its_options_and_warns_when_given_others(counting, tmp_path,
                                                                                        monkeypatch):
    model, x = mlp(), torch.randn(16, 8)
    plan = cached_plan_of(model, x, COUNTED, tmp_path, monkeypatch)
    plan.save(tmp_path / "plan.json")
    loaded = compfx.Plan.load(tmp_path / "plan.json")
    compiled = compile_with_plan(model, loaded)
    compiled(x)
    assert compiled.compfx_backend.records[-1].compiled_with["inner"] == "compfx_counting"
    assert counting.compiles and not hasattr(model, "compfx_backend")  # the user's model is not written to
    other = compile_with_plan(model, loaded, inner="aot_eager")
    with pytest.warns(UserWarning, match=r"measured it compiled with inner='compfx_counting'.*inner: "
                                         r"'compfx_counting' -> 'aot_eager'"):
        other(x)
    dynamic = loaded.with_compile_options(CompileOptions(inner="aot_eager", dynamic=True))
    with pytest.warns(UserWarning, match=r"dynamic: True -> None"):
        torch.compile(model, backend=compfx.backend(dynamic))(x)  # torch.compile's own dynamic is not the plan's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        as_searched = compile_with_plan(model, dynamic)  # torch.compile(dynamic=True), as the plan records
        as_searched(x)
    assert as_searched.compfx_backend.records[-1].compiled_with["dynamic"] is True


# -- settings and files -------------------------------------------------------------------------------------------

def test_search_config_takes_compile_options_true_or_none():
    assert SearchConfig(compile=True).compile == CompileOptions()
    assert SearchConfig(compile=False).compile is None and SearchConfig().compile is None
    assert decision_settings(SearchConfig(compile=CompileOptions(inner="aot_eager")))["compile"]["inner"] == "aot_eager"
    with pytest.raises(BadInputError, match="SearchConfig\\(compile='inductor'\\)"):
        SearchConfig(compile="inductor")
    with pytest.raises(BadInputError, match="not a registered torch.compile backend"):
        SearchConfig(compile=CompileOptions(inner="no-such-backend"))
    with pytest.raises(BadInputError, match="configures Inductor"):
        CompileOptions(inner="aot_eager", mode="max-autotune")
    with pytest.raises(BadInputError, match="JSON|strings, numbers"):
        CompileOptions(inductor_options={"post_grad_custom_pass": print})


def test_a_compiled_search_per_module_is_refused_before_any_work():
    model = mlp()
    with pytest.raises(BadInputError, match="per_module"):
        compfx.optimize(model, batches(2, (16, 8)), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        loss_fn=ce, config=SearchConfig(compile=CompileOptions(inner="aot_eager")),
                        per_module=(nn.Linear,))


def test_plan_files_without_compile_options_load_and_bad_ones_are_refused():
    a = compfx.analyze(mlp(), torch.randn(4, 8))
    data = compfx.Plan.amp(a).to_dict()
    assert "compile" not in data and compfx.Plan.from_dict(data).compile_options is None
    assert data["version"] == 1  # the lowest version that holds it: a compfx without compiled search reads it
    compiled = compfx.Plan.amp(a).with_compile_options(CompileOptions(inner="aot_eager")).to_dict()
    assert compiled["version"] == 3 and compiled["compile"]["inner"] == "aot_eager"
    assert compfx.Plan.from_dict(compiled).compile_options == CompileOptions(inner="aot_eager")
    with pytest.raises(PlanFileError, match="compile"):  # a version 1 file holds no compile options
        compfx.Plan.from_dict({**data, "compile": {"inner": "aot_eager"}})
    for bad in ({"inner": 3}, {"backend": "inductor"}, {"mode": "fastest"}, ["inductor"]):
        with pytest.raises(PlanFileError, match="compile"):
            compfx.Plan.from_dict({**compiled, "compile": bad})


def test_the_benchmark_times_the_chosen_plan_and_fp32s_compiled_programs_taking_turns(counting):
    from benchmarks.compiled_search import independent_speedup

    model, loader = mlp(), batches(2, (16, 8))
    analysis = compfx.analyze(model, loader[0][0])
    plans = {"fp32": compfx.Plan.fp32(analysis), "chosen": compfx.Plan.amp(analysis)}
    timed = independent_speedup(model, plans, loader, ce, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                COUNTED, rounds=3, warmup=1)
    assert [len(timed["seconds"][name]) for name in plans] == [3, 3]
    assert timed["speedup_low"] <= timed["speedup"] <= timed["speedup_high"]
    assert sorted(window[0] for window in counting.windows) == sorted([tag_of("111"), tag_of("0f0")] * 3)
