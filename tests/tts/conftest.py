"""One tiny Qwen3-TTS checkpoint with a weak eos row (clips run to max_new_frames) shared by the TTS tests."""
from __future__ import annotations

import pytest

from _tiny_tts import make_tiny_tts


@pytest.fixture(scope="session")
def weak_eos_ckpt(tmp_path_factory):
    return make_tiny_tts(tmp_path_factory.mktemp("tts") / "weak_eos", eos_boost=0.3)[0]
