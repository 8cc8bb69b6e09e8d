"""compfx.plan_blocks(model, plan, blocks=...): the plan applied block by block, in the model itself."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import compfx
from compfx.errors import BadInputError
from compfx.per_module import PlannedBlock
from compfx.regions import analyze_regions


class Block(nn.Module):
    def __init__(self, width=16, dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)
        self.scale = nn.Parameter(torch.ones(width))  # a Parameter of the block itself, not of a child

    def forward(self, x):
        return x + self.scale * self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, dropout=0.0, checkpointed=False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(dropout=dropout), Block(dropout=dropout)])
        self.head = nn.Linear(16, 4)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def grads_after_step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def test_plan_blocks_returns_the_same_model_with_the_blocks_replaced_and_the_same_state():
    torch.manual_seed(0)
    model = Net()
    x, _ = data()
    analysis = compfx.analyze(model, x)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    out = compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=(Block,))
    assert out is model
    assert all(isinstance(b, PlannedBlock) and b.block_type is Block for b in model.blocks)
    assert not isinstance(model.embed, PlannedBlock) and not isinstance(model.head, PlannedBlock)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert model(x).dtype == torch.float32
    # the blocks' graphs run the plan: bf16 casts inside, none outside
    graph = model.blocks[0].graph_for(model.embed(x))
    assert compfx.passes.count_casts(graph) > 0
    assert any(n.target == "_compfx_block.fc1.weight" for n in graph.graph.nodes if n.op == "get_attr")


def test_fp32_plan_applied_per_block_is_bitwise_eager_in_forward_and_grads():
    torch.manual_seed(0)
    eager = Net()
    planned = Net()
    planned.load_state_dict(eager.state_dict())
    x, y = data()
    analysis = compfx.analyze(planned, x)
    compfx.plan_blocks(planned, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(Block,))
    loss_e, grads_e = grads_after_step(eager, x, y)
    loss_p, grads_p = grads_after_step(planned, x, y)
    assert torch.equal(loss_e, loss_p)
    assert grads_e.keys() == grads_p.keys()
    for name in grads_e:
        assert torch.equal(grads_e[name], grads_p[name]), name


def test_activation_checkpointing_around_planned_blocks_gives_the_grads_of_no_checkpointing():
    torch.manual_seed(0)
    plain, ckpt = Net(), Net(checkpointed=True)
    ckpt.load_state_dict(plain.state_dict())
    x, y = data()
    a_plain = compfx.analyze(plain, x)
    compfx.plan_blocks(plain, compfx.Plan.amp(a_plain), analysis=a_plain, blocks=(Block,))
    a_ckpt = analyze_regions(ckpt, x, (Block,))  # checkpoint() is not capturable whole; the blocks are
    compfx.plan_blocks(ckpt, compfx.Plan.amp(a_ckpt), analysis=a_ckpt, blocks=(Block,))
    calls = []
    ckpt.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    loss_p, grads_p = grads_after_step(plain, x, y)
    loss_c, grads_c = grads_after_step(ckpt, x, y)
    assert len(calls) == 2  # forward, then the recomputation in backward: checkpointing really ran
    torch.testing.assert_close(loss_c, loss_p, rtol=0, atol=0)
    for name in grads_p:
        torch.testing.assert_close(grads_c[name], grads_p[name], rtol=0, atol=0, msg=name)


def test_hooks_train_eval_and_a_new_batch_size_keep_working():
    torch.manual_seed(0)
    model = Net(dropout=0.5)
    x, _ = data()
    analysis = compfx.analyze(model, x)
    seen = []
    handle = model.blocks[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(Block,))
    model(x)
    assert seen == [torch.Size([6, 16])]  # the user's hook on the block fires on the planned block
    handle.remove()
    model(x)
    assert len(seen) == 1
    model.eval()  # dropout off: the eval graph is a graph of its own, deterministic
    assert not model.blocks[0].training and not model.blocks[0].drop.training
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(x), model(x))  # dropout on again
    assert model(torch.randn(3, 8)).shape == (3, 4)


def test_a_block_that_cannot_be_captured_whole_model_still_plans_its_blocks():
    class Branchy(Net):
        def forward(self, x):
            x = self.embed(x)
            if x.sum() > -1e9:  # a branch on a tensor's value: no tracer captures the whole model
                for block in self.blocks:
                    x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Branchy()
    x, _ = data()
    with pytest.raises(compfx.CaptureError):
        compfx.analyze(model, x)
    analysis = analyze_regions(model, x, (Block,))
    assert {k.module.split(".")[0] for k in analysis.keys} == {"blocks"}
    compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=(Block,))
    assert model(x).shape == (6, 4)


def test_apply_per_module_still_plans_the_blocks_in_place_with_a_deprecation_warning():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    x, _ = data()
    analysis = compfx.analyze(model, x)
    with pytest.warns(DeprecationWarning, match=r"compfx.plan_blocks\(model, plan, example_inputs, blocks=...\)"):
        out = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis, per_module=(Block,))
    assert out is model and all(isinstance(b, PlannedBlock) for b in model.blocks)
    blocks_alone = analyze_regions(copy.deepcopy(twin), x, Block)
    with pytest.warns(DeprecationWarning):  # from example inputs: each block captured alone, as before
        compfx.apply(twin, compfx.Plan.amp(blocks_alone), x, per_module=Block)
    assert all(isinstance(b, PlannedBlock) for b in twin.blocks)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)


def test_per_module_naming_no_block_or_the_model_itself_is_refused():
    model = Net()
    x, _ = data()
    analysis = compfx.analyze(model, x)
    with pytest.raises(BadInputError, match="no submodule"):
        compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=(nn.Conv2d,))
    with pytest.raises(BadInputError, match="model's own class"):
        compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=(Net,))
    with pytest.raises(BadInputError, match="nn.Module classes"):
        compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=("Block",))
    assert not any(isinstance(m, PlannedBlock) for m in model.modules())


def test_search_per_module_returns_the_model_running_the_chosen_plan():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = [data() for _ in range(2)]
    config = compfx.SearchConfig(progress=False, repeats=1, warmup=0, stage1_budget=4, stage2_budget=2,
                                 cache_plan=False, cost_fn=lambda plan, seconds: 1.0 + sum(
                                     p is compfx.Precision.FP32 for p in plan.values()))
    result = compfx.optimize(model, loader, optimizer=optimizer, per_module=(Block,),
                             loss_fn=lambda out, batch: F.cross_entropy(out, batch[-1]), config=config)
    assert result.module is model
    assert all(k.module.startswith("blocks.") for k in result.plan)
    assert all(b.plan is result.plan for b in model.blocks)


def test_decoder_blocks_handed_the_models_kv_cache_are_captured_without_writing_into_it():
    # a Hugging Face decoder with use_cache on (its config's default) hands every block the forward's DynamicCache,
    # which the block writes its keys into; capturing and checking the block must neither crash on it nor leave
    # the tracer's fake tensors or extra keys in it
    transformers = pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                  n_positions=16, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (2, 8))
    assert model.config.use_cache
    analysis = analyze_regions(model, {"input_ids": ids}, GPT2Block)
    assert {str(k).split(":")[0].split(".attn")[0] for k in analysis.keys} >= {"transformer.h.0", "transformer.h.1"}
    cache = transformers.DynamicCache(config=model.config)  # the caller's own cache, passed in
    analyze_regions(model, {"input_ids": ids, "past_key_values": cache}, GPT2Block)
    keys = [layer.keys for layer in cache.layers]
    assert not any(isinstance(k, FakeTensor) for k in keys)
    assert cache.get_seq_length() == 8  # what the model's own forward wrote, once: no capture's keys on top


def test_pricing_a_plan_whose_blocks_ran_works_nothing_out_on_faketensors_again(monkeypatch):
    # the search prices plans on the blocks' graphs side by side; a plan the blocks have run was worked out on
    # FakeTensors when they built their graphs, and pricing it must reuse that, not do it again
    from compfx.passes.propagate_dtypes import DtypePropagator
    from compfx.planned_module import priced_regions_graph
    from compfx.per_module import plan_blocks_fp32

    model, (x, _) = Net(), data()
    analysis = plan_blocks_fp32(model, x, Block)
    plan = compfx.Plan.amp(analysis)
    categories = {op.key: op.category for op in analysis.ops}
    for module in model.modules():
        if isinstance(module, PlannedBlock):
            module.use_plan(plan, categories)
    model(x).sum().backward()  # a training step builds each block's graph for the plan

    fake_runs = []
    run_fake = DtypePropagator._run_fake
    monkeypatch.setattr(DtypePropagator, "_run_fake",
                        lambda self, run: fake_runs.append(run) or run_fake(self, run))
    priced = priced_regions_graph(analysis, plan)
    assert fake_runs == []
    assert compfx.passes.count_casts(priced) > 0  # it is the plan's graph, casts and all


def test_a_blocks_dropout_switched_off_after_planning_is_off_in_the_planned_block():
    # the block's graphs were keyed on the block's own mode: a child put in eval mode inside it kept its
    # training-mode graph (dropout still dropping)
    torch.manual_seed(0)
    model = Net(dropout=0.5)
    x, _ = data()
    analysis = compfx.analyze(model, x)
    compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(Block,))
    model(x)  # the training-mode graphs, built
    for block in model.blocks:
        block.drop.eval()
    eager = Net(dropout=0.5)
    eager.load_state_dict(model.state_dict())
    for block in eager.blocks:
        block.drop.eval()
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)


def test_plan_blocks_fp32_plans_the_blocks_in_place_and_trains_as_the_model_did():
    # what a search per block starts from (the apply stage's work): every block a PlannedBlock running FP32, each
    # holding the capture the analysis made, and a training step bitwise the eager model's
    from compfx.per_module import plan_blocks_fp32

    torch.manual_seed(0)
    model, (x, y) = Net(), data()
    eager = {name: t.clone() for name, t in model.state_dict().items()}
    before = grads_after_step(model, x, y)
    analysis = plan_blocks_fp32(model, x, Block)
    assert [type(block) for block in model.blocks] == [PlannedBlock, PlannedBlock]
    assert {str(key).split(":")[0] for key in analysis.keys} >= {"blocks.0.fc1", "blocks.1.fc2"}
    assert all(precision is compfx.Precision.FP32 for block in model.blocks for precision in block.plan.values())
    assert list(model.state_dict()) == list(eager)
    assert all(len(block._captures) == 1 for block in model.blocks)  # the analysis's captures, not new ones
    after = grads_after_step(model, x, y)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    for name, grad in before[1].items():
        torch.testing.assert_close(after[1][name], grad, rtol=0, atol=0)
