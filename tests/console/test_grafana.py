"""grafana/strataserve.json: valid dashboard JSON whose every query names metrics the live server exposes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "strataserve.json"


def test_every_dashboard_query_names_an_exposed_metric(console_server):
    url, headers = console_server.url, console_server.headers
    # Traffic first, so every family has samples: a chat request and one KServe inference.
    r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200
    assert httpx.post(url + "/v2/repository/models/py_scale/load", headers=headers, json={}, timeout=60).status_code == 200
    try:
        r = httpx.post(url + "/v2/models/py_scale/infer", headers=headers, timeout=30, json={
            "inputs": [{"name": "IN", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
        assert r.status_code == 200
        exposed = set(re.findall(r"^(strata:[a-z0-9_]+)", httpx.get(url + "/metrics", timeout=10).text, re.M))
    finally:
        httpx.post(url + "/v2/repository/models/py_scale/unload", headers=headers, json={}, timeout=60)
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"] and all(p["targets"] for p in doc["panels"])
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"]]
    names = {n for e in exprs for n in re.findall(r"strata:[a-z0-9_]+", e)}
    assert any(n.startswith("strata:router_") for n in names)
    missing = sorted(n for n in names if n not in exposed)
    assert not missing, f"the dashboard queries metrics the server does not expose: {missing}"
