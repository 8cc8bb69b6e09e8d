"""Capture verifies itself: the graph must train exactly as the model does before anything is planned.

:func:`verify_capture` runs the eager model and the captured graph once each on
the example inputs, forward and backward, from the same RNG state (and the
graph a second time, forward only: below), and compares bitwise
(``torch.testing.assert_close`` with zero tolerance):

* every output tensor, and whether it requires grad;
* the gradient of **every** parameter (``None`` included: a parameter that
  eager trains and the graph does not is the silent failure this catches), and
  of inputs that require grad;
* every buffer after the step (running statistics);
* how many tensors that require grad (activations, parameters) are saved for
  backward, counted with ``torch.autograd.graph.saved_tensors_hooks``: the
  graph may save at most :data:`SAVED_TENSOR_SLACK` more than eager, so
  activation checkpointing that the graph dropped is a difference too. Saved
  tensors that need no gradient (masks, indices) are counted and reported, not
  compared: a graph may build an attention mask that eager leaves to SDPA's
  ``is_causal`` (Hugging Face does so under tracing), with the same results.

The graph is called a second time, forward only: a call that differs from its first where
eager's do not (or fails) is a graph that keeps state between calls, such as a
tensor ``forward`` makes afresh each call and a tracer made one constant that
every call writes in place. A model that reassigns a parameter or buffer
(``self.running = ...``) is refused, and the slot gets its own tensor back: a
graph replays in-place updates only. A model whose eager run draws from
Python's or numpy's generator is run twice: if eager varies and the graph does
not, the graph froze that draw, and it is refused.

Backward starts from the same random gradient on each output for both runs
(the gradient of a sum would hide differences, e.g. all of softmax's).
Nothing of the caller's changes: gradients, ``requires_grad``, train/eval
modes, buffers, parameters the graph writes in place, the RNG (forked), grad
mode and the deterministic-algorithms setting are all as they were. The run is
made with deterministic algorithms on where CUDA is involved, so that kernels
with atomics (CUDA's ``index_add``) give the same bits twice (CPU kernels do).

When the two runs differ in values only, eager is run a second time: if eager
does not reproduce itself either (a kernel or Python code that varies run to
run), bitwise equality is impossible, and the graph is compared within twice
eager's own spread instead; the result says so (``exact`` is False, ``notes``
says why) and :func:`compfx.graph_capture.capture` warns. So it does when the model
itself has no backward on the example inputs (an op without a derivative, in
an inference-only model): only the forwards are compared. And so it does for
a dynamo or recorded graph whose values differ while eager reproduces itself:
a dynamo graph holds the model's ``torch.compile`` code path, and a recorded
one the path the model takes when it sees FakeTensors (transformers treats
them as tracing, and builds an attention mask it leaves to SDPA's
``is_causal`` in eager); some models write those paths differently from their
eager code, so such a graph is compared within :data:`COMPILED_PATH_BOUND` of
each tensor's largest magnitude instead. The symbolic tracer runs no model code
on tensors, so its graphs stay bitwise.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import BadInputError
from ..state import (RngState, outside_torch_states, restore_values, same_states, saved_values, slots_put_back,
                     state_slots, torch_rng_preserved)
from ._sites import first_line
from .model_state import get_attribute, reassignment_error
from .nodes import renormed_weight, writes_input
from .record import is_kv_cache, with_kv_caches_copied

__all__ = ["CaptureVerification", "verify_capture", "SAVED_TENSOR_SLACK", "COMPILED_PATH_BOUND", "VERIFICATION_META"]

#: How many more tensors that require grad than eager the graph may save for backward. The tracers write the same
#: ops as eager runs, so the counts are equal on every model the tests cover; a graph that dropped one
#: checkpointed block saves at least that block's activations more.
SAVED_TENSOR_SLACK = 2

#: How far a dynamo or recorded graph may differ from eager, as a fraction of each compared tensor's largest magnitude,
#: when eager reproduces itself bitwise: the model's torch.compile (or FakeTensor) code path reorders the same math
#: (float32 rounding, about 1e-6 of a magnitude per reordered reduction); a dropped gradient, checkpoint or Function is
#: a difference in kind, and a precision change (bf16: 4e-3) is beyond it.
COMPILED_PATH_BOUND = 1e-4

#: ``gm.meta`` entry: the :class:`CaptureVerification` of the graph.
VERIFICATION_META = "compfx_capture_verification"


@dataclass(frozen=True)
class CaptureVerification:
    """What running the captured graph against the eager model showed.

    ``mismatch`` is the first difference, in words (None: none);
    ``exact`` is True when everything compared was bitwise equal; ``notes`` say
    why equality was not exact where it could not be. ``outputs`` and
    ``gradients`` count the tensors compared, ``saved_eager`` / ``saved_graph``
    the tensors each run saved for backward (all of them; the comparison counts
    those that require grad), ``seconds`` what the check cost. ``code_path`` is
    True when the graph holds another code path of the model (:data:`CODE_PATHS`)
    and was kept within :data:`COMPILED_PATH_BOUND`.
    """

    method: str
    mismatch: str | None
    exact: bool
    notes: tuple[str, ...] = ()
    outputs: int = 0
    gradients: int = 0
    saved_eager: int = 0
    saved_graph: int = 0
    seconds: float = 0.0
    code_path: bool = False

    @property
    def faithful(self) -> bool:
        """Does the graph compute what the model computes (bitwise, or within the bound its notes give)?"""
        return self.mismatch is None

    def summary(self) -> str:
        if not self.faithful:
            return f"{self.method} graph differs from eager: {self.mismatch}"
        # not exact: within eager's own run-to-run spread, or within the bound of another code path (the notes say)
        how = "bitwise equal to eager" if self.exact else "equal to eager, not bitwise,"
        return (f"{self.method} graph {how} in {self.outputs} output(s) and {self.gradients} gradient(s); saves "
                f"{self.saved_graph} tensor(s) for backward (eager {self.saved_eager}); checked in {self.seconds:.2f} s"
                + "".join(f"; {note}" for note in self.notes))


@dataclass
class _Run:
    """One forward and backward: its tensors by what they are (``None``: no gradient), and what it saved."""

    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    saved: int = 0
    saved_requiring_grad: int = 0
    outputs: int = 0
    gradients: int = 0


class _Difference(Exception):
    def __init__(self, text: str, *, values_only: bool):
        super().__init__(text)
        self.values_only = values_only


def verify_capture(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict, *,
                   method: str) -> CaptureVerification:
    """Run ``model`` and ``gm`` forward and backward on ``(args, kwargs)`` and compare them (see the module doc).

    >>> import torch
    >>> from compfx.graph_capture import capture
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5)), torch.randn(2, 4)
    >>> result = verify_capture(model, capture(model, x), (x,), {}, method="symbolic")
    >>> result.faithful, result.exact, result.gradients, result.saved_graph == result.saved_eager
    (True, True, 2, True)
    """
    start = time.perf_counter()
    notes: list[str] = []
    with _state_kept(model, gm) as replay:
        try:
            eager = replay.run(model, args, kwargs)
        except _NoBackward as error:  # an inference-only model (an op without a derivative): forward only
            replay.backward = False
            notes.append(f"only the forward was compared: the model itself has no backward on these inputs "
                         f"({first_line(error.__cause__)})")
            eager = replay.run(model, args, kwargs)
        except Exception as error:  # noqa: BLE001 - the model's own failure: nothing to compare with
            raise BadInputError(
                f"{type(model).__name__} fails on the example inputs even without compfx ({first_line(error)}), when "
                "compfx runs it to check its capture. Give example inputs that forward() accepts (the shapes, dtypes "
                "and device of a real batch).") from error
        if replay.reassigned:  # the graph writes state in place: it cannot replay a reassignment
            return CaptureVerification(method, str(reassignment_error(replay.reassigned)), False,
                                       seconds=time.perf_counter() - start)
        try:
            graph = replay.run(gm, args, kwargs)
        except Exception as error:  # noqa: BLE001 - a graph that fails is unfaithful; say how
            return CaptureVerification(method, f"the graph fails on the example inputs with {first_line(error)}",
                                       False, seconds=time.perf_counter() - start)
        exact, code_path = True, False
        eager_again = functools.cache(lambda: replay.run(model, args, kwargs))
        # a second call shows state the graph keeps between calls in its forward: no backward needed, nor paid (with
        # grad on all the same: kernels may choose otherwise without it, as CPU attention does, by rounding)
        graph_again = functools.cache(lambda: replay.run(gm, args, kwargs, forward_only=True, again=True))
        difference = _difference(eager, graph)
        if difference is not None and not difference.values_only:
            return _result(method, str(difference), eager, graph, start)
        try:
            _same_on_a_second_call(graph, graph_again, eager, eager_again)
            # eager varying while the graph does not is a frozen draw, whatever the first runs showed: the first
            # eager run may draw what the trace drew (capture restores numpy's state), or not
            if difference is not None or replay.drew_outside_torch:
                _no_frozen_draw(eager, eager_again(), graph, graph_again())
        except _Difference as kept:
            return _result(method, str(kept), eager, graph, start)
        if difference is not None:
            try:
                notes.append(_within_eager_spread(eager, graph, eager_again(), difference))
            except _Difference as beyond:
                if method not in CODE_PATHS:
                    return _result(method, str(beyond), eager, graph, start)
                try:
                    notes.append(_within_compiled_path_bound(eager, graph, method))
                except _Difference as still:
                    return _result(method, str(still), eager, graph, start)
                code_path = True
            exact = False
    return _result(method, None, eager, graph, start, exact=exact, notes=tuple(notes), code_path=code_path)


def _difference(eager: _Run, graph: _Run) -> "_Difference | None":
    """The first difference of ``graph`` from ``eager`` (:func:`_compare`), or None."""
    try:
        _compare(eager, graph)
    except _Difference as difference:
        return difference
    return None


def _same_on_a_second_call(graph: _Run, graph_again, eager: _Run, eager_again) -> None:
    """Raise :class:`_Difference` when a second call of the graph, from the same state, differs from its first
    while eager's do not: the graph keeps state between calls that the model does not, e.g. a tensor ``forward``
    makes afresh each call (``torch.zeros(n, d).index_add_(...)``) that became one constant of the graph, written in
    place by every call."""
    try:
        again = graph_again()
    except Exception as error:  # noqa: BLE001 - a graph that fails the second time is unfaithful; say how
        raise _Difference(f"the graph fails on its second call with {first_line(error)}, where the model does not "
                          f"({_KEEPS_STATE})", values_only=False) from None
    try:
        _compare(_forward_part(graph), again)
    except _Difference as difference:
        if not _forward_spread(eager, eager_again()):
            raise _Difference(f"a second call of the graph gives other results than its first, where the model's "
                              f"do not ({_KEEPS_STATE}): {difference}", values_only=False) from None


def _forward_part(run: _Run) -> _Run:
    """``run``'s outputs and buffers: what a forward-only run (``forward_only=True``) holds."""
    return _Run({name: t for name, t in run.tensors.items() if not name.startswith("gradient of ")},
                saved=run.saved, saved_requiring_grad=run.saved_requiring_grad)


