"""Present a benchmark result: a rich table, one parseable summary line, and the JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from strataserve.bench.metrics import DEFAULT_PERCENTILES, METRICS, percentile_name

_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)", "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def _selection(result: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(metrics, percentile stat names) the run printed and saved (--percentile-metrics / --metric-percentiles)."""
    metrics = result.get("percentile_metrics") or list(METRICS)
    percentiles = result.get("metric_percentiles") or list(DEFAULT_PERCENTILES)
    return metrics, [percentile_name(p) for p in percentiles]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(result: dict[str, Any]) -> Table:
    t = Table(title="strata bench serve", show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("Successful requests", "completed"),
        ("Failed requests", "failed"),
        ("Maximum concurrency", "max_concurrency"),
        ("Request rate (req/s)", "request_rate"),
        ("Benchmark duration (s)", "duration"),
        ("Total input tokens", "total_input_tokens"),
        ("Total output tokens", "total_output_tokens"),
        ("Output tokens counted from", "output_tokens_source"),
        ("Request throughput (req/s)", "request_throughput"),
        ("Request goodput (req/s)", "request_goodput"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Total token throughput (tok/s)", "total_token_throughput"),
        ("Peak output token throughput (tok/s)", "max_output_tokens_per_s"),
        ("Peak concurrent requests", "max_concurrent_requests"),
        ("Cost per 1M output tokens", "cost_per_1m_output_tokens"),
    ]
    for label, key in rows:
        t.add_row(label, _fmt(result.get(key)))
    metrics, pct = _selection(result)
    for m in metrics:
        t.add_section()
        t.add_row(f"[bold]{_TITLES[m]}[/] (ms)", "")
        for s in ("mean", "median", "std", *pct):
            t.add_row(f"  {s}", _fmt(result.get(f"{s}_{m}_ms")))
    return t


def summary_line(result: dict[str, Any]) -> str:
    """``bench: key=value ...`` - one line for scripts to grep; absent optional figures print as ``none``."""
    keys = [
        ("completed", "completed"),
        ("failed", "failed"),
        ("duration_s", "duration"),
        ("req_per_s", "request_throughput"),
        ("output_tok_per_s", "output_throughput"),
        ("total_tok_per_s", "total_token_throughput"),
    ]
    metrics, pct = _selection(result)
    keys += [(f"{s}_{m}_ms", f"{s}_{m}_ms") for m in metrics for s in ("mean", "median", *pct)]
    keys += [("goodput_req_per_s", "request_goodput"), ("cost_per_1m_output_tokens", "cost_per_1m_output_tokens"),
             ("output_tokens_from", "output_tokens_source")]
    parts = []
    for name, key in keys:
        v = result.get(key)
        parts.append(f"{name}={'none' if v is None else (f'{v:.4g}' if isinstance(v, float) else v)}")
    return "bench: " + " ".join(parts)


def print_report(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(result))
    errors = result.get("error_summary") or []
    if errors:
        console.print(f"[yellow]first error:[/] {errors[0]}")
    print(summary_line(result), flush=True)


def save(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return p
