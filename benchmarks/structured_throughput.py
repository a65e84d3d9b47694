"""Structured-output overhead (issue 13's benchmark): output throughput with every request JSON-schema
constrained vs the same workload unconstrained, same engine, same run.

The schema is an unbounded array of objects, so the grammar constrains every token until the model closes the
array (at most ``--output-len`` tokens, ignore_eos); each request's unconstrained twin generates exactly as many
tokens as it did, with the same seed, so both passes do the same work but for the grammar. Fixed seed, one warm-up of each kind, then
``--rounds`` rounds, each timing both kinds in alternating order. Prints one line:
``ratio_min=... ratios=... cpu_ratio_min=... free_tok_s=... json_tok_s=...`` (goal: ratio_min >= 0.9).
``cpu_ratio`` divides tokens per second of this process's CPU time (all its threads, the grammar worker's
included): on a shared machine other processes' load moves the wall-clock ratio far more than it moves this one.

    python benchmarks/structured_throughput.py                        # the embedded demo model on CPU
    python benchmarks/structured_throughput.py --model QWEN3_0.6B_DIR --device cuda --dtype bfloat16 \
        --num-requests 256 --output-len 256

The model's tokenizer must spell JSON (byte-level BPE such as Qwen's or the demo model's).
"""
from __future__ import annotations

import argparse
import random
import time

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "score": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "score", "ok"], "additionalProperties": False}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--mode", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from strataserve import LLM, SamplingParams
    from strataserve.types.sampling import GuidedDecodingParams

    if args.model is None:
        from strataserve.assets import DEMO_MODEL_DIR

        args.model = str(DEMO_MODEL_DIR)
    torch.manual_seed(args.seed)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, mode=args.mode,
              kv_cache_memory_gib=args.kv_cache_memory_gib, max_num_seqs=max(args.num_requests, 1))
    vocab = len(llm.get_tokenizer())
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    json_guide = GuidedDecodingParams(json=SCHEMA)
    json_params = [SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True,
                                  seed=args.seed * 1_000_003 + i, guided_decoding=json_guide)
                   for i in range(args.num_requests)]
    # A grammar can end a request early (a trained model rarely closes the array; random weights often do): a
    # calibration pass (also the JSON warm-up) gives each request's length, and the free pass generates exactly
    # as many tokens per request, same seeds, so both passes do the same work but for the grammar.
    t0 = time.perf_counter()
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, json_params, use_tqdm=False)]
    print(f"# calibration: {time.perf_counter() - t0:.1f} s, json lengths mean {sum(lengths) / len(lengths):.1f} "
          f"min {min(lengths)} max {max(lengths)}", flush=True)
    free_params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True,
                                  seed=args.seed * 1_000_003 + i) for i, n in enumerate(lengths)]
    kinds = {"free": free_params, "json": json_params}

    def timed(kind: str, n: int) -> tuple[float, float, int]:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts[:n], kinds[kind][:n], use_tqdm=False)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if kind == "free":
            assert tokens == sum(lengths[:n]), "the free pass must produce each request's calibrated length"
        return tokens / dt, tokens / dc, tokens

    for kind in kinds:  # warm-up: compiles the grammar, fills caches
        timed(kind, min(8, args.num_requests))
    ratios, cpu_ratios, free, json_ = [], [], [], []
    for r in range(args.rounds):
        order = ["free", "json"] if r % 2 == 0 else ["json", "free"]
        got = {k: timed(k, args.num_requests) for k in order}
        free.append(got["free"][0])
        json_.append(got["json"][0])
        ratios.append(got["json"][0] / got["free"][0])
        cpu_ratios.append(got["json"][1] / got["free"][1])
        print(f"# round {r}: order={','.join(order)} free_tok_s={free[-1]:.1f} json_tok_s={json_[-1]:.1f} "
              f"ratio={ratios[-1]:.3f} cpu_ratio={cpu_ratios[-1]:.3f} free_tokens={got['free'][2]} "
              f"json_tokens={got['json'][2]}", flush=True)
    print(f"ratio_min={min(ratios):.3f} ratios={','.join(f'{x:.3f}' for x in ratios)} "
          f"cpu_ratio_min={min(cpu_ratios):.3f} cpu_ratios={','.join(f'{x:.3f}' for x in cpu_ratios)} "
          f"free_tok_s={','.join(f'{x:.1f}' for x in free)} json_tok_s={','.join(f'{x:.1f}' for x in json_)} "
          f"requests={args.num_requests} output_len={args.output_len} device={args.device} dtype={args.dtype} "
          f"torch={torch.__version__}")
    llm.shutdown()


if __name__ == "__main__":
    main()
