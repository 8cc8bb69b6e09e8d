"""compfx: convergence-aware, operator-wise mixed precision as a torch.fx pass.

The pipeline, one module per stage::

    capture  -> analyze  -> plan  -> passes (rewrite)  -> search  -> apply / backend / report
"""

from .analyze import Analysis, OpInfo, analyze
from .capture import capture, op_nodes
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .opkey import OpKey
from .plan import Plan

__version__ = "0.1.0"
__all__ = ["capture", "op_nodes", "OpKey", "analyze", "Analysis", "OpInfo", "Plan", *_error_names]
