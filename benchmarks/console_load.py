"""Issue 14's benchmark: the web console under load. CPU, the demo model, ``--api-key`` set.

Per round, ``strata bench serve`` loads the server (random prompts and outputs, lengths uniform in
[min_len, max_len], ignore_eos, fixed seed) three times, in an order that rotates between rounds:

- ``closed``: nothing else;
- ``polled``: while ``--pollers`` simulated dashboards (plain HTTP clients, no browser) poll the feed each second
  as the page does (``/console/api/stats?since=LAST``): what open consoles cost the API;
- ``browser``: while a headless Chromium reloads the dashboard over and over (cache disabled). Chromium shares
  the machine's cores with the server, so this run's tok/s is reported but is not the API-cost figure.

Before the rounds, on the idle server: the API process's CPU time per second with no poller (the feed's own
1 s sampling, plus the idle loop) and per feed poll (200 sequential polls, that CPU time less the idle rate), read
from /proc. These two are the feed's cost, independent of the machine's other load.

Measured: page load (navigation start to the load event: HTML, CSS, JS, uPlot) and page live (navigation start
to the dashboard showing its first data from the feed, key sent) for every reload under load; the feed's
answer time under load; output tok/s polled / closed.

Goals (issue 14): every page load under 1 s with the server under load; the API not slowed by the feed.
Prints one line per run and a summary line ``load_ms_max=... live_ms_max=... tps_ratio_min=...``.

    python benchmarks/console_load.py                 # 3 rounds
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from router_bench import Server, bench_serve  # noqa: E402

from strataserve.assets import DEMO_MODEL_DIR  # noqa: E402

KEY = "bench-key"


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,800"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    drv.execute_cdp_cmd("Network.enable", {})
    drv.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
    return drv


def load_once(drv, url: str) -> tuple[float, float]:
    """(load event, first live data) in ms after navigation start, for one fresh load of the page."""
    drv.get(url)
    deadline = time.monotonic() + 30
    while True:
        live = drv.execute_script(
            "return document.getElementById('conn').textContent === 'live' ? performance.now() : null")
        nav = drv.execute_script("const n = performance.getEntriesByType('navigation')[0];"
                                 "return n && n.loadEventEnd > 0 ? n.loadEventEnd : null")
        if live is not None and nav is not None:
            return float(nav), float(live)
        if time.monotonic() > deadline:
            raise SystemExit("the console did not go live within 30 s")
        time.sleep(0.02)


def reload_loop(drv, url: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        out.append(load_once(drv, url))
        time.sleep(0.5)


def poll_loop(base: str, stop: threading.Event, out: list[float]) -> None:
    """One dashboard's traffic: the full history once, then only the new samples every second."""
    last = 0.0
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            doc = client.get(f"{base}/console/api/stats", params={"since": last}).json()
            out.append((time.perf_counter() - t0) * 1000)
            if doc["samples"]:
                last = doc["samples"][-1]["t"]
            stop.wait(1.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def feed_cost(server: Server, polls: int = 200, idle_s: float = 10.0) -> tuple[float, float]:
    """(API CPU ms per second idle with the feed sampling, API CPU ms per feed poll) on the idle server."""
    pid = server.proc.pid
    c0, t0 = cpu_s(pid), time.perf_counter()
    time.sleep(idle_s)
    idle = (cpu_s(pid) - c0) / (time.perf_counter() - t0)
    last = 0.0
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        c0, t0 = cpu_s(pid), time.perf_counter()
        for _ in range(polls):
            doc = client.get(f"{server.url}/console/api/stats", params={"since": last}).json()
            if doc["samples"]:
                last = doc["samples"][-1]["t"]
        busy, wall = cpu_s(pid) - c0, time.perf_counter() - t0
    return idle * 1000, (busy - idle * wall) / polls * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--pollers", type=int, default=10, help="simulated open dashboards in the polled runs")
    args = ap.parse_args()
    os.environ["OPENAI_API_KEY"] = KEY  # strata bench serve sends it
    tmp = Path(tempfile.mkdtemp(prefix="console_load_"))
    server = Server([str(DEMO_MODEL_DIR), "--served-model-name", "demo", "--device", "cpu", "--dtype", "float32",
                     "--max-num-seqs", str(args.max_concurrency), "--api-key", KEY], tmp / "server.log")
    drv = browser()
    url = server.url + "/"
    drv.get(url)
    drv.execute_script(f"sessionStorage.setItem('strata-api-key', '{KEY}')")
    loads: list[float] = []
    lives: list[float] = []
    polls: list[float] = []
    ratios: list[float] = []
    modes = ["closed", "polled", "browser"]
    try:
        load_once(drv, url)  # warm-up: the server's first page and feed
        drv.get("about:blank")  # no page polling while the idle cost is measured
        idle_ms, poll_ms = feed_cost(server)
        print(f"feed_cost idle_cpu_ms_per_s={idle_ms:.2f} cpu_ms_per_poll={poll_ms:.3f}", flush=True)
        for r in range(args.rounds):
            got: dict[str, float] = {}
            for mode in modes[r % 3:] + modes[:r % 3]:
                stop = threading.Event()
                pages: list[tuple[float, float]] = []
                waits: list[float] = []
                if mode == "browser":
                    workers = [threading.Thread(target=reload_loop, args=(drv, url, stop, pages))]
                elif mode == "polled":
                    workers = [threading.Thread(target=poll_loop, args=(server.url, stop, waits))
                               for _ in range(args.pollers)]
                else:
                    workers = []
                for w in workers:
                    w.start()
                res = bench_serve(server.url, "demo", str(DEMO_MODEL_DIR), args, tmp / f"r{r}_{mode}.json")
                stop.set()
                for w in workers:
                    w.join()
                got[mode] = res["output_throughput"]
                line = f"round={r} mode={mode} output_tok_s={got[mode]:.1f}"
                if pages:
                    loads += [a for a, _ in pages]
                    lives += [b for _, b in pages]
                    line += (f" page_loads={len(pages)} load_ms_max={max(a for a, _ in pages):.0f}"
                             f" live_ms_max={max(b for _, b in pages):.0f}")
                if waits:
                    polls += waits
                    line += f" polls={len(waits)} poll_ms_p50={statistics.median(waits):.1f} poll_ms_max={max(waits):.1f}"
                print(line, flush=True)
            ratios.append(got["polled"] / got["closed"])
    finally:
        drv.quit()
        server.stop()
    print(f"idle_cpu_ms_per_s={idle_ms:.2f} cpu_ms_per_poll={poll_ms:.3f} load_ms_max={max(loads):.0f} load_ms_p50={statistics.median(loads):.0f} live_ms_max={max(lives):.0f} "
          f"live_ms_p50={statistics.median(lives):.0f} page_loads={len(loads)} poll_ms_p50={statistics.median(polls):.1f} "
          f"poll_ms_max={max(polls):.1f} tps_ratio_min={min(ratios):.3f} "
          f"tps_ratios={','.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
