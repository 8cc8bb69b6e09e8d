"""compfx: convergence-aware, operator-wise mixed precision as a torch.fx pass.

The pipeline, one module (or small package) per stage::

    graph_capture -> analysis -> plan -> passes (rewrite) -> search -> planned_module / compile_backend / report

The entry points are functions named for what they do (``compfx.capture``, ``analyze``, ``apply``,
``optimize``, ``diagnose``, ``backend``); their modules are named for what they hold (``compfx.graph_capture``,
``analysis``, ``planned_module``, ``optimization``, ``diagnosis``, ``compile_backend``), so no function hides its
module. ``__all__`` is what a user's path needs; everything else is imported from its module.

>>> import torch, compfx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> analysis = compfx.analyze(model, torch.randn(2, 8))
>>> planned = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis)
>>> planned(torch.randn(2, 8)).dtype
torch.float32
"""

from . import deprecations as _deprecations
from .analysis import Analysis, OpInfo, analyze
from .compile_backend import backend, compile_with_plan
from .compile_options import CompileOptions
from .diagnosis import Diagnosis, diagnose
from .errors import (BadInputError, CacheKeyError, CaptureError, CompfxError, FileWriteError, LogIntegrityError,
                     PassError, PlanExportError, PlanFileError, PlanMismatchError, SearchError)
from .graph_capture import capture
from .guard import Guard
from .opkey import OpKey
from .optimization import optimize
from .passes import cast_report
from .plan import Plan
from .planned_module import PlannedModule, apply, plan_blocks
from .search import DecisionRule, SearchConfig, SearchResult
from .vocabulary import Precision

__version__ = "0.1.0"

#: The errors a user catches (every one a CompfxError); the search's own control flow stays in compfx.errors.
_ERRORS = ["CompfxError", "CaptureError", "BadInputError", "PlanMismatchError", "PlanFileError", "PlanExportError",
           "FileWriteError", "LogIntegrityError", "CacheKeyError", "SearchError", "PassError"]

__all__ = [
    # the pipeline: capture, analyse, plan, apply
    "capture", "analyze", "Analysis", "OpInfo", "OpKey", "Precision", "Plan", "apply", "PlannedModule", "plan_blocks",
    # search
    "optimize", "SearchConfig", "DecisionRule", "SearchResult",
    # torch.compile
    "compile_with_plan", "backend", "CompileOptions",
    # during training, and what a plan casts
    "diagnose", "Diagnosis", "Guard", "cast_report",
    *_ERRORS,
]

_deprecations.alias_renamed_modules()


def __getattr__(name: str):
    # names that left the top level still import from it for one release, with a DeprecationWarning (PEP 562)
    return _deprecations.moved_name(name)
