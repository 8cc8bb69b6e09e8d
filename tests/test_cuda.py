"""CUDA paths, run only on a CUDA GPU (``pytest -m cuda``; the GPU suite runs them, ``benchmarks/gpu_suite.py``).

Without CUDA every test here is skipped with the reason. Each is small: the
whole file should take well under two minutes on an H100, most of it
Inductor's first compiles.

* ``Plan.amp`` against ``torch.autocast("cuda")`` in fp16 and bf16: outputs and gradients;
* Tensor Core eligibility read from the real device's capability;
* fp16 sampling with a GradScaler inside a search (an overflow is the scaler's to skip, not a failed plan);
* ``backend="compfx"`` and ``compfx.backend(plan, inner="inductor")`` with Inductor on CUDA;
* a world-size-1 NCCL search, then DDP (in a spawned process, so a hung collective cannot hang the run);
* the CUDA RNG left as it was by the search;
* the benchmark harness's peak memory through ``torch.cuda.max_memory_allocated``; CUDA-synchronised timing.
"""

from __future__ import annotations

import copy
import json
import math
import random
import socket
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.planned_module import apply
from compfx.compile_backend import backend, registered_backend
from compfx.measure import device_name, timed
from compfx.passes import count_autocast_casts, count_casts
from compfx.search.sampling import FairSampler
from compfx.vocabulary import SampleStatus, Stage
from tests.helpers import assert_matches_apply
from zoo import ZOO, make

CUDA_AVAILABLE = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

CAPABILITY = torch.cuda.get_device_capability() if CUDA_AVAILABLE else (0, 0)
CUDA = torch.device("cuda")
LOW_DTYPES = [pytest.param(torch.float16, id="fp16"),
              pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
                  CAPABILITY < (8, 0), reason="bf16 autocast needs compute capability 8.0"))]
# Same ops, same dtypes, same device: the low dtype's rounding is the only expected difference (atomics in some
# cuDNN backward kernels reorder sums).
LOW_TOL = {torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
# Inductor fuses and reorders reductions; with emulate_precision_casts it still rounds where the plan casts.
COMPILE_TOL = dict(rtol=1e-2, atol=1e-2)


def _on_cuda(name: str, seed: int = 0):
    model, inputs = make(name, seed=seed)
    return model.to(CUDA), tuple(x.to(CUDA) for x in inputs)


def _forward_backward(module, inputs, params, autocast_dtype=None):
    """One seeded forward and backward; returns the output and each named parameter's grad (as test_apply.py)."""
    for param in params.values():
        param.grad = None
    torch.manual_seed(1234)
    with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = module(*inputs)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return out, {name: p.grad for name, p in params.items()}


# -- Plan.amp is CUDA autocast ------------------------------------------------------------------

@pytest.mark.parametrize("low_dtype", LOW_DTYPES)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_amp_plan_matches_cuda_autocast(name, low_dtype):
    model, inputs = _on_cuda(name)
    reference = copy.deepcopy(model)
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)

    expected, expected_grads = _forward_backward(reference, inputs, dict(reference.named_parameters()), low_dtype)
    out, grads = _forward_backward(gm, inputs, dict(model.named_parameters()))

    assert analysis.device.type == "cuda"
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **LOW_TOL[low_dtype])
    for pname, grad in expected_grads.items():
        assert grads[pname].dtype == torch.float32
        torch.testing.assert_close(grads[pname].to(low_dtype), grad.to(low_dtype), **LOW_TOL[low_dtype], msg=pname)


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_matmul", "encoder_sdpa", "shape_branch"])
def test_amp_plan_inserts_as_many_casts_as_cuda_autocast(name):
    model, inputs = _on_cuda(name)
    analysis = compfx.analyze(model, inputs)  # CUDA: fp16 by default
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)
    assert analysis.low_dtype == torch.float16
    assert count_casts(gm) == count_autocast_casts(model, inputs, dtype=torch.float16, device_type="cuda")


@pytest.mark.parametrize("low_dtype", LOW_DTYPES)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_plan_that_runs_every_op_low_trains_on_cuda(name, low_dtype):
    """Norms too: CUDA's layer and group norm kernels take weight and bias only in the input's dtype, where CPU's
    and batch norm's take FP32 ones (cast_policy.SAME_DTYPE_PARAMETERS_ON_CUDA)."""
    model, inputs = _on_cuda(name)
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)
    planned = apply(model, compfx.Plan.from_bitstring(analysis, "0" * len(analysis.ops)), analysis=analysis)
    out, grads = _forward_backward(planned, inputs, dict(model.named_parameters()))
    assert torch.isfinite(out.float()).all()
    assert all(grad is None or grad.dtype == torch.float32 for grad in grads.values())


