"""What the Trainer callbacks share: the regions a model is planned by, planning it in place, and putting its own
submodules back (compfx.integrations.planned_training, per_module.restore_blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.errors import BadInputError
from compfx.integrations.planned_training import plan_model, planned_regions
from compfx.per_module import PlannedBlock, restore_blocks
from compfx.regions import analyze_regions
from tests.quick import quick_config


class Stack(nn.Module):
    """Like a LightningModule: a loss module and a metric-like child that forward never runs, a ModuleList, and
    ops of its own outside any submodule."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(16, 4)
        self.criterion = nn.CrossEntropyLoss()  # the training step's, not forward's
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x) / self.temperature


def ce(output, batch):
    return F.cross_entropy(output, batch[-1])


def batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


FAST_SEARCH = quick_config(stage1_budget=4, stage2_budget=2, cache_plan=False)


def test_the_regions_are_the_outermost_submodules_forward_runs():
    model = Stack()
    rng, state = torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}
    regions, types = planned_regions(model, batches()[0], lambda out, batch: model.criterion(out, batch[-1]))
    assert regions == ["embed", "layers.0", "layers.1", "head"]  # not the loss's criterion, not the ModuleList
    assert types == (nn.Linear, nn.Sequential)
    assert compfx.regions.region_paths(model, types) == regions  # what optimize(per_module=types) plans
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert not model.embed._forward_pre_hooks  # its hooks are gone


def test_a_module_of_a_regions_type_that_forward_does_not_run_is_refused_by_name():
    model = Stack()
    model.spare = nn.Linear(16, 16)  # a Linear, like the regions embed and head, that forward never runs
    with pytest.raises(BadInputError, match="'spare' \\(Linear\\)"):
        planned_regions(model, batches()[0], ce)


def test_plan_model_searches_plans_in_place_and_restore_puts_the_same_modules_back():
    torch.manual_seed(0)
    model = Stack()
    children, keys = dict(model.named_modules()), list(model.state_dict())
    seen = []
    handle = model.head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = plan_model(model, batches(), optimizer=optimizer, loss_fn=ce, config=FAST_SEARCH)
    assert run.searched and set(run.blocks) == {"embed", "layers.0", "layers.1", "head"}
    assert all(isinstance(model.get_submodule(path), PlannedBlock) for path in run.regions)
    assert list(model.state_dict()) == keys and "forward" not in vars(model)
    assert set(map(str, run.plan)) == {str(op.key) for op in run.result.analysis.ops}  # the regions' ops only
    seen.clear()
    model(batches()[0][0])
    assert seen == [torch.Size([8, 4])]  # the user's hook on the head fires on the planned head
    late = model.layers[0].register_forward_pre_hook(lambda module, args: seen.append("late"))
    model.train(False)

    run.restore()
    run.restore()  # idempotent
    assert dict(model.named_modules()) == children and run.blocks == {}
    assert all(model.get_submodule(path) is module for path, module in children.items())
    assert model.layers[0].training is False  # the mode it had when it was given back
    seen.clear()
    model(batches()[0][0])
    assert seen == ["late", torch.Size([8, 4])]  # hooks follow the modules back, both the old and the new
    handle.remove()
    late.remove()
    assert not model.head._forward_hooks and not model.layers[0]._forward_pre_hooks


def test_a_failed_search_puts_the_models_own_modules_back():
    model = Stack()
    children = list(model.modules())
    calls = []

    def interrupted(output, batch):
        calls.append(1)
        if len(calls) == 4:  # the first-batch checks passed; the search is running on planned blocks
            raise KeyboardInterrupt
        return ce(output, batch)

    with pytest.raises(KeyboardInterrupt):
        plan_model(model, batches(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=interrupted,
                   config=FAST_SEARCH)
    assert all(a is b for a, b in zip(model.modules(), children, strict=True))


def test_a_given_plan_is_applied_without_search():
    model = Stack()
    regions_analysis = analyze_regions(model, batches()[0][0], (nn.Linear, nn.Sequential))
    plan = compfx.Plan.amp(regions_analysis)
    run = plan_model(model, batches(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce, plan=plan,
                     source="a file")
    assert not run.searched and run.plan is plan and model.head.plan is plan
    assert "loaded from a file, no search" in run.summary()
    restore_blocks(model)
    assert type(model.head) is nn.Linear


class TestHuggingFace:
    transformers = pytest.importorskip("transformers")

    def _gpt2(self):
        config = self.transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        return self.transformers.GPT2LMHeadModel(config)

    def test_regions_of_a_model_the_record_tracer_captures_are_each_captured_once(self):
        model = self._gpt2()
        ids = torch.randint(0, 64, (2, 16))
        analysis = analyze_regions(model, {"input_ids": ids}, (type(model.transformer), nn.Linear))
        assert {op.key.module.split(".")[0] for op in analysis.ops} == {"transformer", "lm_head"}

    def test_a_planned_base_model_still_answers_the_models_api(self):
        model = self._gpt2()
        batch = {"input_ids": torch.randint(0, 64, (2, 16))}
        batch["labels"] = batch["input_ids"]
        regions, types = planned_regions(model, batch)
        plan = compfx.Plan.amp(analyze_regions(model, batch, types))
        run = plan_model(model, [batch], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
        assert regions == ["transformer", "lm_head"] and isinstance(model.transformer, PlannedBlock)
        assert model.transformer.config is model.config
        assert model.get_input_embeddings() is model.transformer.wte
        assert torch.isfinite(model(**batch).loss)  # the loss, outside the regions, runs eagerly
        run.restore()
        assert type(model.transformer).__name__ == "GPT2Model"
