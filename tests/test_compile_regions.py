"""Regional compilation: compile_with_plan(..., regions=...) compiles each repeated block once per block plan.

Compiled with inner="aot_eager" (AOT autograd without Inductor's slow CPU compiles), so the planned programs
train to compfx.apply's losses exactly; the records say which graphs were compiled and what ran in them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.planned_module import apply
from compfx.compile_backend import compile_with_plan
from compfx.compile_regions import RegionCache, RegionallyCompiled, region_plan, repeated_blocks
from compfx.errors import BadInputError
from compfx.examples import _Block
from compfx.opkey import OpKey

from tests.tiny_gpt import lm_loss, tiny_gpt, token_batches

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

EXACT = dict(rtol=1e-5, atol=1e-6)  # aot_eager runs the planned graph's ops as apply does: float tolerance only


class LoopGPT(nn.Module):
    """nanoGPT's layout: the blocks in an nn.ModuleList, called in a for loop of the model's forward."""

    def __init__(self, layers: int = 2, width: int = 32, heads: int = 2, length: int = 16, vocab: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loop_gpt(layers: int, seed: int = 0) -> LoopGPT:
    torch.manual_seed(seed)
    return LoopGPT(layers)


def train(module, parameters, batches) -> list[float]:
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    losses = []
    for batch in batches:
        loss = lm_loss(module(batch[0]), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def losses_of_apply(make, plan, batches) -> list[float]:
    """The same model, freshly made, trained under compfx.apply's planned module: what the regions must match."""
    model = make()
    return train(apply(model, plan, batches[0][0]), model.parameters(), batches)


def assert_runs_the_plan(records, plan, low_dtype):
    """Every planned op ran, in some graph, at its planned precision (compute dtypes read from the records)."""
    expected = {"low": low_dtype, "fp32": torch.float32}
    ran = {}
    for record in records:
        for key, precision in record.precisions.items():
            assert precision == plan.get(key, "follow"), key
            if precision in expected:
                assert record.compute_dtypes[key] == expected[precision], f"{key} ran in {record.compute_dtypes[key]}"
            ran[key] = precision
    assert set(ran) == set(plan), f"planned ops no graph ran: {sorted(map(str, set(plan) - set(ran)))[:5]}"


def graphs_compiled(compiled: RegionallyCompiled) -> int:
    """Forward graphs compfx's backends compiled: the model's own code's and each region's (one per region)."""
    return len(compiled.compfx_backend.records) + sum(len(r.backend.records) for r in compiled.compfx_regions)


# ---------------------------------------------------------------------------
# finding the blocks


@pytest.mark.parametrize("make, expected", [
    (lambda: tiny_gpt(3), ["blocks.0", "blocks.1", "blocks.2"]),  # an nn.Sequential of blocks
    (lambda: loop_gpt(2), ["h.0", "h.1"]),  # an nn.ModuleList of blocks
    (lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), []),  # layers of several classes
    (lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), []),  # layers, not blocks
    (lambda: nn.ModuleList([tiny_gpt(1).blocks[0]] * 2), []),  # one block twice: its calls would share keys
    (lambda: nn.Sequential(tiny_gpt(2), tiny_gpt(2)), ["0", "1"]),  # the outermost repeats only
])
def test_repeated_blocks_are_the_entries_of_a_container_of_one_block_class(make, expected):
    assert repeated_blocks(make()) == expected


def test_a_block_plan_is_the_plan_inside_the_block_keyed_from_the_block():
    model = tiny_gpt(2)
    analysis = compfx.analyze(model, token_batches(1)[0][0])
    plan = compfx.Plan.amp(analysis).with_precisions({OpKey("blocks.1.mlp.0", "linear", 0): "fp32"})
    first, second = region_plan(plan, "blocks.0"), region_plan(plan, "blocks.1")
    assert set(first) == set(second) and first != second
    assert second[OpKey("mlp.0", "linear", 0)] == "fp32" and first[OpKey("mlp.0", "linear", 0)] == "low"
    assert OpKey("", "add", 0) in first  # the block's own residual add, keyed at the block itself
    assert len(first) + len(second) == sum(key.module.startswith("blocks.") for key in plan)


