"""Where a capture went wrong, told as a line of the user's code.

A tracer's failure is worth reporting only with the file and line in the
user's model that caused it, not the torch or compfx frame that noticed.
Private to the package: the tracers and :func:`compfx.graph_capture.capture` share it.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
import types
from typing import Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..errors import CaptureError, ExplainedCaptureError

# ExplainedCaptureError is compfx.errors' (users catch it there); its old import path from here keeps working
__all__ = ["user_line", "user_frame", "frame_site", "error_site", "first_line", "ValueBranchError", "ValueReadError",
           "ExplainedCaptureError", "with_progress", "causes", "reads_a_value"]


_SKIPPED_DIRS = (  # torch's folder and compfx's (this file's grandparent)
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not path.startswith(_SKIPPED_DIRS) and not filename.startswith("<")


def _format_frame(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"


def user_line(frames: Iterable[traceback.FrameSummary] | None = None) -> str:
    """File:line and source of the innermost frame outside torch and compfx."""
    frames = list(traceback.extract_stack() if frames is None else frames)
    for frame in reversed(frames):
        if _is_user_frame(frame.filename):
            return _format_frame(frame)
    return "an unknown line"


def user_frame() -> types.FrameType | None:
    """The innermost running frame outside torch and compfx (the frame :func:`user_line` names), or None."""
    frame = sys._getframe(1)
    while frame is not None and not _is_user_frame(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_site(frame: types.FrameType | None) -> str:
    """``frame``'s file:line and source, as :func:`user_line` writes them."""
    if frame is None:
        return "an unknown line"
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    return f"{filename}:{lineno} ({linecache.getline(filename, lineno).strip()})"


def error_site(error: BaseException) -> str:
    """Where ``error`` was raised in user code (dynamo keeps that in ``real_stack``)."""
    real_stack = getattr(error, "real_stack", None)
    if real_stack:
        return user_line(real_stack)
    return user_line(traceback.extract_tb(error.__traceback__))


def first_line(error: BaseException) -> str:
    """``'ValueError: the first line of its message'``: an error in a few words, to quote inside another."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class ValueBranchError(CaptureError):
    """The model branches on tensor values; no tracer can make one graph of that."""


class ValueReadError(CaptureError):
    """The model reads a tensor's value into Python (``float(t)``, ``t.item()``), which a tracer's fake tensors do
    not have."""


#: torch's errors for a value only a real run has: dynamo's and FakeTensor's guard on a data-dependent expression,
#: and an op whose output FakeTensor cannot know (``.item()``)
_TORCH_VALUE_READS = (GuardOnDataDependentSymNode, DataDependentOutputException)


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from (or during), and so on: the chain a traceback shows."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def reads_a_value(error: BaseException) -> bool:
    """Did ``error`` come from the model reading a tensor's value? Told by the types along its chain.

    >>> reads_a_value(ValueReadError("...")), reads_a_value(CaptureError("a data-dependent remark"))
    (True, False)
    """
    return any(isinstance(cause, (ValueReadError, *_TORCH_VALUE_READS)) for cause in causes(error))


def with_progress(error: CaptureError, nodes: int) -> CaptureError:
    """``error``, noting how far its tracer got (``nodes`` written before it failed) unless a tracer noted it
    already: when every tracer fails, :func:`compfx.graph_capture.capture` leads with the one that got furthest."""
    if getattr(error, "progress", None) is None:
        error.progress = nodes
    return error
