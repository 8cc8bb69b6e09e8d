"""The kernels a compiled plan runs: a rewritten graph read as Inductor fuses it. The cost model's one fusion rule.

Under ``torch.compile`` a plan's graph does not run op by op. Inductor hands GEMMs, convolutions and attention to
library kernels of their own (*extern* kernels: cuBLAS, oneDNN, flash attention), and generates the rest --
elementwise ops, norms, reductions, and the casts between them -- as few fused kernels, each reading its inputs
and writing its outputs once. So a compiled plan costs, per step:

* each extern op at its own precision (profiled compiled: :mod:`compfx.costmodel.compiled_profile`);
* each fused kernel by the bytes crossing its boundary (what it reads and writes), not per op;
* no cast that fusion removes: a cast fed by, or feeding, an elementwise op (through views) is part of that op's
  kernel, and only changes the bytes at its boundary;
* a cast that fuses with nothing is a kernel of its own: a cast of a parameter (paid once per step, however many
  ops read it), or a cast between extern ops or from a graph input. Per-use casts of one tensor to one dtype are
  one kernel (the compiler's common-subexpression elimination merges them).

:func:`fuse` applies this rule to a graph with fresh ``meta["val"]`` (as
:func:`compfx.planned_module.planned_graph` makes it); the
pricing is :mod:`compfx.costmodel.compiled_pricing`'s.

>>> import torch, compfx
>>> from compfx.planned_module import planned_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.GELU(), torch.nn.Linear(16, 16))
>>> a = compfx.analyze(model, torch.randn(8, 16))
>>> relu, gelu = a.ops[1].key, a.ops[2].key
>>> plan = compfx.Plan.fp32(a).with_precisions({gelu: "low"})  # relu in FP32, gelu low: a cast between them
>>> fusion = fuse(planned_graph(model, plan, a))
>>> [str(k) for k in fusion.extern], [[str(k) for k in kernel.ops] for kernel in fusion.kernels]
(['0:linear#0', '3:linear#0'], [['1:relu#0', '2:gelu#0']])
>>> len(fusion.fused_casts), len(fusion.charged_casts)
(2, 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..graph_capture import meta_value
from ..cast_policy import COMPOSITE_KINDS
from ..opkey import KEY_META, OpKey
from ..passes import CastInfo, casts_in
from ..tensor_cores import CONV_KINDS, GEMM_KINDS

__all__ = ["EXTERN_KINDS", "FusedKernel", "Fusion", "fuse", "runs_as_own_kernel"]

#: Op kinds Inductor calls a library kernel for (cuBLAS / oneDNN GEMMs and convolutions, fused attention, the
#: RNNs), never fusing them with their neighbours. Every other numerical op is generated, and fuses.
EXTERN_KINDS = frozenset(GEMM_KINDS | CONV_KINDS | COMPOSITE_KINDS | {
    "mv", "addmv", "chain_matmul", "linalg_multi_dot", "conv_tbc", "mkldnn_rnn_layer", "cudnn_rnn",
    "scaled_dot_product_attention", "scaled_dot_product_flash_attention", "scaled_dot_product_efficient_attention",
})


def runs_as_own_kernel(node: fx.Node) -> bool:
    """Is ``node`` an extern op: a keyed op of :data:`EXTERN_KINDS`, or a module call (an FP8 matmul, an op under
    autocast, a leaf module), which the compiler cannot fuse into its neighbours' kernels?"""
    if node.op == "call_module":
        return True
    key = node.meta.get(KEY_META)
    return key is not None and key.kind in EXTERN_KINDS


@dataclass(frozen=True)
class FusedKernel:
    """One kernel the compiler generates: the keyed ops in it, the casts it absorbed, and the bytes it reads and
    writes at its boundary, by dtype (``(dtype, bytes)`` pairs)."""

    ops: tuple[OpKey, ...]
    bytes: tuple[tuple[torch.dtype, int], ...]
    casts: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.bytes)


@dataclass(frozen=True)
class Fusion:
    """A graph read as a compiled program: its extern ops, its fused kernels, and its casts -- those fusion removes
    (``fused_casts``) and those that run as kernels of their own (``charged_casts``, one per distinct cast)."""

    extern: tuple[OpKey, ...]
    kernels: tuple[FusedKernel, ...]
    charged_casts: tuple[CastInfo, ...] = field(default=(), repr=False)
    fused_casts: tuple[CastInfo, ...] = field(default=(), repr=False)