_KEEPS_STATE = ("it keeps state between calls, such as a tensor forward() creates afresh each call, which the graph "
                "holds as one constant that every call writes in place")


def _no_frozen_draw(eager: _Run, eager_again: _Run, graph: _Run, graph_again: _Run) -> None:
    """Raise :class:`_Difference` when eager varies from call to call but the graph does not: the graph froze a
    value the model draws anew each call outside torch's RNG (``numpy.random``, ``random``), and would train on
    that one draw for ever."""
    if not _forward_spread(eager, eager_again) or _spread(_forward_part(graph), graph_again):
        return
    raise _Difference("eager gives other results on each call from the same torch RNG state, but the graph gives the "
                      "same every call: forward() draws something outside torch's random generator (numpy.random, "
                      "Python's random) that the graph froze at capture; draw it with torch (torch.rand, "
                      "torch.randint), or pass it in as an input", values_only=False)


def _within_eager_spread(eager: _Run, graph: _Run, again: _Run, difference: _Difference) -> str:
    """The graph differs from eager in values: if a second eager run differs too, compare within twice eager's own
    spread and return the note that says so; else (eager reproduces itself) raise ``difference``."""
    spread = _spread(eager, again)
    if not spread:
        raise difference
    try:
        _compare(eager, graph, atol={name: 2 * value for name, value in spread.items()})
    except _Difference as beyond:
        raise _Difference(f"{beyond} (beyond eager's own run-to-run difference)", values_only=True) from None
    worst = max(spread, key=spread.get)
    return (f"eager does not reproduce itself (two eager runs differ in {len(spread)} tensor(s), most in {worst}, by "
            f"{spread[worst]:.3g}), so the graph was compared within twice that spread, not bitwise")


