"""OmniVoice generation speed: the reference (``omnivoice``: its own unmasking loop, ``_generate_iterative``) at
batch 1 vs strataserve's ``NARRunner`` at batch 1 / 8 / 32, random weights in the released shape (Qwen3-0.6B
backbone, 8 codebooks x 1,025), the same text, FRAMES target frames (25 frames = 1 s of audio), 32 steps,
guidance 2.0, the reference's default sampling (Gumbel position noise). Both load the same saved checkpoint.
Rounds alternate which side runs first. Also: strataserve's audio decode (Higgs decoder, released-like widths,
random weights) per batch, so ``rtf_e2e`` covers tokens + waveform; and a CUDA-graph correctness check on a tiny
fp32 model (tokens of the graph runner vs the reference, greedy and sampled).

Prints one line per measurement (``OMNIBENCH {...}``) and a final ``RESULT {...}``.

    python benchmarks/omnivoice_bench.py                           # H200: ROUNDS=3 FRAMES=200 BATCHES=1,8,32
    SHAPE=tiny ROUNDS=1 FRAMES=20 BATCHES=1,2 python benchmarks/omnivoice_bench.py   # CPU smoke run
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _tiny_omnivoice import TINY_CODEC, import_reference, make_tiny_omnivoice, make_tiny_tokenizer_with_specials  # noqa: E402,E501

from strataserve.models.omnivoice.loader import load_omnivoice  # noqa: E402
from strataserve.models.omnivoice.prompt import build_input_ids  # noqa: E402
from strataserve.runner.nar_runner import NARRequest, NARRunner, UnmaskSettings  # noqa: E402

TINY = os.environ.get("SHAPE") == "tiny"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FRAMES = int(os.environ.get("FRAMES", 20 if TINY else 200))
ROUNDS = int(os.environ.get("ROUNDS", 3))
BATCHES = [int(x) for x in os.environ.get("BATCHES", "1,2" if TINY else "1,8,32").split(",")]
STEPS = int(os.environ.get("STEPS", 32))
TEXT = "the one of you that was at the"
LLM = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
           num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
           rope_theta=1000000.0, tie_word_embeddings=True)
#: released-like audio tokenizer: 25 frames/s, 8 codebooks of 1,024, the library's default decoder widths
CODEC = dict(TINY_CODEC, codebook_size=1024, codebook_dim=64,
             acoustic_model_config=dict(downsampling_ratios=[8, 5, 4, 2, 3], upsampling_ratios=[8, 5, 4, 2, 3]),
             semantic_model_config=None)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def emit(row: dict) -> dict:
    print("OMNIBENCH " + json.dumps(row), flush=True)
    return row


def build_checkpoint(folder: Path):
    """The reference model (random weights) saved as the package saves it, plus tokenizer and audio decoder."""
    from transformers import Qwen3Config

    ref = import_reference()
    if TINY:
        return make_tiny_omnivoice(folder)
    tok = make_tiny_tokenizer_with_specials()
    torch.manual_seed(0)
    with torch.device(DEV):
        m = ref.OmniVoice(ref.OmniVoiceConfig(llm_config=Qwen3Config(**LLM).to_dict())).to(torch.bfloat16).eval()
    m.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    m.text_tokenizer = tok
    from _tiny_omnivoice import write_codec

    write_codec(folder / "audio_tokenizer", CODEC)
    return folder, m


def ref_generate(ref, m, bs: int) -> float:
    task = ref.GenerationTask(batch_size=bs, texts=[TEXT] * bs, target_lens=[FRAMES] * bs, langs=[None] * bs,
                              instructs=[None] * bs, ref_texts=[None] * bs, ref_audio_tokens=[None] * bs,
                              ref_rms=[None] * bs)
    gc = ref.OmniVoiceGenerationConfig(num_step=STEPS, guidance_scale=2.0)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        m._generate_iterative(task, gc)
    sync()
    return time.perf_counter() - t


def ours_generate(ov, runner: NARRunner, bs: int, decode: bool) -> tuple[float, float]:
    reqs = []
    for i in range(bs):
        ids, a0 = build_input_ids(ov.tokenizer, TEXT, FRAMES, 8, ov.config.audio_mask_id)
        reqs.append(NARRequest(f"r{i}", ids, a0, FRAMES, UnmaskSettings(num_step=STEPS), seed=i))
    sync()
    t = time.perf_counter()
    toks = runner.generate(reqs)
    sync()
    gen = time.perf_counter() - t
    if decode and ov.codec is not None:
        ov.codec.decode_batch(toks)
        sync()
    return gen, time.perf_counter() - t


def graph_check() -> dict:
    try:
        return _graph_check()
    except Exception as exc:  # noqa: BLE001 -- reported in the result, the speed figures still come
        return emit({"check_error": repr(exc)})


def _graph_check() -> dict:
    """Tiny fp32 model on this device: the runner (graphs where CUDA) vs the reference, greedy and sampled."""
    ref = import_reference()
    with tempfile.TemporaryDirectory() as d:
        path, m = make_tiny_omnivoice(Path(d) / "tiny")
        m = m.to(DEV)
        ov = load_omnivoice(path, device=DEV, dtype="float32")
        runner = NARRunner(ov.model, num_codebooks=8, mask_id=1024, cuda_graphs=ov.cuda_graphs)
        texts, lens, out = ["the cat sat", "hello there you", "a longer line of words to say"], [9, 14, 23], {}
        for name, pos_t in (("greedy", 0.0), ("sampled", 5.0)):
            gc = ref.OmniVoiceGenerationConfig(num_step=8, position_temperature=pos_t)
            reqs = []
            for i, (tx, n) in enumerate(zip(texts, lens)):
                ids, a0 = build_input_ids(ov.tokenizer, tx, n, 8, 1024)
                reqs.append(NARRequest(f"c{i}", ids, a0, n, UnmaskSettings(num_step=8, position_temperature=pos_t),
                                       seed=11 + i))
            mine = runner.generate(reqs)
            same = []
            for i, (tx, n) in enumerate(zip(texts, lens)):
                torch.manual_seed(11 + i)
                task = ref.GenerationTask(1, [tx], [n], [None], [None], [None], [None], [None])
                with torch.no_grad():
                    r = m._generate_iterative(task, gc)[0]
                same.append(float((r == mine[i]).float().mean()))
            out[name] = same
        out["graphs"] = ov.cuda_graphs
        return emit({"check": "tokens_vs_reference", **out})


def served_ttfa(ov) -> dict:
    """Time to first audio at batch 1 through ``AsyncOmniVoice`` (the scheduler thread, window, decode)."""
    import asyncio

    from strataserve.engine.omnivoice_tts import AsyncOmniVoice
    from strataserve.types.speech import SpeechParams

    tts = AsyncOmniVoice(ov, name="bench")

    async def one(seed: int) -> float:
        t = time.perf_counter()
        stream = tts.synthesize(TEXT, params=SpeechParams(seed=seed, num_step=STEPS))
        async for _ in stream:
            return time.perf_counter() - t
        return float("nan")

    try:
        times = [asyncio.run(one(i)) for i in range(4)][1:]  # the first captures this runner's graph
    finally:
        tts.shutdown()
    return emit({"served_ttfa_s": [round(x, 4) for x in times], "frames": "estimated from the text"})


def main() -> None:
    result: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "frames": FRAMES,
                    "num_step": STEPS, "torch": torch.__version__, "rounds": ROUNDS}
    result["check"] = graph_check()
    ref = import_reference()
    with tempfile.TemporaryDirectory() as d:
        folder, m = build_checkpoint(Path(d) / "omnivoice")
        t = time.perf_counter()
        ov = load_omnivoice(folder, device=DEV, dtype="bfloat16" if DEV == "cuda" else "float32")
        result["load_s"] = round(time.perf_counter() - t, 2)
        runner = NARRunner(ov.model, num_codebooks=8, mask_id=ov.config.audio_mask_id, cuda_graphs=ov.cuda_graphs)
        try:
            for bs in BATCHES:  # warm-up: graph capture per bucket, allocator
                ours_generate(ov, runner, bs, True)
        except Exception as exc:  # noqa: BLE001 -- a failed capture is reported; the eager figures still come
            result["graph_error"] = emit({"graph_error": repr(exc)})
            runner = NARRunner(ov.model, num_codebooks=8, mask_id=ov.config.audio_mask_id, cuda_graphs=False)
            for bs in BATCHES:
                ours_generate(ov, runner, bs, True)
        ref_generate(ref, m, 1)
        rows = []
        for rnd in range(ROUNDS):
            order = ("ref", "ours") if rnd % 2 == 0 else ("ours", "ref")
            for side in order:
                if side == "ref":
                    s = ref_generate(ref, m, 1)
                    rows.append(emit({"round": rnd, "side": "reference", "bs": 1, "s": round(s, 4),
                                      "frames_per_s": round(FRAMES / s, 1), "rtf": round(s / (FRAMES / 25), 4)}))
                    continue
                for bs in BATCHES:
                    gen, e2e = ours_generate(ov, runner, bs, True)
                    rows.append(emit({"round": rnd, "side": "strataserve", "bs": bs, "s": round(gen, 4),
                                      "s_e2e": round(e2e, 4), "frames_per_s": round(bs * FRAMES / gen, 1),
                                      "rtf": round(gen / (FRAMES / 25), 4), "rtf_e2e": round(e2e / (FRAMES / 25), 4)}))
        if not TINY and DEV == "cuda":
            s = ref_generate(ref, m, 32)
            rows.append(emit({"round": "once", "side": "reference", "bs": 32, "s": round(s, 4),
                              "frames_per_s": round(32 * FRAMES / s, 1)}))
        try:
            result["served"] = served_ttfa(ov)
        except Exception as exc:  # noqa: BLE001 -- report, keep the figures above
            result["served"] = emit({"served_error": repr(exc)})
    per_round = []
    for rnd in range(ROUNDS):
        base = next(r for r in rows if r["round"] == rnd and r["side"] == "reference")["frames_per_s"]
        ratios = {f"bs{r['bs']}": round(r["frames_per_s"] / base, 2) for r in rows
                  if r["round"] == rnd and r["side"] == "strataserve"}
        per_round.append(ratios)
    result["speedup_vs_reference_bs1_per_round"] = per_round
    result["rows"] = rows
    print("RESULT " + json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "omnivoice_bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
