"""``strata bench serve``: load-test any OpenAI-compatible server (strataserve, vLLM, ...) over streaming HTTP.

Flags follow ``vllm bench serve``. Requests arrive as a Poisson process (``--request-rate``; gamma-distributed gaps
with ``--burstiness`` != 1, rescaled as vLLM does so the last arrives at N/rate) or all at once (``inf``), capped by
``--max-concurrency`` in flight. One probe request checks the server first; ``--num-warmups`` more run before the
measured ones and are not counted. Probe and warm-ups use prompts of the same shape as, but no prefix in common
with, the measured ones (see ``workload``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from strataserve.bench.client import RequestResult, build_payload, send_request
from strataserve.bench.metrics import METRICS, parse_goodput, parse_percentile_metrics, parse_percentiles
from strataserve.bench.report import print_report, save
from strataserve.bench.results import result_dict
from strataserve.bench.tokenizer import load_tokenizer
from strataserve.bench.workload import arrival_offsets, arrivals, endpoint_of, load_samples, load_workload

__all__ = ["add_cli_args", "endpoint_of", "load_samples", "main", "run"]

_AUTO = "<auto>"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register every ``strata bench serve`` flag on ``parser``."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://host:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="server host")
    g.add_argument("--port", type=int, default=8000, help="server port")
    g.add_argument("--endpoint", default=None, help="/v1/completions or /v1/chat/completions (default: by --backend)")
    g.add_argument("--backend", choices=("openai", "vllm", "openai-chat"), default="openai",
                   help="accepted for vLLM compatibility: openai-chat defaults --endpoint to /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first /v1/models entry)")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer folder for text prompts, exact lengths and counting output tokens when the "
                        "server reports no usage (default: --model if it is a folder)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds before one request is abandoned")

    g = parser.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=1000, help="measured requests")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: unlimited)")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="mean arrivals per second (inf = all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 steadier, inf = evenly spaced; "
                        "as vLLM, the arrival times are rescaled so the last is at num-prompts / request-rate")
    g.add_argument("--seed", type=int, default=0, help="seed for datasets and arrival times")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests sent before the run, with prompts of the same shape that share no "
                        "prefix with the measured ones (so a prefix cache cannot flatter the measured TTFT)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the server to generate exactly max_tokens (vLLM extension); default: on for "
                        "--dataset-name random (as vllm bench serve, which always sets it there), off otherwise")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent with each request")
    g.add_argument("--top-p", type=float, default=None, help="top_p sent with each request")
    g.add_argument("--top-k", type=int, default=None, help="top_k sent with each request (vLLM extension)")

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=("random", "prefix-repetition", "prefix_repetition", "sharegpt"),
                   default="random", help="request set (prefix_repetition is vLLM's spelling of prefix-repetition)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt)")
    g.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens after the prefix (random)")
    g.add_argument("--random-output-len", type=int, default=128, help="mean output tokens (random)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform over the integers in [floor(len*(1-r)), ceil(len*(1+r))] (vLLM's rounding)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own --random-input-len tokens (random)")
    g.add_argument("--random-vocab-size", type=int, default=None, help="token ids drawn below this (default: the tokenizer's size, else 1000)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="shared prefix tokens")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="per-request suffix tokens")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="output tokens")
    g.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="random/prefix-repetition prompts as token-id lists or decoded text (needs --tokenizer); auto = ids for completions, text for chat")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override each conversation's output length")

    g = parser.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:2000")
    g.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help="comma-separated metrics whose mean/median/std/percentiles are printed and saved, of "
                        "ttft,tpot,itl,e2el (vLLM's default is ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", default="95,99",
                   help="comma-separated percentiles printed and saved for those metrics, e.g. 50,90,99.9 "
                        "(keys p50_ttft_ms, p99.9_ttft_ms; vLLM's default is 99)")
    g.add_argument("--gpu-cost-per-hour", type=float, default=None, help="price of the serving hardware, to report cost per 1M output tokens")
    g.add_argument("--label", default=None, help="a label for this run, saved in the result (vLLM's --label)")
    g.add_argument("--save-result", nargs="?", const=_AUTO, default=None, metavar="FILE.json", help="save the JSON result (to FILE.json or --result-filename)")
    g.add_argument("--result-filename", default=None, help="file name for --save-result (default: generated)")
    g.add_argument("--result-dir", default=".", help="folder for --save-result")
    g.add_argument("--save-detailed", action="store_true",
                   help="also save per-request lists as vLLM: input_lens, output_lens, ttfts, itls, start_times, "
                        "generated_texts, errors")
    g.add_argument("--disable-tqdm", "--no-progress", dest="disable_tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; returns (and, if asked, saves) the result dict."""
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(main(args))
    except ValueError as exc:
        raise SystemExit(f"strata bench serve: error: {exc}") from None


