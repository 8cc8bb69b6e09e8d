"""Fair sampling: every search sample trains from the same state with the same step.

Each sample starts from one model + optimizer state, re-seeds the RNG (so
dropout masks and a shuffling ``DataLoader`` repeat), walks the loader in the
same order and runs the same training step. When it ends -- finished, pruned,
failed or interrupted -- the state is restored **in place**: values are
``copy_``-ed back into the very Parameter, buffer and optimizer-state tensors
that existed before, so the user's optimizer and any references they hold stay
valid.

How a batch maps to the model (:func:`split_batch`):

* a ``dict``: every entry is a keyword argument (Hugging Face style, labels included);
* a ``tuple`` / ``list``: all items but the last are positional inputs, the
  last is the target (a 1-item tuple is inputs only);
* a ``Tensor``: the only positional input.

``loss_fn(output, batch)`` receives the model output and the whole batch (on
the device); without one, the model's own loss is used (``output.loss`` or
``output["loss"]``).

Non-finite values: a step whose loss is NaN/inf takes no backward or optimizer
step (the sample is then pruned or rejected by the search). A step whose loss
is finite but whose gradients are not raises :class:`NonFiniteGradientError`
before the optimizer steps, so the sample ends as ``"error"`` and its plan can
never be accepted. With a ``GradScaler`` the scaler owns that case, as in
ordinary AMP training: it skips the optimizer step and lowers the scale, and
the plan is judged by its epoch loss like any other.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import BadInputError, CompfxError, NonFiniteGradientError
from ..measure import Timing, time_interleaved, time_repeats, timed

__all__ = ["split_batch", "move_batch", "model_loss", "check_loss", "check_first_batch", "cuda_devices", "seed_device",
           "call_quietly", "StateSnapshot", "snapshot_state", "restore_state", "FairSampler"]

LossFn = Callable[[Any, Any], torch.Tensor]


# -- batches and losses -----------------------------------------------------------

def split_batch(batch) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)`` (see the module docstring).

    >>> import torch
    >>> args, kwargs = split_batch((torch.zeros(2, 3), torch.zeros(2)))
    >>> len(args), kwargs
    (1, {})
    """
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise BadInputError("the loader yielded an empty batch; expected (inputs..., target) or a dict")
        return (tuple(batch[:-1]) if len(batch) > 1 else tuple(batch)), {}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    raise BadInputError(f"the loader yielded a {type(batch).__name__}; compfx expected a tuple/list "
                        "(inputs..., target), a dict of keyword arguments, or a tensor.")


def move_batch(batch, device: torch.device):
    """The batch with every tensor on ``device`` (non-blocking where it can be)."""
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def model_loss(output, batch) -> torch.Tensor:
    """The default ``loss_fn``: the loss the model computed itself (``output.loss`` / ``output["loss"]``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise BadInputError(
            f"the model returned a {type(output).__name__} without a loss, and no loss_fn was given. Pass "
            "loss_fn=lambda output, batch: torch.nn.functional.cross_entropy(output, batch[-1]) (or your own "
            "loss), or give the model labels so that it returns .loss.")
    return loss


def check_loss(loss) -> torch.Tensor:
    """``loss`` itself when it is a one-element tensor; otherwise :class:`BadInputError`."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise BadInputError(f"loss_fn returned a {type(loss).__name__}{shape}; expected a scalar tensor. Reduce "
                            "the loss (e.g. .mean()) inside loss_fn.")
    return loss


