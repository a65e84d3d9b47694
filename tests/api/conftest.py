"""Fixtures: the tiny checkpoint and one ``strata serve`` subprocess shared by every test in tests/api."""
from __future__ import annotations

from pathlib import Path

import pytest
from _tiny_models import make_tiny_checkpoint
from api_server import launch


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def server(tiny_ckpt, tmp_path_factory):
    # Small limits so overload (503) is reachable: 4 running + 4 waiting sequences.
    srv = launch(tiny_ckpt, tmp_path_factory.mktemp("server") / "server.log", "--max-num-seqs", "4",
                 "--max-waiting-requests", "4")
    try:
        yield srv
    finally:
        srv.stop()
