"""The analysis of a model's blocks alone: ``per_module=(Block, ...)`` plans a model block by block.

:func:`analyze_regions` runs the model once and captures each (outermost)
submodule of the ``per_module`` types on its own, with the inputs it
received, when it is first called. The rest of the model is not captured at
all, so a model that cannot be captured whole plans its blocks. The result is
one :class:`~compfx.analysis.Analysis` whose ops are keyed by model path
(``blocks.0.fc:linear#0``, :func:`model_key`) and whose graph holds the blocks'
graphs side by side (:func:`regions_graph`, what the cost model prices).

Applying a plan block by block is the apply stage's (:mod:`compfx.per_module`);
a block planned already stands in for its block here (:class:`BlockStandIn`):
it counts as its block's type, and its own captures are reused.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> [str(k) for k in analyze_regions(model, torch.randn(3, 4), torch.nn.Linear).keys]
['0:linear#0', '2:linear#0']
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from .analysis import Analysis, analyze_graph
from .batches import model_device
from .graph_capture import capture, input_signature, modes_of, normalize_example_inputs
from .errors import BadInputError
from .opkey import KEY_META, OpKey
from .state import buffers_restored, torch_rng_preserved
from .vocabulary import check_low_dtype, default_low_dtype

__all__ = ["BlockStandIn", "block_types", "region_paths", "model_key", "in_region", "analyze_regions",
           "captured_regions", "regions_analysis", "regions_graph", "is_regions_analysis", "REGIONS_METHOD",
           "BLOCK_METHODS"]

#: ``Analysis.capture_method`` of an analysis made of the blocks' own captures.
REGIONS_METHOD = "per_module"

#: ``gm.meta`` entry of a regions analysis's placeholder graph: the tracer that captured each block, by path.
BLOCK_METHODS = "compfx_block_methods"


class BlockStandIn(nn.Module):
    """A module in the place of one of a model's blocks, standing for it (:class:`compfx.per_module.PlannedBlock`).

    The regions count it as a block of :attr:`block_type`, and take the block's analysis from
    :meth:`analysis_for` (which it keeps) instead of capturing the block again.
    """

    block_type: type

    def analysis_for(self, *args, **kwargs) -> Analysis:
        """The block's analysis (block-relative keys) at these inputs."""
        raise NotImplementedError


def block_types(per_module) -> tuple[type, ...]:
    """``per_module`` as a tuple of ``nn.Module`` subclasses; :class:`BadInputError` for anything else.

    >>> block_types(torch.nn.Linear), block_types([torch.nn.Linear, torch.nn.GELU])
    ((<class 'torch.nn.modules.linear.Linear'>,), (<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.modules.activation.GELU'>))
    """
    types = (per_module,) if isinstance(per_module, type) else tuple(per_module)
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if not types or bad:
        raise BadInputError(f"per_module={per_module!r}; expected nn.Module classes, e.g. per_module=(Block,) for "
                            "the model's transformer block class.")
    return types


def _matches(module: nn.Module, types: tuple[type, ...]) -> bool:
    if isinstance(module, BlockStandIn):
        return issubclass(module.block_type, types)
    return isinstance(module, types)


def region_paths(model: nn.Module, per_module) -> list[str]:
    """Paths of the outermost submodules of ``model`` of the ``per_module`` types (a block inside a block is
    the outer block's), in registration order; :class:`BadInputError` when there is none.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    >>> region_paths(model, torch.nn.Linear)
    ['0', '1.0']
    """
    types = block_types(per_module)
    if _matches(model, types):
        raise BadInputError(f"per_module names the model's own class {type(model).__name__}; per_module is for its "
                            "blocks. Call compfx.apply(model, plan, analysis=...) without it to plan the model whole.")
    paths: list[str] = []
    for name, module in model.named_modules():
        if name and _matches(module, types) and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    if not paths:
        raise BadInputError(f"{type(model).__name__} has no submodule of type(s) "
                            f"{', '.join(t.__name__ for t in types)}; expected per_module to name the class of its "
                            f"blocks (its children are {', '.join(type(m).__name__ for m in model.children()) or '-'}).")
    return paths


def model_key(path: str, key: OpKey) -> OpKey:
    """A block's own OpKey (relative to the block) as the model-wide key of the block at ``path``.

    >>> str(model_key("blocks.0", OpKey("fc", "linear", 0))), str(model_key("blocks.0", OpKey("", "add", 1)))
    ('blocks.0.fc:linear#0', 'blocks.0:add#1')
    """
    return OpKey(f"{path}.{key.module}" if key.module else path, key.kind, key.index)


def in_region(key: OpKey, paths: Iterable[str]) -> bool:
    """Is the op of model-wide ``key`` inside one of the blocks at ``paths``?

    >>> in_region(OpKey("blocks.0.fc", "linear", 0), ["blocks.0"]), in_region(OpKey("head", "linear", 0), ["blocks.0"])
    (True, False)
    """
    return any(key.module == p or key.module.startswith(p + ".") for p in paths)


