"""What a shape-specialised graph is specialised to, and the check that it is called with that.

Example inputs in every accepted form become ``(args, kwargs)``
(:func:`normalize_example_inputs`). A recorded or dynamo-captured graph holds
the example inputs' shapes as constants, so it is good for one
:func:`input_signature` (the train/eval mode, and per tensor its shape, dtype
and device) and checks its inputs first (:func:`check_input_shapes`, put in by
:func:`with_input_check`). :func:`module_modes` is the mode part of that
signature, module by module.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import BadInputError
from .nodes import meta_value

__all__ = [
    "ExampleInputs",
    "normalize_example_inputs",
    "input_signature",
    "module_modes",
    "modes_of",
    "describe_inputs",
    "check_input_shapes",
    "with_input_check",
]


#: Positional args and keyword args for one forward call.
ExampleInputs = tuple[tuple, dict]


def normalize_example_inputs(example_inputs) -> ExampleInputs:
    """Accept a tensor, a tuple/list of positional args, a dict of kwargs, or ``(args, kwargs)``.

    >>> import torch
    >>> normalize_example_inputs({"input_ids": torch.zeros(1, 3)})[0]
    ()
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[0], tuple) and isinstance(example_inputs[1], dict):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise BadInputError(
        f"example_inputs is a {type(example_inputs).__name__}; compfx expected a tensor, a tuple of "
        "positional arguments or a dict of keyword arguments for model.forward."
    )