# -- Tensor Cores on the real capability ---------------------------------------------------------

class _Shapes(nn.Module):
    """One linear with Tensor-Core shapes, one without, one convolution with 3 input channels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fit = nn.Linear(64, 128)
        self.odd = nn.Linear(128, 100)

    def forward(self, x, y):
        return self.conv(x).mean(), self.odd(self.fit(y))


@pytest.mark.parametrize("low_dtype", LOW_DTYPES)
def test_tensor_core_eligibility_comes_from_the_devices_own_capability(low_dtype):
    model = _Shapes().to(CUDA)
    inputs = (torch.randn(2, 3, 8, 8, device=CUDA), torch.randn(32, 64, device=CUDA))
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)  # no capability= : read from the device
    ops = {str(op.key): op for op in analysis.ops}
    assert CAPABILITY >= (7, 0), "Tensor Cores (fp16) need Volta or newer; this test expects such a GPU"
    assert (ops["fit:linear#0"].tc_eligible, ops["fit:linear#0"].reason) == (True, "dims are multiples of 8")
    assert ops["odd:linear#0"].reason == "out_features=100 is not a multiple of 8"
    assert ops["conv:conv2d#0"].reason == "in_channels=3 is not a multiple of 8"
    planned_for_old_gpu = compfx.analyze(model, inputs, low_dtype=low_dtype, capability=(6, 0))
    assert not any(op.tc_eligible for op in planned_for_old_gpu.ops)


# -- fp16 sampling with a GradScaler ---------------------------------------------------------------

def _ce(output, batch):
    return F.cross_entropy(output.float(), batch[-1])


def _cuda_batches(n, features=32, rows=64, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, features, generator=g).to(CUDA), torch.randint(0, classes, (rows,), generator=g).to(CUDA))
            for _ in range(n)]


def _mlp(features=32, hidden=64, classes=4, dropout=0.0):
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes),
                         nn.LogSoftmax(-1)).to(CUDA)


_QUICK = dict(progress=False, repeats=2, warmup=1, stage2_check_batches=2)


def test_fp16_search_samples_with_a_grad_scaler_and_the_module_trains_on():
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = _cuda_batches(4)
    config = compfx.SearchConfig(**_QUICK)
    result = compfx.optimize(model, batches, optimizer=optimizer, loss_fn=_ce, config=config)

    assert config.scaler_on(result.analysis.low_dtype) and result.plan.low_dtype == torch.float16
    stage1 = result.log.samples(Stage.STAGE1)
    assert stage1 and all(math.isfinite(r.loss) for r in stage1 if r.status == SampleStatus.ACCEPTED)
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = _ce(result.module(batch[0]), batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.isfinite(loss)


def test_an_overflowing_fp16_step_is_skipped_by_the_scaler_not_failed():
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 64, device=CUDA) * 10
    analysis = compfx.analyze(model, (x,), low_dtype=torch.float16)
    planned = apply(model, compfx.Plan.uniform(analysis, "low"), analysis=analysis)
    # Scaled by the GradScaler's first scale (65536), the fp16 gradients of this loss overflow.
    loud = lambda out, batch: out.float().square().mean() * 1000  # noqa: E731
    sampler = FairSampler(model, optimizer, [(x, x)], loud, device=CUDA, seed=0, grad_scaler=True)
    epoch, losses = sampler.epoch(planned), []
    while True:  # NonFiniteGradientError here would mean the scaler was not in charge
        try:
            losses.append(next(epoch)[0])
        except StopIteration as end:
            trained = end.value  # the state after the epoch, before the sampler restored the initial one
            break
    assert len(losses) == 1 and math.isfinite(losses[0])
    skipped = all(torch.equal(after, before) for (_, after), (_, before) in zip(trained.tensors, sampler.initial.tensors))
    assert skipped, "the scaler should have skipped the step whose fp16 gradients overflowed"
    assert sampler.initial.matches()


# -- the compile backend with Inductor on CUDA ------------------------------------------------------

def test_registered_compfx_backend_runs_the_default_amp_plan_through_inductor(fresh_dynamo):
    model, inputs = _on_cuda("mlp")
    analysis = compfx.analyze(model, inputs)
    assert_matches_apply(torch.compile(model, backend="compfx"), model, compfx.Plan.amp(analysis), analysis, inputs,
                          COMPILE_TOL)
    record = registered_backend().records[-1]
    assert dict(record.precisions) == dict(compfx.Plan.amp(analysis))
    assert {str(k): d for k, d in record.compute_dtypes.items()}["fc1:linear#0"] == torch.float16


def test_inductor_backend_with_a_random_plan_matches_apply_on_cuda(fresh_dynamo):
    model, inputs = _on_cuda("encoder_sdpa")
    analysis = compfx.analyze(model, inputs)
    rng = random.Random(11)
    plan = compfx.Plan.from_bitstring(analysis, "".join(rng.choice("01f") for _ in analysis.ops))
    compiled = torch.compile(model, backend=backend(plan, inner="inductor"))
    assert_matches_apply(compiled, model, plan, analysis, inputs, COMPILE_TOL)


# -- NCCL, world size 1 ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_search_then_ddp(port: int, out_path: str) -> None:
    """Spawned: NCCL process group of one rank, compfx.optimize, then three DDP steps; results as JSON."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from compfx.search.distributed import rank_context

    report = {}
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))
        torch.manual_seed(0)
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = _cuda_batches(4)
        result = compfx.optimize(model, batches, optimizer=optimizer, loss_fn=_ce, config=compfx.SearchConfig(**_QUICK))
        ddp = DistributedDataParallel(result.module, device_ids=[0])
        scaler = torch.amp.GradScaler("cuda")
        before = [p.detach().clone() for p in model.parameters()]
        losses = []
        for batch in batches[:3]:
            optimizer.zero_grad(set_to_none=True)
            loss = _ce(ddp(batch[0]), batch)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss))
        report = {"backend": dist.get_backend(), "collective_device": str(rank_context().device),
                  "notes": [r.reason for r in result.log.notes()], "losses": losses,
                  "changed": any(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
                  "plan": str(result.plan.assignment(result.analysis))}
    except Exception as error:  # the parent reads the failure from the file
        report = {"error": f"{type(error).__name__}: {error}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        with open(out_path, "w") as handle:
            json.dump(report, handle)


def test_world_size_one_nccl_search_then_ddp_trains(tmp_path):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    out = tmp_path / "nccl.json"
    process = mp.get_context("spawn").Process(target=_nccl_search_then_ddp, args=(_free_port(), str(out)))
    process.start()
    process.join(timeout=240)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the NCCL search did not finish in 240 s")
    report = json.loads(out.read_text())
    assert "error" not in report, report.get("error")
    assert report["backend"] == "nccl" and report["collective_device"].startswith("cuda")
    assert any("torch.distributed" in note for note in report["notes"])  # optimize took the distributed path
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"]) and report["changed"]


# -- RNG ---------------------------------------------------------------------------------------------

def test_the_search_leaves_the_cuda_and_cpu_rng_as_they_were():
    torch.manual_seed(0)
    model = _mlp(dropout=0.3)  # dropout draws from the CUDA generator in every sample
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = _cuda_batches(3)
    torch.cuda.manual_seed(1234)
    cuda_state, cpu_state = torch.cuda.get_rng_state(), torch.get_rng_state()
    compfx.optimize(model, batches, optimizer=optimizer, loss_fn=_ce, config=compfx.SearchConfig(**_QUICK))
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    assert torch.equal(torch.get_rng_state(), cpu_state)


# -- measurement on CUDA ----------------------------------------------------------------------------

def test_benchmark_rows_report_cuda_peak_memory_and_synchronised_times():
    from benchmarks.harness import RunOptions, run_benchmark
    from benchmarks.models import get_spec

    options = RunOptions(device="cuda", epochs=2, batches=2, data="synthetic", low_dtype="fp16")
    for mode in ("fp32", "amp"):
        row = run_benchmark(get_spec("alexnet_cifar"), "small", mode, options)
        assert row["status"] == "ok", row.get("error")
        assert row["peak_memory_bytes"] > 0 and row["time_per_epoch_s"] > 0
    assert row["low_dtype"] == "float16"
    assert device_name("cuda").startswith("cuda:")
    a = torch.randn(1024, 1024, device=CUDA)
    _, seconds = timed(lambda: a @ a, "cuda")
    assert seconds > 0


# -- a timed search step never waits for the device --------------------------------------------------

def test_a_training_step_of_a_search_sample_never_synchronises():
    model = _mlp(dropout=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = _cuda_batches(3)
    sampler = FairSampler(model, optimizer, batches, _ce, device=CUDA, seed=0)
    records = [sampler.train_step(model, batches[0])]  # first call: lazy initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # PyTorch raises on any call that waits for the device
    try:
        records += [sampler.train_step(model, batch) for batch in batches[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    from compfx.search.sampling import read_steps

    assert all(math.isfinite(loss) for loss in read_steps(records))
    sampler.restore()
    assert sampler.initial.matches()
