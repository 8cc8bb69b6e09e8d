"""The dynamo fallback (``torch._dynamo.export``), and keying the graphs dynamo hands a backend.

:func:`compfx.graph_capture.capture` tries it last, for models neither of the
others can follow. It runs the model for real (the buffers are put back), with
static shapes: its graph is specialised to the example inputs. Its parameters
are re-pointed at the model's own FQNs and its grad-mode switches made to
restore the caller's mode, so its graph looks like the other tracers'.
:func:`key_dynamo_graph` gives the graphs ``torch.compile`` hands the compfx
backend the same metadata and OpKeys, call indices continued across the
graphs of a model split at graph breaks (:class:`CallIndexOffsets` remembers
where each dynamo frame's graphs start).
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..opkey import KEY_META, OpKey, assign_op_keys, normalize_module_path
from ..state import buffers_restored
from .autocast_blocks import mark_pinned
from .dtype_limits import mark_dtype_limits
from .model_state import get_attribute, named_tensors
from .nodes import complete_metadata, is_numerical_op, op_nodes

__all__ = ["dynamo_capture", "CAPTURE_DEFAULTS", "capture_defaults", "key_dynamo_graph", "CallIndexOffsets"]


def dynamo_capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``torch._dynamo.export`` of ``model`` with static shapes, its ``get_attr`` targets the model's own FQNs.

    The graph takes the caller's ``(args, kwargs)``: the :data:`CAPTURE_DEFAULTS`
    it ran with are specialised away. The model's buffers are put back afterwards.
    """
    # allow_rnn: keep nn.GRU/LSTM in the graph as one op, as the symbolic tracer does.
    # Static shapes: compfx specialises to the example inputs (TC rules need concrete dims).
    defaults = capture_defaults(model, kwargs)
    # buffers_restored also gives each buffer slot its own tensor back: dynamo replays a write after its graph,
    # in place or (``self.running = ...``) by reassigning; verify_capture's eager run tells the two apart
    with torch._dynamo.config.patch(allow_rnn=True), buffers_restored(model):
        exported = torch._dynamo.export(model, aten_graph=False, assume_static_by_default=True)(
            *args, **kwargs, **defaults)
    gm = exported.graph_module
    if defaults:
        _drop_keywords(gm, args, kwargs, defaults)
    fqn_of = {id(t): name for name, t in named_tensors(model)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = get_attribute(gm, node.target)
            if id(attr) in fqn_of:
                node.target = fqn_of[id(attr)]
    _restore_callers_grad_mode(gm.graph, torch.is_grad_enabled())
    return fx.GraphModule(_root(model, gm), gm.graph, class_name=type(model).__name__ + "Captured")


def _root(model: nn.Module, exported: fx.GraphModule):
    """What the captured graph's targets resolve in: the model itself, unless dynamo lifted constants of its own.

    A plain tensor attribute of the model (not a parameter or buffer) becomes a constant on dynamo's graph,
    under a name the model does not have; those targets are looked up there, everything else in the model.
    """
    targets = [n.target for n in exported.graph.nodes if n.op in ("get_attr", "call_module")]
    missing = [t for t in targets if not _resolves(model, t)]
    if not missing:
        return model
    return {t: get_attribute(model if _resolves(model, t) else exported, t) for t in targets}


def _resolves(root: nn.Module, target: str) -> bool:
    try:
        get_attribute(root, target)
    except AttributeError:
        return False
    return True


def _drop_keywords(gm: fx.GraphModule, args: tuple, kwargs: dict, defaults: dict) -> None:
    """Make an exported graph take the caller's ``(args, kwargs)``, without the capture ``defaults`` it ran with.

    The defaults were passed last, each a single leaf, so they are the last
    placeholders; the graph is specialised to their values and never reads them.
    """
    info = gm.graph._codegen.pytree_info
    dropped = [n for n in gm.graph.nodes if n.op == "placeholder"][-len(defaults):]
    for node in dropped:
        if node.users:
            raise CaptureError(f"dynamo's graph reads {node.name!r}, which compfx passed as a constant "
                               f"({', '.join(f'{k}={v!r}' for k, v in defaults.items())}) and expected to be specialised away")
        gm.graph.erase_node(node)
    in_spec = pytree.tree_structure((args, kwargs))
    gm.graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(info.orig_args[: -len(defaults)], in_spec, info.out_spec)))
    gm.recompile()


