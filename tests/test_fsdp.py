"""FSDP2 (fully_shard per planned block, then the root) on 2 gloo CPU processes: lock-step training that matches
one process, the search under FSDP2 reaching one plan, and examples/torchrun_fsdp.py."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from helpers import run_scenarios, spawn_ranks
from tests.test_per_module import Block, Net, data

WORLD, TIMEOUT_S = 2, 240


def train_planned(distributed: bool, steps: int = 3) -> list[float]:
    """Net with Plan.amp applied per block (then, if distributed, each block and the root fully_shard-ed)."""
    import compfx

    torch.manual_seed(0)
    model = Net()
    x, y = data()
    analysis = compfx.analyze(model, x)
    compfx.plan_blocks(model, compfx.Plan.amp(analysis), analysis=analysis, blocks=(Block,))
    if distributed:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):  # every rank the same batch: FSDP's averaged gradient is one process's gradient
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_scenario(rank, world):
    return {"losses": train_planned(True)}


def search_scenario(rank, world):
    import compfx
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    x, y = data()
    analysis = compfx.analyze(model, x)
    compfx.plan_blocks(model, compfx.Plan.fp32(analysis), analysis=analysis, blocks=(Block,))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard of the data
    loader = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    config = compfx.SearchConfig(progress=False, repeats=1, warmup=0, stage1_budget=4, stage2_budget=2,
                                 cache_plan=False)
    result = compfx.optimize(model, loader, optimizer=optimizer, per_module=(Block,), config=config,
                             loss_fn=lambda out, batch: F.cross_entropy(out, batch[-1]))
    loss = F.cross_entropy(model(loader[0][0]), loader[0][1])  # the sharded model still trains after the search
    loss.backward()
    optimizer.step()
    return {"plan": result.plan.bitstring(result.analysis), "same_model": result.module is model,
            "sharded": type(model.blocks[0]).__name__, "finite": bool(torch.isfinite(loss))}


def example_scenario(rank, world):
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torchrun_fsdp.py"
    spec = importlib.util.spec_from_file_location("torchrun_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--search-batches", "2", "--steps", "2", "--width", "16", "--batch-size", "8"])


SCENARIOS = {"train": train_scenario, "search": search_scenario, "example": example_scenario}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Run every FSDP2 scenario on this rank (one process start for them all)."""
    run_scenarios(rank, world, port, out_dir, SCENARIOS, timeout_s=120)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return spawn_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("fsdp"), TIMEOUT_S)


def scenario(results, name: str) -> list[dict]:
    ranks = [result[name] for result in results]
    for r, result in enumerate(ranks):
        assert "error" not in result, f"scenario {name} failed on rank {r}:\n{result['error']}"
    return ranks


def test_fully_shard_per_planned_block_trains_in_lock_step_and_matches_one_process(fsdp_results):
    ranks = scenario(fsdp_results, "train")
    assert ranks[0]["losses"] == ranks[1]["losses"]
    single = train_planned(False)
    assert len(single) == 3
    for sharded, alone in zip(ranks[0]["losses"], single):
        assert abs(sharded - alone) <= 1e-4


def test_search_under_fsdp2_reaches_one_plan_on_both_ranks(fsdp_results):
    ranks = scenario(fsdp_results, "search")
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert all(r["same_model"] and r["finite"] for r in ranks)
    assert ranks[0]["sharded"].startswith("FSDP")  # the search ran on the sharded blocks themselves


def test_the_torchrun_fsdp_example_agrees_on_a_plan_and_trains(fsdp_results):
    ranks = scenario(fsdp_results, "example")
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert all(r["same_model"] and r["loss"] == r["loss"] for r in ranks)
