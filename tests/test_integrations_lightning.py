"""CompfxCallback in Lightning's Trainer: a small LightningModule, 12 steps on the CPU, a plan in default_root_dir,
and a run resumed from a checkpoint that trains with the checkpoint's plan instead of searching again."""

import math

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

import compfx  # noqa: E402
import compfx.integrations.planned_training as planned_training  # noqa: E402
from compfx.errors import BadInputError  # noqa: E402
from compfx.integrations.lightning import LOG_FILE, PLAN_FILE, CompfxCallback  # noqa: E402
from compfx.per_module import PlannedBlock  # noqa: E402
from tests.quick import quick_config  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 16, generator=generator),
                                          torch.randint(0, 4, (48,), generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=8)  # 6 steps an epoch


def ce(output, batch):
    return F.cross_entropy(output, batch[-1])


FAST_SEARCH = quick_config()


def _fit(root, callback, ckpt_path=None, **trainer_options):
    torch.manual_seed(0)
    module = Classifier()
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=root / "checkpoints", every_n_epochs=1, save_top_k=-1,
                                              filename="{epoch}")
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, callbacks=[callback, checkpoints],
                        **trainer_options)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return trainer, module


def test_lightning_trains_with_the_plan_and_resumes_without_searching(tmp_path, monkeypatch, one_thread):
    callback = CompfxCallback(search_batches=3, loss_fn=ce, config=FAST_SEARCH)
    trainer, module = _fit(tmp_path, callback)
    assert trainer.global_step == 12 and len(module.losses) == 12
    assert all(math.isfinite(loss) for loss in module.losses)
    assert callback.searched is True
    assert compfx.Plan.load(tmp_path / PLAN_FILE) == callback.run.plan
    assert (tmp_path / LOG_FILE).stat().st_size > 0
    # the net was planned in place while training; afterwards it is the module's own again, and nothing is patched
    assert callback.run.regions == ["net"] and callback.run.blocks == {}
    assert type(module.net) is torch.nn.Sequential and "forward" not in vars(module)

    searches = []
    real_optimize = planned_training.optimize
    monkeypatch.setattr(planned_training, "optimize", lambda *a, **k: searches.append(1) or real_optimize(*a, **k))
    resumed_callback = CompfxCallback(search_batches=3, loss_fn=ce, config=FAST_SEARCH)
    _, resumed = _fit(tmp_path, resumed_callback, ckpt_path=str(tmp_path / "checkpoints" / "epoch=0.ckpt"))
    assert searches == [] and resumed_callback.searched is False
    assert resumed_callback.run.source == "the checkpoint" and resumed_callback.run.plan == callback.run.plan
    # the second epoch, resumed, is the uninterrupted run's: same plan, same state
    torch.testing.assert_close(resumed.losses, module.losses[6:])


def test_a_given_plan_trains_without_a_loss_fn(tmp_path):
    """Nothing is searched, so the callback needs no loss of its own: training_step's loss trains the plan."""
    searched = CompfxCallback(search_batches=2, loss_fn=ce, config=FAST_SEARCH)
    _fit(tmp_path / "search", searched)
    given = CompfxCallback(plan=tmp_path / "search" / PLAN_FILE, config=FAST_SEARCH)  # no loss_fn
    trainer, module = _fit(tmp_path / "given", given)
    assert given.searched is False and given.run.plan == searched.run.plan
    assert trainer.global_step == 12 and all(math.isfinite(loss) for loss in module.losses)


def test_the_planned_module_is_what_training_step_calls(tmp_path):
    calls, seen = [], []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                planned = callback.run.blocks["net"]
                seen.extend([planned, list(pl_module.state_dict())])
                planned.register_forward_pre_hook(lambda m, inputs: calls.append(1))

    callback = CompfxCallback(search_batches=2, loss_fn=ce, config=FAST_SEARCH)
    torch.manual_seed(0)
    module = Classifier()
    net, keys = module.net, list(module.state_dict())
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[callback, Spy()])
    trainer.fit(module, _loader())
    assert len(calls) == 4 and callback.state_dict()["plan"] == callback.run.plan.to_dict()
    planned, keys_while_planned = seen
    assert isinstance(planned, PlannedBlock) and len(planned.graphs) >= 1  # self(x) ran the net's planned graph
    assert keys_while_planned == keys and planned.get_submodule("0").weight is net[0].weight
    assert module.net is net and list(module.state_dict()) == keys  # the module's own net is back


def test_an_exception_in_training_puts_the_modules_own_net_back(tmp_path):
    class Failing(Classifier):
        def training_step(self, batch, batch_idx):
            assert isinstance(self.net, PlannedBlock)  # the plan runs
            if batch_idx == 2:
                raise RuntimeError("a bug in training_step")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    module = Failing()
    net = module.net
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[CompfxCallback(search_batches=2, loss_fn=ce, config=FAST_SEARCH)])
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        trainer.fit(module, _loader())
    assert module.net is net and type(module.net) is torch.nn.Sequential


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_mixed_precision_is_refused_naming_the_setting(precision, tmp_path):
    with pytest.raises(BadInputError, match="turn it off"):
        _fit(tmp_path, CompfxCallback(loss_fn=ce, config=FAST_SEARCH), precision=precision)


def test_an_unknown_submodule_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="module='encoder'"):
        _fit(tmp_path, CompfxCallback(loss_fn=ce, module="encoder", config=FAST_SEARCH))
