"""Stage 5 of the pipeline: CoMP's convergence-aware search, as pure logic over an evaluator.

Nothing in the stages touches a model: plans are :class:`~compfx.plan.Assignment` s
over a :class:`SearchSpace`, and every measurement comes from an
:class:`~compfx.search.evaluator.Evaluator`, so the search is exactly testable
with fake evaluators.

==================  ==============================================================
``space``           what the search knows of each op (category, TC, group)
``stage1``          Algorithm 1: the first incumbent, then one trial per candidate
``stage1_space``    Stage 1's candidates, and how it covers them within its budget
``stage1_samples``  one epoch per plan: exact-safe pruning, the loss guard, judging against the incumbent
``stage1_screen``   the cost-model screen: candidates the profiles show cannot win are not sampled
``stage1_turns``    candidates' epochs taking turns with the incumbent's, on the same batches
``stage2``          Algorithm 2: timed steps for the "other" ops between Stage-1 ops
``compare``         the decision rule: when a candidate replaces the incumbent (paired, interleaved duels)
``evidence``        why each op got its precision, read from the log (the report's "why" column)
``convergence``     the guard (loss within ``threshold`` x FP32's) and the final loss check
``allocation``      QSync's per-device allocator (one plan per rank)
``distributed``     the search under ``torch.distributed``: a synchronised evaluator, the rank strategies
``evaluator``       the Evaluator interface; the local, replaying and function evaluators; a log's replay
``per_module``      the search over a model's blocks (``optimize(..., per_module=...)``): its evaluator
``sampling``        fair training samples: same state, same RNG, same batches, restored in place
``driver``          runs the stages and the check, then a strategy's decision; the recorder
``session``         one search of a real model (what :func:`compfx.optimize` runs once it has wired the inputs)
``config``          :class:`SearchConfig` and the settings that decide (for resume)
``log``             the JSON Lines search log: its format, digests and keys
``outcome``         what one sample gave
``result``          :class:`SearchResult`, what :func:`compfx.optimize` returns
``report``          the report of a result (``result.report()``)
==================  ==============================================================
"""

from .allocation import Allocation, allocate_per_device, allocation_starts, recovery_order
from .compare import Comparison, DecisionRule, StepComparison, median_interval, speedup_text
from .config import DECIDES, SearchConfig, decision_settings
from .convergence import check_plan, check_winner, is_accepted, loss_limit
from .driver import SINGLE_PROCESS, Decision, Recorder, SingleProcess, Strategy, compare_steps, run_search
from .evaluator import Evaluator, FunctionEvaluator, LocalEvaluator, Replay, ReplayingEvaluator, measured_time
from .log import SampleRecord, SearchLog
from .outcome import Outcome
from .result import SearchResult
from .space import SearchSpace
from .stage1 import Stage1Result, run_stage1
from .stage1_screen import should_skip, skip_message
from .stage1_space import stage1_candidates, stage1_plan_space
from .stage2 import Segment, Stage2Result, algorithm2_candidates, run_stage2, segment_candidates, stage2_segments

__all__ = [
    "SearchSpace", "SearchConfig", "DECIDES", "decision_settings", "SearchResult",
    "Evaluator", "FunctionEvaluator", "LocalEvaluator", "ReplayingEvaluator", "measured_time",
    "run_search", "Decision", "Strategy", "SingleProcess", "SINGLE_PROCESS", "Recorder", "compare_steps",
    "DecisionRule", "Comparison", "StepComparison", "median_interval", "speedup_text",
    "run_stage1", "Stage1Result", "stage1_candidates", "stage1_plan_space", "should_skip", "skip_message",
    "run_stage2", "Stage2Result", "Segment", "stage2_segments", "algorithm2_candidates", "segment_candidates",
    "loss_limit", "is_accepted", "check_plan", "check_winner",
    "Allocation", "allocate_per_device", "allocation_starts", "recovery_order",
    "SearchLog", "SampleRecord", "Replay", "Outcome",
]
