"""What a timed training step does on the host: no read of a device value inside it (a mock counts every call
that would make the host wait for the device), and the GradScaler's scale, calibrated once, carried into every
sample's timed steps."""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.errors import NonFiniteGradientError
from compfx.search import sampling
from compfx.search.evaluator import LocalEvaluator
from compfx.search.sampling import FairSampler
from tests.helpers import ce

#: Tensor methods that copy a value to the host, so wait for the device to finish the work before them.
SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@contextlib.contextmanager
def counted_syncs():
    """Count every call of :data:`SYNCING` and of ``torch.cuda.synchronize`` while the block runs."""
    counts: Counter = Counter()

    def counting(name, original):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for name in SYNCING:
            stack.enter_context(mock.patch.object(torch.Tensor, name, counting(name, getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", counting("synchronize", torch.cuda.synchronize)))
        yield counts


def test_the_counter_sees_each_kind_of_read():
    t = torch.ones(())
    with counted_syncs() as counts:
        t.item(), float(t), bool(t), int(t), t.tolist()
    assert counts == Counter(item=1, __float__=1, __bool__=1, __int__=1, tolist=1)


def _setup(loss_fn=ce, grad_scaler=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    return model, optimizer, loader, FairSampler(model, optimizer, loader, loss_fn, device="cpu",
                                                 grad_scaler=grad_scaler)


def test_a_training_step_reads_nothing_from_the_device():
    model, _, loader, sampler = _setup()
    with counted_syncs() as counts:
        sampler.train_step(model, loader[0])
    assert not counts, counts
    assert sampler.step(model, loader[1]) > 0  # the reading variant, for callers that do not time


@pytest.fixture
def windows(monkeypatch):
    """The syncs inside each timed window of the sampler (``timed`` is its only clock, directly or via time_repeats)."""
    found: list[Counter] = []

    def counting_timed(fn, device):
        with counted_syncs() as counts:
            result = original(fn, device)
        found.append(counts - Counter(synchronize=2))  # the clock's own two, around the step
        return result

    original = sampling.timed
    monkeypatch.setattr(sampling, "timed", counting_timed)
    monkeypatch.setattr(compfx.measure, "timed", counting_timed)
    return found


def test_no_timed_step_of_a_sample_synchronises(windows):
    model, _, loader, sampler = _setup()
    losses = [loss for loss, _ in sampler.epoch(model, warmup=1)]
    timing = sampler.step_time(model, warmup=1, repeats=3)
    assert len(losses) == 4 and len(timing.samples) == 3
    assert len(windows) == 4 + 3 and all(not counts for counts in windows), windows


def test_with_a_grad_scaler_the_only_read_is_the_scalers_own(windows):
    model, _, loader, sampler = _setup(grad_scaler=True)
    list(sampler.epoch(model))
    # GradScaler.step reads whether it found inf (one device here) before it steps the optimizer: AMP's own cost
    assert windows and all(counts == Counter(item=1) for counts in windows), windows


def test_nonfinite_gradients_under_a_finite_loss_fail_the_plan_after_the_timed_window():
    model, _, loader, sampler = _setup()
    model[0].weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(NonFiniteGradientError, match="loss was finite"):
        sampler.step_time(model, warmup=0, repeats=2)
    assert sampler.initial.matches()


def test_the_gradient_test_runs_after_each_timed_step_not_inside_it(monkeypatch):
    """The seconds are the training step a user's loop takes: the NaN/inf test of the gradients, which no training
    loop makes, runs untimed after each step (epochs, epochs in turns, repeated and interleaved timings)."""
    timing, tested_while_timing = [False], []
    original = sampling.timed

    def flagged(fn, device):
        timing[0] = True
        try:
            return original(fn, device)
        finally:
            timing[0] = False

    class Recording(FairSampler):
        def _gradients_finite(self, device):
            tested_while_timing.append(timing[0])
            return super()._gradients_finite(device)

    monkeypatch.setattr(sampling, "timed", flagged)
    monkeypatch.setattr(compfx.measure, "timed", flagged)
    model, optimizer, loader, _ = _setup()
    sampler = Recording(model, optimizer, loader, ce, device="cpu")
    list(sampler.epoch(model, warmup=1))
    for epoch in sampler.epochs_taking_turns([model, model], warmup=0):
        list(epoch)
    sampler.step_time(model, warmup=1, repeats=2)
    sampler.interleaved_step_times([model, model], rounds=2, warmup=1)
    # every step was tested: 1 + 4 (epoch), 2 x 4 (in turns), 1 + 2 (repeats), 2 x (1 + 2) (interleaved)
    assert len(tested_while_timing) == 5 + 8 + 3 + 6 and not any(tested_while_timing)


def _loud(output, batch):
    """A loss whose gradients overflow FP32 at GradScaler's first scale (65536) and fit at a few thousand."""
    return output.float().square().mean() * 1e34


def test_the_scale_is_calibrated_once_and_every_samples_first_step_trains():
    model, _, loader, sampler = _setup(loss_fn=_loud, grad_scaler=True)
    default = FairSampler(model, sampler.optimizer, loader, _loud, device="cpu", grad_scaler=True)
    epoch = default.epoch(model)  # GradScaler's default scale: the first step overflows and is skipped
    next(epoch)
    assert torch.equal(model[0].weight, default.initial.tensors[0][1])
    epoch.close()

    scale = sampler.calibrate_scale(model)
    assert scale < 2.0 ** 16 and sampler.calibrated and sampler.initial.matches()
    for sample in range(2):  # each sample's scaler starts at the calibrated scale: its first step trains
        epoch = sampler.epoch(model)
        next(epoch)
        assert not torch.equal(model[0].weight, sampler.initial.tensors[0][1]), f"sample {sample} skipped its step"
        epoch.close()
    assert sampler.initial.matches()


def test_the_evaluator_calibrates_on_the_amp_plan_before_its_first_sample(monkeypatch):
    model, optimizer, loader, sampler = _setup(loss_fn=_loud, grad_scaler=True)
    analysis = compfx.analyze(model, loader[0][0])
    evaluator = LocalEvaluator(model, analysis, sampler, warmup=0, repeats=1)
    calibrated = []
    monkeypatch.setattr(sampler, "calibrate_scale", lambda module: calibrated.append(module) or 1024.0)
    fp32 = compfx.Plan.fp32(analysis).assignment(analysis)
    evaluator.time_step(fp32)
    sampler.calibrated = True  # what the real calibrate_scale records
    evaluator.check_loss(fp32, 1)
    amp = compfx.Plan.amp(analysis).assignment(analysis)
    assert calibrated == [evaluator.runner(amp)]


# -- the host allocator a CPU search times under -------------------------------------------------------------

_WHERE_4MIB_COMES_FROM = r"""
import ctypes, sys, torch
from compfx.measure import settle_host_allocator

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
settled = settle_host_allocator("cpu") if sys.argv[1] == "settle" else False
mapped_before = libc.mallinfo2().hblkhd
tensor = torch.empty(4 * 2**20, dtype=torch.uint8)
print(settled, libc.mallinfo2().hblkhd - mapped_before >= 4 * 2**20)
"""


def _glibc_with_mallinfo2() -> bool:
    import ctypes
    import platform

    return platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc >= 2.33 (mallinfo2) shows where a buffer came from")
def test_a_settled_host_allocator_serves_activation_sized_buffers_from_its_heap():
    """A 4 MiB buffer is mapped on its own (and unmapped again on free: its pages faulted in anew each time) in a
    fresh process; after settle_host_allocator it comes from the heap, which keeps freed memory."""
    import subprocess
    import sys

    def run(mode):
        done = subprocess.run([sys.executable, "-c", _WHERE_4MIB_COMES_FROM, mode], capture_output=True, text=True,
                              check=True)
        return done.stdout.split()

    assert run("plain") == ["False", "True"]
    assert run("settle") == ["True", "False"]


def test_a_cpu_search_settles_the_host_allocator_first():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    loader = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    with mock.patch("compfx.optimization.settle_host_allocator") as settle:
        compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce,
                        config=compfx.SearchConfig(progress=False, stage1_budget=1, cache_plan=False,
                                                   decision=compfx.DecisionRule(rounds=0)))
    settle.assert_called_once_with(torch.device("cpu"))
