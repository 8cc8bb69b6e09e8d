"""The model's own ``torch.autocast`` blocks, kept in the graph; ops in an ``enabled=False`` block are *pinned*.

Model code pins computations to FP32 the way autocast's documentation says:
``with torch.autocast(device_type, enabled=False):`` around rotary angles,
router logits or a loss, with ``.float()`` on the inputs. Autocast then casts
nothing inside the block. compfx keeps the block and what it means:

* **In the graph.** Every tracer writes the block as dynamo does,
  ``torch.amp.autocast_mode._enter_autocast(device, dtype, enabled, cache)`` ...
  ``_exit_autocast(enter)``, so the planned graph opens the same block where
  the model did. The symbolic and recording tracers hear of a block through
  :class:`AutocastBlocks`: PyTorch tells a ``PreDispatchTorchFunctionMode``
  (what ``torch.export`` uses to keep autocast) when a block opens and closes.
* **Pinned ops.** :func:`mark_pinned` marks every op of an ``enabled=False``
  block of its own device type (``meta[PINNED_META]``); the analysis reads it
  (``OpInfo.pinned``). ``Plan.amp`` runs pinned ops in FP32, the search never
  lowers them unless told to (``SearchConfig(search_pinned=True)``), and the
  report marks them.
* **Blocks that open only under autocast.** Hugging Face's ``maybe_autocast``
  opens ``autocast(enabled=False)`` only when autocast is on. Capture runs with
  autocast on for the model's device, at FP32 (:func:`autocast_probe`), which
  casts nothing in an FP32 model: the model opens the blocks it opens under
  the user's autocast. A model that holds half-precision tensors is captured
  without it (autocast would cast them).

>>> import torch, compfx
>>> class Head(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc = torch.nn.Linear(4, 4)
...     def forward(self, x):
...         with torch.autocast("cpu", enabled=False):
...             return self.fc(x.float())
>>> a = compfx.analyze(Head(), torch.randn(2, 4))
>>> [(str(op.key), op.pinned) for op in a.ops], str(compfx.Plan.amp(a)[a.ops[0].key])
([('fc:linear#0', True)], 'fp32')
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ._sites import causes
from .nodes import meta_value

__all__ = ["ENTER", "EXIT", "PINNED_META", "AutocastBlocks", "autocast_probe", "AutocastRefusedError", "mark_pinned",
           "is_pinned", "holds_half_precision"]

ENTER, EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast

#: ``node.meta`` flag on every op inside one of the model's ``autocast(enabled=False)`` blocks.
PINNED_META = "compfx_pinned"

#: The dtype :func:`autocast_probe` runs autocast at: it casts nothing in an FP32 model.
_PROBE_DTYPE = torch.float32

AddNode = Callable[[Callable, tuple], fx.Node]


class AutocastBlocks(PreDispatchTorchFunctionMode):
    """While a tracer runs the model, writes each ``torch.autocast`` block it opens with ``add_node(target, args)``.

    ``torch.autocast`` reports its ``__enter__`` and ``__exit__`` to a
    ``PreDispatchTorchFunctionMode`` (after setting autocast's state as usual);
    every other call passes through untouched.
    """

    def __init__(self, add_node: AddNode):
        TorchFunctionMode.__init__(self)
        self._add_node = add_node
        self._open: list[fx.Node] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is ENTER:
            device, dtype, enabled, cache = args
            dtype = None if _probing(device) and dtype == _PROBE_DTYPE else dtype  # the block named no dtype
            self._open.append(self._add_node(ENTER, (device, dtype, enabled, cache)))
            return None
        if func is EXIT:
            self._add_node(EXIT, (self._open.pop(),))
            return None
        return func(*args, **(kwargs or {}))


_PROBED: set[str] = set()


def _probing(device_type: str) -> bool:
    return device_type in _PROBED


class AutocastRefusedError(CaptureError):
    """Under :func:`autocast_probe`, autocast refused an op of the model (CUDA autocast refuses
    ``binary_cross_entropy``): the capture is made again without the probe."""


#: What torch's autocast says when it refuses an op. It raises a plain RuntimeError, so its message is all that tells
#: the refusal apart; :func:`autocast_probe` reads it, once, and raises :class:`AutocastRefusedError` instead.
_REFUSAL = "unsafe to autocast"


@contextlib.contextmanager
def autocast_probe(device_type: str):
    """Run with autocast on for ``device_type`` at FP32, so that code that asks ``torch.is_autocast_enabled``
    before opening an ``autocast(enabled=False)`` block (``maybe_autocast``) opens it; autocast's state is
    put back afterwards. FP32 autocast casts no FP32 or FP64 tensor; check the result with
    :func:`holds_half_precision`. A capture error whose cause is autocast refusing an op becomes an
    :class:`AutocastRefusedError`."""
    if not torch.amp.is_autocast_available(device_type) or torch.is_autocast_enabled(device_type):
        yield  # no autocast there, or the caller's own is on: leave it as it is
        return
    dtype = torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, _PROBE_DTYPE)
    _PROBED.add(device_type)
    try:
        yield
    except CaptureError as error:
        if any(isinstance(cause, RuntimeError) and _REFUSAL in str(cause) for cause in causes(error)):
            raise AutocastRefusedError(str(error)) from error
        raise
    finally:
        _PROBED.discard(device_type)
        torch.set_autocast_enabled(device_type, False)
        torch.set_autocast_dtype(device_type, dtype)


def holds_half_precision(gm: fx.GraphModule) -> bool:
    """Does any value in the graph hold an fp16 or bf16 tensor (which :func:`autocast_probe` may have cast)?"""
    return any(isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16)
               for node in gm.graph.nodes for leaf in pytree.tree_leaves(meta_value(node)))


def mark_pinned(gm: fx.GraphModule) -> int:
    """Mark the ops inside the graph's ``autocast(enabled=False)`` blocks (``meta[PINNED_META]``); returns how many.

    An op is pinned when the innermost block of its own device type disables
    autocast: a block for ``"cuda"`` leaves a CPU op as it is, as autocast does.
    """
    open_blocks: list[tuple[str, bool]] = []
    pinned = 0
    for node in gm.graph.nodes:
        node.meta.pop(PINNED_META, None)
        if node.op == "call_function" and node.target is ENTER:
            open_blocks.append((str(node.args[0]), bool(node.args[2])))
        elif node.op == "call_function" and node.target is EXIT:
            if open_blocks:
                open_blocks.pop()
        elif open_blocks and node.op in ("call_function", "call_method", "call_module"):
            device = _device_type(node)
            block = next((enabled for block_device, enabled in reversed(open_blocks) if block_device == device), None)
            if block is False:
                node.meta[PINNED_META] = True
                pinned += 1
    return pinned


def is_pinned(node: fx.Node) -> bool:
    """Is ``node`` inside one of the model's ``autocast(enabled=False)`` blocks (see :func:`mark_pinned`)?"""
    return bool(node.meta.get(PINNED_META))


def _device_type(node: fx.Node) -> str | None:
    for leaf in pytree.tree_leaves(meta_value(node)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return None
