"""Fixtures shared by the runner tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def two_threads():
    """Torch at two threads for the test (the CPU engine's governor and pool start from torch's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
