"""The compiled search: every plan measured as the program :func:`compfx.compile_with_plan` trains.

``SearchConfig(compile=CompileOptions(...))`` makes the session build a
:class:`CompiledEvaluator` instead of a
:class:`~compfx.search.evaluator.LocalEvaluator`. It answers the same
questions (the :class:`~compfx.search.evaluator.Evaluator` protocol), so the
stages do not know: FP32's and AMP's epochs, the candidates, the duels, the
report's step comparison and the loss check all train ``compile_plan(model,
plan)``, the program ``compfx.compile_with_plan(model, plan)`` makes of a plan
that records the options (``plan.compile_options``). The search layer cannot
import the backend (it sits above it), so the session is handed
``compile_plan``.

What keeps the measurements those of the program that trains:

* **Compiles happen in untimed warm-up.** The sampler readies every batch
  before it times a step (:meth:`~compfx.search.sampling.FairSampler.ready`);
  a :class:`CompiledRunner` meeting an input signature it has not run compiles
  there, with one untimed forward and backward (the backward graph compiles at
  the first backward), its state, gradients and RNG put back. That time is
  the cost breakdown's ``compile`` part. A program that compiled no graph
  (dynamo ran the model eagerly) stops the search: it would time eager steps.
* **Each program compiles as in a process of its own.** Every plan is its own
  ``torch.compile`` region (its recompiles count against
  ``torch._dynamo.config.recompile_limit`` alone), and each keeps its own
  record of the sizes dynamo has seen (:class:`ShapeHistory`) and compiles on
  copies of the batch: without them, a plan compiled after another met a
  ragged last batch would compile dynamic shapes from its first step (dynamo's
  record, and the marks AOT autograd leaves on the batch tensors the other
  program saved for backward, say so), and time another program than its
  training.
* **Nothing falls back to eager unseen.** While the search runs
  (:meth:`CompiledEvaluator.measuring`), dynamo's cap on the compiled entries
  of one function across programs (``accumulated_recompile_limit``) is raised,
  as a search compiles many programs of one model; a program that hits its
  own ``recompile_limit`` raises instead of running eagerly
  (``fail_on_recompile_limit_hit``): the search stops with a
  :class:`~compfx.errors.SearchError` saying what to change; and a program
  that fails to compile fails its plan rather than running eagerly
  (``suppress_errors`` off). The process's settings are back as they were
  afterwards.
* **CUDA graphs are recorded untimed.** Where the options capture CUDA graphs
  (``mode="reduce-overhead"`` or ``"max-autotune"``, or Inductor's
  ``triton.cudagraphs``), the compile step runs :data:`CUDA_GRAPH_WARM_RUNS`
  times, so that the graphs are recorded before any timed step replays them.

* **Compile cost bounded by the model's repeated blocks.** Under
  ``CompileOptions(regions="auto")`` every plan records the setting, and
  ``compile_plan`` compiles its program as ``compile_with_plan(model, plan)``
  then does: each repeated block a region, one graph per block plan. The
  session's ``compile_plan`` shares compiled regions between the programs it
  builds (:class:`~compfx.compile_regions.RegionCache`), so a candidate that
  changes one block's precisions compiles that block's region and the model's
  own code around the regions, not every block. A shared region's graphs were
  compiled in an earlier program's untimed warm-up; this evaluator does not
  know regions exist.

Extending it: the session's cost model prices the compiled program (:class:`~compfx.costmodel.CompiledPredictor`, from
the evaluator's ``module_of``, the eager rewritten graph, with the fusion rule
of :mod:`compfx.costmodel.fusion`); FP8 plans compile as any other (the backend
applies their float8 pass before AOT autograd).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Callable, Hashable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..graph_capture import input_signature
from ..compile_options import CompileOptions
from ..errors import SearchError
from ..plan import Assignment, Plan
from ..planned_module import FollowsModelModes
from ..state import buffers_restored, torch_rng_preserved
from .evaluator import LocalEvaluator, plan_failures

__all__ = ["CompiledEvaluator", "CompiledRunner", "ShapeHistory", "CompilePlan"]

#: ``compile_plan(model, plan)``: the compiled program of ``plan`` (:func:`compfx.compile_with_plan`), with the
#: records of the graphs it compiled (:class:`~compfx.compile_backend.GraphRecord`) as ``.records`` when it is
#: compiled by regions (:class:`~compfx.compile_regions.RegionallyCompiled`), else as ``.compfx_backend.records``.
CompilePlan = Callable[[nn.Module, Plan], nn.Module]

#: dynamo's cap on one function's compiled entries across all programs, while a search runs: each plan's program
#: adds its own, and past the cap dynamo would run the function eagerly.
SEARCH_ACCUMULATED_LIMIT = 1 << 20
#: Untimed runs of the compile step where the program captures CUDA graphs: Inductor's CUDA graph trees run a
#: function eagerly once (warm-up), record it on the next call, and replay it from then on.
CUDA_GRAPH_WARM_RUNS = 3


class ShapeHistory:
    """The sizes dynamo has seen per function, which decide when it compiles dynamic shapes: one per program.

    Dynamo keeps one such record per process (``torch._dynamo.pgo._CODE_STATE``,
    a private global), shared by every program of a function: a second size
    seen by one program makes the next program's first compile dynamic. A
    search gives each program its own, a copy of the process's record (which
    the search never changes: so, the record as the search began), and swaps it
    in around that program's compiles (:meth:`in_use`). Where this torch keeps
    no such record, nothing is swapped.
    """

    def __init__(self, start=None):
        self.state = copy.deepcopy(start)

    @staticmethod
    def now() -> "ShapeHistory":
        """A history starting from the process's record now."""
        pgo = _dynamo_size_records()
        return ShapeHistory(getattr(pgo, "_CODE_STATE", None))

    @contextlib.contextmanager
    def in_use(self):
        pgo = _dynamo_size_records()
        if pgo is None or not hasattr(pgo, "_CODE_STATE"):
            yield
            return
        outer, pgo._CODE_STATE = pgo._CODE_STATE, self.state
        try:
            yield
        finally:
            self.state, pgo._CODE_STATE = pgo._CODE_STATE, outer


