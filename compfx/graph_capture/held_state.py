"""What a planned graph was built from, and whether the model still holds it.

A planned graph is built from the model's parameters, buffers and submodules
as they were at capture: :class:`~compfx.apply.PlannedModule`'s graphs hold
those tensors themselves, a :class:`~compfx.per_module.PlannedBlock`'s graphs
were captured at their shapes. A user who then replaces one
(``model.fc.weight = nn.Parameter(...)``, ``model.load_state_dict(sd,
assign=True)``, ``model.fc = nn.Linear(...)``) or moves the model
(``model.to("meta")``) would otherwise train tensors the model no longer holds,
without a word.

:class:`HeldState` records, by identity, every entry of every module's
``_parameters``, ``_buffers`` and ``_modules`` tables, and the device of the
first tensor (``.to(device)`` keeps a Parameter object and moves its data).
:meth:`HeldState.unchanged` compares them, one dictionary lookup per entry
(microseconds on a small model, at each call); only when something changed
does :meth:`HeldState.change` work out what (:class:`StateChange`), and the
planned module decides: the same tensors' places taken by tensors of the same
shape, dtype and device are followed as they are (the graphs read the new
ones); another shape, a replaced submodule or a move to another device is
captured again; the ``meta`` device, or tensors spread over several devices,
is refused (:func:`check_computable`).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 3))
>>> held = HeldState(model)
>>> held.unchanged()
True
>>> model[0].weight = torch.nn.Parameter(torch.zeros(3, 2))
>>> held.unchanged(), held.change().describe()
(False, 'the model holds other tensors at 0.weight')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..batches import model_devices
from ..errors import BadInputError

__all__ = ["HeldState", "StateChange", "check_computable"]


@dataclass(frozen=True)
class StateChange:
    """How a model's state differs from what a :class:`HeldState` recorded.

    ``swapped``: paths whose tensor was replaced by one of the same shape,
    dtype and device (the graphs can read the new one as they are);
    ``reshaped``: paths whose tensor is gone, or was replaced by one of another
    shape, dtype or device; ``modules``: submodules replaced or removed, each
    with what it was and is; ``devices``: the devices the model's tensors are
    on now, and ``was``: the one(s) they were on.
    """

    swapped: tuple[str, ...]
    reshaped: tuple[str, ...]
    modules: tuple[str, ...]
    devices: frozenset
    was: frozenset

    @property
    def same_layout(self) -> bool:
        """Only tensors replaced by their likes: the graphs stay right, reading the new tensors."""
        return not self.reshaped and not self.modules and self.devices == self.was

    @property
    def device(self) -> torch.device | None:
        """The one device the model's tensors are on now (None when none or several)."""
        return next(iter(self.devices)) if len(self.devices) == 1 else None

    def describe(self) -> str:
        """What changed, in a few words for a message."""
        parts = []
        if self.modules:
            parts.append(f"submodule(s) replaced: {_first(self.modules)}")
        if self.reshaped:
            parts.append(f"tensors replaced by ones of another shape, dtype or device, or removed: "
                         f"{_first(self.reshaped)}")
        if self.swapped:
            parts.append(f"the model holds other tensors at {_first(self.swapped)}")
        if self.devices != self.was:
            parts.append(f"its tensors moved from {_devices(self.was)} to {_devices(self.devices)}")
        return "; ".join(parts) or "nothing"


def _first(paths: tuple[str, ...], count: int = 3) -> str:
    return ", ".join(paths[:count]) + (f" and {len(paths) - count} more" if len(paths) > count else "")


def _devices(devices) -> str:
    return ", ".join(sorted(map(str, devices))) or "no device"


class HeldState:
    """The parameters, buffers and submodules of ``root`` now, by identity (see the module docstring)."""

    def __init__(self, root: nn.Module):
        entries, paths = [], []
        for prefix, module in root.named_modules():
            for table in (module._parameters, module._buffers, module._modules):
                for name, value in table.items():
                    entries.append((table, name, value))
                    paths.append(f"{prefix}.{name}" if prefix else name)
        self.root = root
        self._entries = tuple(entries)
        self._paths = tuple(paths)
        first = next((value for _, _, value in entries if isinstance(value, torch.Tensor)), None)
        self._probe = None if first is None else (first, first.device)
        self.devices = frozenset(model_devices(root))

    def unchanged(self) -> bool:
        """Does the model hold every recorded tensor and submodule in its place, the first tensor on its device?
        The check at each call: one dictionary lookup per entry."""
        for table, name, value in self._entries:
            if table.get(name) is not value:
                return False
        probe = self._probe
        return probe is None or probe[0].device == probe[1]

    def change(self) -> StateChange:
        """What differs from the recorded state (worked out only once :meth:`unchanged` said something does)."""
        swapped, reshaped, modules = [], [], []
        for (table, name, value), path in zip(self._entries, self._paths):
            now = table.get(name)
            if now is value:
                continue
            if isinstance(value, nn.Module) or isinstance(now, nn.Module):
                modules.append(f"{path} ({_what(value)} -> {'another ' if type(now) is type(value) else ''}"
                               f"{_what(now)})")
            elif _like(value, now):
                swapped.append(path)
            else:
                reshaped.append(path)
        return StateChange(tuple(swapped), tuple(reshaped), tuple(modules), frozenset(model_devices(self.root)), self.devices)

    def put_back_modules(self) -> None:
        """Put every recorded submodule back in its place (what a forward that replaces layers replaced). Tensors
        are left as they are: FSDP2 swaps its own between calls."""
        for table, name, value in self._entries:
            if isinstance(value, nn.Module) and table.get(name) is not value:
                table[name] = value


def _like(a, b) -> bool:
    """Tensors a graph built for ``a`` can read ``b`` in place of: same shape, dtype and device."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device)


def _what(value) -> str:
    return "removed" if value is None else type(value).__name__


def check_computable(change: StateChange, what: str) -> None:
    """:class:`BadInputError` when no graph can compute with the model's tensors as they are now: on the
    ``meta`` device (shapes, no values), or spread over several devices. ``what`` names the planned module."""
    if any(device.type == "meta" for device in change.devices):
        raise BadInputError(
            f"the model's parameters or buffers are on the meta device now ({change.describe()}), so {what} has "
            "no values to compute with. Materialise the model's weights first (model.to_empty(device=...) and "
            "model.load_state_dict(...)); the planned module then computes with them.")
    if len(change.devices) > 1:
        raise BadInputError(
            f"the model's parameters and buffers are spread over {_devices(change.devices)} now ({change.describe()}); "
            f"{what} runs the model on one device. Move the whole model with model.to(device).")
