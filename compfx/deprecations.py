"""Names that moved, kept working for one release, each with a ``DeprecationWarning`` that says what to use now.

Two kinds of move:

* **Modules renamed so that no function hides its module** (:data:`RENAMED_MODULES`). ``compfx.apply`` is the
  function users call; its module was ``compfx/apply.py`` too, so ``import compfx.apply`` gave the function and
  the module could only be reached by ``from compfx.apply import ...``. Each module is now named for what it
  holds (``compfx.planned_module`` holds ``PlannedModule``), and the old dotted path still imports, warning:
  ``from compfx.apply import PlannedModule`` reads ``compfx.planned_module.PlannedModule``, and
  ``from compfx.capture.verify import verify_capture`` reads ``compfx.graph_capture.verify`` (the same module
  object, not a second copy of it).
* **Names that left compfx's top level** (:data:`MOVED_NAMES`): ``compfx.__all__`` holds what a user's path
  needs; the rest is imported from its module. ``compfx.Predictor`` still works, warning that it is
  ``compfx.costmodel.Predictor``.

>>> import warnings, compfx
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from compfx.apply import PlannedModule
>>> PlannedModule is compfx.PlannedModule, str(caught[0].message)
(True, 'compfx.apply (the module) is now compfx.planned_module: import PlannedModule from compfx.planned_module (compfx.apply is the function).')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

__all__ = ["RENAMED_MODULES", "MOVED_NAMES", "moved_name", "alias_renamed_modules", "new_module_path",
           "key_backend_graph"]

#: Old module path -> new one. The old name is the name of the function (``compfx.apply``) that the module holds.
RENAMED_MODULES: dict[str, str] = {
    "compfx.capture": "compfx.graph_capture",
    "compfx.analyze": "compfx.analysis",
    "compfx.apply": "compfx.planned_module",
    "compfx.optimize": "compfx.optimization",
    "compfx.backend": "compfx.compile_backend",
    "compfx.diagnose": "compfx.diagnosis",
}

#: A name that was in ``compfx.__all__`` and is not any more -> the module it is imported from now.
MOVED_NAMES: dict[str, str] = {
    "op_nodes": "compfx.graph_capture",
    "key_dynamo_graph": "compfx.graph_capture",
    "Category": "compfx.vocabulary",
    "Assignment": "compfx.plan",
    "insert_casts": "compfx.passes",
    "count_casts": "compfx.passes",
    "SearchLog": "compfx.search",
    "saved_activation_bytes": "compfx.memory",
    "Predictor": "compfx.costmodel",
    "profile_ops": "compfx.costmodel",
    "fit_cast_cost": "compfx.costmodel",
    # errors the search raises and handles itself, and capture's marker for a message that says what to do
    "ExplainedCaptureError": "compfx.errors",
    "PlanFailedError": "compfx.errors",
    "NonFiniteGradientError": "compfx.errors",
    "PlanFailedOnRankError": "compfx.errors",
    "SearchReplayError": "compfx.errors",
}


def moved_name(name: str):
    """``compfx.<name>`` for a name that left the top level: the object, with a DeprecationWarning naming its
    module; AttributeError for any other name (what ``compfx.__getattr__`` returns or raises)."""
    home = MOVED_NAMES.get(name)
    if home is None:
        raise AttributeError(f"module 'compfx' has no attribute {name!r}")
    warnings.warn(f"compfx.{name} is deprecated at compfx's top level: import it from {home} "
                  f"(from {home} import {name}).", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)


def new_module_path(old: str) -> str | None:
    """Where the module ``old`` (a dotted path) lives now, or None if it was not renamed.

    >>> new_module_path("compfx.capture.verify"), new_module_path("compfx.apply"), new_module_path("compfx.plan")
    ('compfx.graph_capture.verify', 'compfx.planned_module', None)
    """
    for before, after in RENAMED_MODULES.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class _RenamedModule(types.ModuleType):
    """What ``sys.modules`` holds under an old module path: every name read from it is read from the new module,
    with a DeprecationWarning. Registered in ``sys.modules`` directly, so importing it never rebinds the
    function of the same name on the ``compfx`` package (the import system sets a submodule as an attribute of
    its package only when it loads one)."""

    def __init__(self, old: str, new: types.ModuleType):
        super().__init__(old, f"Renamed: {new.__name__}.")
        self.__dict__["_compfx_new"] = new
        is_package = hasattr(new, "__path__")
        self.__spec__ = importlib.machinery.ModuleSpec(old, None, is_package=is_package)
        if is_package:
            self.__path__ = []  # its submodules are found by _RenamedSubmodules, as the new package's own

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        new = self.__dict__["_compfx_new"]
        function = self.__name__.rpartition(".")[2]
        warnings.warn(f"{self.__name__} (the module) is now {new.__name__}: import {name} from {new.__name__} "
                      f"(compfx.{function} is the function).", DeprecationWarning, stacklevel=2)
        try:
            return getattr(new, name)
        except AttributeError:
            return importlib.import_module(f"{new.__name__}.{name}")  # a submodule not imported yet


class _RenamedSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a submodule under an old package path (``compfx.capture.verify``) as the new package's own module
    (``compfx.graph_capture.verify``): the same object, imported once."""

    def find_spec(self, fullname, path, target=None):
        if fullname in RENAMED_MODULES or new_module_path(fullname) is None:
            return None  # the old top-level paths are in sys.modules already (alias_renamed_modules)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = new_module_path(spec.name)
        warnings.warn(f"{spec.name} is now {new}: import from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)  # its own name, spec and file are kept (module_from_spec overrides none)

    def exec_module(self, module):
        pass  # imported already, by create_module


def alias_renamed_modules() -> None:
    """Register every old module path of :data:`RENAMED_MODULES` (the new modules must be imported already), and
    the finder of their submodules; idempotent. ``compfx/__init__.py`` calls it once."""
    for old, new in RENAMED_MODULES.items():
        if not isinstance(sys.modules.get(old), _RenamedModule):
            sys.modules[old] = _RenamedModule(old, sys.modules[new])
    if not any(isinstance(finder, _RenamedSubmodules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RenamedSubmodules())


def key_backend_graph(gm, example_inputs=(), *, model=None, index_offsets=None) -> dict:
    """Deprecated (``compfx.compile_backend.key_backend_graph``): use :func:`compfx.graph_capture.key_dynamo_graph`
    (``counts``, ``example_inputs=``, ``model=``). Keys ``gm``'s ops and returns them by key.

    >>> import warnings, torch
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = key_backend_graph(torch.fx.symbolic_trace(torch.nn.Sequential()))
    >>> caught[0].category.__name__
    'DeprecationWarning'
    """
    from collections import Counter

    from .graph_capture import key_dynamo_graph, op_nodes
    from .opkey import KEY_META

    warnings.warn("compfx.compile_backend.key_backend_graph is deprecated; use compfx.graph_capture.key_dynamo_graph("
                  "gm, counts, example_inputs=..., model=...), the one function that keys dynamo's graphs",
                  DeprecationWarning, stacklevel=2)
    key_dynamo_graph(gm, Counter(index_offsets or {}), example_inputs=example_inputs, model=model)
    return {node.meta[KEY_META]: node for node in op_nodes(gm)}
