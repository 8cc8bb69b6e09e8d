"""compfx tells errors apart by their type, never by the text of their message; the capture errors users can catch
are in compfx.errors."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException

import compfx
from compfx.graph_capture import capture
from compfx.graph_capture._sites import ValueReadError, reads_a_value
from compfx.graph_capture.autocast_blocks import AutocastRefusedError, autocast_probe
from compfx.errors import CaptureError
from tests.test_defined_once import _sources, code_only

#: A branch on an error's message: ``"..." in str(error)``, ``str(error).startswith(...)``.
MESSAGE_TEST = (r"\bin str\((error|err|exc|exception|e|cause)\)"
                r"|\bstr\((error|err|exc|exception|e|cause)\)\.(startswith|endswith|find|index)\(")
#: What ends a line's code before ``in str(error)`` when that is a loop over its text, which quotes it
LOOP = re.compile(r"\bfor\s+\w+\s+$")


def message_tests(source: str) -> list[int]:
    """The lines of ``source`` that branch on an error's message (strings and comments blanked first)."""
    code = code_only(source)
    lines = []
    for match in re.finditer(MESSAGE_TEST, code):
        before = code[code.rfind("\n", 0, match.start()) + 1:match.start()]
        if not LOOP.search(before):
            lines.append(code.count("\n", 0, match.start()) + 1)
    return lines


#: file -> why it reads an error's message. Each entry must still be needed (a test checks).
READS_A_MESSAGE = {
    "compfx/graph_capture/autocast_blocks.py": "torch's autocast refuses an op with a plain RuntimeError: autocast_probe "
                                         "reads it once and raises AutocastRefusedError, which capture catches",
    "compfx/guard.py": "torch.amp.GradScaler says unscale_() ran already with a plain RuntimeError, and no public "
                       "state tells it",
}


def _message_tests() -> dict[str, list[int]]:
    found = {name: message_tests(path.read_text()) for name, path in _sources().items()}
    return {name: lines for name, lines in found.items() if lines}


def test_no_error_is_told_apart_by_its_message():
    found = _message_tests()
    stray = [f"{name}:{lines}" for name, lines in sorted(found.items()) if name not in READS_A_MESSAGE]
    assert not stray, "errors told apart by message text (raise and catch a type instead):\n" + "\n".join(stray)
    stale = [name for name in READS_A_MESSAGE if name not in found]
    assert not stale, f"READS_A_MESSAGE names files that no longer read one; drop them: {stale}"


@pytest.mark.parametrize("source, found", [
    ('if "unsafe to autocast" not in str(error):\n    raise\n', True),
    ("if str(e).startswith('CUDA out of memory'):\n    pass\n", True),
    ('message = "in str(error) said nothing"\n', False),
    ("details = [line.strip() for line in str(error).splitlines()]\n", False),
    ('if "." in str(target):\n    pass\n', False),
    ("if 'in-place' in str(exc):\n    pass\n", True),
    ("except AutocastRefusedError:\n    pass\n", False),
])
def test_a_message_test_is_found(source, found):
    assert bool(message_tests(source)) is found


def test_explained_capture_error_is_a_capture_error_users_can_catch_from_compfx_errors():
    from compfx.graph_capture._sites import ExplainedCaptureError as old_path
    from compfx.errors import ExplainedCaptureError

    assert old_path is ExplainedCaptureError and issubclass(ExplainedCaptureError, CaptureError)
    assert "ExplainedCaptureError" in compfx.errors.__all__ and compfx.ExplainedCaptureError is ExplainedCaptureError
    assert ExplainedCaptureError.advice == ""  # its message says what to do: capture adds no general advice


def test_a_value_read_is_told_by_the_types_along_the_chain_not_by_the_words():
    assert reads_a_value(ValueReadError("the model reads a tensor's value"))
    try:
        try:
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        except DataDependentOutputException as error:
            raise CaptureError("symbolic tracing failed") from error
    except CaptureError as wrapped:
        assert reads_a_value(wrapped)  # torch's own type, below compfx's
    assert not reads_a_value(CaptureError("the model's data-dependent check failed (reads a tensor's value)"))
    assert not reads_a_value(RuntimeError("data dependent"))


class RefusedUnderAutocast(nn.Module):
    """Does what CUDA autocast does with binary_cross_entropy: refuses under autocast, with torch's plain error."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.")
        return self.fc(x)


def test_an_op_autocast_refuses_is_captured_without_the_probe():
    model = RefusedUnderAutocast().train()
    gm = capture(model, torch.randn(3, 4))
    torch.testing.assert_close(gm(torch.ones(3, 4)), model(torch.ones(3, 4)), rtol=0, atol=0)


def test_the_probe_turns_only_autocast_refusals_into_autocast_refused_errors():
    def fail(cause: Exception):
        with autocast_probe("cpu"):
            raise CaptureError("the recording run failed") from cause

    with pytest.raises(AutocastRefusedError):
        fail(RuntimeError("binary_cross_entropy is unsafe to autocast."))
    with pytest.raises(CaptureError) as info:
        fail(ValueError("shapes do not match"))
    assert type(info.value) is CaptureError
