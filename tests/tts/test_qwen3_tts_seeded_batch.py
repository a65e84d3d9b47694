"""A seeded Qwen3-TTS request gets the same codec frames (and audio) alone as in any batch, float32 on CPU.

Both draws are per request: codebook 0's uniform comes from (seed, frame) in the LLM sampler, codebooks 1..G-1's
from (seed, codebook, frame) in ``TTSRunner._uniforms``; unseeded batch-mates draw from the global RNG. What the
batch can still change is float rounding (``runner/tts_runner.py`` says where); these tests pin the sampling side:
the seeded request beside unseeded, greedy and top-p mates of other lengths, arriving mid-flight, preempted.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from strataserve.engine.tts import TTS, SpeechOutput
from strataserve.runner.sampling_filters import filtered_logits
from strataserve.types.sampling import SamplingParams
from strataserve.types.speech import SpeechParams

TEXT = "Hello world, this is a seeded test."
SEEDED = SpeechParams(seed=1234, max_new_frames=16)  # the reference's sampling defaults: top_k 50, top_p 1
# (text, voice, params): other texts and lengths, unseeded, greedy, top-p (which routes the whole batch's codebook-0
# filter through the top-p path) and another seed
MATES = [("Short.", "vivian", SpeechParams(max_new_frames=5, top_p=0.8)),
         ("A somewhat longer sentence to speak, with commas and more words.", "eric",
          SpeechParams(max_new_frames=20, temperature=1.3)),
         ("Why?", "ryan", SpeechParams(max_new_frames=9, temperature=0.0, code_temperature=0.0)),
         ("Good morning to you all", "vivian", SpeechParams(seed=99, max_new_frames=12, top_p=0.9))]


def _run(tts: TTS, items: list[tuple[str, str, SpeechParams]], join_at: dict[int, int] | None = None
         ) -> list[SpeechOutput]:
    """Serve ``items`` in one engine; ``join_at`` {item index: step}: that item is submitted at that step (the
    others at once), so it joins a batch that is already decoding."""
    join_at = join_at or {}
    ids: dict[int, str] = {}
    results: dict[str, SpeechOutput] = {}
    step = 0
    while len(ids) < len(items) or tts.has_unfinished():
        for i, (text, voice, params) in enumerate(items):
            if i not in ids and join_at.get(i, 0) <= step:
                ids[i] = tts.submit(text, voice=voice, params=params)
        for out in tts.step():
            results[out.request_id] = out
        step += 1
    return [results[ids[i]] for i in range(len(items))]


@pytest.fixture(scope="module")
def tts(weak_eos_ckpt):
    engine = TTS(str(weak_eos_ckpt), device="cpu", dtype="float32", max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def alone(tts) -> SpeechOutput:
    out = _run(tts, [(TEXT, "ryan", SEEDED)])[0]
    assert len(out.frames) >= 8 and out.waveform.std() > 0.01, "a real clip, not silence"
    return out


def _same(a: SpeechOutput, b: SpeechOutput) -> None:
    assert b.frames.tolist() == a.frames.tolist()
    assert b.finish_reason == a.finish_reason
    np.testing.assert_array_equal(b.waveform, a.waveform)


@pytest.mark.parametrize("slot", [0, 2, 4])
def test_seeded_request_alone_equals_batched(tts, alone, slot):
    items = MATES[:slot] + [(TEXT, "ryan", SEEDED)] + MATES[slot:]
    outs = _run(tts, items)
    _same(alone, outs[slot])
    assert tts.runner.fused_steps > 0
    lengths = {len(o.frames) for o in outs}
    assert len(lengths) >= 3, "mates of other lengths: the batch shrinks while the seeded request decodes"


def test_seeded_request_joining_mid_flight_or_preempted(tts, alone):
    """Joining a decoding batch (its prompt runs in mixed prefill + decode steps), and a pool too small for all
    (preemption, then recompute of its frames) keep the seeded frames."""
    items = MATES[:3] + [(TEXT, "ryan", SEEDED)]
    _same(alone, _run(tts, items, join_at={3: 3})[3])
    tight = TTS(tts.model, max_num_seqs=8, num_blocks=10, block_size=4)
    try:
        out = _run(tight, items, join_at={1: 1, 2: 2})[3]
        assert tight.core.scheduler.num_preemptions > 0, "the pool should be too small for all four at once"
    finally:
        tight.shutdown()
    _same(alone, out)


def test_same_seed_repeats_different_seeds_differ(tts, alone):
    torch.manual_seed(5)  # the global RNG (unseeded rows') must not matter to a seeded request
    again = _run(tts, [(TEXT, "ryan", SEEDED)])[0]
    _same(alone, again)
    both = _run(tts, [(TEXT, "ryan", SEEDED), (TEXT, "ryan", SpeechParams(seed=1235, max_new_frames=16))])
    _same(alone, both[0])
    assert both[1].frames.tolist() != alone.frames.tolist()
    unseeded = [_run(tts, [(TEXT, "ryan", SpeechParams(max_new_frames=16))])[0].frames.tolist() for _ in range(2)]
    assert unseeded[0] != unseeded[1], "unseeded requests still sample freshly"


@pytest.mark.parametrize("sort_top_p", [False, True])  # the CPU's candidate search, the accelerators' full sort
def test_filtered_row_does_not_depend_on_a_top_p_batch_mate(sort_top_p):
    """Codebook 0's filter for a top-k row (top_p = 1, the reference default) alone equals its filter beside a
    top-p row. Before: the batch-mate routed it through the top-p cut-off, whose rounded cumsum dropped the row's
    tiniest top-k tail in ~1.5% of such rows, so its distribution depended on the batch."""
    gen = torch.Generator().manual_seed(0)
    vocab = 1088  # the tiny talker's codec vocabulary
    me = SamplingParams(temperature=0.9, top_k=50, seed=1)
    unfiltered = SamplingParams(temperature=0.9, seed=1)
    mate = SamplingParams(temperature=0.9, top_p=0.8)
    differ = 0
    for _ in range(600):
        x = torch.randn(2, vocab, generator=gen) * 8 * torch.rand(1, generator=gen)
        for p in (me, unfiltered):
            alone_row = filtered_logits(x[:1], [p], sort_top_p)
            batched_row = filtered_logits(x, [p, mate], sort_top_p)[:1]
            differ += not torch.equal(alone_row, batched_row)
    assert differ == 0