def distinct_input_tensors(args: tuple, kwargs: Mapping) -> ExampleInputs:
    """The example inputs with every tensor its own: a tensor passed in two places (``labels=input_ids``) is
    cloned for the second, so that a graph captures two inputs and reads each from its own argument.

    Traced as one tensor, both arguments would become the first placeholder that met it, and a later call that
    passes two different tensors would compute on the wrong one.

    >>> import torch
    >>> ids = torch.zeros(2, 3, dtype=torch.long)
    >>> _, kw = distinct_input_tensors((), {"input_ids": ids, "labels": ids})
    >>> kw["input_ids"] is ids, kw["labels"] is ids, torch.equal(kw["labels"], ids)
    (True, False, True)
    """
    seen: set[int] = set()

    def own(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in seen:
            seen.add(id(leaf))
            return leaf
        return leaf.detach().clone().requires_grad_(leaf.requires_grad)

    return pytree.tree_map(own, (tuple(args), dict(kwargs)))


def module_modes(model: nn.Module, training: bool | None = None) -> dict[str, bool]:
    """Each module's train/eval mode by path; all ``training`` when it is given (what ``model.train(training)`` sets).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    >>> model[1].eval()  # doctest: +ELLIPSIS
    Dropout(...)
    >>> module_modes(model), module_modes(model, False)
    ({'': True, '0': True, '1': False}, {'': False, '0': False, '1': False})
    """
    return {name: module.training if training is None else training for name, module in model.named_modules()}


def modes_of(model: nn.Module) -> tuple[bool, ...]:
    """Every module's train/eval mode, in ``named_modules`` order (:func:`module_modes`' values): the mode part of
    an :func:`input_signature`, so that a submodule switched to ``.eval()`` after capture gets a graph of its own.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    >>> modes_of(model), modes_of(model[1].eval()), modes_of(model)
    ((True, True, True), (False,), (True, True, False))
    """
    return tuple(module.training for module in model.modules())


def input_signature(args: tuple, kwargs: Mapping, training: Hashable) -> Hashable:
    """What a shape-specialised graph is specialised to: the mode (``training``: a bool, or every module's as a
    tuple), the arguments' structure, and per tensor its shape, dtype and device (per other leaf, its value).
    Equal signatures can share one graph.

    >>> import torch
    >>> a = input_signature((torch.zeros(4, 8),), {}, True)
    >>> a == input_signature((torch.ones(4, 8),), {}, True), a == input_signature((torch.zeros(3, 8),), {}, True)
    (True, False)
    """
    if all(isinstance(a, torch.Tensor) for a in args) and all(isinstance(v, torch.Tensor) for v in kwargs.values()):
        # the common case (a tuple or a dict of tensors), without pytree: a training step pays this every call
        return (training, tuple(_leaf_signature(a) for a in args),
                tuple(sorted((name, _leaf_signature(v)) for name, v in kwargs.items())))
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return (training, spec, tuple(_leaf_signature(leaf) for leaf in leaves))


def _leaf_signature(leaf) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    if isinstance(leaf, float) and math.isnan(leaf):  # NaN != NaN: as a value it would never match itself
        return (float, "nan")
    try:
        hash(leaf)
    except TypeError:  # an unhashable object: only this very object is known to fit
        return ("object", id(leaf))
    return (type(leaf), leaf)


def describe_inputs(args: tuple, kwargs: Mapping) -> str:
    """The inputs' tensor shapes in a few words, for logs and reports.

    >>> import torch
    >>> describe_inputs((torch.zeros(4, 8),), {"mask": torch.zeros(4, 8), "scale": 2.0})
    '4x8, mask 4x8, scale=2.0'
    """
    def one(value) -> str:
        if isinstance(value, torch.Tensor):
            return "x".join(map(str, value.shape)) or "scalar"
        if isinstance(value, (tuple, list, dict)):
            return "(" + ", ".join(one(v) for v in (value.values() if isinstance(value, dict) else value)) + ")"
        return repr(value)

    return ", ".join([one(a) for a in args] + [f"{k} {one(v)}" if isinstance(v, (torch.Tensor, tuple, list, dict))
                                               else f"{k}={v!r}" for k, v in kwargs.items()])


@fx.node.has_side_effect  # dead-code elimination keeps it: nothing reads its result
def check_input_shapes(expected: tuple, *tensors) -> None:
    """Raise :class:`~compfx.errors.BadInputError` naming the input and dimension that differ from ``expected``.

    ``expected`` holds ``(name, shape, dtype)`` per tensor input, in order. A
    recorded or dynamo-captured graph calls this first: its ops were written
    for those shapes (views, expands and masks hold the sizes as constants), so
    other shapes would fail deep inside, or worse, run.

    >>> import torch
    >>> check_input_shapes((("x", (2, 3), torch.float32),), torch.zeros(2, 3))
    >>> check_input_shapes((("x", (2, 3), torch.float32),), torch.zeros(5, 3))
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: x has size 5 in dimension 0 (the batch), but this graph was captured with ...
    """
    for (name, shape, dtype), tensor in zip(expected, tensors):
        if tuple(tensor.shape) == shape and tensor.dtype == dtype:
            continue
        if len(tensor.shape) != len(shape):
            what = f"{name} has {len(tensor.shape)} dimensions ({tuple(tensor.shape)}), but this graph was captured with {len(shape)} ({shape})"
        elif tuple(tensor.shape) != shape:
            dim = next(i for i, (a, b) in enumerate(zip(tensor.shape, shape)) if a != b)
            role = " (the batch)" if dim == 0 else " (the sequence, for token inputs)" if dim == 1 and not tensor.is_floating_point() else ""
            what = (f"{name} has size {tensor.shape[dim]} in dimension {dim}{role}, but this graph was captured with "
                    f"{shape[dim]} (shape {shape})")
        else:
            what = f"{name} is {tensor.dtype}, but this graph was captured with {dtype}"
        raise BadInputError(
            f"{what}. Recorded and dynamo-captured graphs are specialised to the shapes and dtypes they were captured "
            "with. Run the model through the PlannedModule this graph is the .graph_module of (compfx.apply(...) or "
            "compfx.optimize(...).module), which re-captures per input shape with the same plan, or capture with "
            "inputs of this shape.")


def with_input_check(gm: fx.GraphModule) -> fx.GraphModule:
    """Put a :func:`check_input_shapes` call after the placeholders of a shape-specialised graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(n.meta.get("val", n.meta.get("example_value")), torch.Tensor)]
    if not tensors:
        return gm
    names = dict(zip(placeholders, _input_names(gm, len(placeholders))))
    expected = tuple((names[n], tuple(_concrete_shape(meta_value(n))), meta_value(n).dtype) for n in tensors)
    with gm.graph.inserting_after(placeholders[-1]):
        check = gm.graph.call_function(check_input_shapes, (expected, *tensors))
    check.meta["val"] = None
    gm.recompile()
    return gm


def _input_names(gm: fx.GraphModule, count: int) -> list[str]:
    """What the caller calls each placeholder: ``input_ids``, ``x``, ``batch[1]`` (dynamo's own names are not that)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None or info.in_spec.num_leaves != count:
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    names = []
    for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(count)), info.in_spec))[0]:
        if _is_args_kwargs(info.in_spec):
            first, rest = path[1], path[2:]
            base = info.orig_args[first.idx] if path[0].idx == 0 else str(
                getattr(first, "key", getattr(first, "idx", "")))
        else:
            first, rest = path[0], path[1:]
            base = info.orig_args[first.idx] if first.idx < len(info.orig_args) else f"arg{first.idx}"
        names.append(base + pytree.keystr(rest))
    return names


def _is_args_kwargs(spec) -> bool:
    return (spec.type is tuple and spec.num_children == 2 and _child(spec, 0).type is tuple
            and _child(spec, 1).type is dict)


def _child(spec, index: int):
    """``spec.child(index)``; ``children_specs`` before torch had it (deprecated since)."""
    return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]


def _concrete_shape(value: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)
