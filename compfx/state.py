"""What a run of the user's model can change, saved and put back: the random generators, the buffers, and the
model's and optimizer's training state. Every stage that runs the user's model saves and restores through here.

compfx runs the user's forward to capture it (:func:`compfx.analyze`), to
rewrite it (:func:`compfx.apply`), to diagnose it and to train samples
(:func:`compfx.optimize`). Nothing of the caller's may change through that:

* **Random generators.** A forward may draw random numbers (dropout) or even
  reseed (``torch.manual_seed`` inside ``forward``). :func:`rng_preserved` puts
  back every generator such a forward can reach: torch's CPU generator, the
  CUDA generators of the devices in use, the CUDA seeds torch queues while CUDA
  is not initialised yet (``torch.manual_seed`` queues one for every GPU, which
  ``torch.random.fork_rng`` cannot undo), Python's and NumPy's global
  generators, and the generators of a ``DataLoader`` given to it
  (:func:`loader_generators`: a seeded shuffle advances them as the loader is
  walked). :func:`torch_rng_preserved` puts back torch's generators alone, for
  work inside a call that already preserves the rest. :class:`RngState` is
  torch's generators' state at one moment, to run twice from it (the same
  dropout masks).
* **Buffers.** :func:`buffers_restored` puts back a model's buffers (BatchNorm
  statistics) after a forward that ran for real, and gives each parameter and
  buffer slot its own tensor back; :func:`saved_values` / :func:`restore_values`
  do the same for any tensors, by value, in place.
* **Training state.** :func:`snapshot_state` copies a model's and optimizer's
  state (parameters, gradients, buffers, optimizer state and hyperparameters);
  :func:`restore_state` copies it back **in place**, into the very tensors that
  existed before, so the user's optimizer and any references they hold stay
  valid. :class:`HeldState` holds a second state out of the model and exchanges
  it with the model's by value (plans taking turns on one model).

>>> import torch
>>> torch.manual_seed(0); before = torch.get_rng_state()  # doctest: +ELLIPSIS
<torch._C.Generator ...>
>>> with rng_preserved():
...     _ = torch.manual_seed(123), torch.rand(3)
>>> torch.equal(before, torch.get_rng_state())
True
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.nn as nn

__all__ = [
    # random generators
    "cuda_devices", "cuda_indices", "rng_preserved", "torch_rng_preserved", "RngState", "seed_device",
    "loader_generators", "saved_generators", "restore_generators", "outside_torch_states", "same_states",
    # buffers and other tensors, by value
    "saved_values", "restore_values", "buffers_restored", "state_slots", "slots_put_back",
    # a model's and optimizer's training state
    "StateSnapshot", "snapshot_state", "restore_state", "restore_grads", "state_bytes", "dense_values", "LiveState", "HeldState",
]


# -- random generators --------------------------------------------------------------------------

def cuda_devices(device: torch.device) -> list[int]:
    """The CUDA device whose generator work on ``device`` draws from ([] off CUDA).

    >>> cuda_devices(torch.device("cpu"))
    []
    """
    return cuda_indices([device])


def cuda_indices(devices: Iterable) -> list[int]:
    """The CUDA device indices among ``devices`` (``torch.device``, str or int), sorted; [] without CUDA.

    >>> cuda_indices(["cpu", torch.device("cpu")])
    []
    """
    if not torch.cuda.is_available():
        return []
    indices = set()
    for device in devices:
        device = torch.device(device)
        if device.type == "cuda":
            indices.add(device.index if device.index is not None else torch.cuda.current_device())
    return sorted(indices)


def _cuda_indices_in_use(devices: Iterable) -> list[int]:
    """:func:`cuda_indices`, plus the current CUDA device once CUDA runs (work may land there unasked)."""
    indices = set(cuda_indices(devices))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        indices.add(torch.cuda.current_device())
    return sorted(indices)


@contextlib.contextmanager
def torch_rng_preserved(*devices) -> Iterator[None]:
    """Run the body; afterwards torch's CPU generator and the CUDA generators of ``devices`` are as they were.

    For work inside compfx's own calls, which :func:`rng_preserved` already
    wraps where the caller's other generators are at stake.

    >>> before = torch.get_rng_state()
    >>> with torch_rng_preserved("cpu"):
    ...     _ = torch.rand(2)
    >>> torch.equal(before, torch.get_rng_state())
    True
    """
    with torch.random.fork_rng(devices=cuda_indices(devices)):
        yield


@dataclass(frozen=True)
class RngState:
    """The states of torch's CPU generator and of some CUDA devices' generators: what a run on them draws from.

    :meth:`now` reads them; :meth:`restore` sets them back, so that a second
    run draws what the first drew (the same dropout masks).

    >>> state = RngState.now("cpu")
    >>> first = torch.rand(2); state.restore()
    >>> torch.equal(first, torch.rand(2))
    True
    """

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...] = ()

    @classmethod
    def now(cls, *devices) -> "RngState":
        """The generators' states now: the CPU's and those of the CUDA devices among ``devices``."""
        return cls(torch.get_rng_state(), tuple((i, torch.cuda.get_rng_state(i)) for i in cuda_indices(devices)))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda:
            torch.cuda.set_rng_state(state, index)


def seed_device(seed: int, device: torch.device) -> None:
    """Seed the generators work on ``device`` draws from: the CPU's, and ``device``'s own when it is a GPU.

    Not ``torch.manual_seed``: it seeds every CUDA device, and, before CUDA is
    initialised, queues that seed for later, where ``torch.random.fork_rng``
    cannot undo it; a search on the CPU would then change the caller's CUDA RNG.

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