def _restore_callers_grad_mode(graph: fx.Graph, mode_at_capture: bool) -> None:
    """Make dynamo's ``_set_grad_enabled(True)`` after a no_grad block restore the caller's mode.

    Dynamo writes the mode it saw at capture time as a literal; a caller that
    runs the graph under ``torch.no_grad()`` would get autograd switched back on.
    """
    switches = [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    if not switches:
        return
    with graph.inserting_before(switches[0]):
        saved = graph.call_function(torch.is_grad_enabled)
    saved.meta["val"] = mode_at_capture
    for switch in switches:
        if switch.args[0] == mode_at_capture:
            switch.args = (saved,)


#: Keyword arguments the dynamo fallback passes to ``forward`` when it takes them and the caller did not say:
#: ``torch._dynamo.export`` cannot return Hugging Face's cache object, and training never reads it. (The
#: recording tracer runs forward as called and returns None in the cache's place: :func:`~compfx.graph_capture.is_kv_cache`.)
CAPTURE_DEFAULTS = {"use_cache": False}


def capture_defaults(model: nn.Module, kwargs: dict) -> dict:
    """The entries of :data:`CAPTURE_DEFAULTS` that ``model.forward`` accepts and ``kwargs`` does not set.

    >>> import torch
    >>> class LM(torch.nn.Module):
    ...     def forward(self, input_ids, use_cache=None): ...
    >>> capture_defaults(LM(), {}), capture_defaults(LM(), {"use_cache": True}), capture_defaults(torch.nn.Linear(2, 2), {})
    ({'use_cache': False}, {}, {})
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: value for name, value in CAPTURE_DEFAULTS.items() if name in parameters and name not in kwargs}


def key_dynamo_graph(gm: fx.GraphModule, counts: dict[tuple[str, str], int] | None = None, *,
                     example_inputs: Sequence = (), model: nn.Module | None = None) -> list[OpKey]:
    """Key the graph that dynamo hands a ``torch.compile`` backend, like :func:`~compfx.graph_capture.capture` would.

    Dynamo graphs keep values in ``meta["example_value"]`` and lift parameters
    to placeholders; this copies the values to ``meta["val"]`` (and adds
    ``tensor_meta``), marks ``torch.finfo`` literals (:func:`~compfx.graph_capture.mark_dtype_limits`) and
    the ops of the model's ``autocast(enabled=False)`` blocks (:func:`~compfx.graph_capture.mark_pinned`),
    then writes an OpKey on every numerical op. Its module paths are
    relative to the frame dynamo started in; ``model``, with the graph's
    ``example_inputs``, maps them back to the model's own names (a frame that
    starts inside a submodule, at a graph break). For a model split into
    several graphs, pass one ``counts`` dict ((module, kind) -> next call
    index, updated in place) to every call, in execution order, so call
    indices continue across the graphs as in one capture of the whole model.
    Returns the keys in graph order.

    >>> import torch
    >>> from compfx.graph_capture import key_dynamo_graph
    >>> keys = []
    >>> def backend(gm, example_inputs):
    ...     keys.extend(key_dynamo_graph(gm))
    ...     return gm.forward
    >>> _ = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), backend=backend)(torch.randn(2, 4))
    >>> [str(k) for k in keys]
    ['0:linear#0', '1:relu#0']
    """
    complete_metadata(gm)
    mark_dtype_limits(gm)
    mark_pinned(gm)
    assign_op_keys(gm, include=is_numerical_op)  # capture's keys, relative to dynamo's frame, indices from 0
    names = _ModelNames(model) if model is not None else None
    prefix = _frame_root_prefix(gm, example_inputs, names) if names is not None else ""
    counts = {} if counts is None else counts
    keys = []
    for node in op_nodes(gm):
        module, kind = _module_path(node, names, prefix), node.meta[KEY_META].kind
        key = OpKey(module, kind, counts.get((module, kind), 0))
        counts[(module, kind)] = key.index + 1
        node.meta[KEY_META] = key
        keys.append(key)
    return keys


class _ModelNames:
    """id(module / parameter / buffer) -> fully qualified name in one model."""

    def __init__(self, model: nn.Module):
        self.modules = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.tensors = {id(t): name for name, t in named_tensors(model)}


def _frame_root_prefix(gm: fx.GraphModule, example_inputs: Sequence, names: _ModelNames) -> str:
    """FQN of the module that dynamo's frame started in ('' for the model itself).

    A parameter placeholder's source reads ``L['self'].a.weight`` relative to the
    frame; the real tensor passed for it has the full name ``inner.a.weight``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        full = names.tensors.get(id(value)) if isinstance(value, torch.Tensor) else None
        source = getattr(node.meta.get("grapharg"), "source", None)
        if full is None or source is None:
            continue
        relative = normalize_module_path(str(source.name))
        if full == relative:
            return ""
        if relative and full.endswith("." + relative):
            return full[: -len(relative) - 1]
    return ""


def _module_path(node: fx.Node, names: _ModelNames | None, prefix: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if names is not None and stack:
        module_id = list(stack.keys())[-1]
        if str(module_id).isdigit() and int(module_id) in names.modules:
            return names.modules[int(module_id)]
    relative = node.meta[KEY_META].module
    return ".".join(part for part in (prefix, relative) if part)


class CallIndexOffsets:
    """Call counts per (module, kind) over the graphs one backend compiled, remembered per dynamo frame.

    Dynamo compiles the graphs of one forward in execution order on the first
    call, so the counts before a frame are that frame's index offsets. A
    recompile of a frame (new shapes, eval mode) reuses its first offsets.

    >>> offsets = CallIndexOffsets()
    >>> dict(offsets.for_frame(1))  # the first frame's graph: indices from 0
    {}
    >>> offsets.count(1, [OpKey("", "relu", 0), OpKey("", "relu", 1)])  # it ran two relus
    >>> dict(offsets.for_frame(2)), dict(offsets.for_frame(1))  # the next frame continues; frame 1 recompiled, not
    ({('', 'relu'): 2}, {})
    """

    def __init__(self):
        self._running: Counter = Counter()
        self._by_frame: dict[int, Counter] = {}
        self._counted: set[int] = set()

    def for_frame(self, frame_id: int | None) -> Counter:
        """The ``counts`` a graph of this frame is keyed from (:func:`key_dynamo_graph`): a copy, to update."""
        if frame_id is None:  # not called by dynamo: a graph of its own
            return Counter()
        return Counter(self._by_frame.setdefault(frame_id, Counter(self._running)))

    def count(self, frame_id: int | None, keys) -> None:
        if frame_id is None or frame_id in self._counted:
            return
        self._counted.add(frame_id)
        for key in keys:
            slot = (key.module, key.kind)
            self._running[slot] = max(self._running[slot], key.index + 1)