#: The tracers whose graph holds a code path the model may write differently from its eager code, and what that
#: path is: dynamo runs the model as torch.compile does; the recording tracer runs it on FakeTensors, which
#: transformers' ``is_tracing`` reads as tracing.
CODE_PATHS = {
    "dynamo": "the dynamo graph follows the model's torch.compile code path",
    "record": ("the recorded graph follows the code path the model takes on FakeTensors (transformers reads them as "
               "tracing: it builds the attention mask that eager leaves to SDPA's is_causal)"),
}


def _within_compiled_path_bound(eager: _Run, graph: _Run, method: str) -> str:
    """A dynamo graph holds the code the model runs under ``torch.compile``, and a recorded one the code it runs on
    FakeTensors, which some models choose to differ from their eager code (transformers: an attention mask built
    instead of SDPA's ``is_causal``, grouped-query attention through ``repeat_kv``, mixture-of-experts through
    ``grouped_mm_fallback``): the same math in another order. Compare it within :data:`COMPILED_PATH_BOUND` of each
    tensor's largest magnitude, and return the note that says how far it was; raise :class:`_Difference` beyond."""
    worst_name, worst = "", 0.0
    for name, expected in eager.tensors.items():
        actual = graph.tensors[name]
        if expected is None or not (expected.is_floating_point() or expected.is_complex()) or not expected.numel():
            continue
        scale = float(expected.detach().abs().max())
        relative = float((actual.detach() - expected.detach()).abs().max()) / scale if scale else 0.0
        if relative > COMPILED_PATH_BOUND or relative != relative:
            raise _Difference(f"{name} differs from eager's by {relative:.3g} of its largest magnitude, beyond the "
                              f"{COMPILED_PATH_BOUND:g} a graph of another code path of the model may differ by",
                              values_only=True)
        if relative > worst:
            worst_name, worst = name, relative
    return (f"{CODE_PATHS[method]}, which differs from its eager code: "
            f"equal to eager within {worst:.2g} of each tensor's largest magnitude (most in {worst_name}; bound "
            f"{COMPILED_PATH_BOUND:g}), not bitwise")


