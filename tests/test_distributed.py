"""compfx under torch.distributed: lock-step search over 2 gloo CPU processes, DDP afterwards, and
QSync's per-device allocator (exact, with fake measurements; and once with real activation bytes)."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx.errors import PlanFailedError, SearchError
from compfx.memory import saved_activation_bytes
from compfx.plan import Assignment
from compfx.search import (FunctionEvaluator, SearchConfig, SearchSpace, allocate_per_device, allocation_starts,
                           recovery_order, run_search, run_stage1, stage1_candidates)
from compfx.search.distributed import (PerDeviceAllocation, RankAgreement, RankContext, SyncedEvaluator,
                                       rank_context)
from compfx.vocabulary import Precision
from helpers import run_scenarios, spawn_ranks

WORLD = 2
TIMEOUT_S = 420  # for all scenarios; every collective also times out (init_process_group timeout)


# -- the per-device allocator, exactly ------------------------------------------------------

def additive_measure(low_seconds, fp32_seconds, low_bytes, fp32_bytes):
    """A fake device model: a plan's time and memory are sums over ops of per-rank, per-precision tables."""
    def measure(plans):
        rows = []
        for rank, plan in enumerate(plans):
            pairs = [(fp32_seconds[rank][i], fp32_bytes[rank][i]) if p is Precision.FP32
                     else (low_seconds[rank][i], low_bytes[rank][i])
                     for i, p in enumerate(plan) if p is not Precision.FOLLOW]
            rows.append((sum(s for s, _ in pairs), sum(m for _, m in pairs)))
        return rows
    return measure


def codes(plans) -> list[str]:
    return [str(plan) for plan in plans]


THREE_LINEARS = SearchSpace(("whitelist", "other", "whitelist", "other", "blacklist"), (False,) * 5,
                            ("a", "r", "b", "r", "c"))


def test_small_budget_rank_goes_low_and_the_other_recovers_up_to_its_pace():
    # low halves time and memory on both ranks; rank 1 is a slow, small device
    low_s, fp32_s = [[1, 0, 1, 0, 1], [3, 0, 3, 0, 3]], [[2, 0, 2, 0, 2], [6, 0, 6, 0, 6]]
    low_b, fp32_b = [[10, 0, 10, 0, 10]] * 2, [[20, 0, 20, 0, 20]] * 2
    allocation = allocate_per_device(THREE_LINEARS, additive_measure(low_s, fp32_s, low_b, fp32_b), [None, 30])
    assert codes(allocation.starts) == ["0f0f0", "0f0f0"]  # low is fastest on both
    assert str(allocation.plans[1]) == "0f0f0" and allocation.activation_bytes[1] == 30  # nothing else fits 30 B
    # rank 0's pace is rank 1's 9 s: recovering all three ops (6 s) keeps it; blacklist op first
    assert str(allocation.plans[0]) == "1f1f1" and allocation.recovered[0] == (4, 0, 2)
    assert allocation.step_seconds == 9


def test_recovery_stops_where_the_slowest_rank_would_wait():
    low_s, fp32_s = [[1, 0, 1, 0, 1], [2, 0, 2, 0, 2]], [[3, 0, 3, 0, 3], [4, 0, 4, 0, 4]]
    low_b = fp32_b = [[1, 0, 1, 0, 1]] * 2
    allocation = allocate_per_device(THREE_LINEARS, additive_measure(low_s, fp32_s, low_b, fp32_b), [None, None])
    # pace 6 s (rank 1 all low); rank 0 at 3 s can give back one op (+2 s each): 5 s, then 7 s > 6 s
    assert codes(allocation.plans) == ["0f0f1", "0f0f0"] and allocation.step_seconds == 6


def test_start_is_the_fastest_plan_that_fits_even_when_fp32_is_fastest():
    # a CPU-like device: low precision is slower but smaller
    low_s, fp32_s = [[5, 0, 5, 0, 5]] * 2, [[1, 0, 1, 0, 1]] * 2
    low_b, fp32_b = [[1, 0, 1, 0, 1]] * 2, [[4, 0, 4, 0, 4]] * 2
    allocation = allocate_per_device(THREE_LINEARS, additive_measure(low_s, fp32_s, low_b, fp32_b), [None, 9])
    assert codes(allocation.starts) == ["1f1f1", "0f1f1"]  # 9 bytes: two ops must go low; the earliest such start
    assert codes(allocation.plans) == ["1f1f1", "0f1f1"]


