"""What a batch is, and what compfx does with one: the model's inputs, on a device, copied; the loss; the model's
device.

How a batch maps to the model (:func:`split_batch`):

* a ``dict``: every entry is a keyword argument (Hugging Face style, labels included);
* a ``tuple`` / ``list``: all items but the last are positional inputs, the
  last is the target (a 1-item tuple is inputs only);
* a ``Tensor``: the only positional input.

``loss_fn(output, batch)`` receives the model output and the whole batch (on
the device); without one, the model's own loss is used (:func:`model_loss`:
``output.loss`` or ``output["loss"]``). :func:`check_first_batch` runs the
model and the loss once on a batch, changing nothing, so that bad inputs fail
before any work.

>>> import torch
>>> args, kwargs = split_batch(move_batch((torch.zeros(2, 3), torch.zeros(2)), torch.device("cpu")))
>>> [a.shape for a in args], kwargs
([torch.Size([2, 3])], {})
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import BadInputError, CompfxError
from .state import restore_state, snapshot_state, torch_rng_preserved

__all__ = ["split_batch", "move_batch", "copied_batch", "model_loss", "check_loss", "check_loss_trains", "check_first_batch",
           "model_device", "model_devices", "LossFn"]

LossFn = Callable[[Any, Any], torch.Tensor]


# -- a batch -----------------------------------------------------------------------------------------

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


def copied_batch(batch):
    """The batch with every tensor cloned: what a model that writes its inputs (``x.mul_(0.5)``) may write.

    The search runs every plan on the same batches, many times; a forward that wrote the loader's own tensors
    would feed each later step other data, and leave the user's data changed.
    """
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


# -- the loss ----------------------------------------------------------------------------------------

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
    """``loss`` itself when it is a one-element tensor that, with grad enabled, requires grad; otherwise
    :class:`BadInputError`."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise BadInputError(f"loss_fn returned a {type(loss).__name__}{shape}; expected a scalar tensor. Reduce "
                            "the loss (e.g. .mean()) inside loss_fn.")
    if torch.is_grad_enabled() and not loss.requires_grad:  # a training step's loss: backward must reach the model
        raise BadInputError("loss_fn returned a loss that does not require grad, so backward cannot train the model; "
                            "compute it from the model's output without .detach(), .item() or torch.no_grad().")
    return loss


# -- the model's device ------------------------------------------------------------------------------

def model_devices(model: nn.Module) -> set[torch.device]:
    """The devices of the model's parameters and buffers (none for a model without any).

    >>> model_devices(torch.nn.Linear(2, 2))
    {device(type='cpu')}
    """
    return {t.device for t in (*model.parameters(), *model.buffers())}


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's parameters (CPU for a model without any).

    >>> model_device(torch.nn.ReLU())
    device(type='cpu')
    """
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_loss_trains(model: nn.Module, loss: torch.Tensor) -> None:
    """:class:`BadInputError` unless ``loss`` (computed with grad) reaches a parameter of ``model`` that requires
    grad: otherwise the search trains nothing and compares plans on a loss they cannot change (a loss of another
    model's output, a new leaf tensor made from a float, a forward returning a string that ``loss_fn`` ignores).
    Read from autograd's graph; where the graph does not show it (a reentrant checkpoint recomputes its part in
    backward), one backward tells (the caller puts the gradients back)."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    if not trained or _reaches(loss, trained):
        return
    model.zero_grad(set_to_none=True)
    loss.backward()
    if any(p.grad is not None for p in model.parameters()):
        return
    raise BadInputError(
        "loss_fn's loss does not depend on the model's parameters (backward gives them no gradient), so the search "
        "would train nothing and compare plans on a loss they cannot change. Compute the loss from the model's "
        "output (not from another model, a detached copy, or a new tensor made from .item()).")


def _reaches(loss: torch.Tensor, parameters: set[int]) -> bool:
    """Does autograd's graph of ``loss`` accumulate a gradient into one of ``parameters`` (by id)?"""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in parameters:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


# -- the first batch, checked ------------------------------------------------------------------------

def check_first_batch(model: nn.Module, batch, loss_fn: LossFn | None, device: torch.device, *,
                      where: str = "the loader's first batch, in FP32 before any search",
                      with_loss: bool = True) -> tuple[tuple, dict]:
    """Run ``model`` and ``loss_fn`` once on ``batch`` to catch bad inputs before any search work;
    ``with_loss=False`` runs the model alone (a given plan, applied without a search, needs no loss).

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
    devices = model_devices(model)
    if len(devices) > 1:
        raise BadInputError(f"the model's parameters and buffers are spread over {sorted(map(str, devices))}; "
                            "compfx expected one device. Move the whole model there with model.to(device).")
    if any(d.type == "meta" for d in devices):
        raise BadInputError("the model's parameters or buffers are on the meta device (shapes, no values), but "
                            "compfx runs it; materialise it first, e.g. model.to_empty(device='cpu') and load its "
                            "weights, then build the optimizer on model.parameters().")
    batch = copied_batch(move_batch(batch, device))  # the model may write its inputs: never the loader's tensors
    args, kwargs = split_batch(batch)
    snapshot = snapshot_state(model)
    try:
        # with grad when there is a loss: it must reach the parameters the search trains
        with torch.set_grad_enabled(with_loss), torch_rng_preserved(device):
            output = _user_call("the model", lambda: model(*args, **kwargs), batch, where)
            if with_loss:
                check_loss_trains(model, check_loss(
                    _user_call("loss_fn", lambda: (loss_fn or model_loss)(output, batch), batch, where)))
    finally:
        restore_state(snapshot)
    return split_batch(copied_batch(batch))  # not the inputs the check ran on, which the model may have written


def _user_call(what: str, call: Callable[[], Any], batch, where: str):
    """``call()``, turning a failure into a :class:`BadInputError` that says which batch and why."""
    try:
        return call()
    except CompfxError:
        raise
    except Exception as error:
        first = (str(error).splitlines() or [""])[0][:300]
        raise BadInputError(
            f"{what} failed on {where} ({type(error).__name__}: "
            f"{first}). The batch was {_describe(batch)}; expected one the model trains on "
            "(a tuple (inputs..., target), a dict of keyword arguments, or a tensor). Fix the loader, the "
            "model or loss_fn so that one FP32 training step runs.") from error


def _describe(batch) -> str:
    return str(pytree.tree_map(lambda t: f"Tensor{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor)
                               else type(t).__name__, batch))[:200]
