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
