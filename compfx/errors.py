"""One exception hierarchy for everything compfx refuses or cannot do.

Every message says what was wrong, what compfx expected, and what to do next.
The original exception (if any) is chained with ``raise ... from``, so the
first line a user reads is ours, not a traceback from inside torch.fx.
"""

from __future__ import annotations

__all__ = [
    "CompfxError",
    "CaptureError",
    "BadInputError",
    "PlanMismatchError",
    "PlanFileError",
    "SearchError",
    "PassError",
    "PlanFailedError",
    "NonFiniteGradientError",
    "PlanFailedOnRankError",
    "SearchReplayError",
]


class CompfxError(Exception):
    """Base class of every error compfx raises on purpose."""


class CaptureError(CompfxError):
    """The model could not be captured as one FX graph."""


class BadInputError(CompfxError, ValueError):
    """Arguments do not fit together (model, inputs, loader, loss, optimizer)."""


class PlanMismatchError(CompfxError, ValueError):
    """A plan does not describe the model it is applied to."""


class PlanFileError(CompfxError):
    """A plan or log file is missing, corrupt or truncated."""


class SearchError(CompfxError):
    """The precision search could not run to a decision."""


class PassError(CompfxError):
    """A graph pass failed; the message names the pass."""


class PlanFailedError(CompfxError):
    """This plan failed; the search records it as ``error`` and tries the next one.

    It is the one error a search evaluator raises for a failure that belongs to
    the plan (a kernel without a low-precision implementation, an overflow, an
    out-of-memory under that plan). Every other exception stops the search:
    :class:`BadInputError` or :class:`SearchError` because the user's inputs are
    wrong whatever the plan, anything else because compfx itself failed.
    """


class NonFiniteGradientError(PlanFailedError, ArithmeticError):
    """A training step under a plan produced NaN/inf gradients; the search rejects that plan."""


class PlanFailedOnRankError(PlanFailedError):
    """Under ``torch.distributed``: the plan failed on another rank, so every rank rejects it in step."""


class SearchReplayError(PlanFailedError):
    """A resumed search replays a sample that had failed: it fails again, the same way, without running."""
