"""Qwen3-TTS generation speed: the official reference (``qwen-tts-hf``) at batch 1 vs strataserve's engine at
batch 1 / 8 / 16 / 32, random weights in the released shapes (``strataserve/models/qwen3_tts/public_shapes.json``),
the same random 40-token texts, greedy talker and code predictor, no eos, FRAMES first-codebook steps per clip
(the reference's way of counting: frames = complete codec frames). Rounds alternate reference and ours.
Also the in-process time to first audio at batch 1 (AsyncTTS, first chunk = 2 frames, codec decode included).

faster-qwen3-tts (batch 1, CUDA only, when installed) runs on the reference's model in the same rounds.

Prints one parseable line per measurement (``TTSBENCH {...}``) and a final ``RESULT {...}``.

    python benchmarks/tts_bench.py                      # H200: SHAPES=1.7B,0.6B ROUNDS=3 FRAMES=100
    SHAPES=tiny ROUNDS=1 FRAMES=8 python benchmarks/tts_bench.py   # CPU smoke run
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from strataserve.engine.async_tts import AsyncTTS  # noqa: E402
from strataserve.types.protocol import EngineCoreRequest  # noqa: E402
from strataserve.types.sampling import SamplingParams  # noqa: E402
from strataserve.engine.tts_engine import TTSModel, build_core, build_talker, tune_talker  # noqa: E402
from strataserve.models.qwen3_tts.codec import CodecDecoder  # noqa: E402
from strataserve.models.qwen3_tts.config import tts_config_from_dict  # noqa: E402
from strataserve.models.qwen3_tts.loader import init_random_talker  # noqa: E402
from strataserve.models.qwen3_tts.prompt import build_prompt  # noqa: E402
from strataserve.runner.tts_runner import CodeSampling, TTSRequestState  # noqa: E402

SHAPES = json.loads((ROOT / "strataserve/models/qwen3_tts/public_shapes.json").read_text())
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
FRAMES = int(os.environ.get("FRAMES", 100))
ROUNDS = int(os.environ.get("ROUNDS", 3))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8,16,32").split(",")]
MODE = os.environ.get("MODE", "auto")  # auto = Triton kernels; all-decode steps in CUDA graphs
TEXT_LEN = 40


def shape(name: str) -> tuple[dict, dict]:
    if name != "tiny":
        return copy.deepcopy(SHAPES[name]), copy.deepcopy(SHAPES["speech_tokenizer"])
    from _tiny_tts import import_reference, tiny_codec_config, tiny_config

    ref = import_reference()
    return tiny_config(ref).to_dict(), tiny_codec_config(ref).to_dict()


def emit(**kw) -> dict:
    print("TTSBENCH " + json.dumps(kw), flush=True)
    return kw


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- reference
def reference_model(name: str, raw: dict):
    from _tiny_tts import import_reference, reference_rope, tiny_config

    ref = import_reference()
    cfg = tiny_config(ref) if name == "tiny" else ref.Config(**{k: v for k, v in raw.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device(DEV), reference_rope():  # its rotary modules need the reference's RoPE initialiser
        m = ref.Model(cfg).to(DT).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def faster_runner(name: str, ref, text: list[int]):
    """faster-qwen3-tts on the reference's model (CUDA only), warmed up; None (reported) if it cannot run."""
    if ref is None or DEV != "cuda" or os.environ.get("SKIP_FASTER"):
        return None
    try:
        from _faster_qwen3_tts import FasterRunner

        fast = FasterRunner(ref, DEV, DT)
        fast.run(text, FRAMES)  # warm-up: captures its graphs
        return fast
    except Exception:  # noqa: BLE001 - benchmark: say what broke and go on
        import traceback

        traceback.print_exc()
        emit(shape=name, runner="faster-qwen3-tts", error="could not run, see traceback")
        return None


def run_reference(m, texts: list[list[int]]) -> tuple[int, float]:
    ids = [torch.tensor([t], device=DEV) for t in texts]
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        codes, _ = m.generate(input_ids=ids, languages=["english"] * len(ids), speakers=["ryan"] * len(ids),
                              max_new_tokens=FRAMES, do_sample=False, subtalker_dosample=False)
    sync()
    return sum(c.shape[0] for c in codes), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- ours
def our_model(raw: dict, codec_raw: dict) -> TTSModel:
    cfg = tts_config_from_dict(raw, codec_raw)
    talker, graphs = build_talker(cfg, torch.device(DEV), DT, MODE, 4096)
    init_random_talker(talker)
    tune_talker(talker, graphs)  # as load_tts_model does (STRATA_GEMV_TUNE=0: none, the code before run 16)
    codec = CodecDecoder(cfg.codec).to(DEV).eval()  # HF-like small init is fine: the codec is not in the loop
    return TTSModel(cfg, talker, codec, tokenizer=None, name=f"random-{cfg.model_size}", cuda_graphs=graphs)


