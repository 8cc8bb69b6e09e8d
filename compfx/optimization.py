"""``compfx.optimize``: search a convergence-safe precision plan on your data, return the model running it.

This module checks the arguments and wires the stages together (analysis,
sampler, log); the search itself is :mod:`compfx.search`, run by
:class:`~compfx.search.session.SearchSession`. The search trains real samples: one FP32
epoch over ``sample_loader``, one epoch per Stage-1 plan, a few timed steps
per Stage-2 plan. Every sample starts from the same state
(:mod:`compfx.search.sampling`), so the plans are compared fairly and the
model and optimizer are left as ``SearchConfig.keep_search_training`` says.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
import warnings
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import cache
from .analysis import analyze
from .batches import check_first_batch, model_device
from .compile_backend import compile_with_plan
from .compile_regions import RegionCache
from .errors import BadInputError
from .float8 import require_torchao
from .graph_capture.held_state import HeldState
from .measure import PhaseClock, long_lived_objects_frozen, settle_host_allocator
from .per_module import plan_blocks_fp32
from .search import SearchConfig, SearchLog, SearchResult, decision_settings
from .search.sampling import FairSampler, loader_batches, training_mode
from .search.session import SearchSession
from .state import loader_generators, rng_preserved
from .vocabulary import LOW_DTYPES, dtype_name

__all__ = ["optimize"]


def optimize(model: nn.Module, sample_loader: Iterable, *, optimizer: torch.optim.Optimizer, loss_fn=None,
             low_dtype: torch.dtype | None = None, config: SearchConfig = SearchConfig(), log=None,
             resume: bool = False, per_module: type | Iterable[type] = ()) -> SearchResult:
    """Search a mixed-precision plan for ``model`` on ``sample_loader``: CoMP's two stages under the loss guard.

    Every sample trains the model itself for one epoch of the loader (or a
    batch, in Stage 2) under a candidate plan, from the same state, RNG and
    batches; the model, optimizer and RNG are put back after each. A plan
    replaces the incumbent only as ``config.decision`` says. The caller's RNG
    (CPU and CUDA, Python's and NumPy's) is the same afterwards, whether the
    search finished, failed, resumed or was interrupted, and even when the
    model's forward reseeds. The chosen plan is saved to the plan cache
    (``result.plan_path``), so that ``torch.compile(model, backend="compfx")``
    runs it (``SearchConfig(cache_plan=False)`` opts out).

    Args:
        model: the ``nn.Module`` to plan; it trains on the device it is on.
        sample_loader: re-iterable batches (a list, a ``DataLoader``); a batch is a tuple ``(inputs..., target)``,
            a dict of keyword arguments, or a tensor. An epoch is ``len(sample_loader)`` batches, or for a loader
            without a length (an ``IterableDataset`` stream) at most
            :data:`~compfx.search.sampling.MAX_EPOCH_BATCHES`. An exception the loader raises reaches you as
            itself, after the state is restored; it is never taken for a failing plan.
        optimizer: the optimizer built on ``model.parameters()``; it keeps training ``result.module``.
        loss_fn: ``loss_fn(output, batch) -> loss``; default: the model's own loss (``output.loss``).
        low_dtype: the precision of "low" ops; default: float16 on CUDA, bfloat16 elsewhere.
        config: how to search (:class:`~compfx.search.config.SearchConfig`).
        log: a path for the JSON Lines search log, or a :class:`~compfx.search.log.SearchLog`.
        resume: continue the search logged at ``log``: samples already logged are replayed, not run again, so it
            reaches the decision an uninterrupted run would have, given the same costs.
        per_module: block types (``(Block,)``): search one plan for the blocks of those types and plan them in
            place (:func:`compfx.plan_blocks`). Under FSDP2, plan the blocks first, then ``fully_shard`` each block
            and the root, then optimize the sharded root: every measured step includes the all-gathers.

    Returns:
        SearchResult: ``.plan`` (the chosen :class:`~compfx.plan.Plan`); ``.module``, a
        :class:`~compfx.planned_module.PlannedModule` running it at any input signature and sharing the model's
        Parameters (with ``per_module``, ``model`` itself); ``.report()``, what was chosen, why, and what the search
        cost. The module runs in the model's train/eval modes as they are at each call.

    Raises:
        BadInputError: arguments that do not fit together (model, loader, loss, optimizer, config). Arguments, the
            log path and the cache folder are checked before any work, and nothing has changed then.
        CaptureError: the model cannot be captured as one faithful graph.
        PlanMismatchError: with ``resume``, a log of another model or written with another setting that can
            change the decision.
        LogIntegrityError: with ``resume``, a log whose records were changed after compfx wrote them.
        PlanFileError: the log cannot be read or written.
        CacheKeyError: a cache folder that cannot be one.

    Example::

        >>> import torch, compfx
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator ...>
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loader = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(4)]
        >>> ce = lambda out, batch: torch.nn.functional.cross_entropy(out, batch[-1])
        >>> result = compfx.optimize(model, loader, loss_fn=ce, optimizer=opt,
        ...                          config=compfx.SearchConfig(progress=False, repeats=2, warmup=1))
        >>> len(result.plan) == 3 and "chosen plan" in result.report()
        True
        >>> result.module(torch.randn(2, 8)).shape
        torch.Size([2, 3])
    """
    started = time.perf_counter()
    _check_arguments(model, sample_loader, optimizer, config, loss_fn, resume, per_module)
    SearchLog.check_path(log, resume=resume)  # a log it cannot write fails now, not after the search
    _check_cache_folder(config)
    device = model_device(model)
    clock = PhaseClock()  # where the search's time goes (SearchResult.cost_breakdown)
    settle_host_allocator(device)  # freed activations stay in the heap: steps timed now run as training will
    # rng_preserved: the caller's generators (a DataLoader's own included), even when the model's forward reseeds
    # them; the process's objects frozen: a full garbage collection during the search walks only the search's own
    with _train_mode(model), rng_preserved(device, generators=loader_generators(sample_loader)), \
            long_lived_objects_frozen():  # the search trains: train mode
        first = next(loader_batches(sample_loader, 1), _NO_BATCH)
        if first is _NO_BATCH:
            raise BadInputError("sample_loader yielded no batches; the search trains on it, so give it some "
                                "(CoMP's Stage 1 uses one epoch of it).")
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(first)):
            raise BadInputError("sample_loader's first batch holds tensors on the meta device (shapes, no values), "
                                "but the search trains on its batches; give batches of real tensors.")
        held = HeldState(model)
        inputs = check_first_batch(model, first, loss_fn, device)  # bad inputs fail here, before any work
        _check_forward_keeps_modules(held)
        args, kwargs = inputs
        with clock.phase("capture"):
            analysis = (plan_blocks_fp32(model, kwargs if kwargs else args, per_module, device=device,
                                         low_dtype=low_dtype, verify=config.verify_capture)
                        if per_module else analyze(model, kwargs if kwargs else args, device=device, low_dtype=low_dtype,
                                                   fp8=config.fp8, verify=config.verify_capture))
        sampler = FairSampler(model, optimizer, sample_loader, loss_fn, device=device, seed=config.seed,
                              grad_scaler=config.scaler_on(analysis.low_dtype))
        search_log = SearchLog.open(log, _log_header(analysis, config), resume=resume)
        # the programs of the plans measured share their compiled regions (under CompileOptions(regions=...)): a
        # plan that changes one block's precisions compiles that block's region alone
        compile_plan = functools.partial(compile_with_plan, shared_regions=RegionCache())
        return SearchSession(model, optimizer, analysis, sampler, config, search_log, inputs, clock,
                             compile_plan=compile_plan).run(started)


_NO_BATCH = object()  # what an empty loader yields first (None is a batch, and a bad one)

log = logging.getLogger("compfx")


def _check_arguments(model, loader, optimizer, config, loss_fn, resume, per_module) -> None:
    if not isinstance(model, nn.Module):
        raise BadInputError(f"optimize() takes an nn.Module; got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise BadInputError(f"loss_fn={loss_fn!r}; expected a callable (output, batch) -> scalar tensor, or None "
                            "for the model's own output.loss.")
    if not isinstance(resume, bool):
        raise BadInputError(f"resume={resume!r}; expected True or False.")
    if not isinstance(loader, Iterable):
        raise BadInputError(f"sample_loader is a {type(loader).__name__}, not iterable; pass a list of batches or "
                            "a DataLoader.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BadInputError(f"optimizer={type(optimizer).__name__}; expected a torch.optim.Optimizer built on "
                            "model.parameters(), e.g. torch.optim.AdamW(model.parameters()).")
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in own for p in held)
    if foreign:
        raise BadInputError(f"{foreign} of the optimizer's parameters are not this model's; build the optimizer "
                            "on model.parameters() (after moving the model to its device).")
    if not held:
        raise BadInputError("the optimizer holds no parameters, so the search would train nothing and compare plans "
                            "on an untrained loss; build it on model.parameters() (or the parameters you train).")
    _warn_low_precision_parameters(model, held)
    if needs_closure(optimizer):
        raise BadInputError(f"{type(optimizer).__name__}.step() needs a closure that re-evaluates the loss, but the "
                            "search steps the optimizer as a training loop does, optimizer.step() after backward(); "
                            "search with an optimizer that steps without one (SGD, AdamW), then train with yours.")
    if isinstance(loader, Iterator):
        raise BadInputError("sample_loader is a one-shot iterator, but every search sample walks it again; pass a "
                            "list of batches or a DataLoader.")
    if not isinstance(config, SearchConfig):
        raise BadInputError(f"config is a {type(config).__name__}; expected a compfx.SearchConfig, e.g. "
                            "SearchConfig(threshold=1.01).")
    if config.fp8:
        require_torchao()  # before any work: FP8 needs compfx[fp8]
    if config.compile is not None and per_module:
        raise BadInputError("SearchConfig(compile=...) with per_module: a compiled search measures the whole model as "
                            "compfx.compile_with_plan compiles it, and does not compile block by block yet. Search "
                            "per block eagerly (compile=None), or the whole model compiled (without per_module).")


def _check_forward_keeps_modules(held: HeldState) -> None:
    """A forward that replaces the model's submodules (``self.fc = nn.Linear(...)``) trains layers the optimizer
    does not hold, and each capture would see another model: refused, with the submodules put back."""
    if held.unchanged():
        return
    change = held.change()
    if change.modules:
        held.put_back_modules()
        raise BadInputError(
            f"forward() replaced submodules of the model while it ran on the first batch ({', '.join(change.modules[:3])}"
            "; they are put back): the optimizer would not train the new ones, and every capture of the model would "
            "see another model. Create submodules in __init__ and only call them in forward.")


def _warn_low_precision_parameters(model: nn.Module, trained: list) -> None:
    """Warn when the optimizer trains parameters held in fp16 or bf16: a plan computes from FP32 master weights
    (its casts make the low copies), so the search's FP32 baseline upcasts them and is not the model's own run."""
    trained_ids = {id(p) for p in trained}
    low = [(name, p.dtype) for name, p in model.named_parameters() if id(p) in trained_ids and p.dtype in LOW_DTYPES]
    if low:
        (name, dtype), *_ = low
        warnings.warn(f"compfx: the optimizer trains {len(low)} parameter(s) held in {dtype_name(dtype)} "
                      f"(e.g. {name!r}). compfx plans "
                      "compute from FP32 master weights, so the search's 'fp32' baseline upcasts them: it, and "
                      "Plan.fp32, are not your model's own run. Keep trained parameters in FP32 (model.float()) and "
                      "let the plan make the low-precision copies.", stacklevel=3)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer.step`` require a closure (``torch.optim.LBFGS``)? Read from its signature, which a
    scheduler's wrapper of ``step`` keeps."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a readable signature: take it as a plain step
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_cache_folder(config: SearchConfig) -> None:
    """The cache folder (plans, and the cost model's profiles) before any work: a path that cannot be one is a
    :class:`~compfx.errors.CacheKeyError`; one this process cannot write is warned about now (the search still
    runs; its plan is then not saved)."""
    if not config.cache_plan and not config.predictor:
        return
    folder = cache.cache_folder(config.cache_dir)
    problem = cache.unwritable(folder)
    if problem and config.cache_plan:
        log.warning("compfx: the plan cache %s cannot be written (%s); the search runs, but its plan will not be "
                    "saved there. Pass SearchConfig(cache_dir=<a folder you can write>), or cache_plan=False.",
                    folder, problem)


@contextlib.contextmanager
def _train_mode(model: nn.Module):
    """Train mode for the search, as the model trains; every module's own mode back afterwards.

    A model in training mode keeps each submodule's own mode: a BatchNorm frozen with ``.eval()`` for
    fine-tuning stays frozen in every sample and in the planned graphs, which keep the modes they were captured
    in. Only a model in eval mode is switched to ``train()`` as a whole.
    """
    modes = {module: module.training for module in model.modules()}
    training_mode(model)
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)


def _log_header(analysis, config: SearchConfig) -> dict:
    """What a resumed search must share with the logged one to replay its samples."""
    return {"fingerprint": analysis.fingerprint, "low_dtype": dtype_name(analysis.low_dtype),
            **decision_settings(config)}
