"""Shared test setup."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The CPU tests use small tensors: one intra-op thread is as fast as two on an idle machine and
    far faster on a busy one, where OpenMP's waiting threads spin on the cores the work needs
    (measured on a loaded 2-core machine: 6.5 ms against 180 ms of CPU time per k3-tiny decode step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