def _dynamo_size_records():
    return sys.modules.get("torch._dynamo.pgo")


class CompiledRunner(FollowsModelModes):
    """What the compiled search trains for one plan: its compiled program, compiled for each input signature in
    untimed warm-up (:meth:`specialize`, which the sampler calls before it times a step).

    It shares the model's Parameters and buffers (through the compiled
    program, its one submodule), and runs in the model's train/eval modes
    as they are at each call.
    """

    def __init__(self, model: nn.Module, program: nn.Module, compile_step: Callable[["CompiledRunner", tuple, dict],
                                                                                  None]):
        super().__init__()
        self.program = program
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_compile_step", compile_step)
        object.__setattr__(self, "_modules_in_order", [module for _, module in model.named_modules()])
        self.signatures: set[Hashable] = set()
        self.history = ShapeHistory.now()

    def forward(self, *args, **kwargs):
        return self.program(*args, **kwargs)

    def specialize(self, args: tuple, kwargs: dict) -> None:
        """Compile the program for these inputs in the model's current modes, if it has not run them yet."""
        signature = input_signature(args, kwargs, tuple(module.training for module in self._modules_in_order))
        if signature not in self.signatures:
            self._compile_step(self, args, kwargs)
            self.signatures.add(signature)


class CompiledEvaluator(LocalEvaluator):
    """:class:`~compfx.search.evaluator.LocalEvaluator` whose plans run as their compiled programs.

    ``compile_options``: the settings every plan's program is compiled under
    (each plan records them: a ``cost_fn`` sees them); ``compile_plan``: what
    compiles a plan that records them (:func:`compfx.compile_with_plan`). The
    rewritten eager modules (:meth:`module_of`) remain what the cost model
    reads (pricing them as they run compiled) and what tells plans that run one
    program apart (``program``).
    """

    def __init__(self, model: nn.Module, analysis, sampler, *, compile_options: CompileOptions,
                 compile_plan: CompilePlan, **kwargs):
        super().__init__(model, analysis, sampler, **kwargs)
        self.compile_options, self.compile_plan = compile_options, compile_plan
        self.compiles = 0  # input signatures compiled, over every program

    def plan(self, plan: Assignment) -> Plan:
        """The :class:`Plan` of an assignment, recording the options its program is measured under."""
        built = super().plan(plan)
        if built.compile_options != self.compile_options:
            built = self._plans[plan] = built.with_compile_options(self.compile_options)
        return built

    def runner_of(self, plan: Plan) -> nn.Module:
        """The :class:`CompiledRunner` of ``plan``'s compiled program (built once per plan; compiled when it first
        meets a batch)."""
        self._check_same_model()
        if plan not in self._runners:
            with self.clock.phase("rewrites"):  # torch.compile wraps the model here; it compiles on first use
                self._runners[plan] = CompiledRunner(self.model, self.program_of(plan), self._compile_step)
        return self._runners[plan]

    def program_of(self, plan: Plan) -> nn.Module:
        """The compiled program of ``plan``, as ``compile_with_plan(model, plan)`` trains it."""
        return self.compile_plan(self.model, plan.with_compile_options(self.compile_options))

    def result_module(self, plan: Plan) -> nn.Module:
        """What the search returns for ``plan``: its compiled program (``result.module``), compiled already."""
        return self.runner_of(plan).program

    @property
    def programs(self) -> int:
        """Plans whose programs were built (each compiles when it first meets a batch)."""
        return len(self._runners)

    def specializations(self) -> tuple[int, list]:
        """(input signatures the programs compiled for, no eager specialisation: the programs compile their own)."""
        return max((len(r.signatures) for r in self._runners.values()), default=1), []

    def measuring(self):
        """While the search runs: room for one compiled entry per program and signature, and a program that hits its
        recompile limit raises rather than running eagerly; the process's dynamo settings back afterwards."""
        config = torch._dynamo.config
        # suppress_errors would run a program that fails to compile eagerly: here the failure is the plan's
        patches = {"suppress_errors": False, "fail_on_recompile_limit_hit": True,
                   "accumulated_recompile_limit": max(config.accumulated_recompile_limit, SEARCH_ACCUMULATED_LIMIT)}
        return config.patch(**{name: value for name, value in patches.items() if hasattr(config, name)})

    def _compile_step(self, runner: CompiledRunner, args: tuple, kwargs: dict) -> None:
        """Compile ``runner``'s program for these inputs: one forward and backward, untimed, that changes nothing
        (gradients, buffers and the RNG are put back; the optimizer does not step)."""
        grads = [(p, p.grad) for p in self.model.parameters()]
        # copies: AOT autograd marks the tensors a program with dynamic shapes saves for backward (the loader's own
        # batches) as dynamic, and a program compiled on a marked tensor would compile dynamic shapes from the start
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        with self.clock.phase("compile"), plan_failures(), runner.history.in_use(), _recompile_limit_explained(), \
                torch_rng_preserved(self.analysis.device), buffers_restored(self.model):
            try:
                for _ in range(CUDA_GRAPH_WARM_RUNS if _captures_cuda_graphs(self.compile_options) else 1):
                    for p, _ in grads:
                        p.grad = None
                    outputs = [t for t in pytree.tree_leaves(runner.program(*args, **kwargs))
                               if isinstance(t, torch.Tensor) and t.requires_grad]
                    if outputs:  # the backward graph compiles at the first backward
                        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            finally:
                for p, grad in grads:
                    p.grad = grad
        self.compiles += 1
        if not runner.signatures and not _graph_records(runner.program):
            raise SearchError(f"torch.compile handed the compfx backend no graph for {type(self.model).__name__} "
                              "(dynamo ran its forward eagerly: an nn.LSTM without torch._dynamo.config.allow_rnn, "
                              "or a graph break at its start), so a compiled search would time the eager model. Set "
                              "what dynamo needs to trace it, or search with SearchConfig(compile=None).")


