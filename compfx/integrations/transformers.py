"""compfx in the Hugging Face ``Trainer``: one callback searches a plan at train begin, and the trainer trains with it.

::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CompfxCallback(search_batches=8)])
    trainer.train()    # output_dir/compfx-plan.json, output_dir/compfx-search.jsonl

Where ``TrainingArguments(bf16=True)`` puts every op the autocast list names in
bf16, the callback searches which ops to run low on this model, data and
machine (:func:`compfx.optimize`), on the first ``search_batches`` batches of
the trainer's own train dataloader, with its model and optimizer and the
model's own loss. The trainer then trains the model planned in place: its base
model and head are replaced by planned modules holding the same Parameters
(see :mod:`compfx.integrations.planned_training`), and put back at train end;
the loss its forward computes runs eagerly, in FP32. The plan is
written to ``output_dir`` and into every checkpoint; a run resumed from a
checkpoint (``trainer.train(resume_from_checkpoint=...)``) loads it from there
and does not search again.
"""

from __future__ import annotations

import logging
import os
import time

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.utils import logging as hf_logging
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError("compfx.integrations.transformers needs transformers and accelerate: "
                      "pip install 'compfx[transformers]'") from error

import torch

from ..batches import model_device
from ..errors import BadInputError
from ..plan import Plan
from ..search.config import SearchConfig
from .planned_training import LOG_FILE, PLAN_FILE, PlannedRun, first_batches, plan_model, saved_plan

__all__ = ["CompfxCallback", "trainer_loss", "PLAN_FILE", "LOG_FILE"]

logger = hf_logging.get_logger("transformers.trainer")  # the trainer's logger: its verbosity settings apply


def _without_search(metrics: dict, search_seconds: float) -> None:
    """The trainer's final speed metrics without the callback's search (``train_runtime`` less it, the rates
    recomputed), and the search's seconds as ``compfx_search_runtime``."""
    runtime = float(metrics["train_runtime"])
    training = max(runtime - search_seconds, 1e-9)
    for key in ("train_samples_per_second", "train_steps_per_second", "train_tokens_per_second"):
        if key in metrics and metrics[key]:
            metrics[key] = round(metrics[key] * runtime / training, 3)
    metrics["train_runtime"] = round(training, 4)
    metrics["compfx_search_runtime"] = round(search_seconds, 4)


def check_training_arguments(args) -> None:
    """Refuse the ``TrainingArguments`` that would fight the plan, naming the flag to turn off."""
    for flag in ("fp16", "bf16"):
        if getattr(args, flag, False):
            raise BadInputError(
                f"TrainingArguments({flag}=True) runs the whole model under autocast, on top of the plan that "
                f"CompfxCallback chooses per op; turn off {flag} (TrainingArguments({flag}=False)) and let the "
                "callback's plan decide precision, or remove CompfxCallback to train with plain AMP.")
    if getattr(args, "torch_compile", False):
        raise BadInputError(
            "TrainingArguments(torch_compile=True) compiles the model around the regions compfx rewrites at run time; "
            "turn off torch_compile with CompfxCallback (or compile with torch.compile(model, backend='compfx'), "
            "which applies the plan compfx.optimize saved, and no callback).")


def trainer_loss(args, model):
    """The loss the ``Trainer`` trains when it is not the model's own ``output.loss``: with
    ``label_smoothing_factor``, its ``LabelSmoother`` on the logits (labels shifted for a causal LM, as the trainer
    decides it); None otherwise, and the search judges the model's own loss.

    >>> import transformers
    >>> trainer_loss(transformers.TrainingArguments("out", report_to=[]), model=None) is None
    True
    """
    if not getattr(args, "label_smoothing_factor", 0):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=args.label_smoothing_factor)
    shift = model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return lambda output, batch: smoother(output, batch["labels"], shift_labels=shift)


