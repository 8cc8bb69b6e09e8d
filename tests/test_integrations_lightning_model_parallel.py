"""CompfxPrecision under Lightning's ModelParallelStrategy (FSDP2, data parallel) on 2 gloo CPU processes: a tiny
decoder whose blocks are planned, then fully_shard-ed, in configure_model trains with a given plan and with a searched
one (the ranks agree on it), resumes from the distributed checkpoint with its plan and no search, and what the plugin
cannot serve is refused clearly."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from helpers import fp32_op_count, run_scenarios, spawn_ranks  # noqa: E402
from tiny_gpt import lm_loss  # noqa: E402

WORLD, TIMEOUT_S = 2, 240
VOCAB, LENGTH = 32, 8
EXAMPLE = torch.zeros(2, LENGTH, dtype=torch.long)  # what configure_model captures the blocks on


def decoder():
    from compfx.examples import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(2, width=16, heads=2, length=LENGTH, vocab=VOCAB)


BLOCK = type(decoder().blocks[0])


class Decoder(L.LightningModule):
    """A tiny decoder; configure_model plans its blocks (unless told not to), then shards them and the decoder."""

    def __init__(self, plan_blocks: bool = True, shard_first: bool = False):
        super().__init__()
        self.model = decoder()
        self.plan_first, self.shard_first = plan_blocks, shard_first
        self.losses, self.blocks_seen = [], []

    def configure_model(self):
        if self.plan_first and not self.shard_first:
            self.trainer.precision_plugin.plan_blocks(self, EXAMPLE, blocks=(BLOCK,))
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        if self.shard_first:
            self.trainer.precision_plugin.plan_blocks(self, EXAMPLE, blocks=(BLOCK,))

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        block = self.model.blocks[0]
        loss = lm_loss(self(batch[0]), batch)
        self.losses.append(loss.item())
        self.blocks_seen.append((type(block).__name__, getattr(block, "plan", None)))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (32, LENGTH + 1), generator=generator)
    data = [(t[:-1], t[1:]) for t in tokens]
    return torch.utils.data.DataLoader(data, batch_size=4)  # 16 sequences a rank: 4 steps an epoch


def fit(root, plugin, module=None, *, tensor_parallel=1, ckpt_path=None, max_epochs=1, checkpoints=False):
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = module or Decoder()
    callbacks = [L.callbacks.ModelCheckpoint(dirpath=root / "checkpoints", every_n_epochs=1, save_top_k=-1,
                                             filename="{epoch}")] if checkpoints else []
    strategy = ModelParallelStrategy(data_parallel_size=WORLD // tensor_parallel, tensor_parallel_size=tensor_parallel)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=max_epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        plugins=[plugin], callbacks=callbacks, enable_checkpointing=checkpoints)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module


#: a short search on a simulated device where low precision pays (no timing decides it)
FAST = dict(progress=False, repeats=1, warmup=0, stage1_budget=4, stage2_budget=2, cache_plan=False,
            cost_fn=fp32_op_count)


def seen(module, plan) -> dict:
    """What the training steps ran: the first block's class each step, and whether it ran ``plan``."""
    return {"types": sorted({name for name, _ in module.blocks_seen}), "steps": len(module.blocks_seen),
            "ran_plan": all(running == plan for _, running in module.blocks_seen),
            "finite": all(math.isfinite(loss) for loss in module.losses)}


def given_scenario(rank, world, out_dir):
    import compfx
    from compfx.integrations.lightning import CompfxPrecision
    from compfx.passes.cast_report import count_casts
    from compfx.regions import analyze_regions

    plan = compfx.Plan.amp(analyze_regions(Decoder(), EXAMPLE, (BLOCK,)))  # each rank builds the same plan
    plugin = CompfxPrecision(plan=plan)  # no loss_fn: nothing is searched
    trainer, module = fit(out_dir / "given", plugin)
    block = module.model.blocks[0]
    return {**seen(module, plan), "searched": plugin.searched, "global_step": trainer.global_step,
            "casts": sum(count_casts(gm) for gm in block.graphs.values()),
            "kept": plugin.state_dict()["plan"] == plan.to_dict(),
            "file": rank != 0 or compfx.Plan.load(out_dir / "given" / "compfx-plan.json") == plan}


def search_scenario(rank, world, out_dir):
    import compfx
    from compfx.integrations.lightning import CompfxPrecision

    plugin = CompfxPrecision(search_batches=2, loss_fn=lm_loss, config=compfx.SearchConfig(**FAST))
    trainer, module = fit(out_dir / "search", plugin, max_epochs=2, checkpoints=True)
    plan = compfx.Plan.from_dict(plugin.state_dict()["plan"])
    result = {**seen(module, plan), "searched": plugin.searched, "plan": plan.to_dict(), "losses": module.losses}
    if rank == 0:  # the distributed checkpoint's metadata holds the plugin's state
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        meta = torch.load(out_dir / "search" / "checkpoints" / "epoch=0.ckpt" / _METADATA_FILENAME, weights_only=False)
        result["checkpointed"] = meta["CompfxPrecision"]["plan"]
    return result


