"""Every docstring example in compfx, its passes and the benchmarks runs and shows what it claims."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import compfx
import compfx.passes
from compfx.float8 import torchao_missing

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _modules(package) -> list[str]:
    return [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
            if not info.name.endswith("__main__")]


def _benchmark_modules() -> list[str]:
    import benchmarks

    return [name for name in _modules(benchmarks) if name != "benchmarks.__main__"]


MODULES = ["compfx", *_modules(compfx), *_modules(compfx.passes), *_benchmark_modules()]
#: Modules whose examples build torchao's float8 pieces: they run where torchao is installed (``compfx[fp8]``).
NEEDS_TORCHAO = {"compfx.float8", "compfx.passes.float8", "compfx.costmodel.roofline"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    if name in NEEDS_TORCHAO and torchao_missing():
        pytest.skip(f"{torchao_missing()}: the examples of {name} build torchao's float8 training")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (see above)"
