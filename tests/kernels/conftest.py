"""Kernel tests: on CPU under Triton's interpreter in float32; on a GPU (STRATA_TEST_DEVICE=cuda) in fp32/fp16/bf16.

TRITON_INTERPRET must be set before triton is first imported, hence at the top of this conftest.
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("STRATA_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    # (CUDA graphs, PDL, pinned memory): the GPU run collects them
    collect_ignore = ["test_cuda_graph_gpu.py", "test_pdl_gpu.py", "test_weight_stream_gpu.py", "test_sampler_sync_gpu.py"]

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
