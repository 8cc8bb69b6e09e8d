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
    "NonFiniteGradientError",
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


class NonFiniteGradientError(CompfxError, ArithmeticError):
    """A training step under a plan produced NaN/inf gradients; the search rejects that plan."""