class _NoBackward(Exception):
    """The eager model's backward fails (an op without a derivative): compare forwards only."""


def _result(method, mismatch, eager: _Run, graph: _Run, start: float, *, exact: bool = False,
            notes: tuple = (), code_path: bool = False) -> CaptureVerification:
    return CaptureVerification(method, mismatch, exact and mismatch is None, notes, eager.outputs, eager.gradients,
                               eager.saved, graph.saved, time.perf_counter() - start, code_path)


# -- comparing two runs ---------------------------------------------------------------------------

def _compare(eager: _Run, graph: _Run, atol: dict[str, float] | None = None) -> None:
    """Raise :class:`_Difference` naming the first thing ``graph`` does differently from ``eager``."""
    atol = atol or {}
    missing = [name for name in eager.tensors if name not in graph.tensors]
    extra = [name for name in graph.tensors if name not in eager.tensors]
    if missing or extra:
        raise _Difference(f"the graph returns {', '.join(extra) or 'nothing'} where eager returns "
                          f"{', '.join(missing) or 'nothing'}", values_only=False)
    for name, expected in eager.tensors.items():
        actual = graph.tensors[name]
        if (expected is None) != (actual is None):
            raise _Difference(_none_difference(name, graph_has=actual is not None), values_only=False)
        if name in eager.requires_grad and eager.requires_grad[name] != graph.requires_grad[name]:
            raise _Difference(f"{name} {'requires' if graph.requires_grad[name] else 'does not require'} grad in the "
                              f"graph, but {'does' if eager.requires_grad[name] else 'does not'} in eager",
                              values_only=False)
        if expected is None:
            continue
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            raise _Difference(f"{name} is {actual.dtype} {tuple(actual.shape)} in the graph, {expected.dtype} "
                              f"{tuple(expected.shape)} in eager", values_only=False)
        try:
            torch.testing.assert_close(actual, expected, rtol=0, atol=atol.get(name, 0.0), equal_nan=True)
        except AssertionError as error:
            details = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
            raise _Difference(f"{name} differs from eager's: {'; '.join(details[:2])}", values_only=True) from None
    if graph.saved_requiring_grad > eager.saved_requiring_grad + SAVED_TENSOR_SLACK:
        raise _Difference(f"the graph saves {graph.saved_requiring_grad} tensors that require grad for backward where "
                          f"eager saves {eager.saved_requiring_grad} (a region eager recomputes, such as "
                          "torch.utils.checkpoint's, is not recomputed by the graph)", values_only=False)


