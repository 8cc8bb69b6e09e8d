"""The package reads top to bottom: no import cycles, and no module imports one of a higher layer.

The import graph is read from the source (``ast``), so it holds every import: at module level and inside
functions, which Python's own import machinery would only meet when the function runs. A function-level import
is still a dependency: it is how a lower stage would reach back into a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The layers, lowest first. A module may import its own layer's modules (without a cycle) and lower layers'.
#: A name is a module or a package (then every module in it, unless a longer name says otherwise).
LAYERS: tuple[tuple[str, ...], ...] = (
    # the shared words, errors and file handling every stage uses; what a batch is, and the state a run of the
    # user's model may change (RNG, buffers, training state), saved and put back; the torch.compile settings of a
    # planned program (a plan records them, the search and the backend compile with them)
    ("compfx.vocabulary", "compfx.errors", "compfx.opkey", "compfx.files", "compfx.state", "compfx.batches",
     "compfx.compile_options"),
    # model -> FX graph
    ("compfx.graph_capture",),
    # can it: classify, Tensor Core / FP8 / padding eligibility, the cast rules; and the plan (OpKey -> precision).
    # One layer: the plan reads only the shared words, while FP8's fallback at a shape the plan's FP8 op cannot run
    # is AMP's precision for the op, which the plan defines (plan.AMP_PRECISION); the analysis of a model's blocks
    # alone (regions, for per_module) is an analysis too
    ("compfx.oplists", "compfx.tensor_cores", "compfx.float8", "compfx.cast_policy", "compfx.analysis", "compfx.plan",
     "compfx.plan_file", "compfx.plan_rules", "compfx.plan_export", "compfx.regions"),
    # graph rewrites
    ("compfx.passes",),
    # a model + a plan -> the planned model (whole, or block by block); the captures it shares per input signature;
    # what a planned step saves
    ("compfx.planned_module", "compfx.signature_captures", "compfx.per_module", "compfx.memory"),
    # should it: timing, the cache, the cost model
    ("compfx.measure", "compfx.cache", "compfx.costmodel"),
    # decides: the stages, the evaluators, the orchestration of one search, its result and report
    ("compfx.search",),
    # wires and uses: the entry points, the tools around a planned model, the training stacks
    ("compfx.optimization", "compfx.compile_backend", "compfx.compile_regions",
     "compfx.report", "compfx.guard", "compfx.diagnosis",
     "compfx.integrations", "compfx.examples", "compfx.demo", "compfx.cli", "compfx.__main__", "compfx",
     "compfx.deprecations"),
)


def _modules() -> dict[str, Path]:
    """Every module of compfx (``passes/`` is installed as ``compfx.passes``), by dotted name."""
    found = {}
    for folder, package in ((ROOT / "compfx", "compfx"), (ROOT / "passes", "compfx.passes")):
        for path in folder.rglob("*.py"):
            if path.is_relative_to(ROOT / "compfx" / "passes"):  # the link to passes/: read there
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The compfx module ``name`` (a module, or a name in one) is, or None outside compfx."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """module -> {imported compfx module: line of the first import}, every import (module level and lazy)."""
    modules = modules if modules is not None else _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                owner = _owner(target, modules)
                # a package imports its own submodules to re-export them: that is containment, not a dependency
                if owner and owner != module and not (is_package and owner.startswith(module + ".")):
                    edges.setdefault(owner, node.lineno)
    return graph


def layer_of(module: str) -> int:
    """The layer of ``module``: the longest name in :data:`LAYERS` that is it or a package holding it."""
    best, layer = "", None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, layer = name, index
    if layer is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return layer


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)}) at line {line}"
            for module, edges in sorted(graph.items()) for target, line in sorted(edges.items())
            if layer_of(target) > layer_of(module)]


def test_every_module_has_a_layer():
    for module in _modules():
        layer_of(module)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (counting imports inside functions): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer():
    found = upward_imports(import_graph())
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


#: Modules that use a planned model or build one, and so need nothing of the search: the training conventions they
#: share with it (batches, losses, state and RNG) are the lowest layer's (compfx.batches, compfx.state).
NOT_THE_SEARCH = ("compfx.diagnosis", "compfx.guard", "compfx.planned_module", "compfx.per_module",
                  "compfx.graph_capture", "compfx.analysis")

#: (module, search module) -> why the import stays. Each entry must still be needed (the test checks).
READS_THE_SEARCH = {
    ("compfx.guard", "compfx.search.log"): "Guard(log=...) notes its repairs in the search's log (SearchLog, the log "
                                           "format the search writes and the report reads)",
}


def search_imports(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """(module, search module) -> line, for the modules of :data:`NOT_THE_SEARCH` (and their submodules)."""
    return {(module, target): line for module, edges in graph.items() for target, line in edges.items()
            if any(module == name or module.startswith(name + ".") for name in NOT_THE_SEARCH)
            and (target == "compfx.search" or target.startswith("compfx.search."))}


def test_diagnose_guard_apply_capture_and_analyze_import_nothing_from_the_search():
    found = search_imports(import_graph())
    stray = [f"{module} imports {target} at line {line}" for (module, target), line in sorted(found.items())
             if (module, target) not in READS_THE_SEARCH]
    assert not stray, "imports from the search:\n" + "\n".join(stray)
    stale = [f"{module} -> {target}" for module, target in READS_THE_SEARCH if (module, target) not in found]
    assert not stale, "READS_THE_SEARCH names imports that are gone; drop them: " + "; ".join(stale)


# -- the checks themselves can fail ---------------------------------------------------------------------------

def test_the_graph_sees_imports_inside_functions(tmp_path):
    (tmp_path / "low.py").write_text("import torch\n\n\ndef f():\n    from .search import driver\n")
    (tmp_path / "high.py").write_text("from ..plan import Plan\n")
    graph = import_graph({"compfx.plan": tmp_path / "low.py", "compfx.search.driver": tmp_path / "high.py"})
    assert graph == {"compfx.plan": {"compfx.search.driver": 5}, "compfx.search.driver": {"compfx.plan": 1}}
    assert cycles(graph) == [["compfx.plan", "compfx.search.driver"]]
    assert upward_imports(graph) == ["compfx.plan (layer 2) imports compfx.search.driver (layer 6) at line 5"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_search_imports_are_found():
    graph = {"compfx.graph_capture.record": {"compfx.search.sampling": 3, "compfx.opkey": 1},
             "compfx.diagnosis": {"compfx.search": 7}, "compfx.optimization": {"compfx.search.session": 2}}
    assert search_imports(graph) == {("compfx.graph_capture.record", "compfx.search.sampling"): 3,
                                     ("compfx.diagnosis", "compfx.search"): 7}


@pytest.mark.parametrize("module, target, upward", [
    ("compfx.planned_module", "compfx.search.evaluator", True),
    ("compfx.search.result", "compfx.report", True),
    ("compfx.per_module", "compfx.planned_module", False),
    ("compfx.optimization", "compfx.search", False),
    ("compfx.passes.insert_casts", "compfx.cast_policy", False),
])
def test_upward_imports_are_found(module, target, upward):
    assert bool(upward_imports({module: {target: 1}})) is upward