def test_no_plan_fits_says_which_rank_and_how_much():
    measure = additive_measure([[1] * 5] * 2, [[1] * 5] * 2, [[5] * 5] * 2, [[5] * 5] * 2)
    with pytest.raises(SearchError, match=r"rank 1's memory_budget=3 bytes.*saves 15"):
        allocate_per_device(THREE_LINEARS, measure, [None, 3])


def test_starts_cover_every_group_combination_or_shrink_past_the_budget():
    assert codes(allocation_starts(THREE_LINEARS)) == ["0f0f0", "0f0f1", "0f1f0", "1f0f0", "0f1f1", "1f0f1",
                                                       "1f1f0", "1f1f1"]
    wide = SearchSpace(("whitelist",) * 8, (False,) * 8, tuple(range(8)))
    starts = allocation_starts(wide, budget=16)
    assert str(starts[0]) == "0" * 8 and str(starts[-1]) == "1" * 8 and len(starts) == 10
    assert recovery_order(SearchSpace(("whitelist", "blacklist", "whitelist"), (True, False, False),
                                      ("a", "b", "c"))) == [1, 2, 0]


per_op = st.lists(st.integers(1, 9), min_size=5, max_size=5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(per_op, per_op, per_op, per_op), min_size=1, max_size=3),
       st.lists(st.one_of(st.none(), st.integers(15, 40)), min_size=3, max_size=3))
def test_allocation_meets_budgets_never_slows_the_step_and_only_recovers(tables, budget_pool):
    world = len(tables)
    low_s, fp32_s, low_b, fp32_b = ([t[k] for t in tables] for k in range(4))
    budgets = budget_pool[:world]
    measure = additive_measure(low_s, fp32_s, low_b, fp32_b)
    starts = allocation_starts(THREE_LINEARS)
    rows = {plan: measure([plan] * world) for plan in starts}
    if any(all(b is not None and rows[s][r][1] > b for s in starts) for r, b in enumerate(budgets)):
        with pytest.raises(SearchError, match="no plan fits"):
            allocate_per_device(THREE_LINEARS, measure, budgets)
        return
    allocation = allocate_per_device(THREE_LINEARS, measure, budgets)
    for r in range(world):
        fitting = [s for s in starts if budgets[r] is None or rows[s][r][1] <= budgets[r]]
        assert rows[allocation.starts[r]][r][0] == min(rows[s][r][0] for s in fitting)  # fastest that fits
        assert budgets[r] is None or allocation.activation_bytes[r] <= budgets[r]
        changed = {i for i, (a, b) in enumerate(zip(allocation.starts[r], allocation.plans[r])) if a != b}
        assert changed == set(allocation.recovered[r])
        assert all(allocation.plans[r][i] is Precision.FP32 for i in changed)
    assert list(measure(allocation.plans)) == list(zip(allocation.seconds, allocation.activation_bytes))
    assert allocation.step_seconds <= max(rows[allocation.starts[r]][r][0] for r in range(world))


# -- activation memory --------------------------------------------------------------------

class Square(nn.Module):
    def forward(self, x):
        return x * x  # autograd saves x twice: one storage


def test_saved_bytes_count_inputs_and_activations_once_and_never_parameters():
    x = torch.randn(32, 16)
    assert saved_activation_bytes(nn.Linear(16, 1000), (x,)) == x.nbytes  # the weight is resident, not counted
    assert saved_activation_bytes(Square(), (x,)) == 0  # nothing needs a gradient: nothing is saved
    assert saved_activation_bytes(Square(), (x.requires_grad_(),)) == x.nbytes
    assert saved_activation_bytes(nn.Linear(16, 8), (torch.randn(32, 16),)) == x.nbytes


def test_measuring_leaves_buffers_rng_and_grads_as_they_were():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 4) * 5 + 3
    rng = torch.get_rng_state()
    assert saved_activation_bytes(model, (x,)) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def activation_heavy_mlp():
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def test_an_all_low_plan_saves_fewer_activation_bytes_than_fp32():
    import compfx
    from compfx.planned_module import apply

    torch.manual_seed(0)
    model, x = activation_heavy_mlp(), (torch.randn(256, 8),)
    a = compfx.analyze(model, x)
    low = saved_activation_bytes(apply(model, compfx.Plan.from_bitstring(a, "0f0f0"), analysis=a), x)
    fp32 = saved_activation_bytes(apply(model, compfx.Plan.fp32(a), analysis=a), x)
    assert low < fp32 == saved_activation_bytes(model, x)