def _none_difference(name: str, *, graph_has: bool) -> str:
    if name.startswith("gradient of parameter"):
        parameter = name[len("gradient of parameter "):]
        return (f"parameter {parameter} gets a gradient from the graph but none in eager" if graph_has else
                f"parameter {parameter} gets no gradient from the graph, but eager gives it one (the graph "
                "does not carry autograd through some op upstream of it)")
    return f"{name} is {'set' if graph_has else 'missing'} in the graph but {'missing' if graph_has else 'set'} in eager"


def _forward_spread(first: _Run, second: _Run) -> dict[str, float]:
    """:func:`_spread` of the two runs' outputs and buffers alone. The graph's second call runs forward only, so
    this is what it is compared with: a backward that varies run to run (CUDA's atomic adds, in attention's and an
    embedding's gradients) is no sign of state kept between calls, nor of a frozen draw."""
    return _spread(_forward_part(first), _forward_part(second))


def _spread(first: _Run, second: _Run) -> dict[str, float]:
    """Largest absolute difference per tensor between two runs of the same model, where they differ at all."""
    spread = {}
    for name, a in first.tensors.items():
        b = second.tensors.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
            continue
        if not torch.equal(a, b):
            difference = (a.double() - b.double()).abs().nan_to_num(nan=0.0, posinf=0.0)
            spread[name] = float(difference.max()) if difference.numel() else 0.0
    return spread


# -- running one side, leaving the caller's state alone -------------------------------------------

