"""Where the API process's CPU goes on the HTTP path (issue 16 item 5): per request, and per output token.

Three figures, each from the API process's own CPU time (/proc), on a CPU `strata serve` of the tiny random Llama:
- ``per_request_ms``: `strata bench serve` with 144-token prompts and one output token, N then 3N requests at
  concurrency 64; the difference over 2N requests (start-up and warm-up cancel out): HTTP, validation, tokenizing
  the prompt, admission, the engine round trip, the response;
- ``per_token_us``: the same with 144 output tokens, minus the per-request share: streaming a token (the output
  pump, the detokenizer, the SSE chunk and its write);
- ``pump_us``: the output pump alone, in this process (``OutputProcessor.process_outputs`` and the collector's
  ``put`` over 64 requests x 144 steps of one token each, the tiny Llama's tokenizer): what of ``per_token_us`` is
  not the chunk's trip through the HTTP stack.

One line, fixed seed:

    python benchmarks/api_cpu_cost.py [--requests 256]
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_random_llama  # noqa: E402
from http_path_ab import cpu_s  # noqa: E402


def served_api_cpu(srv: Server, model: str, requests: int, output_len: int) -> float:
    """The API process's CPU seconds over one `strata bench serve` run."""
    c0 = cpu_s(srv.proc.pid)
    subprocess.run([sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", srv.url, "--tokenizer", model,
                    "--dataset-name", "random", "--random-input-len", "144", "--random-output-len", str(output_len),
                    "--random-range-ratio", "0", "--num-prompts", str(requests), "--max-concurrency", "64",
                    "--ignore-eos", "--num-warmups", "4", "--disable-tqdm", "--seed", "0"],
                   check=True, stdout=subprocess.DEVNULL)
    return cpu_s(srv.proc.pid) - c0


def pump_us(model: str, requests: int = 64, steps: int = 144) -> float:
    from strataserve.engine.async_llm import _Collector
    from strataserve.engine.input_processor import as_tokenizer, load_tokenizer
    from strataserve.engine.output_processor import OutputProcessor, RequestOutputKind
    from strataserve.types.protocol import EngineCoreOutput, EngineCoreOutputs
    from strataserve.types.sampling import SamplingParams

    tok = as_tokenizer(load_tokenizer(model, False)).hf
    rng = random.Random(0)
    vocab = len(tok)
    op = OutputProcessor(tok)
    collectors = {}
    for i in range(requests):
        op.add_request(f"r{i}", None, [rng.randrange(vocab) for _ in range(144)],
                       SamplingParams(max_tokens=steps, ignore_eos=True), kind=RequestOutputKind.DELTA)
        collectors[f"r{i}"] = _Collector(1)
    batches = [EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[rng.randrange(vocab)],
                                                           finish_reason="length" if s == steps - 1 else None)
                                          for i in range(requests)]) for s in range(steps)]
    t = time.process_time()
    for b in batches:
        for ro in op.process_outputs(b).request_outputs:
            c = collectors[ro.request_id]
            c.put(ro)
            c.out, c.ready = None, False  # taken by its (absent) consumer
    return (time.process_time() - t) / (requests * steps) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    args = p.parse_args()
    n = args.requests
    with tempfile.TemporaryDirectory() as d:
        model = str(write_random_llama(Path(d) / "tiny-llama"))
        srv = Server([model, "--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "2048",
                      "--kv-cache-memory-gib", "2"], Path(d) / "server.log")
        try:
            one = served_api_cpu(srv, model, 3 * n, 1) - served_api_cpu(srv, model, n, 1)
            full = served_api_cpu(srv, model, 3 * n, 144) - served_api_cpu(srv, model, n, 144)
        finally:
            srv.stop()
        per_request = one / (2 * n)
        per_token = (full / (2 * n) - per_request) / 143  # the first token comes with the request
        print(f"per_request_ms={per_request * 1e3:.3f} per_token_us={per_token * 1e6:.1f} "
              f"pump_us={pump_us(model):.2f} requests={n} output_tokens=144 concurrency=64", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
