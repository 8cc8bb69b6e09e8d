"""One search of a real model, from its analysis to the :class:`~compfx.search.result.SearchResult`.

:func:`compfx.optimize` checks its arguments, analyses the model and opens the
sampler and the log; :class:`SearchSession` does the rest: it builds the
evaluators (per block with ``per_module``; synchronised and agreed on under
``torch.distributed``), the strategy and the cost model, runs the stages
(:func:`~compfx.search.driver.run_search`), decides the padding, times the
report's step comparison, leaves the model in its final state, saves the plan
to the plan cache and writes the log's notes and its last word (the result).
With ``SearchConfig(compile=...)`` the evaluator is a
:class:`~compfx.search.compiled.CompiledEvaluator`, which measures every plan
as the program ``compile_plan`` (:func:`compfx.compile_with_plan`) makes of it.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path

import torch

from .. import cache
from ..analysis import parameter_shapes
from ..errors import CompfxError
from ..measure import PhaseClock, describe_fp32_math, fp32_math
from ..memory import saved_activation_bytes
from ..regions import is_regions_analysis
from ..state import torch_rng_preserved
from ..vocabulary import Stage
from .compare import IN_THE_FIRST_DUEL, IN_THE_FIRST_EPOCHS, StepComparison
from .compiled import CompiledEvaluator, CompilePlan
from .config import SearchConfig
from .driver import SINGLE_PROCESS, Recorder, compare_steps, comparison_of, run_search
from .evaluator import LocalEvaluator, Replay, ReplayingEvaluator, measured_time
from .log import RESULT, SearchLog
from .padding import PaddingDecision, decide_padding, padding_candidates, padding_gate
from .per_module import PerModuleEvaluator
from .result import SearchResult
from .sampling import FairSampler
from .space import SearchSpace

__all__ = ["SearchSession", "COMPARE_ROUNDS"]

#: The fewest rounds of the report's step comparison (SearchConfig.rounds when it is more): with fewer, no
#: interval of a median could exclude anything.
COMPARE_ROUNDS = 3

log = logging.getLogger("compfx")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class SearchSession:
    """One optimize() run: the evaluators, the strategy, the cost model and the log, wired to the driver."""

    def __init__(self, model, optimizer, analysis, sampler: FairSampler, config: SearchConfig, log: SearchLog,
                 inputs: tuple[tuple, dict], clock: PhaseClock, compile_plan: CompilePlan | None = None):
        self.model, self.analysis, self.sampler, self.config, self.log = model, analysis, sampler, config, log
        self.clock = clock
        self.space = SearchSpace.from_analysis(analysis, fp8=config.fp8, search_pinned=config.search_pinned,
                                               tie_blocks=config.tie_blocks)
        settings = dict(warmup=config.warmup, repeats=config.repeats, cost_fn=config.cost_fn or measured_time,
                        clock=clock, fp8_recipe=config.fp8_recipe)
        if config.compile is not None:  # every plan measured as the program compile_with_plan trains
            if compile_plan is None:
                raise CompfxError("SearchConfig(compile=...) needs the session to be given compile_plan "
                                  "(compfx.optimize gives it compfx.compile_with_plan)")
            self.local = CompiledEvaluator(model, analysis, sampler, compile_options=config.compile,
                                           compile_plan=compile_plan, **settings)
        else:
            evaluator = PerModuleEvaluator if is_regions_analysis(analysis) else LocalEvaluator
            self.local = evaluator(model, analysis, sampler, **settings)
        self.plan_path: Path | None = None
        self.plan_cache = ""  # what became of the chosen plan in the plan cache, for the report
        self.replay = Replay(log.records)  # samples a resumed log already holds are not run again
        self.evaluator = ReplayingEvaluator(self.local, self.replay)
        self.strategy = SINGLE_PROCESS
        if config.per_device or _distributed():
            self._distribute(optimizer, inputs)

    def _distribute(self, optimizer, inputs) -> None:
        """Ranks agree on one plan (or get one each); every measurement is agreed on first."""
        from .distributed import PerDeviceAllocation, RankAgreement, SyncedEvaluator, rank_context

        ctx = rank_context(device=self.analysis.device)  # the collectives use this rank's own GPU
        if ctx.distributed:
            self.evaluator = SyncedEvaluator(self.evaluator, ctx)
        if self.config.per_device:
            args, kwargs = inputs  # every plan's bytes are of the same batch
            self.strategy = PerDeviceAllocation(
                ctx, self.model, optimizer, space=self.space, local=self.local, memory_budget=self.config.memory_budget,
                activation_bytes=lambda plan: saved_activation_bytes(self.local.module(plan), args, kwargs),
                threshold=self.config.threshold, check_batches=self.config.stage2_check_batches)
        else:
            self.strategy = RankAgreement(ctx, self.model, optimizer)

    def _predictor(self):
        """The cost model, or None when it is off or cannot be built (then the search is exact)."""
        if not self.config.predictor:
            return None
        compiled, fp8 = self.config.compile, any(self.space.fp8_eligible)
        if fp8 and not compiled:
            self.log.note(Stage.SEARCH, "cost model off: it prices FP8 ops only as they run compiled (with their "
                          "scaling fused), so every candidate is measured (FP8 costs come from the measured seconds "
                          "and cost_fn)")
            return None
        if _distributed():
            # Each rank would profile its own ops and order or skip candidates on its own
            # predictions, and the ranks' collectives would stop matching; measure them all.
            self.log.note(Stage.SEARCH, "cost model off under torch.distributed: every rank measures every candidate")
            return None
        from ..costmodel import SearchPredictor

        # predictions price the very modules the samples run; per block, the blocks' graphs side by side
        regions = is_regions_analysis(self.analysis)
        rewrite = self._regions_graph_of if regions else self.local.module_of
        try:
            # a regions graph is rewritten for pricing alone: only the plans the search prices are annotated
            # compiled: the programs the samples run are priced as Inductor (or the inner backend) runs them, casts
            # that fuse into their neighbours free; rewrite still gives the planned graph, before compilation
            return SearchPredictor.build(self.analysis, rewrite=rewrite, cache_dir=self.config.cache_dir,
                                         annotate_all=not regions, confidence=self.config.decision.confidence,
                                         compiled=compiled or None,
                                         **({"fp8_recipes": (self.config.fp8_recipe,)} if compiled and fp8 else {}))
        except Exception as error:  # the predictor only orders and skips: never fail the search for it
            self.log.note(Stage.SEARCH, f"cost model unavailable ({type(error).__name__}: {error}); measuring every "
                          "candidate")
            return None

    def _regions_graph_of(self, plan):
        """The blocks' graphs side by side, rewritten for ``plan``: what the cost model prices per block."""
        # the apply stage imports the passes: load it when first needed
        from ..planned_module import priced_regions_graph

        with self.clock.phase("rewrites"):
            return priced_regions_graph(self.analysis, plan)

    def run(self, started: float) -> SearchResult:
        """The search; ``started`` is when ``optimize`` was called (its whole wall time is the search's cost)."""
        config, clock = self.config, self.clock
        progress = _progress_bar(config.progress)
        try:
            # the user's RNG is untouched; what the evaluator needs while it measures (a compiled one: dynamo's room)
            with torch_rng_preserved(self.analysis.device), self.local.measuring():
                with clock.phase("profiling"):
                    predictor = self._predictor()
                recorder = Recorder(self.log, replay=self.replay, predictor=predictor, progress=progress, clock=clock)
                decision = run_search(self.space, self.evaluator, config, report=recorder, predictor=predictor,
                                      strategy=self.strategy)
                padding = self._decide_padding(decision, predictor is not None, recorder)
                if padding.kept:  # the chosen plan runs padded from here on: the comparison times what is returned
                    self.local.settle(decision.plan, padding.plan)
                comparison = self._first_duel_comparison(decision, padding) or self._compare_steps(decision)
                self.local.leave_state(decision.stage1.best, keep_training=config.keep_search_training)
            self._note_specializations()
            self._note_compiled()
            self._note_inputs_written()
            self._note_fp32_math()
            # its file says which widths it was searched at (a per-block plan is keyed by block: none)
            chosen = padding.plan.with_parameter_shapes(
                None if is_regions_analysis(self.analysis) else parameter_shapes(self.analysis.graph_module))
            self._save_plan(chosen)
            search_seconds = time.perf_counter() - started
            result = SearchResult(
                module=self.local.result_module(chosen), plan=chosen,
                stage1_plan=self.local.plan(decision.stage1.best.plan), analysis=self.analysis, log=self.log,
                stage1_mode=decision.stage1.mode, loss0=decision.stage1.loss0,
                fp32_epoch_seconds=decision.stage1.baseline.duration, search_seconds=search_seconds,
                step_seconds={name: comparison.median(name) for name in comparison.seconds},
                step_comparison=comparison, plan_path=self.plan_path, plan_cache=self.plan_cache,
                cost_breakdown=_breakdown(clock, search_seconds))
            # the log's last word: what `compfx report LOG` renders without the model
            self.log.note(Stage.SEARCH, f"finished: chosen plan {decision.plan}", **{RESULT: result.log_summary()})
        except KeyboardInterrupt:
            self.sampler.restore()
            self.log.note(Stage.SEARCH, "interrupted: the model and optimizer were restored to their state before "
                          "the search")
            raise
        except BaseException:
            self.sampler.restore()
            raise
        finally:
            progress.close()
            self.log.close()
        self.strategy.finish()
        return result

    def _decide_padding(self, decision, cost_model: bool, report) -> PaddingDecision:
        """Pad the chosen plan's Tensor Core misfits where that pays (:mod:`compfx.search.padding`)."""
        plan = self.local.plan(decision.plan)
        if self.strategy is not SINGLE_PROCESS or is_regions_analysis(self.analysis):
            # each rank would decide on its own timings; per_module plans are keyed by block
            reason = "padding not searched " + ("with per_module" if is_regions_analysis(self.analysis)
                                                else "under torch.distributed") + ": the plan pads nothing"
            self.log.note(Stage.SEARCH, reason)
            return PaddingDecision(plan, reason=reason)
        from ..costmodel import profile_padding  # the cost model loads when first needed, as in _predictor

        candidates = padding_candidates(self.analysis, plan)
        device = self.analysis.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        with self.clock.phase("profiling"):
            gate = padding_gate(plan, cost=self.local.cost_fn, seconds=_step_seconds(decision), analysis=self.analysis,
                                capability=capability, candidates=candidates,
                                profiles=functools.partial(profile_padding, self.analysis,
                                                           cache_dir=self.config.cache_dir) if cost_model else None)
        return decide_padding(plan, candidates, can_pay=gate, time_plan=self.local.time_plan,
                              cost=self.local.cost_fn, report=report)

    def _compare_steps(self, decision) -> StepComparison:
        """FP32's, AMP's and the chosen plan's steps (padded, where the padding decision kept padding), for the
        report: one interleaved phase, warm, same batches.

        It is not part of the decision, and it is the only timing the report
        quotes: ``config.decision.rounds`` rounds (at least three), each giving every plan one step on the
        same batch (:func:`compfx.search.driver.compare_steps`), after a warm-up round, and in a single process another
        block of them while the chosen plan's speed-up is unclear (ranks of ``torch.distributed`` take the same
        steps). Timings the search took earlier, in other phases, are not mixed in.
        """
        samples_before = self.clock.seconds.get("samples", 0.0)
        rounds = max(self.config.decision.rounds, COMPARE_ROUNDS)
        plans = {"fp32": self.space.fp32_plan, "amp": self.space.amp_plan, "chosen": decision.plan}
        # Warm, even for plans that trained in the search: FP32's plan last ran in the search's first epochs, and
        # after the later samples its first step here ran 1.5-1.8x its others on the README example, which
        # widened the interval of every run and, in one, hid a 1.14x speed-up behind "no measurable difference".
        warmup = max(1, self.config.warmup)
        with self.clock.phase("step comparison"):
            rule = self.config.decision
            comparison = compare_steps(functools.partial(self.local.time_steps, warmup=warmup), self.local.saved_bytes,
                                       plans, self.log, rounds=rounds, confidence=rule.confidence,
                                       margin=rule.margin if self.strategy is SINGLE_PROCESS else None)
        self.clock.move(self.clock.seconds.get("samples", 0.0) - samples_before, source="samples",
                        target="step comparison")
        return comparison

    def _first_duel_comparison(self, decision, padding) -> StepComparison | None:
        """The step comparison read off Stage 1's duel of FP32's and AMP's plans, when the chosen plan is one of
        them (unpadded): that duel was the phase :meth:`_compare_steps` would run -- the plans taking turns on the
        same batches, warm -- so it is not run again. The duel is their first epochs, where those took turns, or
        one after them. None otherwise."""
        fp32, amp, chosen = self.space.fp32_plan, self.space.amp_plan, decision.plan
        if padding.kept or chosen not in (fp32, amp) or self.strategy is not SINGLE_PROCESS:
            return None
        rounds = max(self.config.decision.rounds, COMPARE_ROUNDS)
        for incumbent, challenger, verdict in decision.stage1.duels:
            if {incumbent, challenger} == {fp32, amp} and min(map(len, verdict.seconds), default=0) >= rounds:
                with self.clock.phase("step comparison"):
                    return comparison_of(dict(zip((incumbent, challenger), verdict.seconds)), self.local.saved_bytes,
                                         {"fp32": fp32, "amp": amp, "chosen": chosen}, self.log,
                                         confidence=self.config.decision.confidence,
                                         phase=IN_THE_FIRST_EPOCHS if decision.stage1.first_epochs_in_turns
                                         else IN_THE_FIRST_DUEL)
        return None

    def _note_compiled(self) -> None:
        """Say in the log (and so the report) that every plan was measured compiled, how, and what compiling cost."""
        if not isinstance(self.local, CompiledEvaluator):
            return
        options, seconds = self.local.compile_options, self.clock.seconds.get("compile", 0.0)
        programs = self.local.programs
        self.log.note(Stage.SEARCH, f"compiled search: every plan was measured as compfx.compile_with_plan(model, "
                      f"plan) trains it, compiled with {options.describe()}; {programs} program(s) compiled for "
                      f"{self.local.compiles} input signature(s) in {seconds:.2f} s, each in an untimed step before any "
                      "timed step of it" + ("; the cost model prices the eager programs (it only decides "
                                                  "what to measure)" if self.config.predictor == "on" else ""),
                      compile=options.to_dict(), programs=programs, compiles=self.local.compiles,
                      compile_seconds=seconds)

    def _note_fp32_math(self) -> None:
        """Say what 'fp32' computes in here: the user's TF32 settings, kept as they are (PyTorch's CUDA default
        runs FP32 convolutions in TF32)."""
        math_ = fp32_math(self.analysis.device)
        where = ("torch.backends.cuda.matmul / torch.backends.cudnn.conv .fp32_precision"
                 if self.analysis.device.type == "cuda" else "torch.backends.mkldnn .fp32_precision")
        self.log.note(Stage.SEARCH, f"'fp32' (the FP32 baseline, and ops a plan keeps in FP32) means "
                      f"{describe_fp32_math(math_)} on {self.analysis.device.type}: this process's settings ({where}), "
                      "which compfx keeps", fp32_math=math_)

    def _note_inputs_written(self) -> None:
        """Say in the log when the model wrote its inputs in place, and what the search did about it."""
        if self.sampler.inputs_written:
            self.log.note(Stage.SEARCH, "the model writes its inputs in place (its forward or loss_fn changed a "
                          "batch's tensors): every step of the search fed it copies, so the loader's batches are "
                          "as they were and every plan trained on the same data. A list of batches you train on "
                          "afterwards changes with every step, as it would without compfx", inputs_written=True)

    def _note_specializations(self) -> None:
        """Say in the log (and so the report) how many input signatures the loader had, and what they cost."""
        captured, specializations = self.local.specializations()
        if not specializations:
            return
        capture = sum(s.capture_seconds for s in specializations)
        rewrite = sum(s.rewrite_seconds for s in specializations)
        # specialising happens as a sample meets a new signature: capture and rewrite, not training
        self.clock.move(capture, source="samples", target="capture")
        self.clock.move(rewrite, source="samples", target="rewrites")
        shapes = sorted({s.inputs for s in specializations})
        unplanned = sum(bool(s.unplanned or s.missing) for s in specializations)
        fp8_fallbacks = sorted({f"{key} at {s.inputs} ({why})" for s in specializations for key, why in s.fp8_fallbacks})
        self.log.note(
            Stage.SEARCH,
            f"input signatures: {captured} ({len(shapes)} besides the first batch's, e.g. {shapes[0]}); each plan's "
            f"module re-specialises per signature from the same plan: {captured - 1} capture(s) in {capture:.2f} s, "
            f"{len(specializations)} rewrite(s) in {rewrite:.2f} s, outside the timed steps"
            + (f"; {unplanned} of them ran ops the plan does not name (they follow)" if unplanned else "")
            + (f"; FP8 op(s) that cannot run FP8 at a signature ran at AMP's precision there: "
               f"{'; '.join(fp8_fallbacks[:3])}" if fp8_fallbacks else ""),
            signatures=captured, specializations=len(specializations), capture_seconds=capture,
            rewrite_seconds=rewrite)

    def _save_plan(self, plan) -> None:
        """Put the chosen plan in the plan cache (where ``backend="compfx"`` looks), and say so in the log.

        A cache that cannot be written costs the search nothing: the plan is
        in the result; the log and a warning say why it was not saved.
        """
        if not self.config.cache_plan:
            self.plan_cache = "not saved (SearchConfig(cache_plan=False))"
            self.log.note(Stage.SEARCH, f"plan cache: {self.plan_cache}", plan_path="")
            return
        if self.config.per_device:
            self.plan_cache = "not saved: per-device plans differ by rank, and the cache holds one plan per model"
        elif _distributed() and torch.distributed.get_rank() != 0:
            self.plan_cache = "saved by rank 0"
        else:
            try:
                self.plan_path = cache.save_plan(plan, cache_dir=self.config.cache_dir)
                self.plan_cache = (f"saved to {self.plan_path}; torch.compile(model, backend=\"compfx\") runs this "
                                   "plan")
            except CompfxError as error:
                self.plan_cache = f"not saved: {error}"
                log.warning("compfx: the chosen plan was not saved to the plan cache: %s", error)
        # this process runs it for this model under torch.compile(backend="compfx"), whatever the file holds later
        cache.remember_plan(self.model, plan, self.plan_path)
        self.log.note(Stage.SEARCH, f"plan cache: {self.plan_cache}", plan_path=str(self.plan_path or ""))


def _step_seconds(decision) -> float:
    """A measured step of the chosen plan (Stage 2's timing, else its Stage-1 batches'), for pricing padding."""
    if decision.stage2.best.seconds > 0:
        return decision.stage2.best.seconds
    batches = decision.stage1.best.batch_seconds
    return statistics.median(batches) if batches else 1.0


def _breakdown(clock: PhaseClock, total: float) -> dict[str, float]:
    """The clock's phases, plus ``other``: the rest of ``total`` (argument checks, planning, logging, pricing)."""
    parts = {name: seconds for name, seconds in clock.seconds.items() if seconds > 0}
    return {**parts, "other": max(0.0, total - sum(parts.values()))}


def _progress_bar(enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="compfx search", unit="sample", disable=not enabled, leave=False)