def add(core, runner, model: TTSModel, rid: str, text: list[int]) -> None:
    prompt = build_prompt(model.talker, text, "english", "ryan")
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=FRAMES, min_tokens=2, ignore_eos=True)
    runner.register(rid, TTSRequestState(prompt, sp, CodeSampling(temperature=0.0)))
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[0] * prompt.length, sampling_params=sp,
                                       eos_token_id=model.config.codec_eos_id))


def run_ours(core, runner, model: TTSModel, texts: list[list[int]], tag: str,
             frames_out: list | None = None) -> tuple[int, float]:
    sync()
    t0 = time.perf_counter()
    for i, t in enumerate(texts):
        add(core, runner, model, f"{tag}-{i}", t)
    while core.has_unfinished_requests():
        core.step()
    sync()
    dt = time.perf_counter() - t0
    frames = 0
    for i in range(len(texts)):
        frames += len(runner.states[f"{tag}-{i}"].frames)
        if frames_out is not None:
            frames_out.append(runner.states[f"{tag}-{i}"].frames)
        runner.release(f"{tag}-{i}", deferred=False)
    return frames, dt


def step_ab(core, runner, model: TTSModel, texts: list[list[int]], name: str, rounds: int = 3) -> list[dict]:
    """Batch 16, all-greedy code predictor: the argmax-only graphs vs the general (sampling) graphs, alternating
    in the same process; then, once, where the step's wall time goes (CUDA kernel time vs host) with the profiler."""
    rows, greedy_graphs = [], runner.greedy_graphs
    if greedy_graphs is None:
        return rows
    try:
        for rnd in range(rounds):
            got: dict[bool, list] = {}
            for use in ((True, False) if rnd % 2 == 0 else (False, True)):
                runner.greedy_graphs = greedy_graphs if use else None
                got[use] = []
                n, dt = run_ours(core, runner, model, texts[:16], f"ab{rnd}{int(use)}", got[use])
                rows.append(emit(shape=name, round=rnd, runner="strataserve", metric="b16_greedy_graphs_ab",
                                 greedy_graphs=use, batch=16, frames=n, s=round(dt, 3),
                                 per_sample_fps=round(n / dt / 16, 2)))
            # greedy everywhere: both graph sets must give the same frames
            rows.append(emit(shape=name, round=rnd, metric="b16_greedy_graphs_frames_identical",
                             value=got[True] == got[False]))
        from torch.profiler import ProfilerActivity, profile

        for use in (True, False):
            runner.greedy_graphs = greedy_graphs if use else None
            steps0 = runner.fused_steps
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                n, dt = run_ours(core, runner, model, texts[:16], f"prof{int(use)}")
            kern = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            cuda_s = sum(e.self_device_time_total for e in kern) / 1e6
            steps = runner.fused_steps - steps0
            rows.append(emit(shape=name, runner="strataserve", metric="b16_step_profile", greedy_graphs=use,
                             batch=16, wall_s=round(dt, 3), cuda_kernel_s=round(cuda_s, 3), decode_steps=steps,
                             kernels=sum(e.count for e in kern),
                             top=[(e.key[:60], round(e.self_device_time_total / 1e3, 1), e.count)
                                  for e in sorted(kern, key=lambda e: -e.self_device_time_total)[:8]]))
    except Exception:  # noqa: BLE001 - benchmark: report and go on
        import traceback

        traceback.print_exc()
    finally:
        runner.greedy_graphs = greedy_graphs
    return rows


def time_to_first_audio(model: TTSModel, text: list[int], trials: int = 5) -> list[float]:
    tts = AsyncTTS(model, max_num_seqs=4, first_chunk_frames=2)
    out = []

    async def one() -> float:
        prompt_state = build_prompt(model.talker, text, "english", "ryan")
        rid = f"ttfa-{len(out)}"
        sp = SamplingParams(temperature=0.0, max_tokens=FRAMES, min_tokens=2, ignore_eos=True)
        t0 = time.perf_counter()
        tts.runner.register(rid, TTSRequestState(prompt_state, sp, CodeSampling(temperature=0.0)))
        from strataserve.engine.async_tts import SpeechStream

        stream = SpeechStream(tts, rid, 2, 8)
        tts._streams[rid] = stream
        tts.client.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[0] * prompt_state.length,
                                                 sampling_params=sp, eos_token_id=model.config.codec_eos_id))
        tts._ensure_pump()
        it = stream.__aiter__()
        await it.__anext__()
        dt = time.perf_counter() - t0
        await it.aclose()
        return dt

    async def main() -> None:
        for _ in range(trials + 1):
            out.append(await one())
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    finally:
        tts.shutdown()
    return out[1:]  # the first is warm-up


