"""One exception hierarchy for everything compfx refuses or cannot do.

Every message says what was wrong, what compfx expected, and what to do next.
The original exception (if any) is chained with ``raise ... from``, so the
first line a user reads is ours, not a traceback from inside torch.fx.
"""

from __future__ import annotations

__all__ = [
    "CompfxError",
    "CaptureError",
    "ExplainedCaptureError",
    "BadInputError",
    "PlanMismatchError",
    "PlanFileError",
    "PlanExportError",
    "FileWriteError",
    "LogIntegrityError",
    "CacheKeyError",
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


class ExplainedCaptureError(CaptureError):
    """A capture error whose message says what to do: no general advice is added to it."""

    advice = ""


class BadInputError(CompfxError, ValueError):
    """Arguments do not fit together (model, inputs, loader, loss, optimizer)."""


class PlanMismatchError(CompfxError, ValueError):
    """A plan does not describe the model it is applied to."""


class PlanFileError(CompfxError):
    """A plan, log or cache file is missing, corrupt, truncated, too large, or not one compfx wrote."""


class PlanExportError(CompfxError, ValueError):
    """A plan asks for something the runtime it is exported to cannot express (torchao's float8 conversion swaps
    whole ``nn.Linear`` modules, so an FP8 matmul of another kind, or one call of a module run FP8 and another
    not, has no place in it)."""


class FileWriteError(PlanFileError):
    """compfx could not write a plan, log or cache file (a folder in the way, no permission, disk full)."""


class LogIntegrityError(PlanFileError):
    """A search log's records do not match their chained digests: a line was changed, added, removed or
    reordered after compfx wrote it, or the log predates digests. A resumed search replays logged results
    as measured, so it refuses such a log; the message names the first line that does not match."""


class CacheKeyError(BadInputError):
    """A cache key (a plan's fingerprint, a low dtype) is not one compfx makes, so it could name a path
    outside the cache folder; refused before any file is touched."""


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