def _loop_factory() -> Any:
    """uvloop when installed: its event loop costs the client less CPU per streamed chunk than asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# ----------------------------------------------------------------------------- setup
def _validate(args: argparse.Namespace) -> dict[str, float]:
    if args.dataset_name == "prefix_repetition":
        args.dataset_name = "prefix-repetition"  # one name in the result whichever spelling was given
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset_name == "random"
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf = all at once)")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness={args.burstiness} must be > 0")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups={args.num_warmups} must be >= 0")
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len={args.random_prefix_len} must be >= 0")
    if args.gpu_cost_per_hour is not None and args.gpu_cost_per_hour < 0:
        raise ValueError(f"--gpu-cost-per-hour={args.gpu_cost_per_hour} must be >= 0")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout={args.request_timeout} must be > 0 seconds")
    parse_percentile_metrics(args.percentile_metrics)
    parse_percentiles(args.metric_percentiles)
    # where the result goes, checked now: finding out after the whole run loses it
    if args.save_result is not None:
        folder = Path(args.result_dir)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--result-dir {folder} is a file: give a folder")
        if args.save_result != _AUTO:
            target = Path(args.save_result) if Path(args.save_result).is_absolute() else folder / args.save_result
            if target.is_dir():
                raise ValueError(f"--save-result {target} is a folder: give a file name (or --result-dir FOLDER)")
    return parse_goodput(args.goodput or [])


def _tokenizer_path(args: argparse.Namespace) -> str | None:
    return args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)


async def _first_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    try:
        async with session.get(f"{base}/v1/models", headers=headers, raise_for_status=True) as resp:
            return (await resp.json(content_type=None))["data"][0]["id"]
    except aiohttp.ClientResponseError as exc:
        hint = ("the server wants an API key: pass --api-key (or set OPENAI_API_KEY)" if exc.status == 401
                else "pass --model")
        raise ValueError(f"cannot list models at {base}/v1/models (HTTP {exc.status} {exc.message}); {hint}") from None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"cannot list models at {base}/v1/models ({type(exc).__name__}: {exc}); pass --model") from None


def count_output_tokens(results: list[RequestResult], tokenizer: Any, console: Console) -> None:
    """Requests whose server sent no usage: re-tokenise their text when there is a tokenizer (as vLLM), never
    below the number of output chunks (each carried at least one token); else keep that count and warn once."""
    missing = [r for r in results if r.success and r.output_tokens_source == "chunks"]
    if not missing:
        return
    if tokenizer is None:
        console.print("[yellow]warning:[/] the server reported no usage for "
                      f"{len(missing)} request(s): their output tokens are counted one per streamed chunk, too few "
                      "when a chunk carries several tokens; pass --tokenizer to count by re-tokenising the text")
        return
    for r in missing:
        r.output_tokens = max(r.output_tokens, len(tokenizer.encode(r.generated_text, add_special_tokens=False)))
        r.output_tokens_source = "tokenizer"


# ----------------------------------------------------------------------------- run
async def main(args: argparse.Namespace) -> dict[str, Any]:
    slos = _validate(args)
    metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = endpoint_of(args)
    url = base + "/" + endpoint.lstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampling: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    tokenizer_id = _tokenizer_path(args)
    tokenizer = load_tokenizer(tokenizer_id) if tokenizer_id is not None else None
    err_console = Console(stderr=True)
    samples, warm = load_workload(args, tokenizer, err_console)
    # One pooled connection per request in flight; the timeout spans a whole request, connecting gets 30 s.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or max(args.num_prompts, args.num_warmups))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        model = args.model or await _first_model(client, base, headers)
        bodies = [build_payload(endpoint, model, s, args.ignore_eos, sampling) for s in samples]
        warm_bodies = [build_payload(endpoint, model, s, args.ignore_eos, sampling) for s in warm]

        probe = await send_request(client, url, warm_bodies[0], warm[0].prompt_len, headers)
        if not probe.success:
            raise ValueError(f"the probe request to {url} failed: {probe.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(body: dict[str, Any], prompt_len: int, on_done: Any = None) -> RequestResult:
            if sem is None:
                res = await send_request(client, url, body, prompt_len, headers)
            else:
                async with sem:
                    res = await send_request(client, url, body, prompt_len, headers)
            if on_done is not None:
                on_done()
            return res

        if args.num_warmups:
            k = len(warm_bodies)
            await asyncio.gather(*(one(warm_bodies[i % k], warm[i % k].prompt_len) for i in range(args.num_warmups)))

        offsets = arrival_offsets(len(bodies), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
        columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err_console, disable=args.disable_tqdm, transient=True) as progress:
            task = progress.add_task("requests", total=len(bodies))
            advance = lambda: progress.advance(task)  # noqa: E731
            start = time.perf_counter()
            tasks = [asyncio.create_task(one(bodies[i], samples[i].prompt_len, advance)) async for i in arrivals(offsets)]
            results = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - start

    count_output_tokens(results, tokenizer, err_console)
    result = result_dict(args, base=base, endpoint=endpoint, model=model, tokenizer_id=tokenizer_id, results=results,
                         run_start=start, duration=duration, slos=slos, metrics=metrics, percentiles=percentiles)
    print_report(result)
    if args.save_result is not None:
        name = args.save_result if args.save_result != _AUTO else (args.result_filename or _default_name(args, model))
        path = save(result, Path(args.result_dir) / name if not Path(name).is_absolute() else Path(name))
        err_console.print(f"saved {path}")
    return result


def _default_name(args: argparse.Namespace, model: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    conc = args.max_concurrency or "unlim"
    label = f"{args.label}-" if args.label else ""
    return f"bench-{label}{args.dataset_name}-{args.request_rate}qps-{conc}conc-{Path(model).name}-{stamp}.json"
