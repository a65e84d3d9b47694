"""The offline LLM's generate loop sets the heap that was alive when it started aside from the collector (gc.freeze)
and hands it back at the end (gc.unfreeze): full collections in the loop then walk only what the loop allocates.
Checked from inside the loop (the engine's step sees the freeze), after it (nothing left frozen, even when a step
raises), and where it must stay out of the way: a caller's own freeze is neither undone nor doubled, and
STRATA_GC_FREEZE=0 turns it off."""
from __future__ import annotations

import gc

import pytest

from strataserve import LLM, SamplingParams, envs
from _tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint("llama", path)
    model = LLM(str(path), max_model_len=128)
    yield model
    model.shutdown()


def _generate_recording(llm: LLM, monkeypatch, fail: bool = False) -> list[int]:
    engine, seen = llm.llm_engine, []
    step = engine.step

    def recording_step():
        seen.append(gc.get_freeze_count())
        if fail:
            raise RuntimeError("a step failed")
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    try:
        llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params, use_tqdm=False)
    finally:
        monkeypatch.setattr(engine, "step", step)
    return seen


def test_the_loop_runs_with_the_heap_set_aside_and_hands_it_back(llm, monkeypatch):
    assert gc.get_freeze_count() == 0
    seen = _generate_recording(llm, monkeypatch)
    assert seen and all(n > 1000 for n in seen)  # torch, transformers, the model: all set aside during the loop
    assert gc.get_freeze_count() == 0  # and all handed back


def test_a_failing_loop_hands_the_heap_back(llm, monkeypatch):
    with pytest.raises(RuntimeError, match="a step failed"):
        _generate_recording(llm, monkeypatch, fail=True)
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_is_left_as_it_is(llm, monkeypatch):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen = _generate_recording(llm, monkeypatch)
        # (frozen objects may still be freed by reference counting: the count only drifts down a little)
        assert seen and all(n > frozen // 2 for n in seen)
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen by the loop
    finally:
        gc.unfreeze()


def test_off_with_strata_gc_freeze_0(llm, monkeypatch):
    monkeypatch.setattr(envs, "STRATA_GC_FREEZE", False)
    assert _generate_recording(llm, monkeypatch) and set(_generate_recording(llm, monkeypatch)) == {0}
