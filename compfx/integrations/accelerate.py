"""compfx in a training loop that Hugging Face accelerate runs: search (or load) a plan, then ``accelerator.prepare``.

::

    planner = CompfxAccelerate(search_batches=8, loss_fn=loss)   # or plan="compfx-plan.json"
    accelerator = Accelerator()                                   # mixed_precision="no"
    model, optimizer, loader = planner.prepare(accelerator, model, optimizer, loader)
    ...                                                           # the loop, as before
    accelerator.save_state("ckpt")                                # ckpt/compfx-plan.json too

The plan runs one of two ways, by the accelerator's ``mixed_precision``:

* ``"no"``: compfx's own rewriter runs the whole plan, every op at its
  precision. The model is planned in place, region by region, as the
  ``Trainer`` callbacks plan it (:mod:`compfx.integrations.planned_training`):
  its class, Parameters and ``state_dict`` keys stay, so ``accelerator.prepare``
  (DDP over several processes), ``save_state`` and ``load_state`` see the model
  they know.
* ``"fp8"``: accelerate's torchao backend converts the plan's FP8 linears
  (``Accelerator(kwargs_handlers=[planner.ao_recipe_kwargs()])`` gives it the
  plan's filter and recipe: :func:`compfx.plan_export.torchao_filter`) and runs
  everything else under its own bf16 autocast. compfx rewrites nothing then, so
  the plan's other choices are not run; the log says which.

A combination that would put two precision policies on one model is refused:
``mixed_precision="bf16"`` or ``"fp16"`` (autocast on top of the plan), the
Transformer Engine or MS-AMP FP8 backends and an ``AORecipeKwargs`` whose filter
is not the plan's (two choices of FP8 linears), torch.compile through
accelerate's dynamo plugin, and a model prepared already. ``save_state`` writes
the plan next to the weights; ``prepare(..., resume_from=folder)`` loads it from
there and does not search.
"""

from __future__ import annotations

import dataclasses
import logging
import os

try:
    from accelerate.utils import AORecipeKwargs, DynamoBackend
    from accelerate.utils.dataclasses import FP8BackendType
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError("compfx.integrations.accelerate needs accelerate: pip install 'compfx[accelerate]'") from error

import torch

from ..batches import model_device
from ..errors import BadInputError
from ..float8 import DEFAULT_RECIPE, float8_config, fp8_runs_natively
from ..plan import Plan
from ..plan_export import TorchaoFilter, torchao_filter
from ..search.config import SearchConfig
from ..vocabulary import Float8Recipe
from .planned_training import LOG_FILE, PLAN_FILE, PlannedRun, first_batches, plan_model, saved_plan

__all__ = ["CompfxAccelerate", "PLAN_FILE", "LOG_FILE"]

log = logging.getLogger("compfx")