def resume_scenario(rank, world, out_dir):
    import compfx
    import compfx.integrations.lightning as lightning_integration
    from compfx.integrations.lightning import CompfxPrecision

    searches = []
    optimize = lightning_integration.optimize
    lightning_integration.optimize = lambda *a, **k: searches.append(1) or optimize(*a, **k)
    try:
        plugin = CompfxPrecision(search_batches=2, loss_fn=lm_loss, config=compfx.SearchConfig(**FAST))
        checkpoint = out_dir / "search" / "checkpoints" / "epoch=0.ckpt"
        _, module = fit(out_dir / "resume", plugin, max_epochs=2, ckpt_path=str(checkpoint))
    finally:
        lightning_integration.optimize = optimize
    plan = compfx.Plan.from_dict(plugin.state_dict()["plan"])
    return {**seen(module, plan), "searched": plugin.searched, "searches": len(searches), "plan": plan.to_dict(),
            "losses": module.losses}


def refused_scenario(make_module, **options):
    def scenario(rank, world, out_dir):
        from compfx.errors import BadInputError
        from compfx.integrations.lightning import CompfxPrecision

        try:
            fit(out_dir / "refused", CompfxPrecision(search_batches=2, loss_fn=lm_loss), make_module(), **options)
        except BadInputError as error:
            return {"refused": str(error)}
        return {"refused": None}
    return scenario


SCENARIOS = {"given": given_scenario, "search": search_scenario, "resume": resume_scenario,
             "tensor_parallel": refused_scenario(Decoder, tensor_parallel=2),
             "shard_first": refused_scenario(lambda: Decoder(shard_first=True))}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every scenario on this rank, in one process start; Lightning finds the process group started and the ranks
    in the environment (LOCAL_RANK: the processes are launched from outside)."""
    import os

    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NODE_RANK="0")
    scenarios = {name: (lambda r, w, fn=fn: fn(r, w, pathlib.Path(out_dir))) for name, fn in SCENARIOS.items()}
    run_scenarios(rank, world, port, out_dir, scenarios, timeout_s=180)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("lightning-model-parallel"), TIMEOUT_S)


def scenario(results, name: str) -> list[dict]:
    found = [result[name] for result in results]
    for r, result in enumerate(found):
        assert "error" not in result, f"scenario {name} failed on rank {r}:\n{result['error']}"
    return found


def test_a_given_plan_trains_in_the_blocks_fully_shard_wraps(ranks):
    for rank in scenario(ranks, "given"):
        assert rank["searched"] is False and rank["global_step"] == 4 and rank["steps"] == 4 and rank["finite"]
        assert rank["types"] == ["FSDPPlannedBlock"] and rank["ran_plan"]  # every step: the planned block, sharded
        assert rank["casts"] > 0  # its graphs run the AMP plan: bf16 casts
        assert rank["kept"] and rank["file"]


def test_a_search_on_the_sharded_blocks_reaches_one_plan_on_both_ranks_and_is_checkpointed(ranks):
    first, second = scenario(ranks, "search")
    assert first["searched"] is True and second["searched"] is True
    assert first["plan"] == second["plan"] and first["checkpointed"] == first["plan"]
    assert "low" in first["plan"]["ops"].values()  # a mixed plan, switched into the sharded blocks
    for rank in (first, second):
        assert rank["types"] == ["FSDPPlannedBlock"] and rank["ran_plan"] and rank["steps"] == 8 and rank["finite"]


def test_a_resumed_fit_takes_the_checkpoints_plan_without_searching_and_continues_the_same_training(ranks):
    searched, resumed = scenario(ranks, "search"), scenario(ranks, "resume")
    for before, after in zip(searched, resumed):
        assert after["searched"] is False and after["searches"] == 0 and after["plan"] == before["plan"]
        assert after["types"] == ["FSDPPlannedBlock"] and after["ran_plan"] and after["steps"] == 4
        # the second epoch, resumed from the distributed checkpoint, is the uninterrupted one's
        torch.testing.assert_close(after["losses"], before["losses"][4:])


def test_tensor_parallelism_and_sharding_before_planning_are_refused_clearly(ranks):
    for rank in scenario(ranks, "tensor_parallel"):
        assert rank["refused"] and "tensor_parallel_size=2" in rank["refused"]
    for rank in scenario(ranks, "shard_first"):
        assert rank["refused"] and "is sharded already" in rank["refused"]
        assert "plan_blocks(self, example_inputs, blocks=(YourBlock,))" in rank["refused"]
