"""Fair sampling: every search sample trains from the same state with the same step.

Each sample starts from one model + optimizer state, re-seeds the RNG (so
dropout masks and a shuffling ``DataLoader`` repeat, one shuffling with its own
``generator=`` too), walks the loader in the
same order and runs the same training step. When it ends -- finished, pruned,
failed or interrupted -- the state is restored **in place**: values are
``copy_``-ed back into the very Parameter, buffer and optimizer-state tensors
that existed before (:func:`compfx.state.restore_state`), so the user's
optimizer and any references they hold stay valid.

What a batch is, how it reaches the model and what the loss is are
:mod:`compfx.batches`'; the state snapshots and the RNG are :mod:`compfx.state`'s.
This module walks the loader, takes the steps and keeps every sample fair.

The loader is the user's: an exception it raises (a missing file, a lost
connection) is not a plan's failure. It reaches the caller as itself, after the
model, optimizer and RNG are restored (:func:`from_loader` tells the search's
failure handling to let it through), never logged as a failing plan. An epoch
is bounded: it takes at most ``len(loader)`` batches, or, from a loader without
a length (an ``IterableDataset`` stream, which may never end),
:data:`MAX_EPOCH_BATCHES`, with a warning when it reaches them.

No host-device synchronisation inside a timed step: reading the loss as a
Python number, or testing the gradients for NaN, makes the host wait for the
device and drains the launch queue, which hides the differences between plans
on launch-bound models. The timed step is the training step alone
(:meth:`FairSampler.timed_step`): the gradients are tested after it, untimed,
as a user's loop does not test them; the loss and the test stay on the
device, and :func:`read_steps` reads them once the step (or a window of steps)
has been timed, with one copy. (A ``GradScaler``'s own ``step`` reads whether
it found inf, as in any AMP training loop.)

Non-finite values are judged when read: a step whose loss is NaN/inf ends the
sample (the search prunes or rejects it); a step whose loss is finite but whose
gradients are not raises :class:`NonFiniteGradientError`, so the sample ends
as ``"error"`` and its plan can never be accepted. The step itself was taken
(deciding not to take it would mean reading on the device's time); the
sample's end restores the state as always. With a ``GradScaler`` the scaler
owns non-finite gradients, as in ordinary AMP training: it skips the optimizer
step and lowers the scale, and the plan is judged by its epoch loss like any
other. Every sample's scaler starts from one scale, calibrated once before the
samples (:meth:`FairSampler.calibrate_scale`), not from ``GradScaler``'s 65536,
at which fp16 samples would skip their first steps (timing faster, training less).
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager
from typing import Callable, Generator, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..batches import LossFn, check_loss, copied_batch, model_loss, move_batch, split_batch
from ..errors import BadInputError, NonFiniteGradientError
from ..measure import Timing, time_interleaved, time_repeats, timed
from ..state import (HeldState, LiveState, StateSnapshot, dense_values, loader_generators, restore_generators,
                     restore_state, saved_generators, seed_device, snapshot_state)

__all__ = ["training_mode", "call_quietly", "FairSampler", "MAX_EPOCH_BATCHES", "loader_batches", "from_loader",
           "epoch_limit", "read_steps", "CALIBRATION_STEPS"]

#: At most this many steps find the loss scale (each skipped step halves it: 2**16 down to 2**-8).
CALIBRATION_STEPS = 24

#: Most batches one epoch takes from a loader without ``len()``: it may be an endless stream, and every Stage-1
#: sample walks one epoch of it.
MAX_EPOCH_BATCHES = 1000

_FROM_LOADER = "_compfx_raised_by_loader"


# -- walking the loader -----------------------------------------------------------

def from_loader(error: BaseException) -> bool:
    """Whether ``error`` was raised by the sample loader itself (so it is no plan's failure)."""
    return getattr(error, _FROM_LOADER, False) is True


def _loader_failed(error: Exception) -> Exception:
    try:
        setattr(error, _FROM_LOADER, True)
    except AttributeError:  # an exception type without a __dict__: wrap it
        wrapped = RuntimeError(f"{type(error).__name__}: {error}")
        setattr(wrapped, _FROM_LOADER, True)
        wrapped.__cause__ = error
        error = wrapped
    if hasattr(error, "add_note") and not getattr(error, "_compfx_noted", False):
        error.add_note("(raised by the sample loader while compfx walked it; compfx restored the model, optimizer "
                       "and RNG before passing it on)")
        error._compfx_noted = True
    return error


def loader_batches(loader: Iterable, limit: int) -> Iterator:
    """At most ``limit`` batches of ``loader``; what the loader raises reaches the caller as itself (marked,
    :func:`from_loader`), and a loader whose ``__iter__`` raises StopIteration is a :class:`BadInputError`.

    >>> list(loader_batches(range(10), 3))
    [0, 1, 2]
    """
    try:
        iterator = iter(loader)
    except StopIteration as error:  # a protocol error, not "empty": an empty loader's iterator raises it from next()
        raise BadInputError(f"the sample loader's __iter__ raised StopIteration; expected it to return an iterator "
                            f"(a {type(loader).__name__} whose __iter__ returns iter(batches), or a generator).") \
            from error
    except Exception as error:
        raise _loader_failed(error)
    for _ in range(limit):
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as error:
            raise _loader_failed(error)
        yield batch


def epoch_limit(loader: Iterable) -> int | None:
    """``len(loader)`` when the loader has a length, else None (then :data:`MAX_EPOCH_BATCHES` bounds an epoch)."""
    try:
        length = len(loader)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - no __len__, or an IterableDataset's DataLoader refusing it
        return None
    return length if isinstance(length, int) and length >= 0 else None


# -- a step's inputs and mode ------------------------------------------------------

def training_mode(module: nn.Module) -> None:
    """Training mode for a sample; a module in training mode already keeps each submodule's own mode (a BatchNorm
    frozen with ``.eval()`` for fine-tuning stays frozen, as in the user's own training)."""
    if not module.training:
        module.train()


def _versions(batch) -> list[int]:
    """Each tensor's version counter: it moves whenever the tensor (or a view of it) is written in place."""
    return [t._version for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def call_quietly(module: nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)``; for a GraphModule, without torch.fx printing a traceback to stderr on failure.

    torch.fx's ``GraphModule.__call__`` prints the generated code around a
    failing line before it re-raises. In the search a failure belongs to the
    plan and is logged as its reason, so calling ``nn.Module.__call__`` (the
    same hooks and forward, without that wrapper) keeps stderr quiet; the
    exception and its traceback are unchanged.
    """
    if isinstance(module, fx.GraphModule):
        return nn.Module.__call__(module, *args, **kwargs)
    return module(*args, **kwargs)


def _is_dtensor(value) -> bool:
    """Is ``value`` a DTensor (FSDP2's sharded gradients)? Asked without importing ``torch.distributed.tensor``
    (half a second, most of ``import compfx``'s own time) where nothing has: no DTensor exists until it is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


# -- the sampler -----------------------------------------------------------------

class FairSampler:
    """Runs training samples of any module that shares ``model``'s Parameters, all from one start.

    ``module`` is the plan-applied module (the search's: a :class:`compfx.planned_module.PlannedModule`); it shares
    the model's Parameter and buffer objects, so ``optimizer`` (built on ``model.parameters()``) trains it.

    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loader = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    >>> mse = lambda out, batch: torch.nn.functional.mse_loss(out, batch[-1])
    >>> sampler = FairSampler(model, opt, loader, mse, device="cpu", seed=0)
    >>> first = [loss for loss, _ in sampler.epoch(model)]
    >>> second = [loss for loss, _ in sampler.epoch(model)]
    >>> first == second and sampler.initial.matches()
    True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable,
                 loss_fn: LossFn | None, *, device: torch.device | str, seed: int = 0, grad_scaler: bool = False):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.loss_fn = loss_fn or model_loss
        self.device = torch.device(device)
        self.seed, self.grad_scaler = seed, grad_scaler
        self.initial = snapshot_state(model, optimizer)
        #: the loader's own generators (a DataLoader's seeded shuffle) and their states now: every epoch starts
        #: from these, so every sample walks the loader in one order, as seeding torch's does for an unseeded one
        self.loader_rng = saved_generators(loader_generators(loader))
        length = epoch_limit(loader)
        self.epoch_batches = length if length is not None else MAX_EPOCH_BATCHES  # what bounds an epoch
        self._bounded = length is None
        self._warned_bound = False
        #: the loss scale every sample's GradScaler starts from (GradScaler's default until calibrate_scale)
        self.scale, self.calibrated = 2.0 ** 16, False
        #: whether a step wrote its batch's tensors in place (None until the first step says): then every step
        #: gets copies of them, so that the loader's batches stay as they are and every plan trains on them
        self.inputs_written: bool | None = None

    def restore(self, snapshot: StateSnapshot | None = None) -> None:
        restore_state(snapshot or self.initial)

    def reseed(self) -> None:
        """Seed what a sample draws from: the device's generators (dropout, an unseeded shuffle) and the loader's
        own, back at their states when the sampler was made."""
        seed_device(self.seed, self.device)
        restore_generators(self.loader_rng)

    @contextmanager
    def fresh_start(self, module: nn.Module):
        """Seed the RNG and switch to training mode; restore the initial state on the way out, whatever happens."""
        self.reseed()
        training_mode(module)
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()  # let the next sample start with the memory this one held
            raise
        finally:
            self.restore()

    def _scaler(self):
        if not self.grad_scaler:
            return None
        # a fresh one per sample, all from the calibrated scale: same starting point for every plan
        return torch.amp.GradScaler(self.device.type, init_scale=self.scale)

    def calibrate_scale(self, module: nn.Module, max_steps: int = CALIBRATION_STEPS) -> float:
        """Find the loss scale every sample's ``GradScaler`` starts from; returns it (also in :attr:`scale`).

        ``module`` (the search passes its AMP plan) trains from the initial
        state with a GradScaler at its default scale, on the loader's first
        batches, until a step is not skipped (or ``max_steps``); the state is
        restored afterwards. A no-op without ``grad_scaler``.
        """
        if not self.grad_scaler:
            return self.scale
        scaler = torch.amp.GradScaler(self.device.type, init_scale=self.scale)
        with self.fresh_start(module):
            for batch in self._cycled_batches(max_steps):
                before = scaler.get_scale()
                self.train_step(module, self.ready(module, batch), scaler)
                if scaler.get_scale() >= before:  # not skipped: the scale held (it grows only every 2000 steps)
                    break
        self.scale = scaler.get_scale()
        self.calibrated = True
        return self.scale

    def train_step(self, module: nn.Module, batch, scaler=None) -> torch.Tensor:
        """One training step (forward, loss, (scaled) backward, optimizer step), with nothing read on the host.

        Returns ``[loss, gradients finite]`` as a device tensor, to read with
        :func:`read_steps` (without a scaler, the gradients are tested but not
        read: 1.0 when every gradient is finite; with one, the scaler judges
        them: NaN). To time a step, use :meth:`timed_step`, which leaves the
        test out of the seconds.
        """
        return self.step_record(self.step_only(module, batch, scaler), scaler)

    def timed_step(self, module: nn.Module, batch, scaler=None) -> tuple[torch.Tensor, float]:
        """:meth:`train_step` and the synchronised seconds of the step itself (the gradient test after it, untimed)."""
        loss, seconds = timed(lambda: self.step_only(module, batch, scaler), device=self.device)
        return self.step_record(loss, scaler), seconds

    def step_only(self, module: nn.Module, batch, scaler=None) -> torch.Tensor:
        """The training step a user's loop takes, and nothing more: the timed part of :meth:`train_step`. Returns
        the loss, on the device; pass it to :meth:`step_record` before the next step replaces the gradients."""
        batch = move_batch(batch, self.device)
        if self.inputs_written is not False:  # until the first step shows the model leaves its inputs alone
            batch = copied_batch(batch)
        versions = _versions(batch) if self.inputs_written is None else None
        args, kwargs = split_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = check_loss(self.loss_fn(call_quietly(module, args, kwargs), batch))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        if versions is not None:
            self.inputs_written = versions != _versions(batch)
        return loss

    def step_record(self, loss: torch.Tensor, scaler=None) -> torch.Tensor:
        """``[loss, gradients finite]`` of the step just taken (its gradients are still there), on the device."""
        # Without a scaler nothing else stops a NaN/inf gradient from reaching the weights: a step with one makes
        # the plan unusable (read_steps says so). The step has updated the weights, not the gradients.
        finite = (torch.full((), math.nan, device=loss.device) if scaler is not None
                  else self._gradients_finite(loss.device))
        return torch.stack([loss.detach().reshape(()).float(), finite])

    def step(self, module: nn.Module, batch, scaler=None) -> float:
        """:meth:`train_step`, read at once (see :func:`read_steps`): the loss, as a Python number.

        Reading waits for the device: time :meth:`train_step` and read after, as the sampler's own timings do.
        """
        return read_steps([self.train_step(module, batch, scaler)])[0]

    def _gradients_finite(self, device: torch.device) -> torch.Tensor:
        grads = [dense_values(p.grad) for group in self.optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return torch.ones((), device=device)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)
        if _is_dtensor(norm):  # FSDP2's sharded gradients: every rank judges the whole norm
            norm = norm.full_tensor()
        return torch.isfinite(norm).float().to(device)

    def warm_up(self, module: nn.Module, steps: int) -> None:
        """Untimed steps on the first batches, then the initial state again.

        A plan's first steps pay one-off costs (first kernel launches, allocator
        growth, lazy optimizer state) that later training does not; without a
        warm-up they would count against whichever plan runs first.
        """
        if steps <= 0:
            return
        with self.fresh_start(module):
            scaler = self._scaler()
            for batch in self._cycled_batches(steps):  # readied: a compiled module compiles there, not in the step
                self.train_step(module, self.ready(module, batch), scaler)  # nothing read: the epoch judges the plan

    def epoch(self, module: nn.Module, warmup: int = 0) -> Generator[tuple[float, float], None, StateSnapshot]:
        """Train one epoch (after ``warmup`` untimed steps); yield ``(loss, seconds)`` per batch; return the state.

        Closing the generator early (pruning) restores the initial state, as does any exception.
        """
        self.warm_up(module, warmup)
        with self.fresh_start(module):
            scaler = self._scaler()
            count = 0
            # iterated after seeding: a shuffling loader repeats its order
            for batch in loader_batches(self.loader, self.epoch_batches):
                batch = self.ready(module, batch)
                record, seconds = self.timed_step(module, batch, scaler)
                count += 1
                yield read_steps([record])[0], seconds  # read after the step's timing: the device is idle
            self._note_bound(count)
            return snapshot_state(self.model, self.optimizer)

    def _note_bound(self, count: int) -> None:
        """Warn (once) when an epoch of ``count`` batches stopped at the bound of a loader without a length."""
        if self._bounded and count == self.epoch_batches and not self._warned_bound:
            self._warned_bound = True
            warnings.warn(f"the sample loader has no len() and yielded {count} batches; an epoch of the search "
                          f"takes at most its first {MAX_EPOCH_BATCHES} (it may be endless). Pass a finite loader "
                          "(a list, or itertools.islice of it) to choose the epoch yourself.", UserWarning,
                          stacklevel=3)

    def epochs_taking_turns(self, modules: Sequence[nn.Module], *, warmup: int = 0,
                            switch: Callable[[int], object] | None = None) -> list[Generator]:
        """One :meth:`epoch` per module, their steps taking turns on the same batches; each module trains a copy of
        the state of its own, from the initial state.

        Each returned generator yields ``(loss, seconds)`` per batch and returns
        its module's final state, as :meth:`epoch` does; advance them in turns
        (the search runs them in the interleaved order,
        :func:`compfx.measure.interleaved_order`). Before its step a module's
        state (Parameters, buffers, gradients, optimizer state, RNG) is copied
        into the model's own tensors, the other's copied out (untimed), so each
        step runs on the memory an epoch alone uses. Closing one drops its copy;
        once all are closed the model holds the initial state again. The state
        copies cost one model's parameters, gradients, buffers and optimizer
        state per module after the first. ``switch(j)`` runs before each step
        of ``modules[j]`` (a model whose plan is switched in).

        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loader = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> mse = lambda out, batch: torch.nn.functional.mse_loss(out, batch[-1])
        >>> sampler = FairSampler(model, opt, loader, mse, device="cpu", seed=0)
        >>> alone = [loss for loss, _ in sampler.epoch(model)]
        >>> a, b = sampler.epochs_taking_turns([model, model])
        >>> turns = [(next(a)[0], next(b)[0]) for _ in range(3)]
        >>> [x for x, _ in turns] == alone == [y for _, y in turns], sampler.initial.matches()
        (True, False)
        >>> a.close(); b.close(); sampler.initial.matches()
        True
        """
        for j, module in enumerate(modules):
            if switch is not None:
                switch(j)
            self.warm_up(module, warmup)
        return _Turns(self, list(modules), switch).epochs()

    def ready(self, module: nn.Module, batch):
        """The batch on the device, with ``module`` specialised to its input signature: what a timed step excludes.

        A module with a ``specialize(args, kwargs)`` method
        (:class:`compfx.planned_module.PlannedModule`) builds its graph for a new
        signature (a ragged last batch, another sequence length) here, not
        inside the step being timed (a compiled program,
        :class:`compfx.search.compiled.CompiledRunner`, compiles there); every
        plan then pays it outside its measurements. The copy to the device is outside too, the same for every plan.
        """
        batch = move_batch(batch, self.device)
        specialize = getattr(module, "specialize", None)
        if specialize is not None:
            specialize(*split_batch(batch))
        return batch

    def _cycled_batches(self, count: int) -> list:
        batches = []
        while len(batches) < count:
            before = len(batches)
            batches.extend(loader_batches(self.loader, count - len(batches)))
            if len(batches) == before:
                raise BadInputError("the sample loader yielded no batches; expected at least one")
        return batches

    def step_time(self, module: nn.Module, *, warmup: int, repeats: int) -> Timing:
        """Median time of a training step, on the loader's first batches, from the initial state."""
        with self.fresh_start(module):
            batches = [self.ready(module, batch) for batch in self._cycled_batches(warmup + repeats)]
            scaler = self._scaler()
            records = []
            timing = time_repeats(lambda i: self.step_only(module, batches[i], scaler),
                                  warmup=warmup, repeats=repeats, device=self.device,
                                  after=lambda loss: records.append(self.step_record(loss, scaler)))
            read_steps(records)  # once, after the timed steps: a non-finite gradient fails the plan
            return timing

    def interleaved_step_times(self, modules: Sequence[nn.Module], *, rounds: int, warmup: int,
                               switch: Callable[[int], object] | None = None) -> list[list[float]]:
        """Seconds of one training step of each module per round, the modules taking turns on the same batches.

        From the initial state, with ``warmup`` untimed steps each first (see
        :func:`compfx.measure.time_interleaved`); round ``i`` gives every module
        the loader's batch ``warmup + i`` (cycled). The modules share the model's
        Parameters, so they train one state between them; the initial state is
        restored afterwards. ``switch(j)`` runs untimed before each step of
        ``modules[j]`` (a model whose plan is switched in, not a module per plan).
        """
        with self.fresh_start(modules[0]):
            batches = self._cycled_batches(warmup + rounds)
            ready = []
            for j, module in enumerate(modules):
                training_mode(module)
                if switch is not None:
                    switch(j)
                ready.append([self.ready(module, batch) for batch in batches])
            scalers = [self._scaler() for _ in modules]
            records = []  # read once, after the timed rounds: no host-device sync inside a timed step
            steps = [lambda i, j=j: self.step_only(modules[j], ready[j][i], scalers[j]) for j in range(len(modules))]
            seconds = time_interleaved(steps, rounds=rounds, warmup=warmup, device=self.device, before=switch,
                                       after=lambda j, loss: records.append(self.step_record(loss, scalers[j])))
            read_steps(records)  # a non-finite gradient fails the plans timed
            return seconds

    def first_inputs(self, module: nn.Module) -> tuple[tuple, dict]:
        """The model inputs of the loader's first batch, on the device, ``module`` specialised to them: copies,
        which the caller's forward may write."""
        return split_batch(copied_batch(self.ready(module, self._cycled_batches(1)[0])))

    def mean_loss(self, module: nn.Module, batches: int) -> float:
        """Mean training loss over the loader's first ``batches`` batches, from the initial state."""
        with self.fresh_start(module):
            scaler = self._scaler()
            losses = read_steps([self.train_step(module, self.ready(module, batch), scaler)
                                 for batch in loader_batches(self.loader, batches)])
        if not losses:
            raise BadInputError("the sample loader yielded no batches; expected at least one")
        return sum(losses) / len(losses)


class _Turns:
    """The modules of :meth:`FairSampler.epochs_taking_turns`: the model holds the state of the module whose turn it
    is; each other module's waits in a :class:`~compfx.state.HeldState`, exchanged with the model's by value when
    its turn comes."""

    def __init__(self, sampler: FairSampler, modules: list[nn.Module], switch: Callable[[int], object] | None):
        self.sampler, self.modules, self.switch = sampler, modules, switch
        sampler.reseed()
        for module in modules:
            training_mode(module)
        self.loader = loader_batches(sampler.loader, sampler.epoch_batches)
        self.fetched: list = []
        self._fetch(0)  # a shuffling loader draws its order now, after seeding, as in an epoch alone
        # the model holds the initial state now (every warm-up restored it): each other module starts from a copy
        self.state = LiveState.of(sampler.initial, sampler.device)
        self.live = 0
        self.held = {j: HeldState.copy_of(sampler.initial, sampler.device) for j in range(1, len(modules))}
        self.scalers = [sampler._scaler() for _ in modules]
        self.open = set(range(len(modules)))

    def epochs(self) -> list[Generator]:
        return [self._epoch(j) for j in range(len(self.modules))]

    def _fetch(self, index: int):
        """Batch ``index`` of the epoch (fetched once, for every module), or None past the epoch's end."""
        while len(self.fetched) <= index:
            batch = next(self.loader, None)
            if batch is None:
                return None
            self.fetched.append(batch)
        return self.fetched[index]

    def _turn_of(self, j: int) -> None:
        if j != self.live:
            held = self.held.pop(j)
            held.exchange(self.state)
            self.held[self.live] = held
            self.live = j
        if self.switch is not None:
            self.switch(j)

    def _epoch(self, j: int):
        sampler, module = self.sampler, self.modules[j]
        out_of_memory = False
        try:
            index = 0
            while True:
                self._turn_of(j)
                batch = self._fetch(index)
                if batch is None:
                    break
                batch = sampler.ready(module, batch)
                record, seconds = sampler.timed_step(module, batch, self.scalers[j])
                index += 1
                yield read_steps([record])[0], seconds
            if index == 0:
                return None
            sampler._note_bound(index)
            return snapshot_state(sampler.model, sampler.optimizer)
        except torch.cuda.OutOfMemoryError:
            out_of_memory = True
            raise
        finally:
            self._close(j)
            if out_of_memory:  # its copy is dropped: let the next steps start with the memory it held, as alone
                torch.cuda.empty_cache()

    def _close(self, j: int) -> None:
        self.open.discard(j)
        self.held.pop(j, None)  # its copy of the state is dropped
        if not self.open:
            self.held.clear()
            self.sampler.restore()


def read_steps(records) -> list[float]:
    """The losses of :meth:`FairSampler.train_step` records, read with one copy from the device.

    A step whose loss is finite but whose gradients were not raises
    :class:`NonFiniteGradientError`; a non-finite loss is returned as it is
    (the search ends that sample).

    >>> read_steps([torch.tensor([0.5, 1.0]), torch.tensor([float("inf"), 0.0])])
    [0.5, inf]
    >>> read_steps([torch.tensor([0.5, 0.0])])
    Traceback (most recent call last):
    ...
    compfx.errors.NonFiniteGradientError: a gradient became NaN/inf under this plan (the loss was finite), so the plan is rejected. Keep the overflowing ops in FP32, or use grad_scaler=True.
    """
    if not records:
        return []
    losses = []
    for loss, finite in torch.stack(list(records)).tolist():
        if math.isfinite(loss) and finite == 0.0:
            raise NonFiniteGradientError(
                "a gradient became NaN/inf under this plan (the loss was finite), so the plan is rejected. Keep the "
                "overflowing ops in FP32, or use grad_scaler=True.")
        losses.append(loss)
    return losses