def cuda_devices(device: torch.device) -> list[int]:
    """The CUDA device whose RNG ``torch.random.fork_rng`` must protect for work on ``device`` ([] off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def seed_device(seed: int, device: torch.device) -> None:
    """Seed the generators work on ``device`` draws from: the CPU's, and ``device``'s own when it is a GPU.

    Not ``torch.manual_seed``: it seeds every CUDA device, and, before CUDA is
    initialised, queues that seed for later, where ``torch.random.fork_rng``
    cannot undo it; a search on the CPU would then change the caller's CUDA RNG.

    >>> import torch
    >>> seed_device(3, torch.device("cpu")); a = torch.rand(1)
    >>> seed_device(3, torch.device("cpu")); torch.equal(a, torch.rand(1))
    True
    """
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)  # other accelerators (mps, xpu): their own seeding


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


def check_first_batch(model: nn.Module, batch, loss_fn: LossFn | None, device: torch.device) -> tuple[tuple, dict]:
    """Run ``model`` and ``loss_fn`` once on ``batch`` (no grad) to catch bad inputs before any search work.

    The model's parameters, buffers (e.g. BatchNorm statistics) and the RNG are
    put back afterwards, so the check changes nothing. Returns the batch's
    model inputs on ``device``, as ``(args, kwargs)``.

    >>> import torch
    >>> model = torch.nn.Linear(3, 2)
    >>> args, kwargs = check_first_batch(model, (torch.randn(4, 3), torch.randn(4, 2)),
    ...                                  lambda out, b: torch.nn.functional.mse_loss(out, b[-1]), torch.device("cpu"))
    >>> args[0].shape, kwargs
    (torch.Size([4, 3]), {})
    """
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        raise BadInputError(f"the model's parameters and buffers are spread over {sorted(map(str, devices))}; "
                            "compfx expected one device. Move the whole model there with model.to(device).")
    if any(d.type == "meta" for d in devices):
        raise BadInputError("the model's parameters or buffers are on the meta device (shapes, no values), but the "
                            "search trains it; materialise it first, e.g. model.to_empty(device='cpu') and load its "
                            "weights, then build the optimizer on model.parameters().")
    batch = move_batch(batch, device)
    args, kwargs = split_batch(batch)
    snapshot = snapshot_state(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices(device)):
            output = _user_call("the model", lambda: model(*args, **kwargs), batch)
            check_loss(_user_call("loss_fn", lambda: (loss_fn or model_loss)(output, batch), batch))
    finally:
        restore_state(snapshot)
    return args, kwargs


def _user_call(what: str, call: Callable[[], Any], batch):
    """``call()``, turning a failure into a :class:`BadInputError` that says which batch and why."""
    try:
        return call()
    except CompfxError:
        raise
    except Exception as error:
        first = (str(error).splitlines() or [""])[0][:300]
        raise BadInputError(
            f"{what} failed on the loader's first batch, in FP32 before any search ({type(error).__name__}: "
            f"{first}). The batch was {_describe(batch)}; expected one the model trains on "
            "(a tuple (inputs..., target), a dict of keyword arguments, or a tensor). Fix the loader, the "
            "model or loss_fn so that one FP32 training step runs.") from error


def _describe(batch) -> str:
    return str(pytree.tree_map(lambda t: f"Tensor{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor)
                               else type(t).__name__, batch))[:200]


# -- state snapshots ------------------------------------------------------------

@dataclass
class StateSnapshot:
    """Copies of a model's and optimizer's state, plus the live tensors to restore them into."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live parameter or buffer, saved copy)
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: list[tuple[torch.Tensor, dict | None]] = field(default_factory=list)  # (param, saved)
    param_groups: list[dict] = field(default_factory=list)

    def matches(self) -> bool:
        """True when the live state is bitwise equal to this snapshot."""
        if not all(_same(live, saved) for live, saved in self.tensors):
            return False
        if not all(_same(p.grad, g) for p, g in self.grads):
            return False
        if self.optimizer is None:
            return True
        for param, saved in self.optimizer_state:
            live = self.optimizer.state.get(param)
            if (saved is None) != (not live):
                return False
            if saved is not None and (saved.keys() != live.keys()
                                      or not all(_same(live[k], v) for k, (_, v) in saved.items())):
                return False
        return [_hyper(g) for g in self.optimizer.param_groups] == self.param_groups


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def snapshot_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateSnapshot:
    """Copy the parameters, gradients, buffers and optimizer state (and hyperparameters).

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> snapshot = snapshot_state(model)
    >>> with torch.no_grad(): _ = model.weight.add_(1)
    >>> restore_state(snapshot); snapshot.matches()
    True
    """
    params = list(model.parameters())
    tensors = [(t, t.detach().clone()) for t in (*params, *model.buffers())]
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params]
    snapshot = StateSnapshot(tensors, grads, optimizer)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                # keep the live tensor next to its copy, to restore into the same object
                saved = {k: (v, _clone(v)) for k, v in state.items()} if state else None
                snapshot.optimizer_state.append((param, saved))
        snapshot.param_groups = [copy.deepcopy(_hyper(g)) for g in optimizer.param_groups]
    return snapshot


@torch.no_grad()
def restore_state(snapshot: StateSnapshot) -> None:
    """Copy the snapshot back into the same tensors it was taken from (bitwise)."""
    for live, saved in snapshot.tensors:
        live.copy_(saved)
    for param, grad in snapshot.grads:
        if grad is None:
            param.grad = None
        elif param.grad is not None and param.grad.shape == grad.shape and param.grad.dtype == grad.dtype:
            param.grad.copy_(grad)
        else:
            param.grad = grad.clone()
    optimizer = snapshot.optimizer
    if optimizer is None:
        return
    for param, saved in snapshot.optimizer_state:
        if saved is None:
            optimizer.state.pop(param, None)  # the optimizer had not stepped yet: it starts lazily again
            continue
        restored = {}
        for key, (original, value) in saved.items():
            if isinstance(original, torch.Tensor):
                original.copy_(value)
                restored[key] = original
            else:
                restored[key] = copy.deepcopy(value)
        optimizer.state[param] = restored
    for group, hyper in zip(optimizer.param_groups, snapshot.param_groups):
        for key, value in hyper.items():
            if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = copy.deepcopy(value)


