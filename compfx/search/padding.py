"""Should the chosen plan pad its Tensor Core misfits? Campo's input padding, decided as precision is: by measuring.

The analysis says which ops *can* be padded (``OpInfo.pad_eligible``: the op
misses the multiple-of-8 rule and zero-padding would meet it). Padding only
buys something for an op that runs in the low dtype on Tensor Cores, so the
candidates are the pad-eligible ops the plan runs ``low``
(:func:`padding_candidates`). Then, as Inductor's ``pad_mm`` keeps "can we"
apart from "should we":

1. **Can it pay?** (:func:`padding_gate`, per op, nothing trained) The cost
   function says so when it prices the padded plan below the unpadded one at
   the same measured seconds (a ``cost_fn`` that simulates a GPU). Otherwise
   the hardware decides first: padding exists to reach Tensor Cores, so on a
   device without them for the low dtype (a CPU, a GPU too old for bf16) it
   cannot pay and nothing is timed. On a device with them, the cost model
   times the op alone, unpadded and padded (:func:`compfx.costmodel.profile_padding`),
   or, with the cost model off, every candidate goes to the measurement.
2. **Does it pay?** (:func:`decide_padding`) The plan and the plan with the
   passing ops padded take turns, ``rounds`` times, on the same training
   steps (the evaluator's timed step). Padding is kept only when every padded
   round costs less than every unpadded one: a difference the rounds' spread
   could explain keeps the plan unpadded.

Padding changes no precision and adds only zeros (the pass's docstring gives
the tolerance), so the loss check is not run again.

>>> from compfx.opkey import OpKey
>>> a, b = OpKey.parse("fc:linear#0"), OpKey.parse("head:linear#0")
>>> def step(plan):  # the padded head is 20% faster
...     return 1.0 - 0.2 * (b in plan.padded)
>>> class Plan:  # a stand-in: decide_padding needs only .padded and with_padding
...     def __init__(self, padded=()): self.padded = frozenset(padded)
...     def with_padding(self, keys): return Plan(keys)
>>> decision = decide_padding(Plan(), [b], can_pay=lambda key: (True, "priced"), time_plan=step,
...                           cost=lambda plan, s: s)
>>> sorted(map(str, decision.plan.padded)), decision.kept
(['head:linear#0'], True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from ..errors import PlanFailedError
from ..opkey import OpKey
from ..plan import Plan
from ..tensor_cores import device_tensor_core_reason
from ..vocabulary import Precision, Stage
from .outcome import Reporter, failure_reason, note

__all__ = ["PaddingDecision", "padding_candidates", "padding_gate", "decide_padding", "PADDING"]

#: key, in the ``extra`` of the search log's padding notes, of what was decided (see :meth:`PaddingDecision.summary`)
PADDING = "padding"

Gate = Callable[[OpKey], tuple[bool, str]]


@dataclass(frozen=True)
class PaddingDecision:
    """What :func:`decide_padding` decided: the plan to run, and why.

    ``candidates``: the pad-eligible ops the plan runs low; ``tried``: those
    the gate let through to the measurement; ``kept``: whether the plan pads
    them; ``costs``: each round's cost of ``"unpadded"`` and ``"padded"``;
    ``seconds``: each round's measured step of both.
    """

    plan: Plan
    candidates: tuple[OpKey, ...] = ()
    tried: tuple[OpKey, ...] = ()
    kept: bool = False
    reason: str = ""
    costs: Mapping[str, list] = field(default_factory=dict)
    seconds: Mapping[str, list] = field(default_factory=dict)

    def summary(self) -> dict:
        """As JSON, for the search log."""
        return {"candidates": sorted(map(str, self.candidates)), "tried": sorted(map(str, self.tried)),
                "kept": self.kept, "costs": {k: list(v) for k, v in self.costs.items()},
                "seconds": {k: list(v) for k, v in self.seconds.items()}}


def padding_candidates(analysis, plan: Plan) -> tuple[OpKey, ...]:
    """The ops padding could help in ``plan``: ``pad_eligible`` in ``analysis`` and run ``low`` by the plan."""
    return tuple(op.key for op in analysis.ops if op.pad_eligible and plan.get(op.key) is Precision.LOW)


def padding_gate(plan: Plan, *, cost: Callable[[Plan, float], float], seconds: float, analysis,
                 capability: tuple[int, int] | None = None,
                 profiles: Callable[[Iterable[OpKey]], Mapping] | None = None,
                 candidates: Iterable[OpKey] = ()) -> Gate:
    """Per op: can padding pay, and why (step 1 of the module docstring).

    ``cost`` is the search's cost function over :class:`Plan` s and ``seconds``
    a measured step of ``plan``; ``profiles(keys)`` (the cost model, or None
    when it is off) gives each op's :class:`~compfx.costmodel.PaddingProfile`.
    Profiles are only taken on a device with Tensor Cores for the low dtype.
    """
    base = cost(plan, seconds)
    no_tensor_cores = device_tensor_core_reason(device=analysis.device, low_dtype=analysis.low_dtype,
                                                capability=capability)
    timed = {}
    if no_tensor_cores is None and profiles is not None:
        timed = dict(profiles(list(candidates)))

    def gate(key: OpKey) -> tuple[bool, str]:
        if cost(plan.with_padding([key]), seconds) < base:
            return True, "the cost function prices it lower"
        if no_tensor_cores is not None:
            return False, f"{no_tensor_cores}: padding only pays on Tensor Cores"
        if profiles is None:
            return True, "no cost model: the measured step decides"
        profile = timed.get(key)
        if profile is None or profile.skipped:
            return False, f"the cost model could not time it ({profile.skipped if profile else 'no profile'})"
        return profile.pays, (f"op alone {profile.padded_s * 1e3:.3g} ms padded vs {profile.low_s * 1e3:.3g} ms "
                              "unpadded")

    return gate


def decide_padding(plan: Plan, candidates: Iterable[OpKey], *, can_pay: Gate, time_plan: Callable[[Plan], float],
                   cost: Callable[[Plan, float], float], rounds: int = 3,
                   report: Reporter | None = None) -> PaddingDecision:
    """Pad the ``candidates`` that ``can_pay`` lets through when the measured step says it pays (see the module
    docstring); returns the decision, its ``plan`` padded or not. Each step is noted in ``report``'s log.

    ``time_plan(plan)`` is one timed training step (seconds) of a :class:`Plan`;
    ``cost(plan, seconds)`` what the search minimises. A plan that fails to run
    padded (:class:`~compfx.errors.PlanFailedError`) is kept unpadded.
    """
    candidates = tuple(candidates)
    if not candidates:
        return _decided(report, PaddingDecision(plan, reason="no op the plan runs low misses the Tensor Core rule "
                                                             "in a way padding would fix: nothing to pad"))
    verdicts = {key: can_pay(key) for key in candidates}
    tried = tuple(key for key in candidates if verdicts[key][0])
    if not tried:
        why = sorted({reason for _, reason in verdicts.values()})
        return _decided(report, PaddingDecision(
            plan, candidates, reason=f"padding off: it cannot pay for any of the {len(candidates)} op(s) that could "
                                     f"be padded ({'; '.join(why[:3])}); no step was timed for it"))
    padded = plan.with_padding(tried)
    costs: dict[str, list] = {"unpadded": [], "padded": []}
    seconds: dict[str, list] = {"unpadded": [], "padded": []}
    try:
        for _ in range(rounds):  # turns: drift on a busy machine hits both alike
            for name, candidate in (("unpadded", plan), ("padded", padded)):
                measured = float(time_plan(candidate))
                seconds[name].append(measured)
                costs[name].append(float(cost(candidate, measured)))
    except PlanFailedError as error:
        return _decided(report, PaddingDecision(plan, candidates, tried, reason="padding off: the padded plan "
                                                f"failed ({failure_reason(error)})", costs=costs, seconds=seconds))
    kept = max(costs["padded"]) < min(costs["unpadded"])
    spread = (f"padded {min(costs['padded']):.4g}-{max(costs['padded']):.4g}, unpadded "
              f"{min(costs['unpadded']):.4g}-{max(costs['unpadded']):.4g} over {rounds} rounds")
    reason = (f"padding on for {len(tried)} op(s) ({', '.join(sorted(map(str, tried))[:3])}): every padded step "
              f"cost less ({spread})" if kept else
              f"padding off: the padded step did not cost less in every round ({spread}); tried "
              f"{len(tried)} of {len(candidates)} op(s) that could be padded")
    return _decided(report, PaddingDecision(padded if kept else plan, candidates, tried, kept, reason, costs,
                                            seconds))


def _decided(report: Reporter | None, decision: PaddingDecision) -> PaddingDecision:
    note(report, Stage.SEARCH, decision.reason, **{PADDING: decision.summary()})
    return decision
