"""The fused all-decode step (code predictor -> frame embedding -> talker -> logits, the step CUDA graphs capture)
is chosen only for batches whose every row is a request's fresh frame, and the graph decoder's extra per-row
inputs are checked. That its frames equal the reference's is asserted in test_qwen3_tts_reference.py, where the
CPU runner takes this path for every all-decode step."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strataserve.engine.tts import TTS
from strataserve.types.speech import SpeechParams
from strataserve.runner.cuda_graph import CudaGraphDecoder


def test_fused_step_only_for_fresh_frames(weak_eos_ckpt):
    tts = TTS(str(weak_eos_ckpt), device="cpu", max_num_seqs=4)
    rid = tts.submit("Hello there.", voice="ryan", params=SpeechParams(temperature=0.0, code_temperature=0.0,
                                                                      max_new_frames=6))
    st = tts.runner.states[rid]
    p = st.prompt.length

    def chunk(pos: int) -> SimpleNamespace:
        return SimpleNamespace(req_id=rid, start_pos=pos, token_ids=[0])

    assert not tts.runner._all_fresh_frames([chunk(p - 1)]), "a one-token prompt piece is no frame"
    for _ in range(3):
        tts.step()
    k = len(st.frames)
    assert k >= 1 and tts.runner.fused_steps >= 1
    assert tts.runner._all_fresh_frames([chunk(p + k)])
    assert not tts.runner._all_fresh_frames([chunk(p + k - 1)]), "a recomputed old frame is already complete"
    while tts.has_unfinished():
        tts.step()
    assert tts.runner.graph_steps == 0  # no graphs on CPU: the same step runs eagerly
    tts.shutdown()


def test_graph_decoder_checks_extra_inputs():
    def step(*args, **kw):
        return args[0]

    with pytest.raises(ValueError, match="extra buffer 'x': needs >= 4 rows"):
        CudaGraphDecoder(step, 4, 2, torch.device("cpu"), extra={"x": torch.zeros(2, 3)})
    dec = CudaGraphDecoder(step, 4, 2, torch.device("cpu"), extra={"x": torch.zeros(4, 3)})
    z = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"extra inputs \['y'\] do not match the captured ones \['x'\]"):
        dec.run(z, z, z, torch.zeros(1, 2, dtype=torch.int32), z.int(), y=torch.zeros(1, 3))


def test_greedy_only_inner_loop_equals_the_sampling_loop_on_greedy_rows(weak_eos_ckpt):
    """The argmax-only loop (what an all-greedy batch replays) picks the codes the full sampling loop picks for
    greedy rows; a batch with one sampled row keeps the full loop (and the greedy rows' codes)."""
    from strataserve.runner.tts_code_predictor import RowSampling

    tts = TTS(str(weak_eos_ckpt), device="cpu", max_num_seqs=4)
    cfg = tts.model.config
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, cfg.talker.hidden_size, generator=gen)
    first = torch.randint(0, cfg.code_predictor.vocab_size, (4,), generator=gen)
    u = torch.rand(4, cfg.num_code_groups - 1, generator=gen)
    vocab = cfg.code_predictor.vocab_size

    def rows(greedy: list[bool]) -> RowSampling:
        return RowSampling(torch.full((4,), 0.9), torch.full((4,), vocab), torch.ones(4), torch.tensor(greedy))

    argmax = tts.runner.cp.loop(hidden, first, rows([True] * 4), u, greedy_only=True)
    full = tts.runner.cp.loop(hidden, first, rows([True] * 4), u)
    assert torch.equal(argmax, full)
    mixed = tts.runner.cp.loop(hidden, first, rows([True, False, True, True]), u)
    assert torch.equal(mixed[[0, 2, 3]], argmax[[0, 2, 3]]) and not torch.equal(mixed[1], argmax[1])
    tts.shutdown()