# -- the sampler -----------------------------------------------------------------

class FairSampler:
    """Runs training samples of any module that shares ``model``'s Parameters, all from one start.

    ``module`` is the plan-applied module (the search's: a :class:`compfx.apply.PlannedModule`); it shares
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

    def restore(self, snapshot: StateSnapshot | None = None) -> None:
        restore_state(snapshot or self.initial)

    @contextmanager
    def fresh_start(self, module: nn.Module):
        """Seed the RNG and switch to training mode; restore the initial state on the way out, whatever happens."""
        seed_device(self.seed, self.device)
        module.train()
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
        return torch.amp.GradScaler(self.device.type)  # a fresh one per sample: same starting scale for all

    def step(self, module: nn.Module, batch, scaler=None) -> float:
        """One training step: forward, loss, (scaled) backward, optimizer step. Returns the loss."""
        batch = move_batch(batch, self.device)
        args, kwargs = split_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = check_loss(self.loss_fn(call_quietly(module, args, kwargs), batch))
        value = float(loss.detach().float())
        if not math.isfinite(value):
            return value  # this sample is over: the search stops it; do not push NaN into the weights
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            scaler.update()
        else:
            loss.backward()
            self._check_gradients()
            self.optimizer.step()
        return value

    def _check_gradients(self) -> None:
        # Without a scaler nothing else stops a NaN/inf gradient from reaching the
        # weights; a step that cannot be taken makes the plan unusable.
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=math.inf)):
            raise NonFiniteGradientError(
                "a gradient became NaN/inf under this plan (the loss was finite); the optimizer step was not taken "
                "and the plan is rejected. Keep the overflowing ops in FP32, or use grad_scaler=True.")

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
            for batch in self._cycled_batches(steps):
                self.step(module, batch, scaler)

    def epoch(self, module: nn.Module, warmup: int = 0) -> Generator[tuple[float, float], None, StateSnapshot]:
        """Train one epoch (after ``warmup`` untimed steps); yield ``(loss, seconds)`` per batch; return the state.

        Closing the generator early (pruning) restores the initial state, as does any exception.
        """
        self.warm_up(module, warmup)
        with self.fresh_start(module):
            scaler = self._scaler()
            for batch in self.loader:  # iterated after seeding: a shuffling loader repeats its order
                batch = self.ready(module, batch)
                loss, seconds = timed(lambda: self.step(module, batch, scaler), device=self.device)
                yield loss, seconds
            return snapshot_state(self.model, self.optimizer)

    def ready(self, module: nn.Module, batch):
        """The batch on the device, with ``module`` specialised to its input signature: what a timed step excludes.

        A module with a ``specialize(args, kwargs)`` method
        (:class:`compfx.apply.PlannedModule`) builds its graph for a new
        signature (a ragged last batch, another sequence length) here, not
        inside the step being timed; every plan then pays it outside its
        measurements. The copy to the device is outside too, the same for every plan.
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
            batches.extend(islice(self.loader, count - len(batches)))
            if len(batches) == before:
                raise BadInputError("the sample loader yielded no batches; expected at least one")
        return batches

    def step_time(self, module: nn.Module, *, warmup: int, repeats: int) -> Timing:
        """Median time of a training step, on the loader's first batches, from the initial state."""
        with self.fresh_start(module):
            batches = [self.ready(module, batch) for batch in self._cycled_batches(warmup + repeats)]
            scaler = self._scaler()
            return time_repeats(lambda i: self.step(module, batches[i], scaler),
                                warmup=warmup, repeats=repeats, device=self.device)

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
                module.train()
                if switch is not None:
                    switch(j)
                ready.append([self.ready(module, batch) for batch in batches])
            scalers = [self._scaler() for _ in modules]
            steps = [lambda i, j=j: self.step(modules[j], ready[j][i], scalers[j]) for j in range(len(modules))]
            return time_interleaved(steps, rounds=rounds, warmup=warmup, device=self.device, before=switch)

    def first_inputs(self, module: nn.Module) -> tuple[tuple, dict]:
        """The model inputs of the loader's first batch, on the device, ``module`` specialised to them."""
        return split_batch(self.ready(module, self._cycled_batches(1)[0]))

    def mean_loss(self, module: nn.Module, batches: int) -> float:
        """Mean training loss over the loader's first ``batches`` batches, from the initial state."""
        with self.fresh_start(module):
            scaler = self._scaler()
            losses = [self.step(module, batch, scaler) for batch in islice(self.loader, batches)]
        if not losses:
            raise BadInputError("the sample loader yielded no batches; expected at least one")
        return sum(losses) / len(losses)