# ---------------------------------------------------------------------------
# one compiled block for every block with the same plan


def test_the_same_plan_in_every_block_compiles_one_block_graph_at_every_depth():
    graphs = {}
    for layers in (2, 4, 8):
        batches = token_batches(3)
        model = tiny_gpt(layers)
        analysis = compfx.analyze(model, batches[0][0])
        plan = compfx.Plan.amp(analysis)
        compiled = compile_with_plan(model, plan, inner="aot_eager", regions="auto")
        losses = train(compiled, model.parameters(), batches)
        (region,) = compiled.compfx_regions
        assert region.paths == tuple(f"blocks.{i}" for i in range(layers))
        assert len(region.backend.records) == 1, "one block graph, shared by every block"
        assert {r.region for r in compiled.records} == {"", *region.paths}
        assert_runs_the_plan(compiled.records, plan, analysis.low_dtype)
        torch.testing.assert_close(losses, losses_of_apply(lambda: tiny_gpt(layers), plan, batches), **EXACT)
        graphs[layers] = graphs_compiled(compiled)
    assert len(set(graphs.values())) == 1, f"graphs compiled by depth: {graphs}"


def test_blocks_with_two_plans_compile_two_block_graphs():
    batches = token_batches(3)
    model = tiny_gpt(4)
    analysis = compfx.analyze(model, batches[0][0])
    amp = compfx.Plan.amp(analysis)
    plan = amp.with_precisions({key: "fp32" for key in amp if key.module.startswith(("blocks.1.", "blocks.3."))})
    compiled = compile_with_plan(model, plan, inner="aot_eager", regions="auto")
    losses = train(compiled, model.parameters(), batches)
    assert sorted(r.paths for r in compiled.compfx_regions) == [("blocks.0", "blocks.2"), ("blocks.1", "blocks.3")]
    assert [len(r.backend.records) for r in compiled.compfx_regions] == [1, 1]
    assert_runs_the_plan(compiled.records, plan, analysis.low_dtype)
    torch.testing.assert_close(losses, losses_of_apply(lambda: tiny_gpt(4), plan, batches), **EXACT)


def test_block_classes_name_the_regions_and_the_model_is_its_own_between_calls():
    batches = token_batches(1)
    model = tiny_gpt(2)
    blocks = list(model.blocks)
    plan = compfx.Plan.amp(compfx.analyze(model, batches[0][0]))
    compiled = compile_with_plan(model, plan, inner="aot_eager", regions=(_Block,))
    compiled(batches[0][0])
    assert [r.paths for r in compiled.compfx_regions] == [("blocks.0", "blocks.1")]
    assert list(model.blocks) == blocks and list(compiled.parameters()) == list(model.parameters())
    assert compiled.wte is model.wte  # the model's attributes, as torch.compile's wrapper forwards them
    model.blocks[1] = _Block(32, 2)
    with pytest.raises(BadInputError, match="replaced after compile_with_plan"):
        compiled(batches[0][0])


# ---------------------------------------------------------------------------
# a forward that calls its blocks in a loop


