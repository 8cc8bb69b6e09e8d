"""Fair sampling (compfx.search.sampling): same start, same RNG, same batches, state restored in place."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compfx.batches import model_loss, split_batch
from compfx.errors import BadInputError
from compfx.measure import Timing, time_repeats, timed
from compfx.search.sampling import FairSampler, read_steps
from compfx.state import restore_state, snapshot_state
from tests.helpers import ce


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


class SmallNet(nn.Module):
    """Has everything state restore must cover: parameters, BatchNorm buffers, dropout randomness."""

    def __init__(self, fail_on_call: int | None = None):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3)
        self.drop = nn.Dropout(0.3)
        self.fail_on_call, self.calls = fail_on_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("low precision not supported here")
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def make(fail_on_call=None, batches=4, optimizer=torch.optim.Adam):
    torch.manual_seed(0)
    model = SmallNet(fail_on_call)
    opt = optimizer(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
              for _ in range(batches)]
    return model, opt, loader


def warm_start(model, opt, loader):
    """Give the optimizer state to restore (Adam's moments exist only after a step)."""
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    for batch in loader[:2]:
        sampler.step(model, batch)


def test_restore_copies_into_the_same_tensors():
    model, opt, loader = make()
    warm_start(model, opt, loader)
    params = list(model.parameters())
    moments = {id(p): opt.state[p]["exp_avg"] for p in params}
    mean = model.bn.running_mean
    snapshot = snapshot_state(model, opt)
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    for batch in loader:
        sampler.step(model, batch)
    assert not snapshot.matches()
    restore_state(snapshot)
    assert snapshot.matches()
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert all(opt.state[p]["exp_avg"] is moments[id(p)] for p in params)  # user references stay valid
    assert model.bn.running_mean is mean


def test_restore_empties_optimizer_state_that_did_not_exist():
    model, opt, loader = make()
    snapshot = snapshot_state(model, opt)
    FairSampler(model, opt, loader, ce, device="cpu").step(model, loader[0])
    assert len(opt.state) > 0
    restore_state(snapshot)
    assert len(opt.state) == 0 and snapshot.matches()


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD])
def test_exception_inside_a_sample_restores_the_state_bitwise(optimizer):
    model, opt, loader = make(fail_on_call=3, optimizer=optimizer)  # fails in the 3rd step
    warm_start(model, opt, loader)
    before = snapshot_state(model, opt)
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    model.calls = 0
    with pytest.raises(RuntimeError, match="not supported"):
        for _ in sampler.epoch(model):
            pass
    assert model.calls == 3 and before.matches()


def test_closing_an_epoch_early_restores_the_state():
    model, opt, loader = make()
    before = snapshot_state(model, opt)
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    epoch = sampler.epoch(model)
    next(epoch), next(epoch)
    assert not before.matches()
    epoch.close()  # what pruning does
    assert before.matches()


def test_every_sample_sees_the_same_rng_and_batch_order():
    model, opt, _ = make()
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # order drawn from the global RNG
    sampler = FairSampler(model, opt, loader, ce, device="cpu", seed=3)
    first = list(sampler.epoch(model))
    torch.rand(5)  # disturb the global RNG between samples
    second = list(sampler.epoch(model))
    assert [loss for loss, _ in first] == [loss for loss, _ in second]
    assert sampler.initial.matches()


def test_epoch_returns_the_trained_state_and_mean_loss_matches_its_first_batches():
    model, opt, loader = make()
    sampler = FairSampler(model, opt, loader, ce, device="cpu", grad_scaler=True)
    epoch, losses = sampler.epoch(model, warmup=1), []
    try:
        while True:
            losses.append(next(epoch)[0])
    except StopIteration as stop:
        trained = stop.value
    assert sampler.initial.matches() and not trained.matches()
    restore_state(trained)
    assert trained.matches()
    sampler.restore()
    # the Stage-2 loss check compares against FP32's first batches of Stage 1: the same numbers
    assert sampler.mean_loss(model, 2) == sum(losses[:2]) / 2


def test_step_time_restores_the_state():
    model, opt, loader = make()
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    timing = sampler.step_time(model, warmup=1, repeats=5)  # cycles through the 4 batches
    assert isinstance(timing, Timing) and len(timing.samples) == 5 and timing.median > 0
    assert sampler.initial.matches()


def test_a_nonfinite_loss_is_read_after_the_step_and_the_sample_ends_restored():
    model, opt, loader = make(optimizer=torch.optim.SGD)
    before = snapshot_state(model, opt)
    sampler = FairSampler(model, opt, loader, lambda out, batch: out.sum() * float("nan"), device="cpu")
    record = sampler.train_step(model, loader[0])  # taken: deciding not to would read the loss on the device's time
    assert record.shape == (2,) and read_steps([record])[0] != read_steps([record])[0]
    sampler.restore()
    losses = [loss for loss, _ in sampler.epoch(model)]
    assert len(losses) == len(loader) and all(loss != loss for loss in losses) and before.matches()


@pytest.mark.parametrize("batch, n_args, kwargs", [
    ((torch.zeros(2, 3), torch.zeros(2)), 1, []),
    ([torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2)], 2, []),
    ((torch.zeros(2, 3),), 1, []),
    ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2)}, 0, ["input_ids", "labels"]),
    (torch.zeros(2, 3), 1, []),
])
def test_split_batch_maps_batches_to_model_inputs(batch, n_args, kwargs):
    args, kw = split_batch(batch)
    assert len(args) == n_args and sorted(kw) == kwargs


