"""compfx: convergence-aware, operator-wise mixed precision as a torch.fx pass.

The pipeline, one module per stage::

    capture  -> analyze  -> plan  -> passes (rewrite)  -> search  -> apply / backend / report

>>> import torch, compfx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> analysis = compfx.analyze(model, torch.randn(2, 8))
>>> planned = compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis)
>>> planned(torch.randn(2, 8)).dtype
torch.float32
"""

from .analyze import Analysis, OpInfo, analyze
from .apply import apply
from .backend import backend, compile_with_plan
from .capture import capture, key_dynamo_graph, op_nodes
from .costmodel import Predictor, fit_cast_cost, profile_ops
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .opkey import OpKey
from .optimize import SearchConfig, optimize
from .memory import saved_activation_bytes
from .passes import cast_report, count_casts, insert_casts
from .plan import Plan
from .searchlog import SearchLog

__version__ = "0.1.0"
# Note: compfx.capture, compfx.analyze, compfx.apply, compfx.optimize and compfx.backend
# are the functions; import their modules with `from compfx.capture import ...`.
__all__ = [
    # pipeline
    "capture", "op_nodes", "OpKey", "key_dynamo_graph", "analyze", "Analysis", "OpInfo", "Plan",
    "insert_casts", "apply", "optimize", "SearchConfig", "SearchLog", "backend", "compile_with_plan",
    # measurement and reports
    "cast_report", "count_casts", "saved_activation_bytes", "Predictor", "profile_ops", "fit_cast_cost",
    *_error_names,
]
