"""Where batch-1 time to first audio goes (issue 10): engine steps until the first 2 frames exist (each step timed,
synchronised), then the codec decode of those 2 frames, on random weights in the 1.7B shape (graphs as ``auto``).

Prints ``TTFAPARTS {...}`` per trial (the first is warm-up).

    python benchmarks/tts_ttfa_parts.py
"""
from __future__ import annotations

import json
import time

import torch

import tts_bench as tb


def main() -> None:
    raw, codec_raw = tb.shape("1.7B")
    model = tb.our_model(raw, codec_raw)
    core, runner = tb.build_core(model, max_num_seqs=4, max_num_batched_tokens=4096, kv_cache_memory_gib=1.0)
    vocab = min(raw["talker_config"]["text_vocab_size"], 150000) - 8
    text = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for trial in range(4):
        rid = f"t{trial}"
        tb.sync()
        t0 = time.perf_counter()
        tb.add(core, runner, model, rid, text)
        steps = []
        while len(runner.states[rid].frames) < 2:
            s0 = time.perf_counter()
            core.step()
            tb.sync()
            steps.append(round((time.perf_counter() - s0) * 1e3, 2))
        t_frames = time.perf_counter() - t0
        c0 = time.perf_counter()
        codes = torch.tensor(runner.states[rid].frames[:2], dtype=torch.long).T[None].to(model.codec_device)
        with torch.inference_mode():  # as AsyncTTS decodes its first chunk
            model.codec.decode_window(codes, 0, 2)[0].cpu()
        t_codec = time.perf_counter() - c0
        core.abort_requests([rid])
        while core.has_unfinished_requests():
            core.step()
        runner.release(rid, deferred=False)
        print("TTFAPARTS " + json.dumps(dict(trial=trial, steps_ms=steps, frames_ms=round(t_frames * 1e3, 1),
                                             codec_ms=round(t_codec * 1e3, 1), graph_steps=runner.graph_steps)),
              flush=True)


if __name__ == "__main__":
    main()
