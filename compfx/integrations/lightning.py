"""compfx in Lightning's ``Trainer``: a precision plugin, or a callback, searches a plan and the trainer trains with it.

Lightning's idiom for how a model computes is a precision plugin, and
:class:`CompfxPrecision` is one: ``Trainer(plugins=[CompfxPrecision(...)])``. It
is what to use by default: the plan goes into every checkpoint with the
plugin's state, and the :class:`~compfx.Guard` can watch the training step
through the plugin's hooks. :class:`CompfxCallback` does the same from a
callback, beside the precision plugin the ``Trainer`` makes for
``precision="32-true"`` (and for code written against it).

::

    trainer = L.Trainer(max_epochs=3, callbacks=[CompfxCallback(search_batches=8, loss_fn=loss)])
    trainer.fit(module, loader)    # default_root_dir/compfx-plan.json, default_root_dir/compfx-search.jsonl

Where ``Trainer(precision="bf16-mixed")`` runs every op autocast lists in bf16,
the callback searches which ops to run low (:func:`compfx.optimize`) on the
first ``search_batches`` batches of the trainer's train dataloader, with the
LightningModule's forward (or a submodule's) and the trainer's optimizer; then
``self(x)`` in ``training_step`` runs the plan: the submodules the forward runs
are replaced, in the module itself, by planned modules holding the same
Parameters (see :mod:`compfx.integrations.planned_training`), and put back at
train end or on an exception. The plan is
part of the callback's checkpoint state, so ``trainer.fit(..., ckpt_path=...)``
loads it instead of searching again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError("compfx.integrations.lightning needs lightning: pip install 'compfx[lightning]'") from error

import torch

from ..analysis import analyze
from ..planned_module import PlannedModule
from ..batches import check_first_batch, model_device
from ..errors import BadInputError, PlanFileError
from ..guard import Guard
from ..optimization import optimize
from ..plan import Plan
from ..search.config import SearchConfig
from .planned_training import LOG_FILE, PLAN_FILE, PlannedRun, first_batches, plan_model

__all__ = ["CompfxPrecision", "CompfxCallback", "PLAN_FILE", "LOG_FILE"]

#: Lightning precisions that leave the model in FP32 without autocast, as the plan expects
_FP32_PRECISIONS = ("32-true", "32")


class CompfxCallback(Callback):
    """Search a mixed-precision plan at train start; Lightning's ``Trainer`` then trains with it.

    * ``search_batches``: how many of the trainer's first training batches the
      search trains on; taking them leaves the data order and RNG as they were.
    * ``loss_fn(output, batch)``: the loss of the planned module's output
      (the LightningModule's ``training_step`` mixes forward, loss and logging,
      so the search needs the loss apart); defaults to ``output.loss``. A given ``plan``
      needs none: nothing is searched, and ``training_step``'s loss trains it.
    * ``module``: the attribute path of the submodule to plan (e.g. ``"model"``
      for a LightningModule that wraps a Hugging Face model); default: the
      LightningModule's own ``forward``. The submodules that forward runs (the
      outermost ones) become :class:`~compfx.per_module.PlannedBlock` s in
      place (``run.blocks``), until train end or an exception; ops of the
      forward itself, outside them, run eagerly in FP32.
    * ``config``, ``low_dtype``, ``plan``: as for :func:`compfx.optimize`
      (``keep_search_training`` is set False: the trainer owns the training);
      a given ``plan`` (a :class:`~compfx.Plan` or plan file of the regions,
      as this callback writes them) skips the search.

    It writes ``compfx-plan.json`` and the search log ``compfx-search.jsonl``
    to ``trainer.default_root_dir`` (global rank zero), logs a summary line and
    ``compfx/*`` metrics to the trainer's loggers, and keeps the plan in its
    checkpoint state: ``fit(ckpt_path=...)`` trains with the checkpoint's plan,
    no search (``searched`` is False). A ``precision`` other than ``"32-true"``
    is refused at setup; so is more than one optimizer.

    >>> cb = CompfxCallback(search_batches=4, loss_fn=lambda out, batch: out.sum())
    >>> cb.search_batches, cb.searched, cb.state_dict()
    (4, None, {})
    """

    def __init__(self, search_batches: int = 8, *, loss_fn=None, module: str | None = None,
                 config: SearchConfig | None = None, low_dtype: torch.dtype | None = None,
                 plan: Plan | str | os.PathLike | None = None):
        if isinstance(search_batches, bool) or not isinstance(search_batches, int) or search_batches < 1:
            raise BadInputError(f"search_batches={search_batches!r}; expected a positive int, e.g. 8.")
        if config is not None and not isinstance(config, SearchConfig):
            raise BadInputError(f"config is a {type(config).__name__}; expected a compfx.SearchConfig.")
        self.search_batches, self.loss_fn, self.module, self.config = search_batches, loss_fn, module, config
        self.low_dtype = low_dtype
        self.plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.run: PlannedRun | None = None
        self._restored: Plan | None = None  # the plan a checkpoint's state held

    @property
    def searched(self) -> bool | None:
        """True: this run searched its plan; False: it used a given or checkpointed one; None: not started."""
        return None if self.run is None else self.run.searched

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        precision = str(trainer.precision)
        if precision not in _FP32_PRECISIONS:
            raise BadInputError(
                f"Trainer(precision={precision!r}) changes every op's precision on top of the plan that "
                "CompfxCallback chooses per op; turn it off (Trainer(precision=\"32-true\"), the default) and let "
                "the callback's plan decide, or remove CompfxCallback to train with plain mixed precision.")

    def on_train_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise BadInputError(f"the LightningModule configures {len(trainer.optimizers)} optimizers; "
                                "CompfxCallback searches with one (the one that trains the planned module). Plan a "
                                "single network with module=... and one optimizer, or use compfx.optimize directly.")
        target = self._target(pl_module)
        self._remove()  # a second fit() with the same callback
        plan, source = ((self.plan, "the plan given to CompfxCallback") if self.plan is not None else
                        (self._restored, "the checkpoint") if self._restored is not None else (None, "searched"))
        root = trainer.default_root_dir
        batches = first_batches(trainer.train_dataloader, self.search_batches, model_device(target))
        log = os.path.join(root, LOG_FILE) if trainer.is_global_zero and plan is None else None
        self.run = plan_model(target, batches, optimizer=trainer.optimizers[0], loss_fn=self.loss_fn,
                              low_dtype=self.low_dtype, config=self.config, plan=plan, log=log, source=source)
        if trainer.is_global_zero:
            self.run.plan.save(os.path.join(root, PLAN_FILE))
        rank_zero_info(self.run.summary())
        for logger in trainer.loggers:
            logger.log_metrics(self.run.metrics(), step=trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._remove()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._remove()

    def state_dict(self) -> dict:
        return {} if self.run is None else {"plan": self.run.plan.to_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, Mapping):
            raise PlanFileError(f"CompfxCallback.load_state_dict() got a {type(state_dict).__name__}; expected the "
                                "mapping its state_dict() returned (from the checkpoint's callback state).")
        if "plan" in state_dict:
            self._restored = Plan.from_dict(state_dict["plan"], source="the checkpoint's CompfxCallback state")

    def _target(self, pl_module):
        return _submodule(pl_module, self.module, "CompfxCallback")

    def _remove(self) -> None:
        if self.run is not None:
            self.run.restore()


def _submodule(pl_module, path: str | None, who: str):
    """The network a plugin or callback plans: the LightningModule itself, or its submodule at ``path``."""
    if path is None:
        return pl_module
    try:
        return pl_module.get_submodule(path)
    except AttributeError as error:
        raise BadInputError(f"{who}(module={path!r}): {type(pl_module).__name__} has no such submodule; expected the "
                            "attribute path of the network to plan, e.g. module=\"model\".") from error


def _check_one_optimizer(trainer, who: str) -> None:
    if len(trainer.optimizers) != 1:
        raise BadInputError(f"the LightningModule configures {len(trainer.optimizers)} optimizers; {who} searches with "
                            "one (the one that trains the planned module). Plan a single network with module=... and "
                            "one optimizer, or use compfx.optimize directly.")


#: Strategies whose precision must be a plugin of their own (FSDPPrecision, DeepSpeedPrecision, XLAPrecision):
#: Lightning refuses another plugin for FSDP and XLA when the Trainer is built; CompfxPrecision refuses the rest.
_OWN_PRECISION_STRATEGIES = (FSDPStrategy, DeepSpeedStrategy)


class CompfxPrecision(Precision):
    """compfx's plan as Lightning's precision plugin: ``Trainer(plugins=[CompfxPrecision(plan=...)])``, or
    ``CompfxPrecision(search_batches=8, loss_fn=...)`` to search one on the trainer's first training batches.

    * ``convert_module`` (Lightning calls it in the strategy's setup, after
      ``configure_model``) checks the strategy and keeps the module. compfx
      captures a model on real inputs, which the train dataloader only gives
      later, so the plan is applied (or searched, on the first
      ``search_batches`` batches of the trainer's train dataloader, leaving its
      data order and RNG as they were) when the first training step starts,
      before its forward: the submodules the LightningModule's forward runs (or
      ``module``'s) become :class:`~compfx.per_module.PlannedBlock` s in place,
      as :class:`CompfxCallback` plans them, and are put back at teardown.
    * ``state_dict`` holds the plan (and the Guard's state): every checkpoint
      carries it, and ``trainer.fit(..., ckpt_path=...)`` trains with it
      without searching (``searched`` is False).
    * ``guard=True`` (or a dict of :class:`~compfx.Guard` options) watches
      the training step: ``optimizer_step`` runs the step's closure, then the
      Guard's step, which skips a step with non-finite values and moves the ops
      where they start to FP32. The Guard watches a whole planned network, so it
      needs ``module=`` naming the network that holds every trained Parameter,
      which then runs as one :class:`~compfx.PlannedModule`; one process only.
    * ``loss_fn``, ``config``, ``low_dtype``, ``plan`` (a :class:`~compfx.Plan`
      or plan file) as for :class:`CompfxCallback`. The plan and the search log
      go to ``default_root_dir`` (global rank zero).

    Parameters stay FP32 (``precision == "32-true"``). Served: a single device
    and DDP. Refused: ``FSDPStrategy`` and DeepSpeed, whose precision must be
    their own plugin, and ``ModelParallelStrategy``: it shards the model in
    ``configure_model``, before Lightning calls ``convert_module``, and compfx
    captures a block before ``fully_shard`` wraps it (see docs/distributed.md:
    plan with ``compfx.apply(..., per_module=...)`` in ``configure_model``, then
    shard); also a ``CompfxCallback`` on the same trainer (two planners) and
    more than one optimizer.

    >>> plugin = CompfxPrecision(search_batches=4, loss_fn=lambda out, batch: out.sum())
    >>> plugin.precision, plugin.searched, plugin.state_dict()
    ('32-true', None, {})
    """

    precision = "32-true"

    def __init__(self, plan: Plan | str | os.PathLike | None = None, *, search_batches: int = 8, loss_fn=None,
                 module: str | None = None, config: SearchConfig | None = None, low_dtype: torch.dtype | None = None,
                 guard: bool | Mapping | None = None):
        if isinstance(search_batches, bool) or not isinstance(search_batches, int) or search_batches < 1:
            raise BadInputError(f"search_batches={search_batches!r}; expected a positive int, e.g. 8.")
        if config is not None and not isinstance(config, SearchConfig):
            raise BadInputError(f"config is a {type(config).__name__}; expected a compfx.SearchConfig.")
        if guard and module is None:
            raise BadInputError("CompfxPrecision(guard=...) watches one planned network: name it with module=... (the "
                                "LightningModule's attribute that holds every trained Parameter, e.g. module=\"net\").")
        if guard is not None and not isinstance(guard, (bool, Mapping)):
            raise BadInputError(f"guard={guard!r}; expected True, or a dict of compfx.Guard options.")
        self.search_batches, self.loss_fn, self.module, self.config = search_batches, loss_fn, module, config
        self.low_dtype = low_dtype
        self.plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.guard_options = dict(guard) if isinstance(guard, Mapping) else {} if guard else None
        self.run: PlannedRun | None = None  # the regions, planned in place
        self.planned: PlannedModule | None = None  # with the Guard: the network, planned whole
        self.guard: Guard | None = None
        self._module = None  # the LightningModule convert_module got
        self._put_back = None  # with the Guard: how to put the network back
        self._restored: dict | None = None  # a checkpoint's state
        self._searched: bool | None = None
        self._last: dict = {}  # the state of the last fit, once torn down

    @property
    def searched(self) -> bool | None:
        """True: this run searched its plan; False: it used a given or checkpointed one; None: not planned yet."""
        return self._searched

    @property
    def running_plan(self) -> Plan | None:
        """The plan the model runs now (the Guard's repairs included); None before the first training step."""
        if self.planned is not None:
            return self.planned.plan
        return self.run.plan if self.run is not None else None

    # -- Lightning's hooks -------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            self._check_trainer(trainer)
        self._module = module
        return module

    @contextlib.contextmanager
    def train_step_context(self):
        if self._module is not None and self.running_plan is None:
            self._plan_model(self._module.trainer)
        with self.forward_context():
            yield

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.guard is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        loss = closure()  # training_step and backward
        self._after_closure(model, optimizer)
        if loss is None:  # training_step returned None: Lightning skips the step
            return None
        self.guard.step(optimizer, loss)  # steps, or skips the step and repairs the plan
        return loss

    def state_dict(self) -> dict:
        plan = self.running_plan
        if plan is None:
            return dict(self._last)  # after fit (a checkpoint saved at its end): the plan it trained with
        return {"plan": plan.to_dict(), **({"guard": self.guard.state_dict()} if self.guard is not None else {})}

    def load_state_dict(self, state_dict: Mapping) -> None:
        if not isinstance(state_dict, Mapping) or "plan" not in state_dict:
            raise PlanFileError("CompfxPrecision.load_state_dict() got no 'plan'; expected the mapping its "
                                "state_dict() returned (from the checkpoint's CompfxPrecision state).")
        Plan.from_dict(state_dict["plan"], source="the checkpoint's CompfxPrecision state")  # damaged: refused now
        self._restored = dict(state_dict)

    def teardown(self) -> None:
        """Put the model's own submodules back (Lightning tears the strategy down after fit, and after an error)."""
        self._last = self.state_dict()
        if self.guard is not None:
            self.guard.remove()
        if self._put_back is not None:
            self._put_back()
            self._put_back = None
        if self.run is not None:
            self.run.restore()
        self.run = self.planned = self.guard = None

    # -- planning ------------------------------------------------------------------------------------
    def _check_trainer(self, trainer) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, _OWN_PRECISION_STRATEGIES):
            raise BadInputError(
                f"{type(strategy).__name__} runs a precision plugin of its own making, so CompfxPrecision cannot "
                "serve it. Train with DDP (or one device) and CompfxPrecision, or plan the blocks with "
                "compfx.apply(..., per_module=...) before sharding them (docs/distributed.md).")
        if isinstance(strategy, ModelParallelStrategy):
            raise BadInputError(
                "ModelParallelStrategy shards the model in configure_model, before Lightning hands it to "
                "CompfxPrecision, and compfx captures each block before fully_shard wraps it. In configure_model, "
                "plan the blocks with compfx.apply(model, plan, analysis=..., per_module=(Block,)) first, then "
                "fully_shard them (docs/distributed.md), and train without CompfxPrecision.")
        if any(type(c).__name__ == "CompfxCallback" for c in trainer.callbacks):
            raise BadInputError("the Trainer has a CompfxCallback and CompfxPrecision: two planners for one model. "
                                "Keep one (CompfxPrecision, as plugins=[...]).")
        if self.guard_options is not None and (isinstance(strategy, ModelParallelStrategy) or trainer.world_size > 1):
            raise BadInputError("CompfxPrecision(guard=...) repairs the plan of one process's network, planned whole; "
                                f"under {type(strategy).__name__} with {trainer.world_size} process(es) the ranks "
                                "would run different plans. Use the Guard in one process, or leave guard= out.")

    def _given_plan(self) -> tuple[Plan | None, str]:
        if self.plan is not None:
            return self.plan, "the plan given to CompfxPrecision"
        if self._restored is not None:
            return Plan.from_dict(self._restored["plan"], source="the checkpoint"), "the checkpoint"
        return None, "searched"

    def _plan_model(self, trainer) -> None:
        _check_one_optimizer(trainer, "CompfxPrecision")
        pl_module = self._module
        target = _submodule(pl_module, self.module, "CompfxPrecision")
        plan, source = self._given_plan()
        batches = first_batches(trainer.train_dataloader, self.search_batches, model_device(target))
        log = os.path.join(trainer.default_root_dir, LOG_FILE) if trainer.is_global_zero and plan is None else None
        optimizer = trainer.optimizers[0]
        if self.guard_options is None:
            self.run = plan_model(target, batches, optimizer=optimizer, loss_fn=self.loss_fn, low_dtype=self.low_dtype,
                                  config=self.config, plan=plan, log=log, source=source)
            summary = self.run.summary()
        else:
            self._plan_whole(pl_module, target, batches, optimizer, plan, log)
            summary = f"compfx: plan {self.planned.plan.fingerprint} in {self.module} under compfx.Guard; {source}"
        self._searched = plan is None
        if trainer.is_global_zero:
            self.running_plan.save(os.path.join(trainer.default_root_dir, PLAN_FILE))
        rank_zero_info(summary)

    def _plan_whole(self, pl_module, target, batches, optimizer, plan, log) -> None:
        """The network at ``module`` as one :class:`~compfx.PlannedModule` in its place, watched by the Guard."""
        if plan is None:
            config = dataclasses.replace(self.config or SearchConfig(), keep_search_training=False)
            planned = optimize(target, batches, optimizer=optimizer, loss_fn=self.loss_fn, low_dtype=self.low_dtype,
                               config=config, log=log).module
        else:
            args, kwargs = check_first_batch(target, batches[0], self.loss_fn, model_device(target),
                                             with_loss=self.loss_fn is not None)
            analysis = analyze(target, kwargs if kwargs else args, low_dtype=plan.low_dtype,
                               fp8=plan.fp8_recipe is not None)
            planned = PlannedModule(target, plan, analysis=analysis)
        parent_path, _, name = self.module.rpartition(".")
        parent = pl_module.get_submodule(parent_path)
        parent._modules[name] = planned
        self._put_back = lambda: parent._modules.__setitem__(name, target)
        self.planned = planned
        self.guard = Guard(planned, **self.guard_options)
        if self._restored is not None and "guard" in self._restored:
            self.guard.load_state_dict(self._restored["guard"])