def test_a_model_calling_its_blocks_in_a_loop_compiles_its_other_children_as_regions():
    batches = token_batches(3)
    model = loop_gpt(4)
    analysis = compfx.analyze(model, batches[0][0])
    plan = compfx.Plan.amp(analysis)
    compiled = compile_with_plan(model, plan, inner="aot_eager", regions="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(compiled, model.parameters(), batches)
    assert not [w for w in caught if "no compiled graph" in str(w.message)], "the op left uncompiled follows"
    paths = sorted(path for region in compiled.compfx_regions for path in region.paths)
    assert paths == sorted(["h.0", "h.1", "h.2", "h.3", "wte", "wpe", "ln_f", "lm_head"])
    assert len(next(r for r in compiled.compfx_regions if "h.0" in r.paths).backend.records) == 1
    own = [key for key in plan if key not in {k for r in compiled.records for k in r.precisions}]
    assert [str(key) for key in own] == [":add#0"] and plan[own[0]] == "follow"
    torch.testing.assert_close(losses, losses_of_apply(lambda: loop_gpt(4), plan, batches), **EXACT)


def test_a_planned_op_left_to_a_loop_forward_s_own_code_is_warned_about():
    batches = token_batches(1)
    model = loop_gpt(2)
    plan = compfx.Plan.amp(compfx.analyze(model, batches[0][0])).with_precisions({OpKey("", "add", 0): "low"})
    compiled = compile_with_plan(model, plan, inner="aot_eager", regions="auto")
    with pytest.warns(UserWarning, match=r"1 op\(s\) of the plan ran in no compiled graph.*:add#0"):
        compiled(batches[0][0])


def test_a_hugging_face_gpt2_compiles_one_block_graph_and_its_loss_by_regions():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    ids = token_batches(1)[0][0]
    inputs = {"input_ids": ids, "labels": ids}
    plan = compfx.Plan.amp(compfx.analyze(model, inputs))
    compiled = compile_with_plan(model, plan, inner="aot_eager", regions="auto")
    loss = compiled(**inputs).loss
    blocks = next(r for r in compiled.compfx_regions if "transformer.h.0" in r.paths)
    assert blocks.paths == ("transformer.h.0", "transformer.h.1")
    assert len(blocks.backend.records) == 1
    ran = {key for record in compiled.records for key in record.precisions}
    assert {key for key in plan if key not in ran} == {OpKey("transformer", "add", 0)}  # GPT2Model's own code
    assert {OpKey("lm_head", "linear", 0), OpKey("", "cross_entropy", 0)} <= ran  # the model's own, compiled
    assert_runs_the_plan(compiled.records, {k: p for k, p in plan.items() if k in ran}, plan.low_dtype)
    torch.testing.assert_close(loss, apply(model, plan, inputs)(**inputs).loss, **EXACT)
    assert type(model.transformer).__name__ == "GPT2Model"  # back in place after the call


# ---------------------------------------------------------------------------
# arguments, and compiling many plans


def test_regions_fall_back_to_the_whole_model_or_refuse_what_cannot_be_divided():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = compfx.Plan.amp(compfx.analyze(model, torch.randn(2, 4)))
    whole = compile_with_plan(model, plan, inner="eager", regions="auto")  # no repeated blocks
    assert not isinstance(whole, RegionallyCompiled)
    whole(torch.randn(2, 4))
    assert len(whole.compfx_backend.records) == 1
    with pytest.raises(BadInputError, match="regions='every'"):
        compile_with_plan(model, plan, inner="eager", regions="every")
    with pytest.raises(BadInputError, match="needs the plan"):
        compile_with_plan(tiny_gpt(2), None, inner="eager", regions=(_Block,))


@pytest.mark.parametrize("regions", [None, "auto"])
def test_many_plans_of_one_model_each_compile_past_dynamo_s_recompile_limit(regions):
    batches = token_batches(1)
    model = tiny_gpt(2)
    analysis = compfx.analyze(model, batches[0][0])
    plans = [compfx.Plan.amp(analysis), compfx.Plan.fp32(analysis)]
    for i in range(torch._dynamo.config.recompile_limit + 2):  # each compile is another backend: a recompile
        compiled = compile_with_plan(model, plans[i % 2], inner="eager", regions=regions)
        compiled(batches[0][0])
        records = compiled.records if regions else compiled.compfx_backend.records
        assert records and all(r.plan_fingerprint == analysis.fingerprint for r in records), f"compile {i}"


# ---------------------------------------------------------------------------
# programs sharing their regions, and plans that record regions


def graphs_dynamo_compiled(run) -> int:
    """Graphs dynamo compiled while ``run()`` ran (its own counter of the distinct graphs it handed a backend)."""
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    run()
    return counters["unique_graphs"] - before


@pytest.mark.parametrize("shared", [True, False])
def test_a_plan_that_changes_one_block_compiles_that_block_s_region_alone_when_programs_share_regions(shared):
    batches = token_batches(1)
    model = tiny_gpt(4)
    amp = compfx.Plan.amp(compfx.analyze(model, batches[0][0]))
    one_block = amp.with_precisions({key: "fp32" for key in amp if key.module.startswith("blocks.1.")})
    cache = RegionCache() if shared else None
    compiled = {}
    graphs = {}
    for name, plan in (("amp", amp), ("one block", one_block), ("amp again", amp)):
        compiled[name] = compile_with_plan(model, plan, inner="aot_eager", regions="auto", shared_regions=cache)
        graphs[name] = graphs_dynamo_compiled(lambda: train(compiled[name], model.parameters(), batches))
    own = len(compiled["amp"].compfx_backend.records)  # the model's own code around the regions: every program's
    assert own >= 1 and all(len(c.compfx_backend.records) == own for c in compiled.values())
    if shared:  # the changed block's region, then nothing but the model's own code
        assert graphs == {"amp": own + 1, "one block": own + 1, "amp again": own}
        assert [(t.__name__, len(b.records)) for t, _, b in cache.entries()] == [("_Block", 1), ("_Block", 1)]
        assert cache.reuses == 2  # blocks 0, 2, 3 in the second program; every block in the third
    else:  # every program compiles each of its block plans
        assert graphs == {"amp": own + 1, "one block": own + 2, "amp again": own + 1}
    assert_runs_the_plan(compiled["one block"].records, one_block, amp.low_dtype)


def test_a_plan_records_regions_and_compiles_by_them_again_from_its_file(tmp_path):
    batches = token_batches(2)
    model = tiny_gpt(2)
    analysis = compfx.analyze(model, batches[0][0])
    options = compfx.CompileOptions(inner="aot_eager", regions=(_Block,))
    assert options.regions == ("compfx.examples._Block",)  # a class is recorded by its name
    compfx.Plan.amp(analysis).with_compile_options(options).save(tmp_path / "plan.json")
    written = (tmp_path / "plan.json").read_text()
    assert '"regions": [' in written
    loaded = compfx.Plan.load(tmp_path / "plan.json")
    assert loaded.compile_options == options
    compiled = compile_with_plan(model, loaded)  # by the regions it records
    losses = train(compiled, model.parameters(), batches)
    assert isinstance(compiled, RegionallyCompiled) and compiled.compfx_regions[0].paths == ("blocks.0", "blocks.1")
    assert {record.compiled_with["inner"] for record in compiled.records} == {"aot_eager"}
    torch.testing.assert_close(losses, losses_of_apply(lambda: tiny_gpt(2), loaded, batches), **EXACT)
    whole = compile_with_plan(tiny_gpt(2), loaded, regions=False)  # given, a setting wins over the recorded one
    assert not isinstance(whole, RegionallyCompiled)
    assert "regions" not in compfx.CompileOptions(inner="aot_eager").to_dict()  # files as compfx wrote them before
    with pytest.raises(BadInputError, match="regions="):
        compfx.CompileOptions(regions=3)


def test_backend_compfx_compiles_a_plan_searched_by_regions_whole_and_says_so(caplog):
    batches = token_batches(1)
    model = tiny_gpt(2)
    plan = compfx.Plan.amp(compfx.analyze(model, batches[0][0]))
    plan = plan.with_compile_options(compfx.CompileOptions(inner="aot_eager", regions="auto"))
    with caplog.at_level("INFO", logger="compfx"):
        compiled = torch.compile(model, backend=compfx.backend(plan))
        compiled(batches[0][0])
    assert "searched compiled by regions, compiles whole here" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="compfx"):
        compile_with_plan(model, plan)(batches[0][0])
    assert "compiles whole here" not in caplog.text