class _LazySeeds:
    """The seeds torch queued for CUDA devices before CUDA started (``torch.cuda._lazy_seed_tracker``)."""

    _FIELDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")

    def __init__(self):
        self.tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
        self.saved = None
        if self.tracker is not None and all(hasattr(self.tracker, f) for f in self._FIELDS):
            self.saved = {f: getattr(self.tracker, f) for f in self._FIELDS}
            self.saved["call_order"] = list(self.saved["call_order"])

    def restore(self) -> None:
        if self.saved is not None and not torch.cuda.is_initialized():  # once CUDA ran, the queue has been used
            for name, value in self.saved.items():
                setattr(self.tracker, name, value)


def loader_generators(loader) -> list[torch.Generator]:
    """The generators a DataLoader and its samplers own (``DataLoader(..., generator=g)``): a seeded shuffle draws
    its order from them, not from torch's global generator. [] for a loader that holds none (a list)."""
    found = []
    for holder in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                   getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def saved_generators(generators: Iterable[torch.Generator]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each generator with its state now, for :func:`restore_generators`."""
    return [(generator, generator.get_state()) for generator in generators]


def restore_generators(saved: Iterable[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in saved:
        generator.set_state(state)


@contextlib.contextmanager
def rng_preserved(*devices, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Run the body; afterwards every random generator it could reach is as it was (see the module docstring).

    ``devices`` are the devices the body's work runs on (their CUDA generators
    are saved; the current CUDA device's always is, once CUDA runs);
    ``generators`` are other generators it may advance (:func:`loader_generators`).
    """
    own = saved_generators(generators)
    outside = outside_torch_states()
    lazy = _LazySeeds()
    try:
        with torch.random.fork_rng(devices=_cuda_indices_in_use(devices)):
            yield
    finally:
        lazy.restore()
        restore_generators(own)
        _set_outside_torch_states(outside)


def outside_torch_states() -> tuple:
    """Python's global generator state, and NumPy's where NumPy is installed: the generators no graph draws from.

    >>> import random
    >>> before = outside_torch_states(); _ = random.random()
    >>> same_states(before, outside_torch_states())
    False
    """
    states = [random.getstate()]
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return tuple(states)
    return (*states, numpy.random.get_state())


def _set_outside_torch_states(states: tuple) -> None:
    random.setstate(states[0])
    if len(states) > 1:
        import numpy

        numpy.random.set_state(states[1])


def same_states(first, second) -> bool:
    """Are two :func:`outside_torch_states` equal (NumPy's key is an array, compared element by element)?"""
    if isinstance(first, tuple) and isinstance(second, tuple):
        return len(first) == len(second) and all(same_states(a, b) for a, b in zip(first, second))
    if hasattr(first, "shape"):
        return first.shape == second.shape and bool((first == second).all())
    return first == second


# -- buffers and other tensors, by value -----------------------------------------------------------

def saved_values(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor with a copy of its value now, for :func:`restore_values`."""
    return [(tensor, tensor.detach().clone()) for tensor in tensors]


@torch.no_grad()
def restore_values(saved: Iterable[tuple[torch.Tensor, torch.Tensor]], *, keep: frozenset[int] = frozenset()) -> None:
    """Copy each saved value back into its tensor, in place (the same object), but the tensors whose id is in
    ``keep``.

    >>> t = torch.zeros(2); saved = saved_values([t]); _ = t.add_(1)
    >>> restore_values(saved); t.tolist()
    [0.0, 0.0]
    """
    for tensor, value in saved:
        if id(tensor) not in keep:
            tensor.copy_(value)


@contextlib.contextmanager
def buffers_restored(model: nn.Module):
    """Put every buffer of ``model`` back afterwards (dynamo export, and any measuring forward, run it for real).

    Yields a list, filled on the way out with the names of the parameters and buffers that ``forward`` reassigned
    (``self.running = 0.9 * self.running + ...``): each slot gets its own tensor back as well as its value.

    >>> class Ema(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.register_buffer("mean", torch.zeros(2))
    ...     def forward(self, x):
    ...         self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
    ...         return x - self.mean
    >>> model = Ema(); mean = model.mean
    >>> with buffers_restored(model) as reassigned:
    ...     _ = model(torch.ones(3, 2))
    >>> reassigned, model.mean is mean, model.mean.tolist()
    (['mean'], True, [0.0, 0.0])
    """
    saved = saved_values(model.buffers())
    slots = state_slots(model)
    reassigned: list[str] = []
    try:
        yield reassigned
    finally:
        reassigned.extend(slots_put_back(slots))
        restore_values(saved)


def state_slots(model: nn.Module) -> list[tuple[str, dict, dict]]:
    """(module prefix, its parameter dict, a copy of it) and the same for buffers, for every module."""
    return [(prefix, tensors, dict(tensors)) for prefix, module in model.named_modules(remove_duplicate=False)
            for tensors in (module._parameters, module._buffers)]


def slots_put_back(slots) -> list[str]:
    """Give every parameter and buffer slot of :func:`state_slots` its tensor back; the names of those that
    held another."""
    names = []
    for prefix, tensors, before in slots:
        for name, value in list(tensors.items()):
            if name in before and value is not before[name]:
                tensors[name] = before[name]
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


# -- a model's and optimizer's training state -------------------------------------------------------

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


def dense_values(grad: torch.Tensor) -> torch.Tensor:
    """The values a gradient holds, as a dense tensor: a sparse gradient's (``nn.Embedding(sparse=True)``)
    stored values, summed where indices repeat, since norms and finiteness tests take no sparse tensor."""
    return grad.coalesce().values() if grad.is_sparse else grad


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def snapshot_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateSnapshot:
    """Copy the parameters, gradients, buffers and optimizer state (and hyperparameters).

    >>> model = torch.nn.Linear(2, 2)
    >>> snapshot = snapshot_state(model)
    >>> with torch.no_grad(): _ = model.weight.add_(1)
    >>> restore_state(snapshot); snapshot.matches()
    True
    """
    params = list(model.parameters())
    tensors = saved_values((*params, *model.buffers()))
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


def state_bytes(snapshot: StateSnapshot) -> int:
    """Bytes of the state a snapshot holds: parameters, buffers, gradients and the optimizer's tensors.

    >>> state_bytes(snapshot_state(torch.nn.Linear(2, 2)))  # 6 float32 values
    24
    """
    tensors = [saved for _, saved in snapshot.tensors] + [grad for _, grad in snapshot.grads]
    tensors += [value for _, saved in snapshot.optimizer_state if saved for _, value in saved.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@torch.no_grad()
def restore_state(snapshot: StateSnapshot) -> None:
    """Copy the snapshot back into the same tensors it was taken from (bitwise)."""
    restore_values(snapshot.tensors)
    restore_grads(snapshot)
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


@torch.no_grad()
def restore_grads(snapshot: StateSnapshot) -> None:
    """Give every parameter the gradient the snapshot holds: None where it had none, else the saved values.

    >>> model = torch.nn.Linear(2, 2)
    >>> snapshot = snapshot_state(model)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> restore_grads(snapshot); model.weight.grad is None
    True
    """
    for param, grad in snapshot.grads:
        if grad is None:
            param.grad = None
        elif param.grad is not None and param.grad.shape == grad.shape and param.grad.dtype == grad.dtype:
            param.grad.copy_(grad)
        else:
            param.grad = grad.clone()


@dataclass
class LiveState:
    """The model's and optimizer's tensors a snapshot restores (a buffer the model later replaces by another object
    is not followed, as in :func:`restore_state`), and the device whose generators a step on it draws from."""

    tensors: list[torch.Tensor]  # Parameters and buffers
    params: list[nn.Parameter]  # their gradients
    optimizer_params: list[torch.Tensor]  # the optimizer's state is keyed by them
    optimizer: torch.optim.Optimizer | None
    device: torch.device

    @classmethod
    def of(cls, snapshot: StateSnapshot, device: torch.device) -> "LiveState":
        return cls([live for live, _ in snapshot.tensors], [param for param, _ in snapshot.grads],
                   [param for param, _ in snapshot.optimizer_state], snapshot.optimizer, device)

    def optimizer_state(self, param) -> dict | None:
        return (self.optimizer.state.get(param) or None) if self.optimizer is not None else None


class HeldState:
    """A model's and optimizer's state held out of the model, and the RNG's, exchanged with the model's in place.

    Values are copied, not the model's tensors replaced: each plan's step then runs on the same memory as an epoch
    alone does (warm in the caches as it would be), and the user's Parameters, buffers and optimizer state keep
    their own storage throughout.

    >>> model = torch.nn.Linear(2, 1)
    >>> snapshot = snapshot_state(model)
    >>> held = HeldState.copy_of(snapshot, torch.device("cpu"))
    >>> with torch.no_grad(): _ = model.weight.add_(1)
    >>> held.exchange(LiveState.of(snapshot, torch.device("cpu"))); snapshot.matches()
    True
    """

    def __init__(self, tensors: list, grads: list, optimizer_state: list, rng: RngState):
        self.tensors, self.grads, self.optimizer_state, self.rng = tensors, grads, optimizer_state, rng

    @classmethod
    def copy_of(cls, snapshot: StateSnapshot, device: torch.device) -> "HeldState":
        """A copy of the state ``snapshot`` holds (it stays as it is), and the RNG's state now."""
        optimizer_state = [None if saved is None else {key: _clone(copy) for key, (_, copy) in saved.items()}
                           for _, saved in snapshot.optimizer_state]
        return cls([_clone(copy) for _, copy in snapshot.tensors],
                   [None if grad is None else _clone(grad) for _, grad in snapshot.grads], optimizer_state,
                   RngState.now(device))

    @torch.no_grad()
    def exchange(self, live: LiveState) -> None:
        """Put this state into the live tensors, and hold the state they had instead."""
        for tensor, held in zip(live.tensors, self.tensors):
            _exchange_values(tensor, held)
        for i, param in enumerate(live.params):
            param.grad, self.grads[i] = self.grads[i], param.grad  # set anew by every step: no copy needed
        for i, param in enumerate(live.optimizer_params):
            current, held = live.optimizer_state(param), self.optimizer_state[i]
            if current is not None and held is not None and _same_layout(current, held):
                for key in current:
                    if isinstance(current[key], torch.Tensor):
                        _exchange_values(current[key], held[key])
                    else:
                        current[key], held[key] = held[key], current[key]
                continue
            # one of them has no state yet (the optimizer creates it at its first step): the dicts change places
            if held is None:
                live.optimizer.state.pop(param, None)
            else:
                live.optimizer.state[param] = held
            self.optimizer_state[i] = current
        rng = RngState.now(live.device)
        self.rng.restore()
        self.rng = rng


def _exchange_values(live: torch.Tensor, held: torch.Tensor) -> None:
    kept = live.detach().clone()
    live.copy_(held)
    held.copy_(kept)


def _same_layout(a: dict, b: dict) -> bool:
    """Do two optimizer states hold the same keys, with tensors of the same shape and dtype?"""
    if a.keys() != b.keys():
        return False
    return all(isinstance(a[k], torch.Tensor) == isinstance(b[k], torch.Tensor)
               and (not isinstance(a[k], torch.Tensor) or (a[k].shape == b[k].shape and a[k].dtype == b[k].dtype))
               for k in a)
