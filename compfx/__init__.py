"""compfx: convergence-aware, operator-wise mixed precision as a torch.fx pass.

The pipeline, one module (or small package) per stage::

    capture  -> analyze  -> plan  -> passes (rewrite)  -> search  -> apply / backend / report / integrations

>>> import torch, compfx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> analysis = compfx.analyze(model, torch.randn(2, 8))
>>> planned = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis)
>>> planned(torch.randn(2, 8)).dtype
torch.float32
"""

from .analyze import Analysis, OpInfo, analyze
from .apply import PlannedModule, apply
from .backend import backend, compile_with_plan
from .capture import capture, key_dynamo_graph, op_nodes
from .compile_options import CompileOptions
from .costmodel import Predictor, fit_cast_cost, profile_ops
from .diagnose import Diagnosis, diagnose
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .guard import Guard
from .memory import saved_activation_bytes
from .opkey import OpKey
from .optimize import optimize
from .passes import cast_report, count_casts, insert_casts
from .plan import Assignment, Plan
from .search import SearchConfig, SearchLog, SearchResult
from .vocabulary import Category, Precision

__version__ = "0.1.0"
# Note: compfx.capture, compfx.analyze, compfx.apply, compfx.optimize and compfx.backend
# are the functions; import their modules with `from compfx.capture import ...`.
__all__ = [
    # pipeline
    "capture", "op_nodes", "OpKey", "key_dynamo_graph", "analyze", "Analysis", "OpInfo", "Category", "Plan",
    "Precision", "Assignment", "insert_casts", "apply", "PlannedModule", "optimize", "SearchConfig", "SearchResult",
    "SearchLog", "backend", "compile_with_plan", "CompileOptions",
    # during training
    "diagnose", "Diagnosis", "Guard",
    # measurement and reports
    "cast_report", "count_casts", "saved_activation_bytes", "Predictor", "profile_ops", "fit_cast_cost",
    *_error_names,
]
