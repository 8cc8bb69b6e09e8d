"""Every docstring example in compfx, its passes and the benchmarks runs and shows what it claims."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import compfx
import compfx.passes

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _modules(package) -> list[str]:
    return [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
            if not info.name.endswith("__main__")]


def _benchmark_modules() -> list[str]:
    import benchmarks

    return [name for name in _modules(benchmarks) if name != "benchmarks.__main__"]


MODULES = ["compfx", *_modules(compfx), *_modules(compfx.passes), *_benchmark_modules()]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (see above)"
