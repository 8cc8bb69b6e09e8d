"""The model's parameters and buffers as capture reads them, and its buffers put back.

Every tracer names tensors by the model's own FQNs (:func:`named_tensors`,
:func:`get_attribute`), so graphs from different tracers read the same
``get_attr`` targets; a forward that runs for real (dynamo export, an eager
check, a measurement) leaves the buffers as it found them (:func:`buffers_restored`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

__all__ = ["named_tensors", "get_attribute", "buffers_restored"]


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