class _Replay:
    """Runs the model or the graph forward and backward (if ``backward``) from the same starting state each time."""

    backward = True

    def __init__(self, model: nn.Module, rng: RngState, buffers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model = model
        self.reassigned: list[str] = []  # parameters and buffers a run of the model reassigned (then put back)
        self.drew_outside_torch = False  # did a run of the model draw from Python's or numpy's generator?
        self.graph_private: frozenset[int] = frozenset()  # ids of the graph's tensors the model does not hold
        self.private_storages: frozenset[int] = frozenset()  # and their storages' data pointers
        self._slots = state_slots(model)
        self.parameters = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self._rng = rng
        self._buffer_values = buffers

    def run(self, fn, args: tuple, kwargs: dict, *, forward_only: bool = False, again: bool = False) -> _Run:
        """``fn`` forward and backward (``forward_only``: no backward, outputs and buffers only), from the
        caller's state; ``again``: the graph's own tensors (constants a tracer made) as its last call left them."""
        self._reset(keep=self.graph_private if again else frozenset())
        args, kwargs = _fresh_inputs((args, kwargs))
        result = _Run()
        counted = [0, 0]

        def pack(tensor):
            counted[0] += 1
            counted[1] += tensor.requires_grad
            return tensor.detach()  # not the tensor: an output saved by its own grad_fn would leak the graph

        outside = outside_torch_states() if fn is self.model else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = fn(*args, **kwargs)
        finally:
            self.reassigned.extend(slots_put_back(self._slots))
        if outside is not None:
            self.drew_outside_torch |= not same_states(outside, outside_torch_states())
        result.saved, result.saved_requiring_grad = counted
        outputs = _output_tensors(output)
        if forward_only:
            result.tensors = {f"output{name}": self._kept(tensor) for name, tensor in outputs.items()}
            result.tensors.update(self._buffers_now())
            return result
        roots = [(name, t) for name, t in outputs.items() if t.requires_grad] if self.backward else []
        if roots and fn is not self.model:
            torch.autograd.backward([t for _, t in roots], [_probe(t, i) for i, (_, t) in enumerate(roots)])
        elif roots:
            try:
                torch.autograd.backward([t for _, t in roots], [_probe(t, i) for i, (_, t) in enumerate(roots)])
            except Exception as error:  # noqa: BLE001 - the model's own: its backward is not ours to judge
                raise _NoBackward() from error
        for name, tensor in outputs.items():
            result.tensors[f"output{name}"] = self._kept(tensor)
            result.requires_grad[f"output{name}"] = tensor.requires_grad
        for name, parameter in self.parameters.items():
            result.tensors[f"gradient of parameter {name!r}"] = parameter.grad
            parameter.grad = None
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                result.tensors[f"gradient of input{pytree.keystr(path)}"] = leaf.grad
        result.tensors.update(self._buffers_now())
        result.outputs, result.gradients = len(outputs), len(self.parameters) if self.backward else 0
        return result

    def _kept(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` as this run left it: a copy where it is (a view of) a graph's own tensor, which a later call
        writes (``torch.zeros(n, d).index_add_(...)`` returns the constant itself)."""
        output = output.detach()
        return output.clone() if output.untyped_storage().data_ptr() in self.private_storages else output

    def _buffers_now(self) -> dict[str, torch.Tensor]:
        return {f"buffer {name!r} after the step": buffer.detach().clone() for name, buffer in self.buffers.items()}

    def _reset(self, keep: frozenset = frozenset()) -> None:
        """The state the caller left: buffers (but those whose id is in ``keep``), RNG, no gradients."""
        restore_values(self._buffer_values, keep=keep)
        self._rng.restore()
        for parameter in self.parameters.values():
            parameter.grad = None


def _model_tensor_ids(model: nn.Module) -> set[int]:
    """Every tensor the model holds: parameters, buffers and plain tensor attributes (which a recorded graph shares
    as constants)."""
    return {id(value) for module in model.modules()
            for value in (*module._parameters.values(), *module._buffers.values(), *module.__dict__.values())
            if isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def _state_kept(model: nn.Module, gm: fx.GraphModule):
    """A :class:`_Replay`; afterwards every gradient, ``requires_grad``, mode, buffer, written parameter, the RNG,
    grad mode and the deterministic-algorithms setting are as before."""
    parameters = list(dict.fromkeys(model.parameters()))
    grads = [(p, p.grad, p.requires_grad) for p in parameters]
    modes = [(m, m.training) for m in (*model.modules(), *gm.modules())]
    tensors = list({id(t): t for t in (*model.buffers(), *gm.buffers(), *_written_parameters(gm))}.values())
    saved = saved_values(tensors)
    devices = {t.device for t in (*parameters, *tensors)}
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with torch_rng_preserved(*devices), torch.inference_mode(False), torch.enable_grad(), _warnings_quiet():
            # CUDA kernels with atomics (index_add, scatter_add) vary run to run; CPU ones do not
            if any(d.type == "cuda" for d in devices):
                torch.use_deterministic_algorithms(True, warn_only=True)
            replay = _Replay(model, RngState.now(*devices), saved)
            private = [t for t in gm.buffers() if id(t) not in _model_tensor_ids(model)]
            replay.graph_private = frozenset(map(id, private))
            replay.private_storages = frozenset(t.untyped_storage().data_ptr() for t in private)
            yield replay
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        restore_values(saved)
        for parameter, grad, requires_grad in grads:
            parameter.grad = grad
            parameter.requires_grad_(requires_grad)
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _warnings_quiet():
    """Deterministic mode warns about every op without a deterministic kernel, and the two runs repeat the model's
    own warnings: neither is news to the user."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _written_parameters(gm: fx.GraphModule) -> list[torch.Tensor]:
    """Parameters the graph updates in place (``self.w.add_(...)``, an embedding's ``max_norm``): put back after
    the check."""
    written = []
    for node in gm.graph.nodes:
        targets = []
        if node.op in ("call_function", "call_method") and writes_input(node) and node.args:
            targets.append(node.args[0])
        weight = renormed_weight(node)
        if weight is not None:
            targets.append(weight)
        for target in targets:
            if isinstance(target, fx.Node) and target.op == "get_attr":
                value = get_attribute(gm, target.target)
                if isinstance(value, nn.Parameter):
                    written.append(value)
    return written


def _fresh_inputs(inputs):
    """A copy of every input tensor (a forward may write its inputs), a leaf that requires grad where it did, and of
    every KV cache (a decoder block writes its keys into it: :func:`~compfx.graph_capture.record.with_kv_caches_copied`)."""
    def fresh(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        copy = leaf.detach().clone()
        return copy.requires_grad_(leaf.requires_grad) if copy.is_floating_point() or copy.is_complex() else copy
    return pytree.tree_map(fresh, with_kv_caches_copied(inputs))


def _output_tensors(output) -> dict[str, torch.Tensor]:
    """The output's tensors by path (a Hugging Face KV cache is no output: the graph returns None there)."""
    output = pytree.tree_map(lambda leaf: None if is_kv_cache(leaf) else leaf, output)
    return {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(output)[0]
            if isinstance(leaf, torch.Tensor)}


def _probe(output: torch.Tensor, index: int) -> torch.Tensor:
    """The gradient backward starts from at the ``index``-th output: random, and the same in every run."""
    generator = torch.Generator(device=output.device).manual_seed(index)
    return torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
