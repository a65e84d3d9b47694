"""``strata serve`` prints where its start-up time went: the engine process's phases (spawned before the API
process's heavy imports) and when HTTP was ready, all on the clock of the API process's start."""
from __future__ import annotations

import re


def test_serve_prints_its_startup_breakdown(server):
    log = server.log.read_text(errors="replace")
    imports = re.search(r"start-up: API process imports (\d+\.\d+) s \(beside the engine process\)", log)
    engine = re.search(r"engine process: spawned at (\d+\.\d+) s, ready at (\d+\.\d+) s \((.*?)\); "
                       r"tokenizer (\d+\.\d+) s beside it", log, re.S)
    ready = re.search(r"start-up: HTTP ready (\d+\.\d+) s after the process started", log)
    assert imports and engine and ready, log[-3000:]
    spawned, engine_ready, http_ready = float(engine[1]), float(engine[2]), float(ready[1])
    assert spawned < float(imports[1]) <= http_ready  # the engine started before the heavy imports were done
    assert spawned < engine_ready <= http_ready
    phases = dict((m[0], float(m[1])) for m in re.findall(r"([A-Za-z][\w ]*?) (\d+\.\d+) s", engine[3]))
    assert {"process spawn", "imports", "weights"} <= set(phases), engine[3]