# -- two gloo processes --------------------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Run every scenario on this rank, one after the other (one process start for them all)."""
    run_scenarios(rank, world, port, out_dir, SCENARIOS, timeout_s=240)


def run_ranks(out_dir, world: int = WORLD) -> list[dict]:
    """Run all scenarios on ``world`` gloo processes; every process is gone when this returns."""
    return spawn_ranks(_rank_main, world, out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("gloo"))


def scenario(gloo_results, name: str) -> list[dict]:
    ranks = [result[name] for result in gloo_results]
    for r, result in enumerate(ranks):
        assert "error" not in result, f"scenario {name} failed on rank {r}:\n{result['error']}"
    return ranks


# scenario 1: the synced Stage 1 with fake evaluators ------------------------------------------

SPACE3 = SearchSpace(("whitelist", "other", "blacklist"), (False,) * 3, ("a", "b", "c"))


def synced(run_epoch, ctx) -> SyncedEvaluator:
    return SyncedEvaluator(FunctionEvaluator(run_epoch=run_epoch), ctx)


def lockstep(rank, world):
    ctx = rank_context()

    def run_epoch(plan):  # rank 1 is slower, and plan 0f1 fails on it in its second batch
        for batch in range(3):
            if rank == 1 and str(plan) == "0f1" and batch == 1:
                raise PlanFailedError("RuntimeError: rank 1 cannot run 0f1")
            yield 1.0 + rank, (1.0 + rank) * (1.0 - 0.2 * str(plan).count("0"))

    result = run_stage1(SPACE3, synced(run_epoch, ctx))
    samples = [(str(o.plan), o.status, o.loss, o.seconds) for o in result.samples]

    def uneven(plan):
        yield from ((1.0, 1.0) for _ in range(2 + rank))

    try:
        run_stage1(SPACE3, synced(uneven, ctx))
        uneven_error = ""
    except SearchError as error:
        uneven_error = str(error)

    def broken(plan):  # under plan 0f0, rank 1 hits an error that is not the plan's (a bug, a lost file)
        for _ in range(2):
            if rank == 1 and str(plan) == "0f0":
                raise RuntimeError("rank 1 lost its data")
            yield 1.0, 1.0

    try:
        run_stage1(SPACE3, synced(broken, ctx))
        stopped = ""
    except Exception as error:
        stopped = f"{type(error).__name__}: {error}"
    return {"rank": ctx.rank, "world": ctx.world_size, "samples": samples, "best": str(result.best.plan),
            "uneven_error": uneven_error, "stopped": stopped}


def test_synced_stage1_sees_mean_loss_max_seconds_and_fails_a_plan_on_every_rank(gloo_results):
    ranks = scenario(gloo_results, "lockstep")
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world"] == WORLD
    assert ranks[0]["samples"] == ranks[1]["samples"]  # same numbers, same decisions, in the same order
    by_plan = {plan: (status, loss, seconds) for plan, status, loss, seconds in ranks[0]["samples"]}
    assert by_plan["111"] == ("accepted", 1.5, pytest.approx(6.0))  # mean of 1 and 2; 3 batches x rank 1's 2 s
    assert by_plan["0f1"][0] == "error"  # rank 1's failure fails the plan on rank 0 too
    assert ranks[0]["best"] == ranks[1]["best"] == "0f0"
    assert all("different lengths" in r["uneven_error"] for r in ranks)


def test_an_error_that_is_not_the_plans_stops_the_search_on_every_rank(gloo_results):
    ranks = scenario(gloo_results, "lockstep")
    assert ranks[1]["stopped"] == "RuntimeError: rank 1 lost its data"  # its own error, where it happened
    assert ranks[0]["stopped"].startswith("SearchError:") and "rank(s) [1]" in ranks[0]["stopped"]
    assert "not the plan's" in ranks[0]["stopped"]


# scenario 2: the strategies, through the evaluator interface alone ------------------------------

def fake_seconds(rank: int, plan) -> float:
    """Rank 0 gains 0.2 s per low op; rank 1 loses 0.3 s with op 0 low and gains 0.2 s with op 2 low."""
    low = [p is Precision.LOW for p in plan]
    return 1.0 - 0.2 * sum(low) if rank == 0 else 1.0 + 0.3 * low[0] - 0.2 * low[2]