def test_bad_batches_and_losses_say_what_to_do():
    with pytest.raises(BadInputError, match="tuple/list"):
        split_batch(3)
    with pytest.raises(BadInputError, match="loss_fn"):
        model_loss(torch.zeros(2), None)
    assert model_loss({"loss": torch.tensor(1.0)}, None).item() == 1.0
    model, opt, loader = make()
    sampler = FairSampler(model, opt, loader, lambda out, batch: out, device="cpu")
    with pytest.raises(BadInputError, match="scalar"):
        sampler.step(model, loader[0])


def test_timing_helpers():
    assert timed(lambda: 7, "cpu")[0] == 7
    calls = []
    timing = time_repeats(calls.append, warmup=2, repeats=3, device="cpu")
    assert calls == [0, 1, 2, 3, 4] and len(timing.samples) == 3
    with pytest.raises(ValueError):
        time_repeats(calls.append, warmup=0, repeats=0, device="cpu")


# -- epochs taking turns ------------------------------------------------------------------------------

class Doubled(nn.Module):
    """Another program on the same Parameters (its loss, and so its training, differs from the model's)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return 2.0 * self.model(x)


def _alone(sampler, module):
    return _drained(sampler.epoch(module))


def _drained(epoch, losses=()):
    """An epoch run to its end: (its losses, after ``losses`` already taken; the state it returns)."""
    losses = list(losses)
    while True:
        try:
            losses.append(next(epoch)[0])
        except StopIteration as stop:
            return losses, stop.value


def test_epochs_taking_turns_train_each_module_as_its_epoch_alone_and_restore_the_state_in_place():
    # dropout (RNG), BatchNorm (buffers) and Adam (optimizer state that exists before): each module's epoch in
    # turns is its epoch alone, batch for batch, and its returned state is the one its epoch alone ends in
    model, opt, loader = make(batches=4)  # the last turn is the second module's: its copies are in the model
    warm_start(model, opt, loader)
    sampler = FairSampler(model, opt, loader, ce, device="cpu", seed=3)
    doubled = Doubled(model)
    alone = [_alone(sampler, module) for module in (model, doubled)]
    storage = [t.data_ptr() for t in (*model.parameters(), *model.buffers())]
    moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
    epochs = sampler.epochs_taking_turns([model, doubled])
    losses, states = [[], []], [None, None]
    for round_index in range(len(loader) + 1):
        for j in (round_index % 2, 1 - round_index % 2):  # the order the search uses: AB, BA, ...
            try:
                losses[j].append(next(epochs[j])[0])
            except StopIteration as stop:
                states[j] = stop.value
    assert losses[0] == alone[0][0] and losses[1] == alone[1][0] and losses[0] != losses[1]
    for state, (_, reference) in zip(states, alone):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state.tensors, reference.tensors))
    for epoch in epochs:
        epoch.close()
    assert sampler.initial.matches()
    # the user's own tensors are back in the model and optimizer, not the copies the turns trained
    assert storage == [t.data_ptr() for t in (*model.parameters(), *model.buffers())]
    assert all(opt.state[p]["exp_avg"] is m for p, m in zip(model.parameters(), moments))


def test_closing_epochs_taking_turns_part_way_restores_the_state():
    model, opt, loader = make()
    warm_start(model, opt, loader)
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    first, second = sampler.epochs_taking_turns([model, Doubled(model)])
    next(first), next(second), next(first)
    second.close()  # dropped part-way (a plan that lost): the other goes on alone
    next(first)
    assert not sampler.initial.matches()
    first.close()
    assert sampler.initial.matches()


def test_a_module_whose_partner_stops_part_way_ends_in_the_state_of_its_epoch_alone():
    # a candidate's epoch goes on alone once the incumbent's steps stop (the pairs decided): its losses and the
    # state it returns (kept when it wins the search) are those of its epoch alone, dropout and Adam included
    model, opt, loader = make(batches=5)
    warm_start(model, opt, loader)
    sampler = FairSampler(model, opt, loader, ce, device="cpu", seed=3)
    doubled = Doubled(model)
    alone_losses, alone_state = _alone(sampler, doubled)
    incumbent, candidate = sampler.epochs_taking_turns([model, doubled])
    next(incumbent)  # AB BA, as the search runs them
    taken = [next(candidate)[0], next(candidate)[0]]
    next(incumbent)
    incumbent.close()
    losses, state = _drained(candidate, taken)
    assert losses == alone_losses and len(losses) == 5
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state.tensors, alone_state.tensors))
    assert sampler.initial.matches()


class Recording(nn.Module):
    """Replaces one of its buffers by a longer tensor at every forward (a running log kept as a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.register_buffer("history", torch.zeros(0))

    def forward(self, x):
        self.history = torch.cat([self.history, x.detach().mean().reshape(1)])
        return self.fc(x)


def test_epochs_taking_turns_follow_the_tensors_that_were_there_not_buffers_a_model_replaces():
    torch.manual_seed(0)
    model = Recording()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _, _, loader = make()
    sampler = FairSampler(model, opt, loader, ce, device="cpu")
    alone = _alone(sampler, model)[0]
    epochs = sampler.epochs_taking_turns([model, Doubled(model)])
    losses = [[], []]
    for round_index in range(len(loader)):
        for j in (round_index % 2, 1 - round_index % 2):
            losses[j].append(next(epochs[j])[0])  # the replaced buffer (another shape each step) is not exchanged
    for epoch in epochs:
        epoch.close()
    assert losses[0] == alone and sampler.initial.matches()


def test_importing_compfx_does_not_import_dtensor():
    # torch.distributed.tensor takes half a second to import; the sampler asks whether a norm is a DTensor only where
    # it was imported (FSDP2 imports it), so `import compfx` (the CLI's start) does not pay it
    code = "import sys, compfx; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
