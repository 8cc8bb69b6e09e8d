"""Activation checkpointing kept: the ops a model runs inside ``torch.utils.checkpoint.checkpoint`` are
recomputed in backward in the captured (and every planned) graph too.

A tracer follows ``checkpoint(block, x, use_reentrant=False)`` into ``block``
and writes its ops down like any others: every pass sees them, with OpKeys,
and a plan covers them. :class:`CheckpointRegions` marks each of those nodes
with its :class:`CheckpointedRegion` (``node.meta["compfx_checkpoint"]``). The
graph stays flat; only the Python code generated from it calls each region
through ``checkpoint`` again (:class:`CheckpointedGraph`), so the casts a plan
puts on a region's ops (they carry their op's mark) are recomputed with them.

``use_reentrant=True`` is kept too: ``checkpoint`` then calls
``CheckpointFunction.apply``, which the tracers hand to :meth:`CheckpointRegions.reentrant`
instead of running it as an opaque custom Function, and the code calls the
region through ``checkpoint(..., use_reentrant=True)``. Parameters are read
inside the region (through the graph's module), as in eager, so a region whose
inputs need no gradient gives its parameters none, exactly as eager does.

``torch.compile`` hands its backend each region as a subgraph that the graph
calls through ``torch.ops.higher_order.tag_activation_checkpoint``. The compfx
backend writes those subgraphs into the graph (:func:`inline_checkpoint_bodies`,
each op marked with its region, as a tracer marks it), so the region's ops are
keyed and planned in execution order like the rest, exactly as a captured
graph's; then it calls each region through the higher-order op again
(:func:`outline_checkpoint_regions`), casts included, for AOT autograd and
Inductor to recompute.

Nested checkpoints become one region, the outermost. Checkpointing entered
without ``checkpoint`` (``torch.distributed``'s composable ``checkpoint(module)``)
is found by its saved-tensor hook and kept with the default settings. Other
recomputation (a module's own saved-tensor hooks) is not seen: the capture
verification then finds more tensors saved than eager saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import sys
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["CHECKPOINT_META", "CheckpointedRegion", "CheckpointRegions", "CheckpointedGraph", "keep_checkpoints",
           "checkpointed_nodes", "is_reentrant_checkpoint", "inline_checkpoint_bodies", "outline_checkpoint_regions"]

#: ``node.meta`` entry: the :class:`CheckpointedRegion` a node computes in.
CHECKPOINT_META = "compfx_checkpoint"

_CHECKPOINT_CODE = inspect.unwrap(torch_checkpoint.checkpoint).__code__
_CHECKPOINT_OPTIONS = tuple(name for name in ("context_fn", "determinism_check", "debug", "early_stop")
                            if name in inspect.signature(torch_checkpoint.checkpoint).parameters)


@dataclasses.dataclass(eq=False)
class CheckpointedRegion:
    """One ``checkpoint(...)`` call of the model's forward, with the settings it was called with."""

    index: int
    use_reentrant: bool
    options: dict[str, Any]  # preserve_rng_state, and context_fn, determinism_check, ... (non-reentrant)

    def __repr__(self) -> str:
        return f"CheckpointedRegion({self.index}, use_reentrant={self.use_reentrant})"


