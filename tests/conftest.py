"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is fastest, and immune to OpenMP stalls when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def session_cache_dir(tmp_path_factory):
    """Plans that optimize() saves and the cost model's profiles go to a folder of this test session, never to
    the user's ~/.cache; profiles stay warm across tests. Tests that need an empty cache set their own."""
    from compfx.cache import CACHE_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("compfx-cache")))
        yield


@pytest.fixture
def fresh_dynamo(tmp_path, monkeypatch):
    """Compile from scratch and see an empty plan cache: dynamo reset before and after, a cache folder of the test."""
    from compfx.cache import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "plans"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
