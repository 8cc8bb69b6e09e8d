"""``compfx.optimize``: search a convergence-safe precision plan on your data, return the model running it.

The search (CoMP, see :mod:`compfx.search`) trains real samples: one FP32
epoch over ``sample_loader``, one epoch per Stage-1 plan, a few timed steps per
Stage-2 plan. Every sample starts from the same state (:mod:`compfx.training`),
so the plans are compared fairly and the model and optimizer are left as
described by ``SearchConfig.keep_search_training``.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from .analyze import analyze, model_device
from .errors import BadInputError, SearchError
from .plan import Plan
from .vocabulary import dtype_name
from .report import SearchSummary, render_report
from .search import SearchSpace, check_stage2, run_stage1, run_stage2
from .searchlog import Replay, ReplayedState, SampleRecord, SearchLog
from .training import FairSampler, check_first_batch, cuda_devices, restore_state

__all__ = ["SearchConfig", "optimize", "measured_time"]

CostFn = Callable[[Plan, float], float]


def measured_time(plan: Plan, seconds: float) -> float:
    """The default cost: the measured seconds themselves."""
    return seconds


@dataclass(frozen=True)
class SearchConfig:
    """How :func:`optimize` searches.

    * ``threshold``: a plan is accepted when its epoch loss is below
      ``loss_0 * threshold`` (``loss_0 + (threshold - 1) * |loss_0|``), loss_0
      being the FP32 epoch's. The paper uses 1.01.
    * ``stage1_budget``: most Stage-1 samples after the FP32 baseline; past
      ``2**k`` the space is reduced (see :func:`compfx.search.stage1_plan_space`).
    * ``stage2_budget``: most Stage-2 candidates timed, the Stage-1 winner included.
    * ``seed``: the RNG seed every sample starts from.
    * ``warmup``: untimed steps before each timed sample (a Stage-1 epoch or a
      Stage-2 timing), so that one-off costs of a plan's first steps are not
      counted; ``repeats``: timed steps per Stage-2 timing (their median counts).
    * ``grad_scaler``: scale the loss with ``torch.amp.GradScaler`` in every
      sample; ``None`` = on for float16, off for bfloat16 (it has FP32's range).
    * ``progress``: a tqdm bar over samples.
    * ``cost_fn(plan, seconds) -> float``: what the search minimises (default:
      the measured seconds). Stage 1 calls it on the running sum of per-batch
      seconds to prune; pruning is exact only if it never decreases as the
      seconds grow.
    * ``keep_search_training``: True leaves the model and optimizer in the state
      the chosen plan's Stage-1 epoch trained them to (that epoch is not wasted);
      False puts back the state they had before ``optimize``.
    * ``stage2_check_batches``: batches on which the Stage-2 winner's loss is
      checked against FP32's (0 skips the check).
    * ``prune``: False runs every Stage-1 sample to the end (to measure what pruning saves).
    * ``per_device``: under ``torch.distributed``, let ranks hold different plans
      (QSync's allocator, see :mod:`compfx.distributed`); ``memory_budget``: this
      rank's limit on activation bytes saved for backward per step (None: no limit).
    * ``predictor``: ``"on"`` profiles each op once (cached, see :mod:`compfx.costmodel`),
      runs Stage-1 candidates cheapest-predicted first and skips those whose
      predicted cost exceeds ``predictor_margin`` times the best measured accepted
      cost; ``"off"`` measures every candidate (the exact CoMP search).
    * ``early_stop``: with the cost model on, a Stage-1 sample stops once its
      pace, batch for batch against the best plan's, projects its epoch cost
      more than this fraction over the best accepted cost (None: never; with
      ``predictor="off"`` only exact pruning stops samples).
    """

    threshold: float = 1.01
    stage1_budget: int = 64
    stage2_budget: int = 32
    seed: int = 0
    warmup: int = 1
    repeats: int = 5
    grad_scaler: bool | None = None
    progress: bool = True
    cost_fn: CostFn | None = None
    keep_search_training: bool = True
    stage2_check_batches: int = 4
    prune: bool = True
    per_device: bool = False
    memory_budget: int | None = None
    predictor: str = "on"
    predictor_margin: float = 1.25
    early_stop: float | None = 0.05

    def __post_init__(self):
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold >= 1):
            raise BadInputError(f"SearchConfig(threshold={self.threshold!r}); expected a finite number >= 1, "
                                "e.g. 1.01 (accept plans whose loss is within 1% of FP32's).")
        for name, low in (("stage1_budget", 1), ("stage2_budget", 1), ("warmup", 0), ("repeats", 1),
                          ("stage2_check_batches", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BadInputError(f"SearchConfig({name}={value!r}); expected an int >= {low}.")
        if not isinstance(self.seed, int):
            raise BadInputError(f"SearchConfig(seed={self.seed!r}); expected an int.")
        if self.cost_fn is not None and not callable(self.cost_fn):
            raise BadInputError(f"SearchConfig(cost_fn={self.cost_fn!r}); expected a callable (plan, seconds) -> float.")
        if self.predictor not in ("on", "off"):
            raise BadInputError(f"SearchConfig(predictor={self.predictor!r}); expected \"on\" or \"off\".")
        if not (isinstance(self.predictor_margin, (int, float)) and not isinstance(self.predictor_margin, bool)
                and self.predictor_margin >= 1):
            raise BadInputError(f"SearchConfig(predictor_margin={self.predictor_margin!r}); expected a number >= 1, "
                                "e.g. 1.25 (skip plans predicted 25% costlier than the best measured); "
                                "math.inf only reorders.")
        if self.early_stop is not None and not (isinstance(self.early_stop, (int, float))
                                                and not isinstance(self.early_stop, bool) and self.early_stop >= 0):
            raise BadInputError(f"SearchConfig(early_stop={self.early_stop!r}); expected a fraction >= 0, e.g. 0.05 "
                                "(stop a sample projected 5% over the best plan), or None.")
        if self.grad_scaler not in (None, True, False):
            raise BadInputError(f"SearchConfig(grad_scaler={self.grad_scaler!r}); expected None, True or False.")
        budget = self.memory_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise BadInputError(f"SearchConfig(memory_budget={budget!r}); expected a positive int (bytes of "
                                "activations saved for backward per step on this rank) or None.")
        if budget is not None and not self.per_device:
            raise BadInputError("SearchConfig(memory_budget=...) is a per-rank limit used by the per-device "
                                "allocator; set per_device=True as well, or leave memory_budget=None.")

    def scaler_on(self, low_dtype: torch.dtype) -> bool:
        return self.grad_scaler if self.grad_scaler is not None else low_dtype == torch.float16


def optimize(model: nn.Module, sample_loader: Iterable, *, loss_fn=None, optimizer: torch.optim.Optimizer,
             device=None, low_dtype: torch.dtype | None = None, config: SearchConfig = SearchConfig(),
             log=None, resume: bool = False) -> nn.Module:
    """Search a mixed-precision plan for ``model`` and return the model rewritten to run it.

    ``sample_loader`` is re-iterable (a list of batches or a ``DataLoader``); a
    batch is a dict of keyword arguments, or a tuple ``(inputs..., target)``
    (see :mod:`compfx.training`). ``loss_fn(output, batch)`` defaults to the
    model's own loss (``output.loss``). ``optimizer`` must be built on
    ``model.parameters()``: the returned GraphModule shares those Parameters, so
    it keeps training them. ``log`` is a path for the JSON Lines search log (or
    a :class:`SearchLog`). The result has ``.plan``, ``.log`` and ``.report()``.
    ``resume=True`` continues the search logged at ``log`` (an interrupted one):
    samples already logged are replayed from it, not run again, so it reaches the
    decision an uninterrupted run would have, given the same costs; the winner's
    Stage-1 epoch is trained again when its state came from the log. A log of
    another model or other search settings is refused (:class:`PlanMismatchError`).
    The returned graph is specialised to training mode.

    >>> import torch, compfx
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loader = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(4)]
    >>> ce = lambda out, batch: torch.nn.functional.cross_entropy(out, batch[-1])
    >>> fast = compfx.optimize(model, loader, loss_fn=ce, optimizer=opt,
    ...                        config=compfx.SearchConfig(progress=False, repeats=2, warmup=1))
    >>> len(fast.plan.bitstring(fast.plan_analysis)) == 3 and "chosen plan" in fast.report()
    True
    """
    _check_arguments(model, sample_loader, optimizer, device)
    device = model_device(model)
    modes = {module: module.training for module in model.modules()}
    model.train()  # the search trains; the captured graph is specialised to this mode
    try:
        first = next(iter(sample_loader), None)
        if first is None:
            raise BadInputError("sample_loader yielded no batches; the search trains on it, so give it some "
                                "(CoMP's Stage 1 uses one epoch of it).")
        args, kwargs = check_first_batch(model, first, loss_fn, device)  # bad inputs fail here, before any work
        analysis = analyze(model, kwargs if kwargs else args, device=device, low_dtype=low_dtype)
        sampler = FairSampler(model, optimizer, sample_loader, loss_fn, device=device, seed=config.seed,
                              grad_scaler=config.scaler_on(analysis.low_dtype))
        search_log = SearchLog.open(log, _log_header(analysis, config), resume=resume)
        search = _Search(model, analysis, sampler, config, search_log)
        if config.per_device or config.memory_budget is not None or (
                torch.distributed.is_available() and torch.distributed.is_initialized()):
            from .distributed import distribute_search  # ranks agree on one plan, or get one per device

            search = distribute_search(search)
        result = search.run()
    finally:
        for module, training in modes.items():
            module.train(training)
    return result


def _check_arguments(model, loader, optimizer, device) -> None:
    if not isinstance(model, nn.Module):
        raise BadInputError(f"optimize() takes an nn.Module; got {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BadInputError(f"optimizer={type(optimizer).__name__}; expected a torch.optim.Optimizer built on "
                            "model.parameters(), e.g. torch.optim.AdamW(model.parameters()).")
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise BadInputError(f"{foreign} of the optimizer's parameters are not this model's; build the optimizer "
                            "on model.parameters() (after moving the model to its device).")
    if isinstance(loader, Iterator):
        raise BadInputError("sample_loader is a one-shot iterator, but every search sample walks it again; pass a "
                            "list of batches or a DataLoader.")
    if device is not None and torch.device(device) != model_device(model):
        here = model_device(model)
        if torch.device(device).type != here.type or torch.device(device).index not in (None, here.index):
            raise BadInputError(f"device={device}, but the model's parameters are on {here}. Move the model first "
                                "(model.to(device)), then build the optimizer, then call optimize().")


class _Search:
    """One optimize() run: wires the pure search to real training samples."""

    def __init__(self, model, analysis, sampler: FairSampler, config: SearchConfig, log: SearchLog):
        self.model, self.analysis, self.sampler, self.config, self.log = model, analysis, sampler, config, log
        self.space = SearchSpace.from_analysis(analysis)
        self.cost_fn = config.cost_fn or measured_time
        self.modules: dict[str, nn.Module] = {}
        self.plans: dict[str, Plan] = {}
        self.progress = _progress_bar(config.progress)
        self.predictor = None  # a SearchPredictor while predictor="on"
        self.replay = Replay(log.records)  # samples a resumed log already holds are not run again

    # -- evaluators handed to the pure search ------------------------------------
    def plan(self, bits: str) -> Plan:
        if bits not in self.plans:  # cost_fn sees a Plan once per batch: build each one once
            self.plans[bits] = Plan.from_bitstring(self.analysis, bits)
        return self.plans[bits]

    def module(self, bits: str) -> nn.Module:
        if bits not in self.modules:
            from .apply import apply  # the apply stage imports passes/; load it when first needed

            self.modules[bits] = apply(self.model, self.plan(bits), analysis=self.analysis)
        return self.modules[bits]

    def planned_module(self, plan: Plan) -> nn.Module:
        """:meth:`module` for a :class:`Plan` (the cost model prices plans)."""
        return self.module(plan.bitstring(self.analysis))

    def program(self, bits: str) -> str:
        """What ``bits`` runs: the rewritten module's structure and code (equal text, equal program)."""
        return str(self.module(bits))

    def cost(self, bits: str, seconds: float) -> float:
        return float(self.cost_fn(self.plan(bits), seconds))

    def run_epoch(self, bits: str):
        return self.replay.epoch(bits, lambda: self.sampler.epoch(self.module(bits), warmup=self.config.warmup))

    def time_step(self, bits: str) -> float:
        if self.replay.has("stage2", bits):
            return self.replay.time_step(bits)
        return self.sampler.step_time(self.module(bits), warmup=self.config.warmup,
                                      repeats=self.config.repeats).median

    def check_loss(self, bits: str) -> float:
        if self.replay.has("check", bits):
            return self.replay.check_loss(bits)
        return self.sampler.mean_loss(self.module(bits), self.config.stage2_check_batches)

    def report(self, record: SampleRecord) -> None:
        annotated = self.replay.annotate(record)  # None: replayed, the log holds it already
        record = annotated or record
        if self.predictor is not None:
            record = self.predictor.observe(record)
        if annotated is not None:
            self.log.append(record)
        if record.is_sample:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{record.stage} {record.status}", refresh=False)

    # -- the search ------------------------------------------------------------
    def run(self) -> nn.Module:
        c, start = self.config, time.perf_counter()
        try:
            with torch.random.fork_rng(devices=cuda_devices(self.analysis.device)):  # the user's RNG is untouched
                # profiling counts as search time; predictions price the very modules the samples run
                self.predictor = _build_predictor(self.analysis, c, self.log, rewrite=self.planned_module)
                stage1 = run_stage1(self.space, self.run_epoch, self.cost, threshold=c.threshold,
                                    budget=c.stage1_budget, prune=c.prune, report=self.report,
                                    predict=self.predictor and self.predictor.epoch_seconds,
                                    bound=self.predictor and self.predictor.lower_bound_seconds,
                                    margin=c.predictor_margin, identity=self.program,
                                    early_stop=c.early_stop if self.predictor is not None else None)
                stage2 = run_stage2(self.space, stage1.best.bits, self.time_step, self.cost,
                                    budget=c.stage2_budget, report=self.report, identity=self.program)
                chosen = self._checked(stage1, stage2.best.bits)
                search_seconds = time.perf_counter() - start  # the comparison below is for the report only
                steps = self._compare(chosen)
        except KeyboardInterrupt:
            self.sampler.restore()
            self.log.note("search", "interrupted: the model and optimizer were restored to their state before "
                          "the search")
            raise
        except BaseException:
            self.sampler.restore()
            raise
        finally:
            self.progress.close()
            self.log.close()
        if c.keep_search_training and isinstance(stage1.best.artifact, ReplayedState):
            restore_state(self._retrain(stage1.best.bits))  # its state was not in the log
        elif c.keep_search_training and stage1.best.artifact is not None:
            restore_state(stage1.best.artifact)
        else:
            self.sampler.restore()
        summary = SearchSummary(self.analysis, self.plan(chosen), self.plan(stage1.best.bits), self.log,
                                stage1.mode, stage1.loss0, stage1.baseline.duration, search_seconds, steps)
        return self._result(chosen, summary)

    def _retrain(self, bits: str):
        """Train the Stage-1 epoch of ``bits`` again (same seed, same start) and return its final state."""
        epoch = self.sampler.epoch(self.module(bits), warmup=self.config.warmup)
        while True:
            try:
                next(epoch)
            except StopIteration as stop:
                return stop.value

    def _checked(self, stage1, winner: str) -> str:
        batches = min(self.config.stage2_check_batches, stage1.baseline.batches)
        if batches == 0:
            return winner
        reference = sum(stage1.baseline.batch_losses[:batches]) / batches
        return check_stage2(winner, stage1.best.bits, self.check_loss, reference, self.config.threshold,
                            report=self.report)

    def _compare(self, chosen: str, rounds: int = 3) -> dict[str, float]:
        """Step time of FP32, AMP and the chosen plan on the same batches (for the report).

        The plans take turns, round after round, and each reports the median of
        its round medians: drift on a busy machine then hits all three alike. A
        plan equal to another is timed once.
        """
        plans = {"fp32": self.space.fp32_bits, "amp": Plan.amp(self.analysis).bitstring(self.analysis),
                 "chosen": chosen}
        medians: dict[str, list[float]] = {bits: [] for bits in plans.values()}
        failed: set[str] = set()
        for _ in range(rounds):
            for bits in medians:
                if bits in failed:
                    continue
                try:  # this rank's own timing: under per-device plans ranks compare different plans
                    medians[bits].append(self.sampler.step_time(self.module(bits), warmup=self.config.warmup,
                                                                repeats=self.config.repeats).median)
                except Exception as error:  # a comparison is informative only; never fail the search for it
                    failed.add(bits)
                    self.log.append(SampleRecord("compare", bits, "error", reason=f"{type(error).__name__}: {error}"))
        steps = {name: statistics.median(medians[bits]) for name, bits in plans.items() if medians[bits]}
        for name, seconds in steps.items():
            self.log.append(SampleRecord("compare", plans[name], "accepted", seconds=seconds, reason=name,
                                         extra={"round_medians": medians[plans[name]]}))
        return steps

    def _result(self, chosen: str, summary: SearchSummary) -> nn.Module:
        module = self.module(chosen)
        taken = [name for name in ("plan", "log", "report", "plan_analysis", "search_summary")
                 if hasattr(module, name)]
        if taken:
            raise SearchError(f"the model has attributes named {taken}, which optimize() uses on the module it "
                              "returns; rename them in the model.")
        module.plan = summary.plan
        module.log = self.log
        module.plan_analysis = self.analysis
        module.search_summary = summary
        module.report = functools.partial(render_report, summary)
        return module


def _build_predictor(analysis, config: SearchConfig, log: SearchLog, rewrite=None):
    """The cost model for the search, or None when it is off or cannot be built (then the search is exact)."""
    if config.predictor == "off":
        return None
    from .search_predictor import SearchPredictor

    try:
        predictor = SearchPredictor.build(analysis, rewrite=rewrite)
    except Exception as error:  # the predictor only orders and skips: never fail the search for it
        log.note("search", f"cost model unavailable ({type(error).__name__}: {error}); measuring every candidate")
        return None
    return predictor  # what profiling cost lands in the FP32 baseline's log line


def _log_header(analysis, config: SearchConfig) -> dict:
    """What a resumed search must share with the logged one to replay its samples."""
    return {"fingerprint": analysis.fingerprint, "low_dtype": dtype_name(analysis.low_dtype),
            "seed": config.seed, "threshold": config.threshold, "prune": config.prune,
            "stage1_budget": config.stage1_budget, "stage2_budget": config.stage2_budget,
            "warmup": config.warmup, "repeats": config.repeats, "grad_scaler": config.grad_scaler,
            "stage2_check_batches": config.stage2_check_batches, "predictor": config.predictor,
            "early_stop": config.early_stop if config.predictor == "on" else None}


def _progress_bar(enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="compfx search", unit="sample", disable=not enabled, leave=False)


