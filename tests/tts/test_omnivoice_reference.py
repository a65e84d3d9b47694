"""OmniVoice tokens against the reference package (``omnivoice``'s own prompt building and unmasking loop) on tiny
random checkpoints built with its config classes: greedy batches of mixed lengths (with and without a reference
voice, with guidance and without), sampled requests per seed, and the conditional input ids themselves."""
from __future__ import annotations

import pytest
import torch

from _tiny_omnivoice import import_reference, make_tiny_omnivoice
from strataserve.models.omnivoice.loader import load_omnivoice
from strataserve.models.omnivoice.prompt import VoiceReference, build_input_ids
from strataserve.runner.nar_runner import NARRequest, NARRunner, UnmaskSettings, unmask_schedule

TEXTS = ["the cat sat on the mat", "hello", "a much longer sentence that goes on and on for a while"]
LENS = [22, 7, 31]
REF = VoiceReference(torch.randint(0, 1024, (8, 10), generator=torch.Generator().manual_seed(5)), "nice to meet")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, ref_model = make_tiny_omnivoice(tmp_path_factory.mktemp("omnivoice") / "ckpt")
    ov = load_omnivoice(path, device="cpu")
    return import_reference(), ref_model, ov, NARRunner(ov.model, num_codebooks=8, mask_id=1024)


def _ours(ov, i: int, settings: UnmaskSettings, seed: int = 0, ref: VoiceReference | None = None) -> NARRequest:
    ids, a0 = build_input_ids(ov.tokenizer, TEXTS[i], LENS[i], 8, 1024, language="en", instruct="female, low pitch",
                              ref=ref)
    return NARRequest(f"r{i}", ids, a0, LENS[i], settings, seed)


def _reference(ref, model, idx: list[int], gc, refs=None) -> list[torch.Tensor]:
    refs = refs or [None] * len(idx)
    task = ref.GenerationTask(batch_size=len(idx), texts=[TEXTS[i] for i in idx], target_lens=[LENS[i] for i in idx],
                              langs=["en"] * len(idx), instructs=["female, low pitch"] * len(idx),
                              ref_texts=[r.text if r else None for r in refs],
                              ref_audio_tokens=[r.tokens if r else None for r in refs], ref_rms=[None] * len(idx))
    with torch.no_grad():
        return model._generate_iterative(task, gc)


@pytest.mark.parametrize("guidance", [2.0, 0.0])
def test_greedy_batch_of_mixed_lengths_equals_reference(tiny, guidance):
    ref, model, ov, runner = tiny
    refs = [None, REF, None]
    want = _reference(ref, model, [0, 1, 2], ref.OmniVoiceGenerationConfig(
        num_step=6, position_temperature=0.0, guidance_scale=guidance), refs)
    s = UnmaskSettings(num_step=6, position_temperature=0.0, guidance_scale=guidance)
    batched = runner.generate([_ours(ov, i, s, ref=refs[i]) for i in range(3)])
    for i in range(3):
        assert (want[i] != ref_mask(model)).all()  # fully unmasked
        assert torch.equal(batched[i], want[i]), f"request {i}: {(batched[i] != want[i]).sum()} tokens differ"
    alone = runner.generate([_ours(ov, 1, s, ref=REF)])[0]  # padding in the batch changed nothing
    assert torch.equal(alone, want[1])


def ref_mask(model) -> int:
    return model.config.audio_mask_id


def test_sampled_tokens_equal_reference_per_seed_in_any_batch(tiny):
    """Each request's noise comes from its own seed: in a batch it gets what the reference gives it alone."""
    ref, model, ov, runner = tiny
    for class_t, idx in ((0.0, [0, 1, 2]), (1.0, [1, 0])):
        s = UnmaskSettings(num_step=6, class_temperature=class_t)
        gc = ref.OmniVoiceGenerationConfig(num_step=6, class_temperature=class_t)
        got = runner.generate([_ours(ov, i, s, seed=100 + i) for i in idx])
        for j, i in enumerate(idx):
            torch.manual_seed(100 + i)
            want = _reference(ref, model, [i], gc)[0]
            assert torch.equal(got[j], want), f"class_temperature={class_t} request {i}"
    s = UnmaskSettings(num_step=6)
    assert not torch.equal(runner.generate([_ours(ov, 1, s, seed=1)])[0], runner.generate([_ours(ov, 1, s, seed=2)])[0])


@pytest.mark.parametrize("text", ["Hello [laughter] there,\nfriend  (yes)", "你好 世界 ok", "[sigh]"])
def test_input_ids_equal_reference(tiny, text):
    ref, model, ov, _ = tiny
    for voice in (None, REF):
        want = model._prepare_inference_inputs(text, 12, voice.text if voice else None,
                                               voice.tokens if voice else None, "zh", "male", True)
        ids, a0 = build_input_ids(ov.tokenizer, text, 12, 8, 1024, language="zh", instruct="male", ref=voice)
        assert torch.equal(ids, want["input_ids"][0])
        assert torch.equal(torch.arange(ids.shape[1]) >= a0, want["audio_mask"][0])


def test_schedule_unmasks_everything_once(tiny):
    ref = tiny[0]
    for steps, t_shift in ((32, 0.1), (7, 1.0), (1, 0.5)):
        s = UnmaskSettings(num_step=steps, t_shift=t_shift)
        sched = unmask_schedule(33, 8, s)
        assert sum(sched) == 33 * 8 and len(sched) == steps
        ts = ref._get_time_steps(0.0, 1.0, steps, t_shift).tolist()
        assert sched[0] == min(-(-264 * (ts[1] - ts[0]) // 1), 264)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="num_step"):
        UnmaskSettings(num_step=0)
    with pytest.raises(ValueError, match="guidance_scale"):
        UnmaskSettings(guidance_scale=-1)
    with pytest.raises(ValueError, match="temperature"):
        UnmaskSettings(position_temperature=-0.5)
