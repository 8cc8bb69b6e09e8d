"""How people train around a plan: optimizers, gradients and loops that compfx's own steps must take as they are."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import compfx
from helpers import ce

QUICK = dict(progress=False, stage1_budget=4, decision=compfx.DecisionRule(rounds=3, confidence=0.7), cache_plan=False)


class SparseBag(nn.Module):
    """A bag of token embeddings with sparse gradients (``sparse=True``), which SGD, Adagrad and SparseAdam take."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def token_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 10, (8, 4), generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def test_a_model_with_sparse_gradients_is_searched_guarded_and_diagnosed_and_its_optimizer_left_as_it_was():
    # The search's step, the guard's step and diagnose each test gradients for finiteness; a sparse gradient has
    # no norm, so each failed on a model that trains in eager
    torch.manual_seed(0)
    model, data = SparseBag(), token_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        ce(model(x), (x, y)).backward()
        opt.step()
    assert model.embed.weight.grad.is_sparse
    before = copy.deepcopy(opt.state_dict())
    result = compfx.optimize(model, data, optimizer=opt, loss_fn=ce,
                             config=compfx.SearchConfig(keep_search_training=False, **QUICK))
    torch.testing.assert_close(opt.state_dict(), before, rtol=0, atol=0)
    guard = compfx.Guard(result.module)
    for x, y in data:
        opt.zero_grad()
        loss = ce(result.module(x), (x, y))
        loss.backward()
        guard.step(opt, loss)
    assert guard.repairs == []
    assert compfx.diagnose(result.module, data[0], loss_fn=ce).origins == ()


class FrozenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_a_batch_norm_frozen_for_fine_tuning_stays_frozen_in_the_search_and_the_planned_module():
    # the search put the whole model in train mode, so it trained the frozen norm, and result.module's graphs,
    # captured then, kept updating its running statistics after optimize() had put the model's modes back
    torch.manual_seed(0)
    model = FrozenNorm()
    model.bn.eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    frozen = model.bn.running_mean.clone()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = compfx.optimize(model, data, optimizer=opt, loss_fn=ce, config=compfx.SearchConfig(**QUICK))
    assert model.training and not model.bn.training
    torch.testing.assert_close(model.bn.running_mean, frozen, rtol=0, atol=0)
    x, y = data[0]
    ce(result.module(x), (x, y)).backward()
    torch.testing.assert_close(model.bn.running_mean, frozen, rtol=0, atol=0)


def planned_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(4, 8)
    analysis = compfx.analyze(model, x)
    return model, compfx.PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis), x


def test_pickling_a_planned_module_is_refused_with_what_to_save_instead_and_copies_still_work():
    # pickle.loads gave a module whose first call failed inside torch.fx (it traces the graph's code again)
    import pickle
    model, planned, x = planned_mlp()
    for save in (pickle.dumps, lambda m: torch.save(m, __import__("io").BytesIO())):
        with pytest.raises(compfx.errors.BadInputError, match="state_dict"):
            save(planned)
    twin = copy.deepcopy(planned)
    assert all(a is not b for a, b in zip(twin.parameters(), model.parameters()))
    torch.testing.assert_close(twin(x), planned(x), rtol=0, atol=0)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert twin(x).abs().max() == 0 and planned(x).abs().max() > 0  # the copy's graphs read its own Parameters
    assert copy.copy(planned)(x).shape == (4, 3)


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.float64), lambda m: m.half(),
                                     lambda m: m.to(torch.bfloat16)])
def test_converting_a_planned_modules_parameters_to_another_dtype_is_refused_before_anything_is_converted(convert):
    # the model's Parameters were converted and the graphs then failed in torch ("expected scalar type Double")
    model, planned, x = planned_mlp()
    with pytest.raises(compfx.errors.BadInputError, match="FP32 master weights"):
        convert(planned)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert planned.to("cpu").float()(x).dtype == torch.float32


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)])
def test_converting_the_planned_models_own_parameters_is_refused_at_the_next_call_and_converting_back_works(convert):
    # .double() failed in torch ("expected scalar type"); .half() and .to(bfloat16) ran, with every cast made for
    # FP32 weights, so ops the plan keeps in FP32 ran in the converted dtype
    model, planned, x = planned_mlp()
    expected = planned(x)
    convert(model)
    with pytest.raises(compfx.errors.BadInputError, match="converted from float32 to .* after it was planned"):
        planned(x)
    model.float()  # back (rounded to the other dtype and back), it runs again
    assert planned(x).dtype == expected.dtype and torch.isfinite(planned(x)).all()


