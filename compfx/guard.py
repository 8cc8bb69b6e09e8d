"""``compfx.Guard``: keeps watching a plan while training runs, and moves an op to FP32 when it overflows.

The search checks convergence once; activations drift afterwards, and an op
that was safe at step 100 may overflow at step 50,000. Used like ``GradScaler``::

    guard = compfx.Guard(fast)                 # fast: optimize(...).module, a PlannedModule
    loss = loss_fn(fast(x), y); loss.backward()
    guard.step(optimizer, loss)                # steps, or skips the step and repairs the plan

On a non-finite loss or gradient the guard skips the optimizer step, finds the
op(s) where the non-finite values start (:func:`compfx.diagnosis.diagnose_inputs`
on the same batch, backward from the gradient that reached the module's
output in this step) and moves them, or when they already run in FP32 their
producers, to FP32 with :meth:`~compfx.planned_module.PlannedModule.replan`: the same
module object, the same Parameters, so the optimizer keeps working. It checks
the repaired plan on the same batch and repairs again while non-finite values
remain (at most ``max_rounds`` times). With gradient accumulation (several
forwards before one step) the guard keeps every forward's inputs until the step;
when the last forward shows no source, the earlier ones are replayed, forward
only (their output gradients are gone). Each repair is kept in
:attr:`Guard.repairs` and, given ``log``, noted in the search log.

With fp16 pass the ``GradScaler``: non-finite gradients under a finite loss
are the scaler's to handle (it skips the step and lowers the scale) while the
scale is at least ``min_scale``; they are not repairs. Every ``shadow_every``
steps the guard also compares this step's loss (or, without ``loss_fn`` and
``batch``, the module's output) with an FP32 shadow run of the same batch and,
past ``drift_threshold``, moves the op that adds the most error to FP32.

:meth:`Guard.state_dict` holds the repaired plan: save it with the model's and
the optimizer's, and :meth:`Guard.load_state_dict` puts the repairs back into
a resumed run's module.

The guard checks its use: its settings are checked like ``SearchConfig``'s
(a bool is not a number, NaN is refused); ``step`` refuses an optimizer that
holds none of the module's parameters or another model's, and a call without a
``backward`` since the last one (which would step twice on one gradient), each
with a :class:`~compfx.errors.BadInputError` before anything changes. A
``log`` path is added to, never truncated: an existing file must be a search log.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
from torch.utils import _pytree as pytree

from .planned_module import PlannedModule
from .diagnosis import Diagnosis, diagnose_inputs, rng_state, shadow_graph_of, untouched_state
from .errors import BadInputError, PlanFileError, PlanMismatchError
from .opkey import OpKey
from .optimization import needs_closure
from .plan import Plan
from .search.log import SearchLog
from .state import dense_values
from .vocabulary import Precision, Stage

__all__ = ["Guard", "Repair"]

log = logging.getLogger("compfx")


@dataclass(frozen=True)
class Repair:
    """One op moved to FP32 by the guard: in which ``guard.step`` call (1 = the first), why, and what it ran before."""

    key: OpKey
    step: int
    reason: str
    was: Precision

    def to_dict(self) -> dict:
        return {**asdict(self), "key": str(self.key), "was": str(self.was)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Repair":
        step = data["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step {step!r} is not a count")
        return cls(OpKey.parse(data["key"]), step, str(data["reason"]), Precision(data["was"]))


class Guard:
    """Watches a :class:`~compfx.PlannedModule` during training; repairs its plan in place when it overflows.

    Used like ``GradScaler``: ``guard.step(optimizer, loss)`` after the
    backward steps the optimizer, or, on a non-finite loss or gradient, skips
    the step and moves the op(s) where the non-finite values start to FP32 in
    the same module (same Parameters). The module docstring has the details.

    Args:
        planned: the module to watch: ``compfx.apply``'s, or ``compfx.optimize(...).module``.
        scaler: the fp16 run's ``torch.amp.GradScaler``: non-finite gradients under a finite loss are its to
            handle while its scale is at least ``min_scale``.
        check_every: check the loss and gradients every that many steps (1: every step; between checks a
            non-finite step reaches the optimizer).
        shadow_every: compare with an FP32 shadow run every that many steps (None: never); past
            ``drift_threshold`` the op that adds the most error moves to FP32.
        drift_threshold: the relative difference from the FP32 shadow that counts as drift.
        loss_fn: ``loss_fn(output, batch)``: with ``step(..., batch=)``, the shadow compares losses (else the
            module's outputs).
        log: a search log (:class:`~compfx.search.SearchLog`, or its path, added to) to note repairs in.
        max_rounds: most repairs of one step while non-finite values remain.
        min_scale: the GradScaler scale below which non-finite gradients count as the plan's.

    Raises:
        BadInputError: ``planned`` is not a PlannedModule, or a setting is out of range or of another type (a bool
            is not a number, NaN is refused). ``step`` refuses, before anything changes, an optimizer that holds
            none of the module's parameters, and a call without a backward since the last one.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4), low_dtype=torch.float16)
        >>> fast = compfx.apply(model, compfx.Plan.amp(a), analysis=a)
        >>> opt, guard = torch.optim.SGD(model.parameters(), lr=0.1), compfx.Guard(fast)
        >>> fast(torch.randn(3, 4)).sum().backward(); guard.step(opt, torch.tensor(1.0))  # all finite: it steps
        True
        >>> with torch.no_grad(): _ = model[1].weight.mul_(1e6)  # now the second linear overflows fp16
        >>> loss = fast(torch.full((3, 4), 10.0)).sum(); opt.zero_grad(); loss.backward()
        >>> guard.step(opt, loss), [(str(r.key), r.reason) for r in guard.repairs]
        (False, [('1:linear#0', 'non-finite loss')])
        >>> fast.plan[compfx.OpKey("1", "linear", 0)]
        <Precision.FP32: 'fp32'>
    """

    def __init__(self, planned: PlannedModule, *, scaler=None, check_every: int = 1, shadow_every: int | None = None,
                 drift_threshold: float = 0.05, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 log: SearchLog | str | os.PathLike | None = None, max_rounds: int = 8, min_scale: float = 1.0):
        if not isinstance(planned, PlannedModule):
            raise BadInputError(f"Guard watches a compfx PlannedModule (compfx.apply(model, plan, ...), or "
                                f"optimize(...).module); got {type(planned).__name__}. "
                                "It repairs the module's plan in place, so it needs the module that runs one.")
        _check_count(check_every, "check_every")
        if shadow_every is not None:
            _check_count(shadow_every, "shadow_every")
        _check_count(max_rounds, "max_rounds")
        if not _is_real(drift_threshold) or not 0 < drift_threshold < math.inf:
            raise BadInputError(f"drift_threshold={drift_threshold!r}; expected a positive finite number (not a bool), "
                                "e.g. 0.05 for 5% relative difference from the FP32 shadow.")
        if not _is_real(min_scale) or not 0 <= min_scale < math.inf:
            raise BadInputError(f"min_scale={min_scale!r}; expected a finite number >= 0 (not a bool): the GradScaler "
                                "scale below which non-finite gradients count as the plan's, e.g. 1.0.")
        if scaler is not None and (isinstance(scaler, type) or not all(
                hasattr(scaler, m) for m in ("unscale_", "step", "update", "get_scale"))):
            what = f"the class {scaler.__name__}" if isinstance(scaler, type) else type(scaler).__name__
            raise BadInputError(f"scaler={what}; expected the GradScaler object the training loop uses (e.g. "
                                "scaler = torch.amp.GradScaler('cuda'); compfx.Guard(fast, scaler=scaler)), or None.")
        _check_not_guarded(planned)
        if loss_fn is not None and not callable(loss_fn):
            raise BadInputError(f"loss_fn={loss_fn!r}; expected a callable (output, batch) -> scalar tensor, or None.")
        self.planned, self.scaler, self.loss_fn = planned, scaler, loss_fn
        self.check_every, self.shadow_every, self.drift_threshold = check_every, shadow_every, float(drift_threshold)
        self.max_rounds, self.min_scale = max_rounds, float(min_scale)
        if log is not None and not isinstance(log, (str, os.PathLike, SearchLog)):
            raise BadInputError(f"log={log!r}; expected a search log's path, a compfx.search.SearchLog, or None.")
        # a path is added to (the search's own log, say), never truncated
        self.log = SearchLog.append_to(log) if isinstance(log, (str, os.PathLike)) else log
        self.repairs: list[Repair] = []
        self.steps = 0  # guard.step calls so far
        self.skipped = 0  # optimizer steps the guard skipped (non-finite values)
        self.scaler_skips = 0  # non-finite gradients left to the GradScaler
        self.drift: float | None = None  # the last shadow comparison
        self._inputs: tuple[tuple, dict] | None = None
        #: the inputs of every forward since the last step (gradient accumulation runs several): where a
        #: non-finite value may have started
        self._forwards: list[tuple[tuple, dict]] = []
        self._outputs: list[torch.Tensor] = []
        self._output_grads: dict[int, torch.Tensor] = {}
        self._output = None
        self._rng = None
        self._hooks = [planned.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       planned.register_forward_hook(self._after_forward)]
        # a backward since the last step: set when a gradient reaches one of the module's parameters
        self._parameters = {id(p) for p in planned._model.parameters()}
        self._backward_seen = False
        trained = [p for p in planned._model.parameters() if p.requires_grad]
        self._needs_backward = bool(trained)
        this = weakref.ref(self)  # the hooks live on the user's Parameters: they must not keep the guard alive

        def seen(_parameter):
            guard = this()
            if guard is not None:
                guard._backward_seen = True

        self._hooks += [p.register_post_accumulate_grad_hook(seen) for p in trained]
        _GUARDED[planned] = this

    @property
    def plan(self) -> Plan:
        """The plan the module runs now, repairs included."""
        return self.planned.plan

    def remove(self) -> None:
        """Stop watching: remove the guard's hooks from the module (another guard may then watch it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if _GUARDED.get(self.planned) is not None and _GUARDED[self.planned]() is self:
            del _GUARDED[self.planned]

    # -- what the training step's forward and backward leave behind ------------------
    def _before_forward(self, module, args, kwargs):
        if torch.is_grad_enabled():  # an evaluation forward between backward and step() is not the step's
            self._inputs = (args, kwargs)
            self._forwards.append(self._inputs)
            if self._shadow_due(self.steps + 1):
                self._rng = rng_state(self.planned._model)  # the shadow replays this forward's dropout masks

    def _after_forward(self, module, args, kwargs_or_output, output=None):
        output = kwargs_or_output if output is None else output
        if not torch.is_grad_enabled():
            return
        self._output = output
        self._outputs = [t for t in pytree.tree_leaves(output)
                         if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        self._output_grads = {}
        for i, tensor in enumerate(self._outputs):
            tensor.register_hook(self._keep_grad(i))

    def _keep_grad(self, index: int):
        def keep(grad):
            self._output_grads[index] = grad.detach()
        return keep

    # -- the step -------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, *, batch=None) -> bool:
        """Step ``optimizer`` (through the scaler, if any) unless the loss or gradients are non-finite; True if it did.

        ``loss`` is the unscaled loss of this step. On non-finite values the
        step is skipped and the plan repaired (see the module docstring).
        ``batch`` is only needed for a loss comparison with the FP32 shadow.
        """
        self._check_step(optimizer, loss)
        self._backward_seen = False
        self.steps += 1
        refused = False
        try:
            return self._step(optimizer, loss, batch)
        except BadInputError:  # refused before the optimizer stepped (a batch loss_fn cannot take): as it was
            refused, self._backward_seen, self.steps = True, True, self.steps - 1
            raise
        finally:
            if not refused:
                self._forwards = []  # the next step's forwards start now

    def _step(self, optimizer, loss, batch) -> bool:
        if self.scaler is not None:
            _unscale(self.scaler, optimizer)
        bad_loss = bad_grads = False
        if self.steps % self.check_every == 0:
            bad_loss, bad_grads = _nonfinite(loss, optimizer)
        if not (bad_loss or bad_grads):
            if self._shadow_due(self.steps):  # before the step: the shadow runs on the weights this forward used
                self._check_drift(loss, batch)
            self._optimizer_step(optimizer)
            return True
        if not bad_loss and self.scaler is not None and self.scaler.get_scale() >= self.min_scale:
            self._optimizer_step(optimizer)  # the scaler sees the inf, skips the step and lowers its scale
            self.scaler_skips += 1
            return False
        if self.scaler is not None:
            self.scaler.update(new_scale=self.scaler.get_scale())  # ends the scaler's step; the scale stays
        self.skipped += 1
        self._repair_nonfinite("non-finite loss" if bad_loss else "non-finite gradients", backward=not bad_loss)
        return False

    def _check_step(self, optimizer, loss) -> None:
        """Refuse a step the guard cannot vouch for, before anything changes."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise BadInputError(f"guard.step() takes the optimizer first; got {type(optimizer).__name__}.")
        if not isinstance(loss, torch.Tensor):
            raise BadInputError(f"guard.step() takes this step's loss tensor; got {type(loss).__name__}.")
        if needs_closure(optimizer):
            raise BadInputError(f"guard.step() got a {type(optimizer).__name__}, whose step() needs a closure that "
                                "re-evaluates the loss; the guard steps the optimizer as a training loop does "
                                "(optimizer.step() after backward). Train with an optimizer that steps without one "
                                "(SGD, AdamW), or step that one yourself without the guard.")
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in self._parameters for p in held):  # a head outside the planned module may share it
            what = "no parameters" if not held else "only parameters that are not the guarded module's"
            raise BadInputError(f"guard.step() got an optimizer holding {what}; the guard skips or takes the step of "
                                "the module it watches, so pass the optimizer that trains that model's parameters.")
        if self._needs_backward and not self._backward_seen:
            raise BadInputError("guard.step() was called without a backward since the last step (no gradient reached "
                                "the module's parameters): it would step again on the same gradients. Call "
                                "loss.backward() (or scaler.scale(loss).backward()) before every guard.step().")

    def _optimizer_step(self, optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def _shadow_due(self, step: int) -> bool:
        return self.shadow_every is not None and step % self.shadow_every == 0

    # -- repairs --------------------------------------------------------------------
    def _repair_nonfinite(self, reason: str, *, backward: bool) -> None:
        if self._inputs is None:
            log.warning("compfx.Guard: step %d was not finite, but the module ran no forward with gradients since "
                        "the last step; skipped the step without a repair", self.steps)
            return
        grads = [self._output_grads.get(i) for i in range(len(self._outputs))]
        from_output = None
        if backward and grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads):
            def from_output(output):
                return _float_leaves(output), grads
        repaired = self._repair_on(*self._inputs, from_output, reason)
        # gradient accumulation: the values may have started in an earlier forward of this step; their output
        # gradients are gone, so those are replayed forward only
        for args, kwargs in reversed(self._forwards[:-1]):
            if repaired:
                break
            repaired = self._repair_on(args, kwargs, None, reason)
        if not repaired:
            log.warning("compfx.Guard: step %d had a %s, but no op that runs below FP32 produced it (an FP32 "
                        "overflow, or one in the loss function); skipped the step without a repair", self.steps, reason)

    def _repair_on(self, args: tuple, kwargs: dict, from_output, reason: str) -> list[Repair]:
        """Diagnose one forward's inputs and move the ops where non-finite values start to FP32, until the
        repaired plan is finite on them (at most ``max_rounds`` times); the repairs made."""
        repaired = []
        for _ in range(self.max_rounds):
            diagnosis = diagnose_inputs(self.planned, args, kwargs, backward_from=from_output)
            if diagnosis.finite and repaired:
                break
            targets = self._targets(diagnosis)
            if not targets:
                break
            repaired += self._move_to_fp32(targets, reason)
        return repaired

    def _targets(self, diagnosis: Diagnosis) -> list[OpKey]:
        """The origins that run below FP32; for an origin already in FP32, its producers that do not."""
        targets = []
        for key in diagnosis.origins:
            chosen = [key] if self.plan[key] is not Precision.FP32 else [
                p for p in diagnosis.producers.get(key, ()) if self.plan[p] is not Precision.FP32]
            targets += [k for k in chosen if k not in targets]
        return targets

    def _move_to_fp32(self, keys: list[OpKey], reason: str) -> list[Repair]:
        plan = self.plan
        repairs = [Repair(key, self.steps, reason, plan[key]) for key in keys]
        self.planned.replan(plan.with_precisions({key: Precision.FP32 for key in keys}))
        self.repairs += repairs
        for repair in repairs:
            log.warning("compfx.Guard: step %d: %s; moved %s (%s) to fp32", repair.step, reason, repair.key, repair.was)
            if self.log is not None:
                self.log.note(Stage.GUARD, "repaired", op=str(repair.key), step=repair.step, cause=reason,
                              was=str(repair.was), plan=self.plan.fingerprint)
        return repairs

    def _check_drift(self, loss: torch.Tensor, batch) -> None:
        if self._inputs is None or self._output is None:
            return
        args, kwargs = self._inputs
        with torch.no_grad(), untouched_state(self.planned._model, self._rng):
            shadow = shadow_graph_of(self.planned, args, kwargs).forward(*args, **kwargs)
        if self.loss_fn is not None and batch is not None:
            with torch.no_grad():
                reference = float(_loss_on(self.loss_fn, shadow, batch))
            self.drift = abs(float(loss.detach()) - reference) / max(abs(reference), 1e-12)
        else:
            self.drift = _relative_error(_float_leaves(self._output), _float_leaves(shadow))
        if self.drift > self.drift_threshold:
            with torch.no_grad():
                diagnosis = diagnose_inputs(self.planned, args, kwargs)
            key = _largest_error_gain(diagnosis, self.plan)
            if key is not None:
                self._move_to_fp32([key], f"drift {self.drift:.3g} > {self.drift_threshold:g} from FP32")

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The plan the module runs (repairs included), the repairs and the counters; JSON-serialisable."""
        return {"plan": self.plan.to_dict(), "repairs": [r.to_dict() for r in self.repairs], "steps": self.steps,
                "skipped": self.skipped, "scaler_skips": self.scaler_skips}

    def load_state_dict(self, state: Mapping) -> None:
        """Run the saved plan (with its repairs) on this guard's module, in place, and take over its record.

        The plan must be one for this module's model (the same op keys and
        fingerprint): a :class:`~compfx.errors.PlanMismatchError` otherwise.
        """
        if not isinstance(state, Mapping) or not {"plan", "repairs", "steps"} <= set(state):
            raise PlanFileError("Guard.load_state_dict() got something that is not a Guard.state_dict() (expected "
                                "'plan', 'repairs' and 'steps' entries).")
        counters = {name: state.get(name, 0) for name in ("steps", "skipped", "scaler_skips")}
        bad = {name: value for name, value in counters.items()
               if not isinstance(value, int) or isinstance(value, bool) or value < 0}
        if bad:
            raise PlanFileError(f"the guard's state has {bad}; expected counts (ints >= 0). It is damaged; load the "
                                "checkpoint it came from.")
        plan = Plan.from_dict(state["plan"], source="the guard's state")
        try:
            if not isinstance(state["repairs"], list):
                raise TypeError(f"'repairs' is a {type(state['repairs']).__name__}, not a list")
            repairs = [Repair.from_dict(r) for r in state["repairs"]]
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanFileError(f"the guard's state has a damaged repair record ({error}).") from error
        unknown = [str(r.key) for r in repairs if r.key not in self.planned.analysis.keys]
        if unknown:
            raise PlanMismatchError(f"the guard's state records repairs of op(s) {unknown[:3]}, which this module's "
                                    "model does not have; it is the state of another model's guard. Load the "
                                    "checkpoint of this model.")
        self.planned.replan(plan)  # validates the plan before it replaces anything: all or nothing
        self.repairs = repairs
        self.steps, self.skipped, self.scaler_skips = counters["steps"], counters["skipped"], counters["scaler_skips"]

    def __repr__(self) -> str:
        return (f"Guard(steps={self.steps}, repairs={[str(r.key) for r in self.repairs]}, skipped={self.skipped}, "
                f"scaler_skips={self.scaler_skips})")


#: The guard watching each planned module: two guards on one module would each repair its plan and step its
#: optimizer. Weak both ways: a module or a guard dropped by the user is not kept alive here.
_GUARDED: "weakref.WeakKeyDictionary[PlannedModule, weakref.ref]" = weakref.WeakKeyDictionary()


def _check_not_guarded(planned: PlannedModule) -> None:
    other = _GUARDED.get(planned)
    if other is not None and other() is not None and other()._hooks:
        raise BadInputError("this module already has a compfx.Guard watching it; two guards would each repair its "
                            "plan and step its optimizer. Keep the first one, or call its .remove() first.")


def _loss_on(loss_fn, output, batch) -> torch.Tensor:
    """``loss_fn(output, batch)`` for the FP32 shadow; a failure says it is the batch given to ``guard.step``."""
    try:
        return loss_fn(output, batch)
    except Exception as error:  # noqa: BLE001 - the user's loss on the user's batch
        raise BadInputError(f"guard.step(..., batch=...) gave a batch loss_fn cannot take "
                            f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); expected this step's "
                            "batch, as loss_fn(output, batch) takes it in training. The step was not taken.") from error


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _check_count(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadInputError(f"{name}={value!r}; expected a positive int.")


def _unscale(scaler, optimizer) -> None:
    """Unscale the gradients, unless the training loop already did (e.g. to clip them)."""
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as error:
        if "already been called" not in str(error):
            raise


def _nonfinite(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
    """(loss non-finite, gradients non-finite), with one synchronisation."""
    grads = [dense_values(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    flags = [~torch.isfinite(loss.detach()).all()]
    if grads:
        # the max-norm is non-finite exactly when an element is (NaN propagates through max)
        flags.append(~torch.isfinite(torch.nn.utils.get_total_norm(grads, math.inf)).to(loss.device))
    result = torch.stack(flags).tolist()
    return bool(result[0]), bool(result[1]) if len(result) > 1 else False


def _float_leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@torch.no_grad()
def _relative_error(values: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    difference = sum(float(torch.linalg.vector_norm(v.double() - r.double())) ** 2 for v, r in zip(values, references))
    norm = sum(float(torch.linalg.vector_norm(r.double())) ** 2 for r in references)
    return math.sqrt(difference / norm) if norm > 0 else math.sqrt(difference)


def _largest_error_gain(diagnosis: Diagnosis, plan: Plan) -> OpKey | None:
    """The op below FP32 whose output's error against the shadow grows most over its producers' (where drift enters)."""
    error = {row.key: row.error or 0.0 for row in diagnosis.rows}
    gains = {row.key: error[row.key] - max((error.get(p, 0.0) for p in diagnosis.producers.get(row.key, ())),
                                           default=0.0)
             for row in diagnosis.rows if plan[row.key] is not Precision.FP32 and row.error is not None}
    return max(gains, key=gains.get) if gains else None