def fuse(gm: fx.GraphModule) -> Fusion:
    """Read ``gm`` (fresh ``meta["val"]`` on every node) as the kernels its compiled program runs: see the module
    docstring for the rule."""
    casts = {cast.node: cast for cast in casts_in(gm) if cast.src is not None}
    nodes = list(gm.graph.nodes)
    groups = _Groups(node for node in nodes if _fusible(node, casts))
    for node in nodes:
        if node in groups:
            for arg in node.all_input_nodes:
                if arg in groups and _carries_tensor(arg):
                    groups.join(arg, node)
    by_name = {node.name: node for node in nodes}
    kernels, fused, charged, seen = [], [], [], set()
    for members in groups.components():
        ops = tuple(n.meta[KEY_META] for n in members if KEY_META in n.meta)
        absorbed = [casts[n.name] for n in members if n.name in casts]
        if ops:
            kernels.append(FusedKernel(ops, _boundary_bytes(members), tuple(c.node for c in absorbed)))
            fused.extend(absorbed)
        else:  # views and casts between extern ops or graph inputs: each distinct cast is a kernel
            for cast in absorbed:
                merged = (by_name[cast.node].args[0], cast.dst)
                if merged not in seen:
                    seen.add(merged)
                    charged.append(cast)
    charged.extend(cast for cast in casts.values() if cast.parameter)
    order = {node.name: i for i, node in enumerate(nodes)}
    extern = tuple(node.meta[KEY_META] for node in nodes if KEY_META in node.meta and runs_as_own_kernel(node))
    return Fusion(extern, tuple(kernels), tuple(sorted(charged, key=lambda c: order[c.node])),
                  tuple(sorted(fused, key=lambda c: order[c.node])))


def _fusible(node: fx.Node, casts: dict[str, CastInfo]) -> bool:
    """Can the compiler put ``node`` into a generated kernel? Keyed ops that are not extern, casts other than of
    parameters (those are paid once per step, on their own), and the unkeyed calls between them (views, getitem)."""
    if node.op not in ("call_function", "call_method"):
        return False  # placeholders, parameters, the output, extern module calls
    if node.name in casts:
        return not casts[node.name].parameter
    return not runs_as_own_kernel(node)


def _carries_tensor(node: fx.Node) -> bool:
    """Does ``node``'s value hold a tensor? Sizes and other Python values join no kernels."""
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(meta_value(node)))


def _tensor_bytes(node: fx.Node) -> list[tuple[torch.dtype, int]]:
    return [(leaf.dtype, leaf.numel() * leaf.element_size()) for leaf in pytree.tree_leaves(meta_value(node))
            if isinstance(leaf, torch.Tensor)]


def _boundary_bytes(members: list[fx.Node]) -> tuple[tuple[torch.dtype, int], ...]:
    """Bytes read from outside the kernel (each input once) and written for use outside it, by dtype."""
    inside = set(members)
    inputs = {arg for node in members for arg in node.all_input_nodes if arg not in inside}
    outputs = [node for node in members if any(user not in inside for user in node.users)]
    total: dict[torch.dtype, int] = {}
    for node in [*sorted(inputs, key=lambda n: n.name), *outputs]:
        for dtype, size in _tensor_bytes(node):
            total[dtype] = total.get(dtype, 0) + size
    return tuple(sorted(total.items(), key=lambda item: str(item[0])))


class _Groups:
    """Union-find over the fusible nodes; components come out in graph order, their members in graph order."""

    def __init__(self, nodes: Iterable[fx.Node]):
        self._order = {node: i for i, node in enumerate(nodes)}
        self._parent = {node: node for node in self._order}

    def __contains__(self, node: fx.Node) -> bool:
        return node in self._parent

    def _root(self, node: fx.Node) -> fx.Node:
        while self._parent[node] is not node:
            self._parent[node] = self._parent[self._parent[node]]
            node = self._parent[node]
        return node

    def join(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self._root(a), self._root(b)
        if ra is not rb:
            first, second = sorted((ra, rb), key=self._order.__getitem__)
            self._parent[second] = first

    def components(self) -> list[list[fx.Node]]:
        found: dict[fx.Node, list[fx.Node]] = {}
        for node in self._order:
            found.setdefault(self._root(node), []).append(node)
        return sorted(found.values(), key=lambda members: self._order[members[0]])
