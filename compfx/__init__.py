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
from .backend import backend
from .capture import capture, op_nodes
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .opkey import OpKey
from .optimize import SearchConfig, optimize
from .plan import Plan

__version__ = "0.1.0"
__all__ = [
    "capture", "op_nodes", "OpKey", "analyze", "Analysis", "OpInfo", "Plan", "apply",
    "optimize", "SearchConfig", "backend", *_error_names,
]