class CompfxAccelerate:
    """Search (or load) a plan and apply it before ``accelerator.prepare``; ``save_state`` keeps it.

    * ``search_batches``: how many of the loader's first batches the search
      trains on (taking them leaves its data order and the RNG as they were).
    * ``loss_fn(output, batch)``: the loss the search judges; default the
      output's ``.loss`` (a Hugging Face model given labels).
    * ``config``, ``low_dtype``: as for :func:`compfx.optimize`
      (``keep_search_training`` is set False: the loop owns the training);
      under ``mixed_precision="fp8"`` the search also tries FP8 (``config.fp8``).
    * ``plan``: a :class:`~compfx.Plan` or plan file to train with, no search.
    * ``log``: where the search log goes (the main process writes it).

    :meth:`prepare` plans the model and returns what ``accelerator.prepare``
    returns; ``searched`` says whether it searched, ``plan`` is the plan.

    >>> planner = CompfxAccelerate(search_batches=4)
    >>> planner.search_batches, planner.searched
    (4, None)
    """

    def __init__(self, search_batches: int = 8, *, loss_fn=None, config: SearchConfig | None = None,
                 low_dtype: torch.dtype | None = None, plan: Plan | str | os.PathLike | None = None,
                 log: str | os.PathLike | None = None):
        if isinstance(search_batches, bool) or not isinstance(search_batches, int) or search_batches < 1:
            raise BadInputError(f"search_batches={search_batches!r}; expected a positive int, e.g. 8.")
        if config is not None and not isinstance(config, SearchConfig):
            raise BadInputError(f"config is a {type(config).__name__}; expected a compfx.SearchConfig.")
        if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
            raise BadInputError(f"plan is a {type(plan).__name__}; expected a compfx.Plan or a plan file's path.")
        self.search_batches, self.loss_fn, self.config, self.low_dtype = search_batches, loss_fn, config, low_dtype
        self.plan: Plan | None = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.log = log
        self.run: PlannedRun | None = None  # mixed_precision="no": the regions compfx runs
        self.filter: TorchaoFilter | None = None  # mixed_precision="fp8": the linears accelerate converts
        self.searched: bool | None = None
        self._recipe: Float8Recipe | None = None  # the recipe ao_recipe_kwargs() configured accelerate with
        self._save_hook = None

    def ao_recipe_kwargs(self, *, emulate: bool | None = None) -> AORecipeKwargs:
        """accelerate's ``AORecipeKwargs`` for ``Accelerator(mixed_precision="fp8")``: torchao's float8 config of the
        plan's recipe (the given plan's, else ``config.fp8_recipe``) and the plan's filter, which :meth:`prepare`
        sets before accelerate converts the model. ``emulate`` (default: where float8 GEMMs do not run natively)
        makes torchao run the scaled matmuls in high precision: same numbers, no speed."""
        given = self.plan.fp8_recipe if self.plan is not None else None
        self._recipe = Float8Recipe(given or (self.config.fp8_recipe if self.config is not None else DEFAULT_RECIPE))
        if emulate is None:
            emulate = not (torch.cuda.is_available() and fp8_runs_natively(torch.device("cuda")))
        return AORecipeKwargs(config=float8_config(self._recipe, emulate=emulate), module_filter_func=self._convert)

    def _convert(self, module, fqn: str) -> bool:
        """The filter accelerate's torchao backend calls: the plan's, once :meth:`prepare` chose it."""
        if self.filter is None:
            raise BadInputError("accelerate is converting the model to FP8 before compfx chose its linears: call "
                                "planner.prepare(accelerator, model, optimizer, loader) instead of "
                                "accelerator.prepare(...).")
        return self.filter(module, fqn)

    def prepare(self, accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader, *others,
                resume_from: str | os.PathLike | None = None):
        """Search (or load) the plan on ``loader``'s first batches, apply it to ``model`` (or hand its FP8 linears
        to accelerate), and return ``accelerator.prepare(model, optimizer, loader, *others)``.

        ``resume_from`` is a folder ``accelerator.save_state`` wrote: its plan is
        used, without a search (then call ``accelerator.load_state(folder)`` as usual).
        """
        mode = self._check(accelerator, model, optimizer)
        plan, source = self._given(resume_from)
        if mode == "fp8":
            self._hand_to_accelerate(model, optimizer, loader, plan, source, accelerator)
        else:
            self._plan_in_place(model, optimizer, loader, plan, source, accelerator)
        if self._save_hook is not None:
            self._save_hook.remove()
        self._save_hook = accelerator.register_save_state_pre_hook(self._saver(accelerator))
        return accelerator.prepare(model, optimizer, loader, *others)

    def restore(self) -> None:
        """Put the model's own submodules back in place of the planned ones (``mixed_precision="no"``; idempotent)."""
        if self.run is not None:
            self.run.restore()

    # -- the steps of prepare ----------------------------------------------------------------------
    def _check(self, accelerator, model, optimizer) -> str:
        """The accelerator's mixed precision, when it leaves the model's precision to the plan; refuse others."""
        if not isinstance(model, torch.nn.Module) or getattr(model, "_is_accelerate_prepared", False):
            raise BadInputError("CompfxAccelerate.prepare() plans the model before accelerate wraps it; pass the model "
                                "itself, not one accelerator.prepare() returned.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise BadInputError(f"the optimizer is a {type(optimizer).__name__}; expected the torch optimizer of the "
                                "model's parameters (the search trains with it), before accelerator.prepare().")
        mode = str(accelerator.mixed_precision)
        if mode in ("fp16", "bf16"):
            raise BadInputError(f"Accelerator(mixed_precision={mode!r}) runs the whole model under autocast, on top of "
                                "the plan compfx chooses per op; use mixed_precision='no' (compfx runs the plan) or "
                                "'fp8' (accelerate's torchao backend runs the plan's FP8 linears).")
        if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise BadInputError("accelerate's dynamo plugin compiles the model around the regions compfx rewrites at "
                                "run time; turn it off (dynamo_backend='no') with CompfxAccelerate, or compile with "
                                "torch.compile(model, backend='compfx') and no CompfxAccelerate.")
        if mode == "fp8":
            handler = accelerator.ao_recipe_handler
            ours = handler is not None and handler.module_filter_func == self._convert
            if accelerator.fp8_backend != FP8BackendType.AO or not ours:
                raise BadInputError("Accelerator(mixed_precision='fp8') converts the linears its own FP8 recipe "
                                    "chooses; give it the plan's: Accelerator(mixed_precision='fp8', "
                                    "kwargs_handlers=[planner.ao_recipe_kwargs()]) (torchao backend).")
        return mode

    def _given(self, resume_from) -> tuple[Plan | None, str]:
        if resume_from is not None and self.plan is not None:
            raise BadInputError("CompfxAccelerate got a plan and resume_from=; give one (a resumed run trains with the "
                                "plan its checkpoint holds).")
        if resume_from is not None:
            found = saved_plan(os.path.join(resume_from, PLAN_FILE))
            if found is None:
                raise BadInputError(f"resume_from={os.fspath(resume_from)!r} holds no {PLAN_FILE}: it was not saved by "
                                    "accelerator.save_state after CompfxAccelerate.prepare. Pass the folder save_state "
                                    "wrote, or plan= to give the plan.")
            return found
        if self.plan is not None:
            return self.plan, "the plan given to CompfxAccelerate"
        return None, "searched"

    def _search_config(self, fp8: bool) -> SearchConfig:
        config = self.config or SearchConfig()
        return dataclasses.replace(config, fp8=True, fp8_recipe=self._recipe) if fp8 else config

    def _plan_in_place(self, model, optimizer, loader, plan, source, accelerator) -> None:
        """``mixed_precision="no"``: compfx's rewriter runs the plan, in the model's regions."""
        self.restore()  # a second prepare with the same planner
        batches = first_batches(loader, self.search_batches, model_device(model))
        log_path = self.log if accelerator.is_main_process and plan is None else None
        self.run = plan_model(model, batches, optimizer=optimizer, loss_fn=self.loss_fn, low_dtype=self.low_dtype,
                              config=self.config, plan=plan, log=log_path, source=source)
        self.plan, self.searched = self.run.plan, self.run.searched
        log.info("%s", self.run.summary())

    def _hand_to_accelerate(self, model, optimizer, loader, plan, source, accelerator) -> None:
        """``mixed_precision="fp8"``: the plan's FP8 linears go to accelerate's torchao conversion; compfx applies
        nothing (accelerate's autocast runs the rest), so a searched plan's regions are put back at once."""
        if plan is None:
            batches = first_batches(loader, self.search_batches, model_device(model))
            log_path = self.log if accelerator.is_main_process else None
            run = plan_model(model, batches, optimizer=optimizer, loss_fn=self.loss_fn, low_dtype=self.low_dtype,
                             config=self._search_config(fp8=True), log=log_path)
            run.restore()
            plan = run.plan
        if plan.fp8_recipe is not None and plan.fp8_recipe != self._recipe:
            raise BadInputError(f"the plan's FP8 recipe is {plan.fp8_recipe}, but accelerate was configured for "
                                f"{self._recipe}; build the accelerator with planner.ao_recipe_kwargs() after giving "
                                "CompfxAccelerate the plan.")
        # a given plan must fit torchao's conversion whole; a searched one may hold FP8 ops it cannot take (said below)
        self.filter = torchao_filter(plan, plan.fp8_recipe, strict=source != "searched")
        self.filter.check(model)
        self.plan, self.searched = plan, source == "searched"
        log.info("compfx: plan %s: %d linear(s) in FP8 through accelerate's torchao backend (%s); %s", plan.fingerprint,
                 len(self.filter.fqns), source, "; ".join(self.filter.not_expressed) or "nothing else to run")

    def _saver(self, accelerator):
        def save_plan(models, weights, output_dir) -> None:  # accelerate's save_state pre-hook, on every process
            if accelerator.is_main_process and self.plan is not None:
                self.plan.save(os.path.join(output_dir, PLAN_FILE))
        return save_plan
