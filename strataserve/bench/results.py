"""The result record of one ``strata bench serve`` run: settings, aggregate figures and, with ``--save-detailed``,
per-request lists, under the keys vLLM's ``vllm bench serve --save-result`` writes (its plotting and conversion
scripts read them) plus strataserve's own."""
from __future__ import annotations

import argparse
import math
from datetime import datetime, timezone
from typing import Any, Sequence

from strataserve.bench.client import RequestResult
from strataserve.bench.metrics import compute_metrics

# Per-request lists vLLM drops without --save-detailed (``latencies`` it always keeps; so do we).
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors",
                 "e2els", "request_errors")  # the last two: strataserve's earlier names, kept for existing readers


def token_source(results: Sequence[RequestResult]) -> str | None:
    """Where the output token counts came from: one of usage / tokenizer / chunks, ``mixed`` or None (no success)."""
    kinds = {r.output_tokens_source for r in results if r.success}
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def result_dict(
    args: argparse.Namespace,
    *,
    base: str,
    endpoint: str,
    model: str,
    tokenizer_id: str | None,
    results: list[RequestResult],
    run_start: float,
    duration: float,
    slos: dict[str, float],
    metrics: Sequence[str],
    percentiles: Sequence[float],
) -> dict[str, Any]:
    errors = [r.error for r in results if not r.success]
    out: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": args.backend,
        "endpoint_type": args.backend,  # vLLM writes both names for the same thing
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "base_url": base,
        "endpoint": endpoint,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",  # JSON has no inf
        "burstiness": args.burstiness if math.isfinite(args.burstiness) else "inf",
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "ignore_eos": args.ignore_eos,
        "goodput_slos_ms": slos or None,
        "gpu_cost_per_hour": args.gpu_cost_per_hour,
        "percentile_metrics": list(metrics),
        "metric_percentiles": list(percentiles),
        **compute_metrics(results, duration, slos or None, args.gpu_cost_per_hour, metrics, percentiles),
        "output_tokens_source": token_source(results),
        "latencies": [r.latency for r in results],
        "error_summary": list(dict.fromkeys(errors))[:10],  # distinct messages, first ten
    }
    if args.save_detailed:
        out["input_lens"] = [r.prompt_len for r in results]
        out["output_lens"] = [r.output_tokens for r in results]
        out["ttfts"] = [r.ttft for r in results]
        out["itls"] = [r.itl for r in results]
        out["start_times"] = [r.start_time - run_start for r in results]  # seconds from the start of the run
        out["generated_texts"] = [r.generated_text for r in results]
        out["errors"] = [r.error for r in results]  # one per request, "" for a success (as vLLM)
        out["e2els"] = out["latencies"]
        out["request_errors"] = out["errors"]
    return out