class CompfxCallback(TrainerCallback):
    """Search a mixed-precision plan at train begin; the ``Trainer`` then trains with it.

    * ``search_batches``: how many of the trainer's first training batches the
      search trains on (each Stage-1 sample is one pass over them). Taking them
      leaves the trainer's data order and RNG as they were.
    * ``config``: a :class:`~compfx.SearchConfig`; its ``keep_search_training``
      is set False (the trainer owns the training: its step count, schedule
      and checkpoints describe the model, and a resumed run matches).
    * ``loss_fn(output, batch)``: defaults to the loss the trainer trains: the
      model's own ``output.loss``, or, with ``label_smoothing_factor``, the
      trainer's label-smoothed loss of the logits (give yours with a custom
      ``compute_loss`` or ``compute_loss_func``).
    * ``low_dtype``: fp16 on CUDA, bf16 elsewhere by default.
    * ``plan``: a :class:`~compfx.Plan` or a plan file to train with, no search:
      one of the model's regions, as this callback writes them (another is a
      :class:`~compfx.errors.PlanMismatchError`).

    At train begin (process zero) it writes ``output_dir/compfx-plan.json`` and
    the search log ``output_dir/compfx-search.jsonl`` (``compfx report`` prints
    it), logs a one-line summary through the trainer's logger and into
    ``trainer.state.log_history`` (saved with checkpoints), and copies the plan
    into each checkpoint. The trainer starts its clock before train begin, so its
    final ``train_runtime`` would include the search: the callback takes it out
    (``train_runtime`` and the ``train_*_per_second`` rates are the training's
    alone) and reports it as ``compfx_search_runtime``, in the metrics
    ``trainer.train()`` returns and in ``log_history``. A resumed run (``global_step > 0`` at train begin)
    loads the plan from ``output_dir/checkpoint-<step>/`` (else from
    ``output_dir``) instead of searching. ``searched`` says which happened.
    While training, the submodules the model's forward runs (its base model and
    head) are :class:`~compfx.per_module.PlannedBlock` s in the model itself
    (``run.blocks``; same Parameters and ``state_dict`` keys); at train end the
    original submodules are put back. The ``Trainer`` has no event for an
    exception in training: after one, call :meth:`restore` (a next ``train()``
    does it first). ``TrainingArguments(fp16=True)`` / ``bf16=True`` /
    ``torch_compile=True`` are refused when the trainer is built.

    >>> cb = CompfxCallback(search_batches=4, config=SearchConfig(progress=False))
    >>> cb.search_batches, cb.searched
    (4, None)
    """

    def __init__(self, search_batches: int = 8, *, config: SearchConfig | None = None, loss_fn=None,
                 low_dtype: torch.dtype | None = None, plan: Plan | str | os.PathLike | None = None):
        if isinstance(search_batches, bool) or not isinstance(search_batches, int) or search_batches < 1:
            raise BadInputError(f"search_batches={search_batches!r}; expected a positive int, e.g. 8.")
        if config is not None and not isinstance(config, SearchConfig):
            raise BadInputError(f"config is a {type(config).__name__}; expected a compfx.SearchConfig.")
        self.search_batches, self.config, self.loss_fn, self.low_dtype = search_batches, config, loss_fn, low_dtype
        self.plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.run: PlannedRun | None = None
        self.setup_seconds = 0.0  # what train begin took here: the search (or loading a plan), not training

    @property
    def searched(self) -> bool | None:
        """True: this run searched its plan; False: it loaded one; None: training has not begun."""
        return None if self.run is None else self.run.searched

    def on_init_end(self, args, state, control, **kwargs):
        check_training_arguments(args)  # at Trainer(...), before any work

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        started = time.perf_counter()
        try:
            self._plan(args, state, model, optimizer, train_dataloader)
        finally:
            self.setup_seconds = time.perf_counter() - started

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Take the search out of the trainer's final throughput: its ``train_runtime`` began before train begin."""
        if not logs or "train_runtime" not in logs or not self.setup_seconds:
            return
        runtime = logs["train_runtime"]
        for entry in (logs, state.log_history[-1] if state.log_history else {}):  # the history holds a copy
            if entry.get("train_runtime") == runtime and "compfx_search_runtime" not in entry:
                _without_search(entry, self.setup_seconds)

    def _plan(self, args, state, model, optimizer, train_dataloader):
        check_training_arguments(args)
        self.restore()  # a second train() on the same trainer, or after one that failed
        plan, source = self._saved_plan(args, state)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper steps only on sync steps
        batches = first_batches(train_dataloader, self.search_batches, model_device(model))
        writes = state.is_world_process_zero
        log = os.path.join(args.output_dir, LOG_FILE) if writes and plan is None else None
        loss_fn = self.loss_fn or trainer_loss(args, model)
        self.run = plan_model(model, batches, optimizer=optimizer, loss_fn=loss_fn, low_dtype=self.low_dtype,
                              config=self.config, plan=plan, log=log, source=source)
        if writes:
            self.run.plan.save(os.path.join(args.output_dir, PLAN_FILE))
        logger.info(self.run.summary())
        state.log_history.append({**{k.replace("/", "_"): v for k, v in self.run.metrics().items()},
                                  "compfx_plan": self.run.plan.fingerprint, "step": state.global_step})

    def on_save(self, args, state, control, **kwargs):
        if self.run is not None and state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isdir(folder):
                self.run.plan.save(os.path.join(folder, PLAN_FILE))

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()

    def restore(self) -> None:
        """Put the model's own submodules back in place of the planned ones (idempotent)."""
        if self.run is not None:
            self.run.restore()

    def _saved_plan(self, args, state) -> tuple[Plan | None, str]:
        """The plan to train with instead of searching: the given one, or a resumed run's."""
        if self.plan is not None:
            return self.plan, "the plan given to CompfxCallback"
        if state.global_step == 0:
            return None, "searched"
        found = saved_plan(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", PLAN_FILE),
                           os.path.join(args.output_dir, PLAN_FILE))
        if found is None:
            logging.getLogger("compfx").warning(
                "compfx: resumed at step %d, but no %s in %s or its checkpoint; searching a plan again",
                state.global_step, PLAN_FILE, args.output_dir)
            return None, "searched"
        return found
