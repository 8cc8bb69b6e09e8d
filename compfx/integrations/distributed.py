"""``torch.distributed`` (``torchrun``, DDP): the search's synchronised evaluator and its rank strategies.

They are the search's (:mod:`compfx.search.distributed`), which
:func:`compfx.optimize` uses when a process group is initialised; their names
stay importable from here.
"""

from ..search.distributed import *  # noqa: F401,F403
from ..search.distributed import __all__  # noqa: F401