class CheckpointRegions:
    """What a tracer asks while it runs: which checkpointed region (if any) the op it writes down is in."""

    def __init__(self):
        self._seen: dict[int, tuple[CheckpointedRegion, Any]] = {}  # id(frame or hook) -> (region, it, kept alive)
        self._reentrant: list[CheckpointedRegion] = []
        self.count = 0

    def current(self) -> CheckpointedRegion | None:
        """The outermost region the running code is in: a reentrant one the tracer opened, else the outermost
        ``checkpoint(..., use_reentrant=False)`` frame on the Python stack, else checkpointing entered without that
        function (``torch.distributed``'s composable ``checkpoint(module)``), whose saved-tensor hook is on top."""
        if self._reentrant:
            return self._reentrant[0]
        outermost = None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CHECKPOINT_CODE and frame.f_locals.get("use_reentrant") is False:
                outermost = frame
            frame = frame.f_back
        if outermost is None:
            return self._hooked_region()
        found = self._seen.get(id(outermost))
        if found is None or found[1] is not outermost:
            local = outermost.f_locals
            options = {"preserve_rng_state": local.get("preserve", True),
                       **{name: local[name] for name in _CHECKPOINT_OPTIONS if name in local}}
            found = self._seen[id(outermost)] = (self._new(False, options), outermost)
        return found[0]

    def _hooked_region(self) -> CheckpointedRegion | None:
        pack = _top_pack_hook()
        if pack is None or not getattr(pack, "__qualname__", "").startswith("_checkpoint_hook."):
            return None
        found = self._seen.get(id(pack))
        if found is None or found[1] is not pack:
            found = self._seen[id(pack)] = (self._new(False, {"preserve_rng_state": True}), pack)
        return found[0]

    @contextlib.contextmanager
    def reentrant(self, preserve_rng_state: bool):
        """Inside: ops are in a new ``use_reentrant=True`` region (unless already inside one)."""
        opened = self.current() is None
        if opened:
            self._reentrant.append(self._new(True, {"preserve_rng_state": preserve_rng_state}))
        try:
            yield
        finally:
            if opened:
                self._reentrant.pop()

    def run_reentrant(self, args: tuple):
        """What ``CheckpointFunction.apply(function, preserve_rng_state, *inputs)`` gives, traced: ``function``'s
        ops, with autograd on, in a reentrant region (not the Function's no-grad forward)."""
        function, preserve_rng_state, *inputs = args
        with self.reentrant(preserve_rng_state):
            return function(*inputs)

    def mark(self, node: fx.Node) -> None:
        region = self.current()
        if region is not None:
            node.meta[CHECKPOINT_META] = region

    def _new(self, use_reentrant: bool, options: dict) -> CheckpointedRegion:
        self.count += 1
        return CheckpointedRegion(self.count - 1, use_reentrant, options)


def _top_pack_hook():
    """The pack function of the innermost ``saved_tensors_hooks`` in force, or None."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # a torch without it: only checkpoint() frames are seen
        return None
    return hooks[0] if hooks else None


def is_reentrant_checkpoint(call) -> bool:
    """Is this custom-Function call (:class:`~compfx.graph_capture.functions.FunctionCall`) ``checkpoint(...,
    use_reentrant=True)``'s own Function?"""
    return call.function is torch_checkpoint.CheckpointFunction


