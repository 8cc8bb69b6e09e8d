"""The model's parameters and buffers as capture reads them, and what a trace may leave in the model.

Every tracer names tensors by the model's own FQNs (:func:`named_tensors`,
:func:`get_attribute`), so graphs from different tracers read the same
``get_attr`` targets; a forward that runs for real (dynamo export, an eager
check, a measurement) leaves the buffers as it found them
(:func:`compfx.state.buffers_restored`); and no trace leaves
a value of its own in the model (:func:`tracer_values_removed`): while tracing, a forward that assigns a
tensor to an attribute (``self.last = h``, or ``self.steps += 1``, which a proxy does out of place) puts the
tracer's proxy or FakeTensor there.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils import _pytree as pytree

from ..errors import CaptureError, ExplainedCaptureError

#: The old ``torch.nn.utils.weight_norm`` / ``spectral_norm`` API's forward pre-hooks: they compute the weight
#: forward reads, which a graph holds.
_WEIGHT_HOOKS = (WeightNorm, SpectralNorm)

__all__ = ["named_tensors", "get_attribute", "tracer_values_removed", "reassignment_error", "stored_attributes_warning",
           "hooks_warning"]


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
def tracer_values_removed(model: nn.Module):
    """Afterwards, every attribute of ``model``'s modules that now holds a tracer's value (a proxy, a FakeTensor,
    or a tuple, list or dict of them) holds what it held before, or is gone; yields the list of the plain
    attributes among them (not parameters or buffers), filled on the way out.

    A parameter or buffer among them is one that ``forward`` reassigns: a graph cannot hold that, since it
    writes its state in place (:func:`reassignment_error`). A plain attribute (``self.last_attention = w``)
    is the model's own business, but a proxy left there would break the next eager forward that reads it;
    and the graph computes its value without storing it (:func:`stored_attributes_warning`).
    """
    saved = [(prefix, module, dict(module.__dict__), dict(module._parameters), dict(module._buffers))
             for prefix, module in model.named_modules(remove_duplicate=False)]
    stored: list[str] = []
    try:
        yield stored
    finally:
        for prefix, module, attributes, parameters, buffers in saved:
            for name in _holding_tracer_values(module, attributes, parameters, buffers):
                stored.append(f"{prefix}.{name}" if prefix else name)
            for name in [n for n in module.__dict__ if n not in attributes and _FX_CONSTANT.fullmatch(n)]:
                del module.__dict__[name]  # torch.fx's tracer keeps its constants on the root; the graph has its own


#: The names ``torch.fx``'s symbolic tracer gives the tensor constants it sets on the module it traces.
_FX_CONSTANT = re.compile(r"_tensor_constant\d+")


def _holding_tracer_values(module: nn.Module, attributes: dict, parameters: dict, buffers: dict) -> list[str]:
    """Names of ``module``'s attributes that hold a tracer's value, each put back to what it held (or removed);
    only the plain attributes' names are returned."""
    found = []
    for now, before in ((module._parameters, parameters), (module._buffers, buffers), (module.__dict__, attributes)):
        for name, value in list(now.items()):
            if value is not before.get(name) and _holds_tracer_value(value):
                if now is module.__dict__ and name not in _derived_attributes(module):
                    found.append(name)
                if name in before:
                    now[name] = before[name]
                else:
                    del now[name]
    return found


def _derived_attributes(module: nn.Module) -> set[str]:
    """Attributes torch sets from a module's parameters, which the graph reads as those parameters: the weight
    the old weight_norm / spectral_norm hooks compute before each forward, an RNN's list of its weights."""
    names = {hook.name for hook in module._forward_pre_hooks.values() if isinstance(hook, _WEIGHT_HOOKS)}
    return names | {"_flat_weights"} if isinstance(module, nn.RNNBase) else names


def _holds_tracer_value(value) -> bool:
    if isinstance(value, (fx.Proxy, FakeTensor)):
        return True
    return isinstance(value, (tuple, list, dict)) and any(
        isinstance(leaf, (fx.Proxy, FakeTensor)) for leaf in pytree.tree_leaves(value))


def stored_attributes_warning(names) -> str:
    """What a graph loses when ``forward`` stores tensors in attributes of the model (``names``)."""
    return (f"compfx: forward() stores tensors in {', '.join(sorted(set(names))[:3])} (self.x = ...); the captured "
            "graph computes them but does not store them, so the planned module leaves them as they were before "
            "capture. A training loop that reads them (an auxiliary loss kept on a module) would read stale "
            "values: return them from forward instead.")


def hooks_warning(model: nn.Module, leaves=frozenset()) -> str | None:
    """What a graph loses when modules inside ``model`` have forward or backward hooks, or None when none has.
    ``leaves`` are the modules the graph calls (``call_module``): their hooks run.

    Tracing runs a forward hook once and keeps what it returns; the graph has no module boundaries, so no hook
    runs again: one that stores activations, logs or counts does nothing in the planned module, and backward
    hooks never run. Hooks that torch or transformers register are not counted (:data:`_LIBRARIES`).
    """
    hooked = [name for name, module in model.named_modules()
              if name and _user_hooks(module) and not any(name == leaf or name.startswith(f"{leaf}.") for leaf in leaves)]
    if not hooked:
        return None
    return (f"compfx: module(s) {', '.join(hooked[:3])}{' and others' if len(hooked) > 3 else ''} of "
            f"{type(model).__name__} have forward or backward hooks. The captured graph keeps what a forward hook "
            "returns, but runs no hook: a hook that stores activations, logs or counts does nothing in the planned "
            "module, and backward hooks never run. Register such hooks on the planned module itself, or compute "
            "what they collect in forward and return it.")


#: Libraries whose own hooks are not counted: the capture keeps torch's checkpointing hooks as regions, and the
#: others they register (weight_norm / spectral_norm / pruning weights, Hugging Face's input gradients) compute
#: values the graph holds.
_LIBRARIES = ("torch.", "transformers.")


def _user_hooks(module: nn.Module) -> list:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values(),
             *module._backward_hooks.values(), *module._backward_pre_hooks.values()]
    return [hook for hook in hooks if not (getattr(hook, "__module__", None) or "").startswith(_LIBRARIES)]


def reassignment_error(names) -> CaptureError:
    """The error for a forward that assigns new tensors to its parameters or buffers (``names``)."""
    return ExplainedCaptureError(
        f"forward() assigns new tensors to {', '.join(sorted(set(names))[:3])}; compfx graphs replay in-place "
        "updates of parameters and buffers (self.x.add_(...), self.x.copy_(...)) but not reassignment "
        "(self.x = ..., and self.x += ... under the symbolic tracer, whose proxies add out of place). Update them "
        "with in-place methods")