def fake_bytes(plan) -> int:
    """Activation bytes: 10 per FP32 op, 4 per low op, none for follow ops."""
    return sum({Precision.FP32: 10, Precision.LOW: 4, Precision.FOLLOW: 0}[p] for p in plan)


FAKE_BUDGET = 14  # rank 1's: ops 0 and 2 cannot both be FP32


def fake_strategies(rank, world):
    ctx = rank_context()

    def run_epoch(plan):
        for _ in range(2):
            yield 1.0, fake_seconds(rank, plan)

    local = FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: fake_seconds(rank, plan),
                              check_loss=lambda plan, batches: 1.0)
    config = SearchConfig(progress=False, stage2_check_batches=1)
    torch.manual_seed(rank)
    model = nn.Linear(2, 2)  # what finish() makes agree: every rank gets rank 0's state
    records = []
    agreement = RankAgreement(ctx, model, None)
    shared = run_search(SPACE3, SyncedEvaluator(local, ctx), config, report=records.append, strategy=agreement)
    agreement.finish()
    allocation = PerDeviceAllocation(ctx, model, None, space=SPACE3, local=local, activation_bytes=fake_bytes,
                                     memory_budget=FAKE_BUDGET if rank == 1 else None, threshold=config.threshold,
                                     check_batches=config.stage2_check_batches)
    per_device = run_search(SPACE3, SyncedEvaluator(local, ctx), config, report=records.append,
                            strategy=allocation)
    return {"shared": str(shared.plan), "per_device": str(per_device.plan),
            "params": [p.detach().flatten().tolist() for p in model.parameters()],
            "notes": [r.reason for r in records if not r.is_sample]}


def test_the_strategies_work_through_the_evaluator_interface_alone(gloo_results):
    ranks = scenario(gloo_results, "fake_strategies")
    # the synced search minimises the slowest rank's time: 0f0 would be 0.6 s on rank 0 but 1.1 s on rank 1
    assert max(fake_seconds(r, Assignment.parse("1f0")) for r in range(WORLD)) == 0.8
    assert ranks[0]["shared"] == ranks[1]["shared"] == "1f0"
    assert any("agreed on plan 1f0" in note for note in ranks[0]["notes"])
    assert ranks[0]["params"] == ranks[1]["params"]  # finish() gave every rank rank 0's state
    # per device: rank 0 starts all low (0.6 s) and gives op 2 back to FP32 while it keeps pace with rank 1's
    # 0.8 s; rank 1's fastest plan within 14 bytes is 1f0
    assert [r["per_device"] for r in ranks] == ["0f1", "1f0"]
    assert any("per-device plans ['0f1', '1f0']" in note for note in ranks[0]["notes"])


# scenario 3: optimize() with per-rank costs, then DDP ------------------------------------------

LINEARS = ("0:linear#0", "2:linear#0", "4:linear#0")
# rank 0 alone would pick all-low (0f0f0), rank 1 alone all-FP32; the max over ranks is lowest at 1f0f1
COST_WEIGHTS = {0: {"fp32": (1.0, 1.0, 0.8), "low": (0.0, 0.0, 0.0)},
                1: {"fp32": (0.0, 0.0, 0.0), "low": (5.0, 1.5, 1.0)}}


def rank_cost(rank, precisions) -> float:
    """Rank ``rank``'s cost of a plan from its three linears' precisions (constant in the seconds)."""
    w = COST_WEIGHTS[rank]
    return sum(w[p][i] for i, p in enumerate(precisions))


def shard(rank, n=2, rows=256):
    g = torch.Generator().manual_seed(100 + rank)  # each rank samples its own data
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(n)]


def ce(output, batch):
    return F.cross_entropy(output, batch[-1])


def optimized(rank, **config):
    from compfx import optimize

    torch.manual_seed(rank)  # different initial weights per rank: the broadcast must make them agree
    model = activation_heavy_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    settings_ = dict(progress=False, warmup=0, repeats=1, stage1_budget=8, stage2_budget=3, stage2_check_batches=1,
                     threshold=2.0, grad_scaler=False)
    result = optimize(model, shard(rank), loss_fn=ce, optimizer=opt, low_dtype=torch.bfloat16,
                      config=SearchConfig(**settings_, **config))
    return model, opt, result


