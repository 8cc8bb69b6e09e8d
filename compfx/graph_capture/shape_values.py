"""Tensors whose values the example's shapes decide: the recording tracer computes them for real.

A recorded graph is specialised to its example's shapes. A tensor a
deterministic factory makes from Python numbers (``torch.arange(seq_len)``,
``torch.ones(n, n).tril()``), and every op on such tensors alone, has the same
values on every call the graph serves; eager code may read those values into
Python and choose its path by them. Hugging Face's decoders do: with no
attention mask and no KV cache (training with ``use_cache=False``), they make
``position_ids`` with ``arange`` and look at them to see whether the batch
packs several sequences; when it does not, attention calls SDPA with
``is_causal=True``. On FakeTensors that check cannot read values, and
transformers, which reads a FakeTensor as tracing, builds a 4-D causal mask
instead: another kernel, other rounding. So the recorder runs such calls on
real tensors (each call is still written into the graph, which makes the
tensor anew on every call), and the model's Python takes eager's path.

A call stays fake when it draws random numbers (each step draws anew), makes
uninitialised memory (``torch.empty``), or makes a leaf that requires grad.
A shape-decided tensor that a fake call writes into
(``torch.zeros(n, d).index_add_(0, index, messages)``) is one no longer: its
later uses are faked (FakeTensorMode takes it in as the fake it wrote), and so
is every tensor that shares its memory.

>>> values = ShapeValues()
>>> values.decides(torch.arange, (4,), {}), values.decides(torch.randn, (4,), {}), values.decides(torch.empty, (4,), {})
(True, False, False)
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from .draws import draws_random_numbers

__all__ = ["ShapeValues"]

#: Words in the names of calls that draw random numbers but whose ATen op has another name (``F.dropout2d`` runs
#: ``feature_dropout``, ``F.gumbel_softmax`` an ``exponential_``): such a call stays fake whatever its tags say.
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson", "uniform", "exponential",
                 "cauchy", "geometric", "gumbel", "rrelu")
#: Factories whose values are whatever the memory held.
_UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class ShapeValues:
    """Which real tensors of a recording run hold values that the example's shapes decide."""

    def __init__(self):
        self._tensors: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids are not reused)

    def holds(self, value) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self._tensors

    def decides(self, func, args, kwargs) -> bool:
        """Would ``func(*args, **kwargs)`` give values the shapes decide: every tensor argument is such a tensor
        (or there is none), and the call neither draws random numbers, makes uninitialised memory, nor makes a
        tensor that requires grad?"""
        name = getattr(func, "__name__", "")
        if (not name or name in _UNINITIALISED or any(word in name.lower() for word in _RANDOM_WORDS)
                or draws_random_numbers(func) or kwargs.get("requires_grad")):
            return False
        leaves = pytree.tree_leaves((args, kwargs))
        return all(self.holds(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))

    def computing(self, decided: bool):
        """The context a call runs in: real tensors where the shapes decide its values, else the FakeTensorMode."""
        return unset_fake_temporarily() if decided else contextlib.nullcontext()

    def add(self, result) -> None:
        """Take the tensors of ``result`` (a call the shapes decide) as shape-decided; a meta tensor has no values."""
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._tensors[id(leaf)] = leaf

    def written(self, targets) -> None:
        """A fake call wrote ``targets``: they, and every shape-decided tensor sharing their memory, are no longer."""
        storages = {_storage(t) for t in targets if self.holds(t)}
        if storages:
            self._tensors = {i: t for i, t in self._tensors.items() if _storage(t) not in storages}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
