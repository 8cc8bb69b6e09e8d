"""compfx's public surface: what ``compfx.__all__`` holds, and every name that moved still working for one release
with a DeprecationWarning that says what to use."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest

import compfx
from compfx.deprecations import MOVED_NAMES, RENAMED_MODULES
from compfx.errors import CompfxError

ROOT = Path(__file__).resolve().parents[1]

#: compfx.__all__ without the errors: what a user's path needs.
PUBLIC = ["capture", "analyze", "Analysis", "OpInfo", "OpKey", "Precision", "Plan", "apply", "PlannedModule",
          "plan_blocks", "optimize", "SearchConfig", "DecisionRule", "SearchResult", "compile_with_plan", "backend",
          "CompileOptions", "diagnose", "Diagnosis", "Guard", "cast_report"]
#: The errors in compfx.__all__: the ones a user catches.
ERRORS = ["CompfxError", "CaptureError", "BadInputError", "PlanMismatchError", "PlanFileError", "PlanExportError",
          "FileWriteError", "LogIntegrityError", "CacheKeyError", "SearchError", "PassError"]

#: Every name of the old compfx.__all__ -> the module it is imported from now ("compfx": still at the top level).
OLD_ALL = {
    "capture": "compfx", "op_nodes": "compfx.graph_capture", "OpKey": "compfx",
    "key_dynamo_graph": "compfx.graph_capture", "analyze": "compfx", "Analysis": "compfx", "OpInfo": "compfx",
    "Category": "compfx.vocabulary", "Plan": "compfx", "Precision": "compfx", "Assignment": "compfx.plan",
    "insert_casts": "compfx.passes", "apply": "compfx", "PlannedModule": "compfx", "optimize": "compfx",
    "SearchConfig": "compfx", "SearchResult": "compfx", "SearchLog": "compfx.search", "backend": "compfx",
    "compile_with_plan": "compfx", "diagnose": "compfx", "Diagnosis": "compfx", "Guard": "compfx",
    "cast_report": "compfx", "count_casts": "compfx.passes", "saved_activation_bytes": "compfx.memory",
    "Predictor": "compfx.costmodel", "profile_ops": "compfx.costmodel", "fit_cast_cost": "compfx.costmodel",
    # errors
    "CompfxError": "compfx", "CaptureError": "compfx", "ExplainedCaptureError": "compfx.errors",
    "BadInputError": "compfx", "PlanMismatchError": "compfx", "PlanFileError": "compfx", "FileWriteError": "compfx",
    "LogIntegrityError": "compfx", "CacheKeyError": "compfx", "SearchError": "compfx", "PassError": "compfx",
    "PlanFailedError": "compfx.errors", "NonFiniteGradientError": "compfx.errors",
    "PlanFailedOnRankError": "compfx.errors", "SearchReplayError": "compfx.errors",
}

#: The modules renamed so that no function hides its module: old path -> (new path, a name it holds).
RENAMED = {
    "compfx.capture": ("compfx.graph_capture", "input_signature"),
    "compfx.analyze": ("compfx.analysis", "analyze_graph"),
    "compfx.apply": ("compfx.planned_module", "PlannedModule"),
    "compfx.optimize": ("compfx.optimization", "optimize"),
    "compfx.backend": ("compfx.compile_backend", "compile_with_plan"),
    "compfx.diagnose": ("compfx.diagnosis", "Diagnosis"),
}


def _caught(action):
    """What ``action()`` returns, and the messages of the DeprecationWarnings it caused."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = action()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_all_is_what_a_users_path_needs_and_the_errors_users_catch():
    assert compfx.__all__ == PUBLIC + ERRORS
    assert len(PUBLIC) <= 25
    assert all(issubclass(getattr(compfx, name), CompfxError) for name in ERRORS)
    names, said = _caught(lambda: [getattr(compfx, name) for name in compfx.__all__])
    assert said == [] and all(value is not None for value in names)


@pytest.mark.parametrize("name", sorted(OLD_ALL))
def test_every_old_public_name_still_imports_from_compfx(name):
    home = OLD_ALL[name]
    value, said = _caught(lambda: getattr(compfx, name))
    if home == "compfx":
        assert name in compfx.__all__ and said == []
        return
    assert name not in compfx.__all__ and MOVED_NAMES[name] == home
    assert value is getattr(importlib.import_module(home), name)
    assert len(said) == 1 and f"from {home} import {name}" in said[0], said
    _, said_by_from_import = _caught(lambda: exec(f"from compfx import {name}", {}))
    assert set(said_by_from_import) == set(said)  # one message, for the user's line (importlib asks twice)


def test_the_moved_names_are_the_old_ones_that_left():
    assert set(MOVED_NAMES) == {name for name, home in OLD_ALL.items() if home != "compfx"}


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        compfx.no_such_name


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_no_function_hides_its_module(old):
    new, held = RENAMED[old]
    assert RENAMED_MODULES[old] == new
    function = getattr(compfx, old.rpartition(".")[2])
    module = importlib.import_module(new)
    assert inspect.isfunction(function) and inspect.ismodule(module)
    assert getattr(compfx, new.rpartition(".")[2]) is module  # compfx.planned_module is the module
    assert function is getattr(module, function.__name__)  # the function lives in the module named for what it holds


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_module_path_still_imports_with_a_warning_and_leaves_the_function_alone(old):
    new, held = RENAMED[old]
    namespace = {}
    _, said = _caught(lambda: exec(f"from {old} import {held}", namespace))
    assert namespace[held] is getattr(importlib.import_module(new), held)
    assert said and set(said) == {said[0]} and f"import {held} from {new}" in said[0], said  # a package: asked twice
    _, _ = _caught(lambda: importlib.import_module(old))
    assert inspect.isfunction(getattr(compfx, old.rpartition(".")[2]))  # importing the old path rebinds nothing