def analyze_regions(model: nn.Module, example_inputs, per_module, *, device=None,
                    low_dtype: torch.dtype | None = None, verify: bool = True) -> Analysis:
    """The ops of the ``per_module`` blocks of ``model``, keyed by model path, in the order the blocks run.

    ``model`` runs once on ``example_inputs`` (no grad; its buffers and the
    RNG are put back); each block is captured on its own, with the inputs it
    received, when it is first called. The rest of the model is not captured
    at all, so a model that cannot be captured whole plans its blocks. Under
    FSDP2 the capture happens inside each block's call, where its Parameters
    are unsharded. Each block's capture is verified against the block (see
    :func:`compfx.analyze`) unless ``verify`` is False; the blocks' graphs are
    captured again later with the tracer that passed.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> [str(k) for k in analyze_regions(model, torch.randn(3, 4), torch.nn.Linear).keys]
    ['0:linear#0', '2:linear#0']
    """
    return regions_analysis(*captured_regions(model, example_inputs, per_module, device, low_dtype, verify))


def regions_analysis(captured: Mapping[str, Analysis], signatures, device, low_dtype) -> Analysis:
    """One analysis of the blocks :func:`captured_regions` captured: their ops under model keys, their graphs side
    by side."""
    ops = tuple(dataclasses.replace(op, key=model_key(path, op.key)) for path in captured for op in captured[path].ops)
    graph = regions_graph(captured)  # no graph of the whole model exists: the blocks' graphs side by side
    graph.meta[BLOCK_METHODS] = {path: captured[path].capture_method for path in captured}
    return Analysis(ops, device, low_dtype, graph, REGIONS_METHOD)


def captured_regions(model: nn.Module, example_inputs, per_module, device, low_dtype, verify: bool):
    """Each block's analysis (block-relative keys) and the input signature it was captured at, by path."""
    paths = region_paths(model, per_module)
    device = torch.device(device) if device is not None else model_device(model)
    low_dtype = check_low_dtype(low_dtype if low_dtype is not None else default_low_dtype(device))
    args, kwargs = normalize_example_inputs(example_inputs)
    captured: dict[str, Analysis] = {}
    signatures: dict[str, Hashable] = {}
    started: set[str] = set()  # the record tracer calls the block itself, which fires this hook again: once is enough

    def capture_block(path):
        def hook(module, block_args, block_kwargs):
            if path in started:
                return None
            started.add(path)
            signatures[path] = input_signature(block_args, block_kwargs, modes_of(module))
            if isinstance(module, BlockStandIn):
                captured[path] = module.analysis_for(*block_args, **block_kwargs)
            else:
                gm = capture(module, (block_args, block_kwargs),
                             modes={name: m.training for name, m in module.named_modules()}, verify=verify)
                captured[path] = analyze_graph(gm, device=device, low_dtype=low_dtype)
            return None
        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(capture_block(p), with_kwargs=True) for p in paths]
    try:
        with torch.no_grad(), torch_rng_preserved(device), buffers_restored(model):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [p for p in paths if p not in captured]
    if missing:
        raise BadInputError(f"the blocks {missing[:3]} did not run on the example inputs, so compfx could not see what "
                            "they compute; give inputs that run every block, or name other types in per_module.")
    return captured, signatures, device, low_dtype


def regions_graph(captured: Mapping[str, Analysis]) -> fx.GraphModule:
    """The blocks' captured graphs side by side in one GraphModule, keyed by model path: what the cost model prices.

    No graph of the whole model exists (the code between the blocks was never
    captured); the cost model needs only each op's node -- its metadata, its
    inputs, the modules and parameters it reads -- and the casts a plan puts
    between them, which this graph holds block by block. Each block's inputs
    are placeholders of their own, its outputs are part of the graph's output,
    its op keys model keys (``blocks.0.fc:linear#0``), and its modules and
    parameters the block's own objects under the block's path.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = analyze_regions(model, torch.randn(3, 4), torch.nn.Linear).graph_module
    >>> [str(n.meta[KEY_META]) for n in gm.graph.nodes if KEY_META in n.meta], gm.get_parameter("2.weight") is model[2].weight
    (['0:linear#0', '2:linear#0'], True)
    """
    graph = fx.Graph()
    state: dict[str, object] = {}
    outputs = []
    for path, analysis in captured.items():
        block_gm = analysis.graph_module
        env: dict[fx.Node, fx.Node] = {}
        for node in block_gm.graph.nodes:
            if node.op == "output":
                outputs.append(fx.map_arg(node.args[0], env.__getitem__))
                continue
            if node.op == "placeholder":  # one argument per block input, named after its block
                copied = graph.placeholder(f"region_{path}_{node.target}".replace(".", "_").replace("*", ""))
                copied.meta = dict(node.meta)
            else:
                copied = graph.node_copy(node, env.__getitem__)
            if node.op in ("get_attr", "call_module"):
                copied.target = f"{path}.{node.target}"
                state[copied.target] = _attribute(block_gm, node.target)
            if KEY_META in node.meta:
                copied.meta[KEY_META] = model_key(path, node.meta[KEY_META])
            env[node] = copied
    graph.output(tuple(outputs))
    return fx.GraphModule(state, graph, class_name="Regions")


def _attribute(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def is_regions_analysis(analysis: Analysis) -> bool:
    """True for an analysis of the blocks alone (:func:`analyze_regions`): its plans are applied per block."""
    return analysis.capture_method == REGIONS_METHOD
