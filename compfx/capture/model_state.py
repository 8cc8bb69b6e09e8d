"""The model's parameters and buffers as capture reads them, and its buffers put back.

Every tracer names tensors by the model's own FQNs (:func:`named_tensors`,
:func:`get_attribute`), so graphs from different tracers read the same
``get_attr`` targets; a forward that runs for real (dynamo export, an eager
check, a measurement) leaves the buffers as it found them (:func:`buffers_restored`); and no trace leaves
a value of its own in the model (:func:`tracer_values_removed`): while tracing, a forward that assigns a
tensor to an attribute (``self.last = h``, or ``self.steps += 1``, which a proxy does out of place) puts the
tracer's proxy or FakeTensor there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import CaptureError

__all__ = ["named_tensors", "get_attribute", "buffers_restored", "tracer_values_removed", "reassignment_error"]


def named_tensors(model: nn.Module):
    """Every parameter and buffer of ``model`` by name, shared ones under each of their names."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def get_attribute(root: nn.Module, target: str):
    """The object a ``get_attr`` node's dotted ``target`` names in ``root`` (a parameter, buffer or module)."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def buffers_restored(model: nn.Module):
    """Put every buffer of ``model`` back afterwards (dynamo export, and any measuring forward, run it for real)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextlib.contextmanager
def tracer_values_removed(model: nn.Module):
    """Afterwards, every attribute of ``model``'s modules that now holds a tracer's value (a proxy, a FakeTensor)
    holds what it held before, or is gone; yields the list of their names, filled on the way out.

    A parameter or buffer among them is one that ``forward`` reassigns: a graph cannot hold that, since it
    writes its state in place (:func:`reassignment_error`). A plain attribute (``self.last_attention = w``)
    is the model's own business, but a proxy left there would break the next eager forward that reads it.
    """
    saved = [(prefix, module, dict(module.__dict__), dict(module._parameters), dict(module._buffers))
             for prefix, module in model.named_modules(remove_duplicate=False)]
    assigned: list[str] = []
    try:
        yield assigned
    finally:
        for prefix, module, attributes, parameters, buffers in saved:
            for name in _holding_tracer_values(module, attributes, parameters, buffers):
                assigned.append(f"{prefix}.{name}" if prefix else name)


def _holding_tracer_values(module: nn.Module, attributes: dict, parameters: dict, buffers: dict) -> list[str]:
    """Names of ``module``'s attributes that hold a tracer's value, each put back to what it held (or removed)."""
    found = []
    for now, before in ((module._parameters, parameters), (module._buffers, buffers), (module.__dict__, attributes)):
        for name, value in list(now.items()):
            if isinstance(value, (fx.Proxy, FakeTensor)) and value is not before.get(name):
                found.append(name)
                if name in before:
                    now[name] = before[name]
                else:
                    del now[name]
    return found


def reassignment_error(names) -> CaptureError:
    """The error for a forward that assigns new tensors to its parameters or buffers (``names``)."""
    return CaptureError(
        f"forward() assigns new tensors to {', '.join(sorted(set(names))[:3])}; compfx graphs replay in-place "
        "updates of parameters and buffers (self.x.add_(...), self.x.copy_(...)) but not reassignment "
        "(self.x = ..., and self.x += ... under the symbolic tracer, whose proxies add out of place). Update them "
        "with in-place methods")