def test_an_old_submodule_path_is_the_new_module_itself(monkeypatch):
    import compfx.graph_capture.verify as verify

    monkeypatch.delitem(sys.modules, "compfx.capture.verify", raising=False)
    namespace = {}
    _, said = _caught(lambda: exec("from compfx.capture.verify import verify_capture", namespace))
    assert namespace["verify_capture"] is verify.verify_capture
    assert sys.modules["compfx.capture.verify"] is verify  # one module object, not a second copy of its code
    assert said == ["compfx.capture.verify is now compfx.graph_capture.verify: import from there."]
    assert inspect.isfunction(compfx.capture)


def _package_of(path: Path) -> str:
    """The package a source file of compfx is in (``passes/`` installs as ``compfx.passes``)."""
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(("compfx", "passes", *parts[1:]) if parts[0] == "passes" else parts)


def _old_paths_imported(source: str, path: Path) -> list[str]:
    """The renamed modules' old paths that ``source`` (the file at ``path``) imports, absolute or relative."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = _package_of(path).rsplit(".", node.level - 1)[0] if node.level else ""
            names = [".".join(part for part in (base, node.module) if part)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                  if any(name == old or name.startswith(old + ".") for old in RENAMED_MODULES)]
    return found


def test_compfx_itself_imports_no_old_module_path():
    files = [*sorted((ROOT / "compfx").rglob("*.py")), *sorted((ROOT / "passes").rglob("*.py"))]
    found = [hit for path in files if (ROOT / "compfx" / "passes") not in path.parents
             for hit in _old_paths_imported(path.read_text(), path)]
    assert found == [], "use the new module paths (compfx.deprecations.RENAMED_MODULES):\n" + "\n".join(found)


def test_the_old_path_check_can_fail():
    search_module, top_module, a_pass = ROOT / "compfx/search/x.py", ROOT / "compfx/x.py", ROOT / "passes/x.py"
    assert _old_paths_imported("from compfx.apply import PlannedModule\n", top_module) == ["compfx/x.py:1 compfx.apply"]
    assert _old_paths_imported("import os\nfrom ..capture.verify import verify_capture\n", search_module) == [
        "compfx/search/x.py:2 compfx.capture.verify"]
    assert _old_paths_imported("from .analyze import analyze\n", top_module) == ["compfx/x.py:1 compfx.analyze"]
    assert _old_paths_imported("from ..backend import backend\n", a_pass) == ["passes/x.py:1 compfx.backend"]
    assert _old_paths_imported("from ..graph_capture import capture\nfrom .apply_x import y\n", search_module) == []


#: The entry points a user's path goes through: each documents its arguments, what it returns and what it raises,
#: torch's way, with a short example that the docstring tests run.
ENTRY_POINTS = {
    "optimize": compfx.optimize, "analyze": compfx.analyze, "capture": compfx.capture, "apply": compfx.apply,
    "plan_blocks": compfx.plan_blocks, "compile_with_plan": compfx.compile_with_plan, "backend": compfx.backend,
    "diagnose": compfx.diagnose, "Plan.load": compfx.Plan.load,
}
#: Classes: their constructor's arguments and errors (a class returns itself).
ENTRY_CLASSES = {"PlannedModule": compfx.PlannedModule, "Guard": compfx.Guard, "Plan": compfx.Plan,
                 "SearchConfig": compfx.SearchConfig, "DecisionRule": compfx.DecisionRule}
#: Plan's constructors from an analysis: an example each (a line of prose says what they return).
PLAN_CONSTRUCTORS = ["fp32", "amp", "uniform", "from_bitstring", "from_assignment"]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_an_entry_point_says_its_args_returns_and_raises_with_an_example(name):
    doc = inspect.getdoc(ENTRY_POINTS[name])
    for section in ("Args:", "Returns:", "Raises:"):
        assert f"\n{section}\n" in doc, f"{name}: no {section} section"
    assert ">>> " in doc, f"{name}: no example"


@pytest.mark.parametrize("name", sorted(ENTRY_CLASSES))
def test_an_entry_class_says_its_args_and_raises_with_an_example(name):
    doc = inspect.getdoc(ENTRY_CLASSES[name])
    assert "\nArgs:\n" in doc and "\nRaises:\n" in doc and ">>> " in doc, name
    documented = set(re.findall(r"^    (\w+):", doc.split("\nArgs:\n")[1].split("\n\n")[0], re.M))
    taken = set(inspect.signature(ENTRY_CLASSES[name]).parameters) - {"self"}
    assert documented == taken, f"{name}: Args documents {sorted(documented)}, the constructor takes {sorted(taken)}"


@pytest.mark.parametrize("name", PLAN_CONSTRUCTORS)
def test_every_plan_constructor_has_an_example(name):
    assert ">>> " in inspect.getdoc(getattr(compfx.Plan, name))
