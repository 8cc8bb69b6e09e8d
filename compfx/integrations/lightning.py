"""compfx in Lightning's ``Trainer``: one callback searches a plan at train start, and the trainer trains with it.

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

import os
from collections.abc import Mapping

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError("compfx.integrations.lightning needs lightning: pip install 'compfx[lightning]'") from error

import torch

from ..batches import model_device
from ..errors import BadInputError, PlanFileError
from ..plan import Plan
from ..search.config import SearchConfig
from .planned_training import LOG_FILE, PLAN_FILE, PlannedRun, first_batches, plan_model

__all__ = ["CompfxCallback", "PLAN_FILE", "LOG_FILE"]

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
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError as error:
            raise BadInputError(f"CompfxCallback(module={self.module!r}): {type(pl_module).__name__} has no such "
                                "submodule; expected the attribute path of the network to plan, e.g. "
                                "module=\"model\".") from error

    def _remove(self) -> None:
        if self.run is not None:
            self.run.restore()