def checkpointed_nodes(graph: fx.Graph) -> dict[CheckpointedRegion, list[fx.Node]]:
    """Each region's nodes in graph order: those marked with it, and any unmarked node a pass inserted between
    them (placeholders and ``get_attr`` reads stay outside: they compute nothing)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    marked: dict[CheckpointedRegion, list[fx.Node]] = {}
    for node in graph.nodes:
        region = node.meta.get(CHECKPOINT_META)
        if region is not None:
            marked.setdefault(region, []).append(node)
    regions = {}
    for region, nodes in marked.items():
        first, last = order[nodes[0]], order[nodes[-1]]
        inside = [n for n in graph.nodes if first <= order[n] <= last and n.op not in ("placeholder", "get_attr", "output")
                  and n.meta.get(CHECKPOINT_META, region) is region]
        while inside and _switches_grad_mode(inside[0]):
            inside.pop(0)
        regions[region] = inside
    return regions


def _switches_grad_mode(node: fx.Node) -> bool:
    """A tracer writes a grad-mode switch when the next op runs, so the switch back after a ``no_grad`` block that
    ended before ``checkpoint`` was called (Hugging Face's rotary embedding) lands at the start of the region; it
    belongs before it: ``checkpoint`` must be entered with autograd on, as in eager."""
    return node.op == "call_function" and node.target in (torch._C._set_grad_enabled, torch.is_grad_enabled)


class CheckpointedGraph(fx.Graph):
    """A flat graph whose generated code calls each checkpointed region through ``checkpoint``.

    Passes, the analysis and the cost model see every op (``graph.nodes`` is
    the flat list); :meth:`python_code` outlines each region into a small
    GraphModule and calls it as the model did, ``checkpoint(region, *inputs,
    use_reentrant=..., ...)``. The region reads parameters, buffers and
    submodules through the graph's owning module at call time.
    """

    def python_code(self, root_module: str, **kwargs):
        owner = self.owning_module
        regions = checkpointed_nodes(self) if owner is not None else {}
        if not regions:
            return super().python_code(root_module, **kwargs)
        return _outlined(self, regions, owner).python_code(root_module, **kwargs)

    def __deepcopy__(self, memo=None):
        copied = super().__deepcopy__(memo)
        copied.__class__ = CheckpointedGraph  # fx.Graph's copy is a plain Graph
        return copied


def keep_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm``'s code call its checkpointed regions through ``checkpoint`` (no-op without regions)."""
    if isinstance(gm.graph, CheckpointedGraph) or not any(CHECKPOINT_META in n.meta for n in gm.graph.nodes):
        return gm
    graph = gm.graph
    graph.__class__ = CheckpointedGraph
    gm.recompile()
    return gm


class RegionCall:
    """The target of an outlined region's call: ``checkpoint(body, *inputs, use_reentrant=..., ...)``."""

    def __init__(self, body: fx.GraphModule, region: CheckpointedRegion):
        self.body, self.region = body, region
        self.__name__ = self.__qualname__ = f"checkpointed_region_{region.index}"

    def __call__(self, *inputs):
        return torch_checkpoint.checkpoint(self.body, *inputs, use_reentrant=self.region.use_reentrant,
                                           **self.region.options)


def _outlined(graph: fx.Graph, regions: dict[CheckpointedRegion, list[fx.Node]], owner: nn.Module) -> fx.Graph:
    """A plain copy of ``graph`` with each region replaced by a :class:`RegionCall` and ``getitem`` s."""
    outlined = fx.Graph()
    outlined.set_codegen(graph._codegen)
    members = {node: region for region, nodes in regions.items() for node in nodes}
    first = {nodes[0]: region for region, nodes in regions.items()}
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in first:
            region = first[node]
            _emit_region(outlined, regions[region], region, owner, env)
        elif node not in members and not (node.op == "get_attr" and node.users and set(node.users) <= members.keys()):
            env[node] = outlined.node_copy(node, env.__getitem__)  # (a read only regions use: they read it)
    return outlined


def _emit_region(outlined: fx.Graph, nodes: list[fx.Node], region: CheckpointedRegion, owner: nn.Module,
                 env: dict[fx.Node, fx.Node]) -> None:
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr":
                inputs.setdefault(arg)
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    body_graph = fx.Graph()
    body_env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        body_env[node] = body_graph.placeholder(node.name)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in body_env:  # read through the owner when the region runs
                body_env[arg] = body_graph.get_attr(f"{_OWNER}.{arg.target}")
        copied = body_graph.node_copy(node, body_env.__getitem__)
        if copied.op == "call_module":
            copied.target = f"{_OWNER}.{copied.target}"
        body_env[node] = copied
    body_graph.output(tuple(body_env[n] for n in outputs))
    body = fx.GraphModule(nn.Module(), fx.Graph(), class_name=f"CheckpointedRegion{region.index}")
    object.__setattr__(body, _OWNER, owner)  # not a child module: the state is the owner's
    body.graph = body_graph
    call = outlined.call_function(RegionCall(body, region), tuple(env[n] for n in inputs))
    for i, node in enumerate(outputs):
        env[node] = outlined.call_function(operator.getitem, (call, i))


_OWNER = "_compfx_owner"


# -- the regions of a graph that torch.compile hands a backend -------------------------------------------------------

#: The higher-order op dynamo calls a checkpointed region's subgraph through.
_TAG = torch.ops.higher_order.tag_activation_checkpoint


def _is_tagged_region(node: fx.Node) -> bool:
    """A call of a region's subgraph whose results are read one by one (as dynamo writes it)."""
    return (node.op == "call_function" and node.target is _TAG and bool(node.args)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and all(user.op == "call_function" and user.target is operator.getitem for user in node.users))


def inline_checkpoint_bodies(gm: fx.GraphModule) -> int:
    """Write each checkpointed region that dynamo passes as a subgraph (``tag_activation_checkpoint(body, *inputs,
    use_reentrant=...)``) into ``gm``'s own graph, its nodes marked with their :class:`CheckpointedRegion`; a region
    nested in another joins the outer one. Returns how many regions were written in.

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> found = []
    >>> def backend(gm, example_inputs):
    ...     found.append((inline_checkpoint_bodies(gm), len(checkpointed_nodes(gm.graph))))
    ...     return outline_checkpoint_regions(gm).forward
    >>> _ = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False), backend=backend)(torch.randn(2, 4))
    >>> found  # one region written into the graph and marked, then called through the higher-order op again
    [(1, 1)]
    >>> torch._dynamo.reset()  # forget the compiled lambda while its globals live
    """
    regions = 0
    for node in list(gm.graph.nodes):
        if _is_tagged_region(node):
            body = getattr(gm, node.args[0].target)
            inline_checkpoint_bodies(body)  # a region inside it joins this one
            options = {k: v for k, v in node.kwargs.items() if k != "use_reentrant"}
            _inline(gm, node, body, CheckpointedRegion(regions, bool(node.kwargs.get("use_reentrant", False)), options))
            regions += 1
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions


def _inline(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, region: CheckpointedRegion) -> None:
    """``body``'s nodes in place of ``call`` (its ``getitem`` users read the body's outputs), marked ``region``."""
    env: dict[fx.Node, Any] = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], call.args[1:]))
    outputs: Any = ()
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = fx.map_arg(node.args[0], env.__getitem__)
                break
            if node.op == "get_attr":  # the body's own attribute (a constant): the graph takes it over
                name = _free_name(gm, f"{call.args[0].target}_{node.target.replace('.', '_')}")
                setattr(gm, name, _attribute(body, node.target))
                copied = gm.graph.get_attr(name)
                copied.meta = dict(node.meta)
            else:
                copied = gm.graph.node_copy(node, env.__getitem__)
            copied.meta[CHECKPOINT_META] = region
            env[node] = copied
    for user in list(call.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    attribute = call.args[0]
    gm.graph.erase_node(call)
    if not attribute.users:
        gm.graph.erase_node(attribute)
        delattr(gm, attribute.target)


def outline_checkpoint_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Call each marked region of ``gm``'s graph (its ops and any casts a pass put among them) through
    ``tag_activation_checkpoint`` again, as dynamo does, for AOT autograd and Inductor to recompute in backward.
    Returns ``gm``."""
    regions = checkpointed_nodes(gm.graph)
    for region, nodes in regions.items():
        _outline(gm, region, nodes)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return gm


def _outline(gm: fx.GraphModule, region: CheckpointedRegion, nodes: list[fx.Node]) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(arg for node in nodes for arg in node.all_input_nodes if arg not in inside))
    outputs = [node for node in nodes if any(user not in inside for user in node.users)]
    graph = fx.Graph()
    env = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    name = _free_name(gm, f"compfx_checkpointed_region_{region.index}")
    gm.add_submodule(name, fx.GraphModule(gm, graph, class_name=f"CheckpointedRegion{region.index}"))
    with gm.graph.inserting_after(nodes[-1]):  # every input is defined before the region's last op
        body = gm.graph.get_attr(name)
        with gm.graph.inserting_after(body):
            call = gm.graph.call_function(_TAG, (body, *inputs),
                                          {"use_reentrant": region.use_reentrant, **region.options})
    call.meta["val"] = tuple(node.meta.get("val") for node in outputs)
    last = call
    for i, node in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, i))
        last.meta = {key: node.meta[key] for key in ("val", "tensor_meta", "example_value") if key in node.meta}
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def _free_name(gm: fx.GraphModule, name: str) -> str:
    candidate, i = name, 0
    while hasattr(gm, candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate


def _attribute(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module