def test_a_block_planned_in_place_refuses_to_run_after_its_model_was_converted():
    # the callbacks' per-module blocks: a model.half() in the middle of training ran the blocks' FP32 casts on fp16
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(4, 8)
    analysis = compfx.regions.analyze_regions(model, x, nn.Linear)
    compfx.plan_blocks(model, compfx.Plan.amp(analysis), x, blocks=(nn.Linear,))
    assert type(model[0]).__name__ == "PlannedBlock"
    expected = model(x)
    model.half()
    with pytest.raises(compfx.errors.BadInputError, match="converted from float32 to float16"):
        model(x.half())
    model.float()
    assert model(x).dtype == expected.dtype


class NormAndDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def test_the_planned_module_runs_in_the_models_modes_as_they_are_now():
    # the graphs were keyed on the planned module's own flag: a BatchNorm frozen, or a model put in eval mode,
    # after planning kept running the training-mode graph (updating running statistics, dropping units)
    torch.manual_seed(0)
    model, x = NormAndDropout(), torch.randn(8, 8)
    analysis = compfx.analyze(model, x)
    fast = compfx.PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    model.bn.eval()
    model.drop.eval()
    eager = copy.deepcopy(model)
    torch.testing.assert_close(fast(x), eager(x), rtol=0, atol=0)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, rtol=0, atol=0)
    model.eval()
    eager.eval()
    assert not fast.training
    torch.testing.assert_close(fast(x), eager(x), rtol=0, atol=0)


def test_train_and_eval_on_the_planned_module_set_the_models_modes():
    model, x = NormAndDropout(), torch.randn(8, 8)
    analysis = compfx.analyze(model, x)
    fast = compfx.PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    fast.eval()
    assert not model.training and not model.bn.training and not model.drop.training
    torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)  # eval: no dropout, running statistics
    fast.train()
    assert model.training and model.bn.training and fast.training


@pytest.mark.parametrize("per_module", [False, True])
def test_a_planned_module_inside_the_users_autocast_runs_its_plan_with_a_warning(per_module):
    # autocast on top of the plan ran the ops the FP32 plan keeps in FP32 in bf16
    torch.manual_seed(0)
    model, x = NormAndDropout().eval(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    analysis = compfx.analyze(model, x)
    if per_module:
        fast = compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(nn.Linear,))
    else:
        fast = compfx.PlannedModule(model, compfx.Plan.fp32(analysis), analysis=analysis)
    with pytest.warns(UserWarning, match="autocast is switched off inside it"), torch.autocast("cpu", torch.bfloat16):
        out = fast(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, eager(x), rtol=0, atol=0)


def seeded_shuffle_loader(seed=5):
    torch.manual_seed(0)
    data = list(zip(torch.randn(32, 8), torch.randint(0, 3, (32,))))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed))


def test_a_loader_shuffling_with_its_own_generator_repeats_its_order_in_every_sample():
    # seeding torch's generator repeated an unseeded shuffle only: each epoch drew a new order from the loader's
    # generator, so each plan trained on other batches
    from compfx.search.sampling import FairSampler
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = FairSampler(model, opt, seeded_shuffle_loader(), ce, device="cpu", seed=0)
    first = [loss for loss, _ in sampler.epoch(model)]
    assert [loss for loss, _ in sampler.epoch(model)] == first


def test_a_search_leaves_the_loaders_own_generator_as_it_was():
    # the search walked the loader many times, advancing the generator of DataLoader(generator=g): the user's next
    # epoch shuffled differently than it would have without the search
    loader = seeded_shuffle_loader()
    before = loader.generator.get_state()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compfx.optimize(model, loader, optimizer=opt, loss_fn=ce, config=compfx.SearchConfig(**QUICK))
    assert torch.equal(loader.generator.get_state(), before)


def test_cast_report_reads_a_planned_module_and_refuses_a_plain_one_clearly():
    model, x = NormAndDropout(), torch.randn(8, 8)
    analysis = compfx.analyze(model, x)
    plan = compfx.Plan.amp(analysis)
    fast = compfx.PlannedModule(model, plan, analysis=analysis)
    assert compfx.cast_report(fast) == compfx.cast_report(compfx.apply(model, plan, analysis=analysis))
    with pytest.raises(compfx.errors.BadInputError, match="got NormAndDropout"):
        compfx.cast_report(model)


def test_a_search_of_a_model_trained_in_bf16_says_its_fp32_baseline_is_not_the_models_own_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).bfloat16()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g).bfloat16(), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"trains 4 parameter\(s\) held in bfloat16 \(e.g. '0.weight'\)"):
        compfx.optimize(model, data, optimizer=opt, loss_fn=ce, config=compfx.SearchConfig(**QUICK))
