"""CompfxPrecision, compfx as Lightning's precision plugin: a LightningModule trains with a given plan and with a
searched one, resumes from ``ckpt_path`` with the checkpoint's plan and no search, lets the Guard repair a step that
overflows, and refuses what it cannot serve."""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

import compfx  # noqa: E402
import compfx.integrations.planned_training as planned_training  # noqa: E402
from compfx.errors import BadInputError  # noqa: E402
from compfx.integrations.lightning import PLAN_FILE, CompfxCallback, CompfxPrecision  # noqa: E402
from compfx.per_module import PlannedBlock  # noqa: E402
from compfx.regions import analyze_regions  # noqa: E402
from tests.quick import quick_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py
FAST_SEARCH = quick_config()


class Classifier(L.LightningModule):
    def __init__(self, width: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(x=None):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(48, 16, generator=generator) if x is None else x
    data = torch.utils.data.TensorDataset(inputs, torch.randint(0, 4, (48,), generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=8)  # 6 steps an epoch


def ce(output, batch):
    return F.cross_entropy(output, batch[-1])


class PlannedWhileTraining(L.Callback):
    """What the LightningModule's net is while training_step runs."""

    def __init__(self):
        self.types = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.types.append(type(pl_module.net).__name__)


def fit(root, plugin, ckpt_path=None, module=None, data=None, callbacks=(), **options):
    torch.manual_seed(0)
    module = module or Classifier()
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=root / "checkpoints", every_n_epochs=1, save_top_k=-1,
                                              filename="{epoch}")
    spy = PlannedWhileTraining()
    settings = dict(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=root, plugins=[plugin],
                    callbacks=[checkpoints, spy, *callbacks])
    trainer = L.Trainer(**{**settings, **options})
    trainer.fit(module, data or loader(), ckpt_path=ckpt_path)
    return trainer, module, spy


def test_a_given_plan_trains_in_the_module_and_is_put_back(tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    plan = compfx.Plan.amp(analyze_regions(model, torch.randn(8, 16), torch.nn.Sequential))
    plugin = CompfxPrecision(plan=plan)  # no loss_fn: nothing is searched, training_step's loss trains it
    trainer, module, spy = fit(tmp_path, plugin, module=model)
    assert plugin.searched is False and trainer.global_step == 12
    assert all(math.isfinite(loss) for loss in module.losses)
    assert spy.types == ["PlannedBlock"] * 12  # every training step ran the plan
    assert type(module.net) is torch.nn.Sequential  # and the module's own net is back after fit
    assert compfx.Plan.load(tmp_path / PLAN_FILE) == plan


def test_a_searched_plan_is_in_every_checkpoint_and_a_resumed_fit_does_not_search(tmp_path, monkeypatch):
    plugin = CompfxPrecision(search_batches=3, loss_fn=ce, config=FAST_SEARCH)
    trainer, module, spy = fit(tmp_path, plugin)
    assert plugin.searched is True and len(module.losses) == 12 and spy.types == ["PlannedBlock"] * 12
    checkpoint = torch.load(tmp_path / "checkpoints" / "epoch=0.ckpt", weights_only=False)
    searched = compfx.Plan.from_dict(checkpoint["CompfxPrecision"]["plan"])
    assert searched == compfx.Plan.load(tmp_path / PLAN_FILE)

    monkeypatch.setattr(planned_training, "optimize", lambda *a, **k: pytest.fail("a resumed fit searched"))
    resumed_plugin = CompfxPrecision(search_batches=3, loss_fn=ce, config=FAST_SEARCH)
    _, resumed, _ = fit(tmp_path, resumed_plugin, ckpt_path=str(tmp_path / "checkpoints" / "epoch=0.ckpt"))
    assert resumed_plugin.searched is False and resumed_plugin.state_dict()["plan"] == searched.to_dict()
    torch.testing.assert_close(resumed.losses, module.losses[6:])  # the second epoch, resumed, is the same


def test_the_guard_skips_a_step_that_overflows_and_repairs_the_plan(tmp_path):
    """fp16 on the CPU; the second linear's weight is blown up before step 3, so its fp16 output overflows."""
    model = Classifier()
    second = model.net[2]
    plan = compfx.Plan.amp(compfx.analyze(model.net, torch.randn(8, 16), low_dtype=torch.float16))

    class BlowUp(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                with torch.no_grad():
                    second.weight.mul_(1e6)

    plugin = CompfxPrecision(plan=plan, module="net", guard={"check_every": 1})
    trainer, module, spy = fit(tmp_path, plugin, module=model, data=loader(torch.full((48, 16), 10.0)),
                               callbacks=[BlowUp()], max_epochs=1)
    assert spy.types == ["PlannedModule"] * 6  # the Guard watches the net planned whole
    state = plugin.state_dict()["guard"]
    assert state["skipped"] >= 1 and [r["key"] for r in state["repairs"]][:1] == ["2:linear#0"]
    assert compfx.Plan.from_dict(plugin.state_dict()["plan"])[compfx.OpKey("2", "linear", 0)] == "fp32"
    assert type(module.net) is torch.nn.Sequential and module.net[2] is second


def test_strategies_whose_precision_is_their_own_are_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    module = Classifier()
    module._trainer = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[], world_size=1)  # as Lightning attaches it
    with pytest.raises(BadInputError, match="FSDPStrategy runs a precision plugin of its own"):
        CompfxPrecision(search_batches=2, loss_fn=ce).convert_module(module)


def test_model_parallel_strategy_without_the_blocks_planned_in_configure_model_names_the_line_to_add(tmp_path):
    """Under ModelParallelStrategy the blocks are planned in configure_model, before fully_shard (see
    test_integrations_lightning_model_parallel.py); forgetting that line is refused, naming it. The Guard, which
    watches one network planned whole, stays refused there."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Sharded(Classifier):
        def configure_model(self):  # where a user calls fully_shard; Lightning calls convert_module after it
            pass

    environment = dict(os.environ)
    try:
        line = re.escape("configure_model, before fully_shard: self.trainer.precision_plugin.plan_blocks(self, "
                         "example_inputs, blocks=(YourBlock,))")
        with pytest.raises(BadInputError, match=line):
            fit(tmp_path, CompfxPrecision(search_batches=2, loss_fn=ce), module=Sharded(),
                strategy=ModelParallelStrategy())
        with pytest.raises(BadInputError, match="repairs the plan of one process's network, planned whole"):
            fit(tmp_path, CompfxPrecision(search_batches=2, loss_fn=ce, module="net", guard=True),
                module=BlocksPlanned(), strategy=ModelParallelStrategy())  # the Guard: refused, with plan_blocks too
    finally:  # the strategy started a one-process gloo group and set WORLD_SIZE & co: later tests must see neither
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def test_two_planners_or_a_guard_without_its_network_are_refused(tmp_path):
    with pytest.raises(BadInputError, match="two planners"):
        fit(tmp_path, CompfxPrecision(search_batches=2, loss_fn=ce, config=FAST_SEARCH),
            callbacks=[CompfxCallback(search_batches=2, loss_fn=ce, config=FAST_SEARCH)])
    with pytest.raises(BadInputError, match="name it with module="):
        CompfxPrecision(search_batches=2, loss_fn=ce, guard=True)


class BlocksPlanned(Classifier):
    """Plans its linears in configure_model, as a LightningModule under ModelParallelStrategy does before sharding."""

    def configure_model(self):
        self.trainer.precision_plugin.plan_blocks(self, torch.randn(8, 16), blocks=(torch.nn.Linear,))


def test_blocks_planned_in_configure_model_are_searched_at_the_first_step_and_stay_planned(tmp_path):
    plugin = CompfxPrecision(search_batches=2, loss_fn=ce, config=FAST_SEARCH)
    trainer, module, _ = fit(tmp_path, plugin, module=BlocksPlanned(), max_epochs=1)
    assert plugin.searched is True and trainer.global_step == 6
    assert type(module.net[0]) is PlannedBlock and type(module.net[2]) is PlannedBlock  # the blocks stay planned
    searched = compfx.Plan.from_dict(plugin.state_dict()["plan"])
    assert module.net[0].plan == searched  # and run the searched plan
    block = module.net[0]
    plugin.plan_blocks(module, torch.randn(8, 16), blocks=(torch.nn.Linear,))  # configure_model runs again
    assert module.net[0] is block and block.plan == searched


def attached(plugin, module=None):
    module = module or Classifier()
    module.trainer = L.Trainer(accelerator="cpu", plugins=[plugin], logger=False)  # as fit() attaches it
    return module


def test_plan_blocks_refuses_a_plan_of_another_network_or_the_guard_and_leaves_the_blocks_as_they_were():
    other = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    plan = compfx.Plan.amp(analyze_regions(other, torch.randn(8, 16), torch.nn.Linear))
    plugin = CompfxPrecision(plan=plan)
    module = attached(plugin)
    with pytest.raises(compfx.errors.PlanMismatchError):
        plugin.plan_blocks(module, torch.randn(8, 16), blocks=torch.nn.Linear)
    assert type(module.net[0]) is torch.nn.Linear and type(module.net[2]) is torch.nn.Linear
    plugin = CompfxPrecision(plan=plan, module="net", guard=True)
    module = attached(plugin)
    with pytest.raises(BadInputError, match="plans it block by block"):
        plugin.plan_blocks(module, torch.randn(8, 16), blocks=torch.nn.Linear)
    with pytest.raises(BadInputError, match="expected the LightningModule of a Trainer"):
        CompfxPrecision().plan_blocks(module.net, torch.randn(8, 16), blocks=torch.nn.Linear)