def _graph_records(program: nn.Module) -> list:
    """The records of the graphs ``program`` compiled (:data:`CompilePlan`): by regions, every region's, which the
    programs of a search share (a program may compile no graph of its own and still run only compiled code)."""
    regional = "records" in vars(type(program))  # the class's own property, not an attribute of the user's model
    return program.records if regional else program.compfx_backend.records


def _captures_cuda_graphs(options: CompileOptions) -> bool:
    """Do these options make Inductor capture CUDA graphs (a mode that does, or its own setting)?"""
    return options.mode in ("reduce-overhead", "max-autotune") or bool(options.inductor_patches.get("triton.cudagraphs"))


def _recompile_limit_hit() -> tuple[type, ...]:
    """What dynamo raises past ``recompile_limit`` under ``fail_on_recompile_limit_hit`` (older torch: its old name)."""
    exc = torch._dynamo.exc
    return tuple(getattr(exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, name))


@contextlib.contextmanager
def _recompile_limit_explained():
    """A program that hit dynamo's recompile limit stops the search with what to change (it would train eagerly)."""
    try:
        yield
    except _recompile_limit_hit() as error:
        raise SearchError(f"a plan's compiled program recompiled past torch._dynamo.config.recompile_limit "
                          f"({torch._dynamo.config.recompile_limit}) on the sample loader's batches, so it would "
                          "train eagerly past it. Raise the limit, give the loader fewer input shapes, or compile "
                          f"with dynamic=True (SearchConfig(compile=CompileOptions(dynamic=True))). ({error})") \
            from error
