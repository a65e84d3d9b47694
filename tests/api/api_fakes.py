"""Engine-core factories for MPCoreClient tests: a real EngineCore over the engine tests' fake runner.

Must be importable by module name in the spawned engine process (tests/ and tests/api are on its sys.path)."""
from __future__ import annotations

import time

from strataserve.config import EngineConfig
from strataserve.engine.engine_core import EngineCore


class SlowRunner:
    """Wraps a FakeRunner so every step takes a little time (requests stay in flight long enough to abort)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.block_size, self.num_blocks, self.max_model_len = inner.block_size, inner.num_blocks, inner.max_model_len

    def execute(self, so):
        time.sleep(self.delay_s)
        return self.inner.execute(so)

    def shutdown(self) -> None:
        self.inner.shutdown()


def fake_core(config: EngineConfig) -> EngineCore:
    from engine.engine_fakes import FakeRunner

    return EngineCore(config, runner=SlowRunner(FakeRunner(num_blocks=64, block_size=4, max_model_len=256,
                                                           verify=False), 0.002))


def failing_core(config: EngineConfig) -> EngineCore:
    raise ValueError(f"model folder {config.model.model!r} has no config.json")