def ddp_train(module, opt, rank, steps=3) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module)
    grad_dtypes = set()
    for batch in shard(rank, n=steps, rows=32):
        opt.zero_grad()
        ce(ddp(batch[0]), batch).backward()
        grad_dtypes |= {str(p.grad.dtype) for p in module.parameters()}
        opt.step()
    return {"params": [p.detach().flatten().tolist() for p in module.parameters()], "grad_dtypes": sorted(grad_dtypes)}


def shared_plan(rank, world):
    def cost(plan, seconds):
        chosen = {str(k): p for k, p in plan.items()}
        return rank_cost(rank, [chosen[k] for k in LINEARS])

    model, opt, result = optimized(rank, cost_fn=cost)
    before = [p.detach().flatten().tolist() for p in model.parameters()]
    trained = ddp_train(result.module, opt, rank)
    return {"plan": result.plan.bitstring(result.analysis), "stage1": result.stage1_plan.bitstring(result.analysis),
            "before_ddp": before, **trained, "notes": [r.reason for r in result.log.notes()]}


def test_ranks_agree_on_the_plan_that_minimises_the_max_cost_and_train_in_step_under_ddp(gloo_results):
    ranks = scenario(gloo_results, "shared_plan")
    stage1 = stage1_candidates(THREE_LINEARS)
    max_cost = {str(plan): max(rank_cost(r, [plan[i] for i in (0, 2, 4)]) for r in range(WORLD))
                for plan in stage1}
    expected = min(max_cost, key=max_cost.get)
    assert expected == "1f0f1" and min(max_cost.values()) < sorted(max_cost.values())[1]  # a unique optimum
    assert ranks[0]["stage1"] == ranks[1]["stage1"] == expected
    # Stage 2 may place the follow ops, which this cost ignores: equal cost, and the one saving less memory wins
    plan = ranks[0]["plan"]
    assert ranks[1]["plan"] == plan and [plan[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert any(f"agreed on plan {plan}" in note for note in ranks[0]["notes"])
    assert ranks[0]["before_ddp"] == ranks[1]["before_ddp"]  # rank 0's searched state was broadcast
    assert ranks[0]["params"] == ranks[1]["params"] != ranks[0]["before_ddp"]  # trained, in step
    assert ranks[0]["grad_dtypes"] == ranks[1]["grad_dtypes"] == ["torch.float32"]  # FP32 gradients reduced


# scenario 4: per-device plans with a small memory budget on rank 1 -----------------------------

SMALL_BUDGET = 100_000  # bytes: all-low saves ~78 kB per step of 256 rows, FP32 ~139 kB, mixed plans more


def low_op_count(plan, seconds) -> float:
    """A device where FP32 is cheaper (an AVX2 CPU): each op run low costs one (constant in the seconds)."""
    return float(sum(str(p) == "low" for p in plan.values()))


def per_device(rank, world):
    # priced, not timed: on an AVX-512 BF16 CPU low precision may win on rank 0 too, and the test would depend on it
    model, opt, result = optimized(rank, per_device=True, memory_budget=SMALL_BUDGET if rank == 1 else None,
                                   cost_fn=low_op_count)
    x, y = shard(rank)[0]
    nbytes = saved_activation_bytes(result.module, (x,))
    return {"plan": result.plan.bitstring(result.analysis), "bytes": nbytes,
            **ddp_train(result.module, opt, rank)}


def test_per_device_plans_meet_the_small_budget_and_the_other_rank_keeps_more_fp32(gloo_results):
    ranks = scenario(gloo_results, "per_device")
    assert ranks[1]["bytes"] <= SMALL_BUDGET  # the budget makes rank 1 run its ops low, although FP32 is cheaper
    assert ranks[0]["plan"].count("1") > ranks[1]["plan"].count("1")
    assert ranks[0]["params"] == ranks[1]["params"]  # different plans, one model
    assert ranks[0]["grad_dtypes"] == ranks[1]["grad_dtypes"] == ["torch.float32"]


# scenario 5: the torchrun example, in the job these processes already joined ---------------------

def torchrun_example(rank, world):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torchrun_search.py"
    spec = importlib.util.spec_from_file_location("torchrun_search", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(["--search-batches", "2", "--epochs", "1", "--batch-size", "64"])


def test_the_torchrun_example_agrees_on_a_plan_and_trains(gloo_results):
    ranks = scenario(gloo_results, "example")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["plan"] == ranks[1]["plan"] and all(r["loss"] == r["loss"] for r in ranks)  # not NaN


SCENARIOS = {"lockstep": lockstep, "fake_strategies": fake_strategies, "shared_plan": shared_plan,
             "per_device": per_device, "example": torchrun_example}


def test_per_device_in_one_process_picks_the_fastest_plan_within_the_budget():
    model, opt, result = optimized(0, per_device=True, memory_budget=SMALL_BUDGET)
    x, _ = shard(0)[0]
    assert result.plan.bitstring(result.analysis) == "0f0f0"  # the only plan that fits
    assert saved_activation_bytes(result.module, (x,)) <= SMALL_BUDGET


def test_a_single_process_search_honours_the_memory_budget_without_per_device():
    # the exact search (no cost model): every candidate is considered, so each plan over the budget is rejected
    model, opt, result = optimized(0, memory_budget=SMALL_BUDGET, predictor=False)
    x, _ = shard(0)[0]
    assert result.plan.bitstring(result.analysis) == "0f0f0"  # the only plan that fits, found by the stages
    assert saved_activation_bytes(result.module, (x,)) <= SMALL_BUDGET
    over = [r for r in result.log.samples() if "over memory_budget" in r.reason]
    baseline, *rejected = over  # the FP32 baseline runs (its loss is loss_0) but cannot be chosen
    assert "cannot be chosen" in baseline.reason and baseline.extra["saved_bytes"] > SMALL_BUDGET
    assert rejected and all(r.status == "rejected" and r.extra["saved_bytes"] > SMALL_BUDGET for r in rejected)


def test_a_single_process_context_makes_collectives_local():
    ctx = RankContext()
    assert ctx.gather([1.0, 2.0]) == [[1.0, 2.0]] and ctx.broadcast_text("01") == "01"
    doubled = SyncedEvaluator(FunctionEvaluator(cost=lambda plan, s: s * 2, time_step=lambda plan: 0.5), ctx)
    assert doubled.cost(Assignment.parse("0"), 1.5) == 3.0 and doubled.time_step(Assignment.parse("0")) == 0.5


# -- where collectives run (no GPU needed: NCCL's choice of device is read from the environment) --------------------

@pytest.fixture
def nccl_rank(monkeypatch):
    """An initialised NCCL process group as rank 3 of 8 sees it, on a machine with 8 GPUs, without any GPU."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nothing below may ask the device which it is
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("current_device is cuda:0 on every rank"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return monkeypatch


def test_nccl_collectives_use_the_models_gpu(nccl_rank):
    assert rank_context(device=torch.device("cuda", 5)).device == torch.device("cuda", 5)


def test_without_a_cuda_model_nccl_collectives_use_local_rank_not_the_current_device(nccl_rank, caplog):
    nccl_rank.setenv("LOCAL_RANK", "3")
    with caplog.at_level("INFO", logger="compfx"):
        ctx = rank_context(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.device) == (3, 8, torch.device("cuda", 3))
    assert "rank 3 runs its collectives on cuda:3 (LOCAL_RANK=3)" in caplog.text
    nccl_rank.delenv("LOCAL_RANK")
    assert rank_context().device == torch.device("cuda", 3)  # the global rank, modulo the GPUs


def test_a_rank_whose_current_device_is_another_gpu_is_warned(nccl_rank, caplog):
    nccl_rank.setenv("LOCAL_RANK", "3")
    nccl_rank.setattr(torch.cuda, "is_available", lambda: True)
    nccl_rank.setattr(torch.cuda, "current_device", lambda: 0)  # set_device was never called
    with caplog.at_level("WARNING", logger="compfx"):
        assert rank_context().device == torch.device("cuda", 3)
    assert "not the current CUDA device cuda:0; call torch.cuda.set_device(3)" in caplog.text


def test_a_process_group_bound_to_a_device_decides_it(nccl_rank):
    import torch.distributed as dist

    bound = type("Group", (), {"bound_device_id": torch.device("cuda", 6)})()
    nccl_rank.setattr(dist.distributed_c10d, "_get_default_group", lambda: bound)
    assert rank_context().device == torch.device("cuda", 6)


def test_gloo_collectives_stay_on_the_cpu(nccl_rank):
    import torch.distributed as dist

    nccl_rank.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert rank_context(device="cuda:1").device == torch.device("cpu")


def test_the_integrations_path_names_the_search_distributed_pieces():
    import compfx.integrations.distributed as old_path
    import compfx.search.distributed as new_path

    assert old_path.__all__ == new_path.__all__
    assert all(getattr(old_path, name) is getattr(new_path, name) for name in new_path.__all__)