def main() -> None:
    global MODE
    result: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
                    "frames": FRAMES, "mode": MODE, "rounds": ROUNDS}
    for name in os.environ.get("SHAPES", "1.7B,0.6B").split(","):
        raw, codec_raw = shape(name)
        vocab = raw["talker_config"]["text_vocab_size"]
        gen = torch.Generator().manual_seed(0)
        texts = [torch.randint(0, min(vocab, 150000) - 8, (TEXT_LEN,), generator=gen).tolist() for _ in range(max(BATCHES))]
        model = core = runner = None
        for mode in dict.fromkeys([MODE, "eager"]):  # a failure of the kernel/graph mode is reported, then eager
            try:
                MODE = mode
                model = our_model(raw, codec_raw)
                core, runner = build_core(model, max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
                                          kv_cache_memory_gib=4.0)
                for b in dict.fromkeys([2, *BATCHES]):  # warm-up: kernels, allocator, each batch size's graphs
                    run_ours(core, runner, model, texts[:b], f"warm{b}")
                break
            except Exception:  # noqa: BLE001 - benchmark: say what broke and go on
                import traceback

                traceback.print_exc()
                emit(shape=name, runner="strataserve", mode=mode, error="setup failed, see traceback")
        result[f"{name}_mode"] = MODE
        ref = None
        if not os.environ.get("SKIP_REF"):
            try:
                ref = reference_model(name, raw)
            except Exception:  # noqa: BLE001 - report, and still measure ours
                import traceback

                traceback.print_exc()
                emit(shape=name, runner="reference", error="could not build the reference, see traceback")
        if ref is not None:
            run_reference(ref, texts[:1])
        fast = faster_runner(name, ref, texts[0])
        rows = []
        for rnd in range(ROUNDS):
            order = ["ref", "faster", "ours"] if rnd % 2 == 0 else ["ours", "faster", "ref"]
            for who in order:
                if who == "faster" and fast is not None:
                    n, dt = fast.run(texts[0], FRAMES)
                    rows.append(emit(shape=name, round=rnd, runner="faster-qwen3-tts", batch=1, frames=n,
                                     s=round(dt, 3), per_sample_fps=round(n / dt, 2)))
                elif who == "ref" and ref is not None:
                    n, dt = run_reference(ref, texts[:1])
                    rows.append(emit(shape=name, round=rnd, runner="reference", batch=1, frames=n, s=round(dt, 3),
                                     per_sample_fps=round(n / dt, 2)))
                elif who == "ours":
                    for b in BATCHES:
                        n, dt = run_ours(core, runner, model, texts[:b], f"r{rnd}b{b}")
                        rows.append(emit(shape=name, round=rnd, runner="strataserve", batch=b, frames=n,
                                         s=round(dt, 3), fps=round(n / dt, 1), per_sample_fps=round(n / dt / b, 2)))
        if os.environ.get("STEP_AB") and 16 in BATCHES:
            rows += step_ab(core, runner, model, texts, name)
        core.shutdown()
        if not os.environ.get("SKIP_TTFA"):
            ttfa = time_to_first_audio(model, texts[0])
            rows.append(emit(shape=name, runner="strataserve", metric="time_to_first_audio_s", batch=1,
                             values=[round(v, 4) for v in ttfa], median=round(sorted(ttfa)[len(ttfa) // 2], 4)))
        refs = [r["per_sample_fps"] for r in rows if r.get("runner") == "reference"]
        fasts = [r["per_sample_fps"] for r in rows if r.get("runner") == "faster-qwen3-tts"]
        ours1 = [r["per_sample_fps"] for r in rows if r.get("runner") == "strataserve" and r.get("batch") == 1
                 and "metric" not in r]
        if fasts:
            result[f"{name}_bs1_vs_faster_per_round"] = [round(o / f, 2) for o, f in zip(ours1, fasts)]
        result[f"{name}_graph_steps"] = [runner.fused_steps, runner.graph_steps]
        for b in BATCHES:
            ours = [r["per_sample_fps"] for r in rows if r.get("runner") == "strataserve" and r.get("batch") == b
                    and "metric" not in r]
            if refs:
                result[f"{name}_bs{b}_vs_ref_bs1_per_round"] = [round(o / r, 2) for o, r in zip(ours, refs)]
        result[f"{name}_rows"] = rows
        del ref, fast, model, core, runner
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print("RESULT " + json.dumps(result), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tts_bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
