"""The console's behaviour at the edges, in the shared headless Chromium against the live `strata serve` of
conftest.py: keys a browser cannot send, a server that is away at boot, model names holding "/", the speech
form, failed chat turns and empty number fields, Stop versus errors, a 375 px phone, accessibility basics, stale
errors and forms, the token count /metrics shows, and INT64/UINT64 values past 2^53.

Each test opens its own browser tab (its own sessionStorage), where a script injected before the page's own
(`Page.addScriptToEvaluateOnNewDocument`) wraps `fetch`: it records each request's URL and body in
`window.__sent`, and answers the URLs listed in `window.__stubs` itself (a network error, an HTTP status, or a
canned body), so a test can play a server that is away, draining, or serving a speech model."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import time
import wave

import httpx
from console_consts import API_KEY, MODEL
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select
from test_console_browser import el, number, tab, wait

KEY_STORE = "strata-api-key"

# window.__stubs: [{path, times (-1: always), error | status + body | b64 + type}], first live match answers.
STUB_JS = """
(() => {
  const cfg = %s;
  if (cfg.key !== null && !sessionStorage.getItem("__seeded")) {
    sessionStorage.setItem("__seeded", "1");
    sessionStorage.setItem("strata-api-key", cfg.key);
  }
  window.__sent = [];
  window.__stubs = cfg.stubs;
  const real = window.fetch.bind(window);
  window.fetch = async (url, opts) => {
    const u = String(url);
    window.__sent.push([u, opts && typeof opts.body === "string" ? opts.body : null]);
    const path = new URL(u, location.href).pathname;
    const s = window.__stubs.find((x) => x.times !== 0 && path === x.path);
    if (!s) return real(url, opts);
    if (s.times > 0) s.times -= 1;
    if (s.error) throw new TypeError(s.error);
    const body = s.b64 ? Uint8Array.from(atob(s.b64), (c) => c.charCodeAt(0)) : s.body;
    return new Response(body, { status: s.status || 200, headers: { "Content-Type": s.type || "application/json" } });
  };
})();
"""


@contextlib.contextmanager
def page(drv, server, *, key: str | None = API_KEY, stubs: list | None = None, width: int = 1280,
         height: int = 800, mobile: bool = False):
    """A new tab on the console (`key` seeded into its sessionStorage, `stubs` answering some URLs), closed after."""
    home = drv.current_window_handle
    drv.switch_to.new_window("tab")
    try:
        drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
        drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": STUB_JS % json.dumps({"key": key, "stubs": stubs or []})})
        drv.get(server.url + "/")
        yield drv
    finally:
        drv.close()
        drv.switch_to.window(home)


def live(drv) -> None:
    wait(drv, lambda d: el(d, "#conn").text == "live", "the dashboard feed")


def sent(drv, path: str) -> list[dict]:
    """The JSON bodies the page sent to `path`, oldest first."""
    return [json.loads(b) for u, b in drv.execute_script("return window.__sent")
            if u.split("?")[0].endswith(path) and b]


def stored_key(drv):
    return drv.execute_script(f"return sessionStorage.getItem('{KEY_STORE}')")


# ---------------------------------------------------------------------------------------------- 1. the API key
def test_a_key_the_browser_cannot_send_is_refused_in_the_dialog(console_server, browser):
    with page(browser, console_server, key=None) as drv:
        wait(drv, lambda d: el(d, "#keybox").is_displayed(), "the key dialog")
        el(drv, "#key").send_keys(API_KEY + "…")  # not ISO-8859-1: fetch would throw before sending
        el(drv, "#keyform button").click()
        wait(drv, lambda d: "invalid key" in el(d, "#key-error").text.lower(), "the invalid-key message")
        assert el(drv, "#keybox").is_displayed() and stored_key(drv) is None
        el(drv, "#key").clear()
        el(drv, "#key").send_keys("clé")  # Latin-1 but not ASCII: refused too
        el(drv, "#keyform button").click()
        wait(drv, lambda d: "invalid key" in el(d, "#key-error").text.lower() and stored_key(d) is None, "refused")
        el(drv, "#key").clear()
        el(drv, "#key").send_keys(API_KEY)
        el(drv, "#keyform button").click()
        live(drv)
        assert stored_key(drv) == API_KEY


def test_a_stored_bad_key_is_dropped_on_boot(console_server, browser):
    with page(browser, console_server, key=API_KEY + "…") as drv:
        wait(drv, lambda d: el(d, "#keybox").is_displayed(), "the key dialog")
        assert "invalid key" in el(drv, "#key-error").text.lower()
        assert stored_key(drv) is None
        drv.refresh()  # the tab is not locked: the bad key is gone, the dialog asks again
        wait(drv, lambda d: el(d, "#keybox").is_displayed(), "the key dialog after a reload")
        el(drv, "#key").send_keys(API_KEY)
        el(drv, "#keyform button").click()
        live(drv)


# ---------------------------------------------------------------------------------------------- 2. boot retries
def test_boot_retries_until_the_model_list_answers(console_server, browser):
    stubs = [{"path": "/v1/models", "times": 1, "error": "Failed to fetch"},
             {"path": "/v1/models", "times": 1, "status": 503,
              "body": json.dumps({"error": {"message": "the server is draining"}})}]
    with page(browser, console_server, stubs=stubs) as drv:
        wait(drv, lambda d: "retrying" in el(d, "#conn").text, "the retry shown in the pill", timeout=5)
        seen = {el(drv, "#conn").text}
        deadline = time.time() + 15
        while el(drv, "#conn").text != "live" and time.time() < deadline:
            seen.add(el(drv, "#conn").text)
            time.sleep(0.05)
        assert el(drv, "#conn").text == "live", seen
        assert any("draining" in s for s in seen), seen  # the 503's message was shown while retrying
        tab(drv, "chat")
        wait(drv, lambda d: MODEL in [o.text for o in Select(el(d, "#chat-model")).options], "the model list")


# ---------------------------------------------------------------------------------------------- 3. "/" in names
def _fake_stats() -> str:
    eng = {"ready": True, "inflight": 0, "kv_usage": 0.5, "prefix_hit_rate": 0.25, "preemptions": 0.0}
    row = {"ttft_p50": 0.01, "ttft_p95": 0.02, "itl_p50": 0.001, "itl_p95": 0.002, "e2e_p50": 0.5, "e2e_p95": 0.9,
           "queue_p50": 0.0, "queue_p95": 0.0, "cost_p50": 0.01, "cost_p95": 0.02}
    sample = {"t": round(time.time(), 3), "inflight": 0,
              "engines": {"org/m": {**eng, "running": 3, "waiting": 2, "tokens_total": 500, "tps": 10.0},
                          "other": {**eng, "running": 7, "waiting": 0, "tokens_total": 400, "tps": 6.0}},
              "series": {"org/m/default": {**row, "model": "org/m", "sla": "default", "tokens_total": 120, "tps": 4.0,
                                           "ok": 4, "errors": 1, "aborted": 2},
                         "other/default": {**row, "model": "other", "sla": "default", "tokens_total": 300,
                                           "tps": 5.0, "ok": 9, "errors": 0, "aborted": 0}},
              "tokens_total": 900, "tps": 16.0, "running": 10, "waiting": 2}
    return json.dumps({"interval": 1, "history": 600, "now": sample["t"], "samples": [sample]})


def _legend(drv, chart: str) -> list[str]:
    css = f'.uplot[data-chart="{chart}"] .u-legend .u-series .u-label'
    return drv.execute_script("return [...document.querySelectorAll(arguments[0])].map((l) => l.textContent)", css)


def test_the_filter_keeps_engine_charts_and_counters_of_a_model_named_with_a_slash(console_server, browser):
    empty = json.dumps({"interval": 1, "history": 600, "now": time.time(), "samples": []})
    stubs = [{"path": "/console/api/stats", "times": 1, "body": _fake_stats()},
             {"path": "/console/api/stats", "times": -1, "body": empty}]
    with page(browser, console_server, stubs=stubs) as drv:
        live(drv)
        wait(drv, lambda d: "org/m/default" in [o.get_attribute("value") for o in Select(el(d, "#series-filter")).options],
             "the filter's options")
        assert number(drv, "#c-running") == 10 and number(drv, "#c-tokens") == 900
        Select(el(drv, "#series-filter")).select_by_value("org/m/default")
        wait(drv, lambda d: _legend(d, "ch-reqs") == ["org/m running", "org/m waiting"], "org/m's engine lines")
        assert _legend(drv, "ch-kv") == ["org/m KV used", "org/m prefix hits"]
        assert _legend(drv, "ch-preempt") == ["org/m"]
        assert _legend(drv, "ch-ttft") == ["org/m/default P50", "org/m/default P95"]
        # The counters follow the filter: that series' tokens and rate, that model's engine.
        assert (number(drv, "#c-tokens"), el(drv, "#c-tps").text) == (120, "4")
        assert (number(drv, "#c-running"), number(drv, "#c-waiting")) == (3, 2)
        assert (number(drv, "#c-ok"), number(drv, "#c-errors"), number(drv, "#c-aborted")) == (4, 1, 2)
        assert "org/m" in el(drv, "#l-running").text


# ---------------------------------------------------------------------------------------------- 4. speech
def _wav() -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 400)
    return base64.b64encode(buf.getvalue()).decode()


def test_speech_offers_the_models_voices_and_sends_optional_fields_only_when_set(console_server, browser):
    models = {"object": "list", "data": [
        {"id": MODEL, "object": "model", "payload": "text", "backend": "local-llm", "ready": True},
        {"id": "tts", "object": "model", "payload": "speech", "backend": "local-tts", "ready": True,
         "voices": ["ryan", "vivian"], "languages": ["auto", "english", "chinese"]},
        {"id": "design", "object": "model", "payload": "speech", "backend": "local-tts", "ready": True,
         "voices": [], "languages": ["english"]}]}
    stubs = [{"path": "/v1/models", "times": -1, "body": json.dumps(models)},
             {"path": "/v1/audio/speech", "times": -1, "b64": _wav(), "type": "audio/wav"}]
    with page(browser, console_server, stubs=stubs) as drv:
        live(drv)
        tab(drv, "speech")
        wait(drv, lambda d: [o.text for o in Select(el(d, "#speech-voice")).options] == ["ryan", "vivian"],
             "the model's voices")
        assert Select(el(drv, "#speech-voice")).first_selected_option.text == "ryan"
        assert [o.get_attribute("value") for o in Select(el(drv, "#speech-language")).options] == [
            "", "auto", "english", "chinese"]
        el(drv, "#speech-go").click()
        wait(drv, lambda d: sent(d, "/v1/audio/speech"), "the speech request")
        assert sent(drv, "/v1/audio/speech")[-1] == {"model": "tts", "input": "Hello from strataserve.",
                                                     "response_format": "wav", "voice": "ryan"}
        Select(el(drv, "#speech-voice")).select_by_visible_text("vivian")
        Select(el(drv, "#speech-language")).select_by_value("english")
        el(drv, "#speech-instructions").send_keys("A calm, low voice.")
        el(drv, "#speech-go").click()
        wait(drv, lambda d: len(sent(d, "/v1/audio/speech")) == 2, "the second speech request")
        body = sent(drv, "/v1/audio/speech")[-1]
        assert (body["voice"], body["language"], body["instructions"]) == ("vivian", "english", "A calm, low voice.")
        # A model without preset voices (VoiceDesign): no voice is sent.
        Select(el(drv, "#speech-model")).select_by_value("design")
        wait(drv, lambda d: not Select(d.find_element(By.ID, "speech-voice")).options, "no voices offered")
        el(drv, "#speech-go").click()
        wait(drv, lambda d: len(sent(d, "/v1/audio/speech")) == 3, "the third speech request")
        body = sent(drv, "/v1/audio/speech")[-1]
        assert "voice" not in body and body["model"] == "design" and body["instructions"] == "A calm, low voice."
        assert el(drv, "#speech-error").text == ""


# ---------------------------------------------------------------------------------------------- 5. chat history
def _send(drv, text: str) -> None:
    el(drv, "#chat-input").send_keys(text)
    el(drv, "#chat-send").click()


def _fill(drv, css: str, value: str) -> None:
    box = el(drv, css)
    box.clear()
    if value:
        box.send_keys(value)


def test_a_failed_chat_turn_is_not_resent_and_empty_numbers_are_left_out(console_server, browser):
    with page(browser, console_server) as drv:
        live(drv)
        tab(drv, "chat")
        wait(drv, lambda d: MODEL in [o.text for o in Select(el(d, "#chat-model")).options], "the model list")
        _fill(drv, "#chat-max-tokens", "100000")  # past the context: the server answers 400
        _send(drv, "first, refused")
        wait(drv, lambda d: "context length" in el(d, "#chat-error").text, "the refusal")
        wait(drv, lambda d: el(d, "#chat-send").is_enabled(), "the end of the failed turn")
        _fill(drv, "#chat-max-tokens", "8")
        _fill(drv, "#chat-temperature", "")
        _fill(drv, "#chat-top-p", "")
        _send(drv, "second")
        wait(drv, lambda d: el(d, "#chat-send").is_enabled() and len(sent(d, "/v1/chat/completions")) == 2,
             "the second reply")
        assert el(drv, "#chat-error").text == ""
        body = sent(drv, "/v1/chat/completions")[-1]
        assert body["messages"] == [{"role": "user", "content": "second"}]
        assert body["max_tokens"] == 8 and "temperature" not in body and "top_p" not in body
        reply = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
        _fill(drv, "#chat-max-tokens", "")  # left out: not max_tokens 0
        _send(drv, "third")
        wait(drv, lambda d: len(sent(d, "/v1/chat/completions")) == 3, "the third request")
        el(drv, "#chat-stop").click()
        wait(drv, lambda d: el(d, "#chat-send").is_enabled(), "the end of the third turn")
        body = sent(drv, "/v1/chat/completions")[-1]
        assert "max_tokens" not in body
        assert [m["content"] for m in body["messages"]] == ["second", reply, "third"]
        assert "failed" in drv.find_elements(By.CSS_SELECTOR, ".msg.user")[0].get_attribute("class")


# ---------------------------------------------------------------------------------------------- 7. phone layout
def test_every_tab_fits_a_375px_viewport(console_server, browser):
    models = httpx.get(console_server.url + "/v1/models", headers=console_server.headers, timeout=10).json()
    models["data"].append({"id": "tts", "object": "model", "payload": "speech", "backend": "local-tts",
                           "ready": True, "voices": ["ryan"], "languages": ["auto"]})
    stubs = [{"path": "/v1/models", "times": -1, "body": json.dumps(models)}]
    with page(browser, console_server, stubs=stubs, width=375, height=812, mobile=True) as drv:
        live(drv)
        for name in ("dashboard", "models", "chat", "tensors", "speech"):
            tab(drv, name)
            time.sleep(0.3)  # charts and tables drawn
            # (not window.innerWidth: a mobile browser zooms out to a page wider than the screen, widening it)
            width = drv.execute_script("return document.documentElement.scrollWidth")
            assert width <= 375, f"{name}: the page is {width} px wide on a 375 px screen"
        tab(drv, "chat")
        right = drv.execute_script("return document.getElementById('chat-send').getBoundingClientRect().right")
        assert right <= 375


# ---------------------------------------------------------------------------------------------- 8. accessibility
UNNAMED = """return [...document.querySelectorAll('input, select, textarea')].filter((e) => !(e.labels && e.labels.length)
  && !e.getAttribute('aria-label') && !e.getAttribute('aria-labelledby') && !e.title).map((e) => e.id)"""


def test_accessibility_basics(console_server, browser):
    with page(browser, console_server, key=None) as drv:
        wait(drv, lambda d: el(d, "#keybox").is_displayed(), "the key dialog")
        assert drv.execute_script(UNNAMED) == []
        box = el(drv, "#keybox")
        assert (box.get_attribute("role"), box.get_attribute("aria-modal")) == ("dialog", "true")
        inside = []
        for _ in range(6):  # Tab never leaves the open dialog
            ActionChains(drv).send_keys(Keys.TAB).perform()
            inside.append(drv.execute_script("return !!document.activeElement.closest('#keybox')"))
        assert all(inside)
        el(drv, "#key").send_keys(API_KEY + Keys.ENTER)
        live(drv)
        assert el(drv, "#tabs").get_attribute("role") == "tablist"
        tab(drv, "chat")
        for b in drv.find_elements(By.CSS_SELECTOR, "#tabs button"):
            page_id = "page-" + b.get_attribute("data-page")
            assert (b.get_attribute("role"), b.get_attribute("aria-controls")) == ("tab", page_id)
            assert b.get_attribute("aria-selected") == ("true" if page_id == "page-chat" else "false")
        live_ids = drv.execute_script(
            "return [...document.querySelectorAll('[aria-live], [role=alert], [role=status]')].map((e) => e.id)")
        for needed in ("conn", "key-error", "repo-error", "chat-error", "tensor-error", "speech-error"):
            assert needed in live_ids


# ---------------------------------------------------------------------------------------------- 9. stale state
def _repo(server, name: str, verb: str) -> None:
    r = httpx.post(f"{server.url}/v2/repository/models/{name}/{verb}", headers=server.headers, json={}, timeout=60)
    assert r.status_code == 200, r.text


def test_tensors_after_every_model_is_unloaded(console_server, browser):
    _repo(console_server, "py_scale", "load")
    try:
        with page(browser, console_server) as drv:
            live(drv)
            tab(drv, "tensors")
            wait(drv, lambda d: d.find_elements(By.CSS_SELECTOR, ".tensor-input"), "the tensor form")
            _repo(console_server, "py_scale", "unload")
            tab(drv, "models")
            tab(drv, "tensors")
            wait(drv, lambda d: "No tensor model is loaded" in el(d, "#tensor-meta").text, "no model loaded")
            assert not drv.find_elements(By.CSS_SELECTOR, ".tensor-input")
            assert not el(drv, "#tensor-infer").is_enabled()
            n = len(drv.execute_script("return window.__sent"))
            drv.execute_script("document.getElementById('tensor-form').requestSubmit()")
            time.sleep(0.3)
            assert not [u for u, _ in drv.execute_script("return window.__sent")[n:] if "/infer" in u]
    finally:
        _repo(console_server, "py_scale", "unload")


def test_load_errors_clear_on_the_next_success(console_server, browser):
    with page(browser, console_server) as drv:
        live(drv)
        drv.execute_script("""window.__stubs.push({path: '/console/api/models', times: 1, error: 'Failed to fetch'},
                                                  {path: '/v1/models', times: 1, error: 'Failed to fetch'})""")
        tab(drv, "models")
        wait(drv, lambda d: el(d, "#repo-error").text == "Failed to fetch", "the models page's error")
        tab(drv, "chat")
        wait(drv, lambda d: el(d, "#chat-error").text == "Failed to fetch", "the chat page's error")
        tab(drv, "models")  # the server answers again
        wait(drv, lambda d: d.find_elements(By.CSS_SELECTOR, "#repo-table tr[data-model]"), "the repository")
        wait(drv, lambda d: el(d, "#repo-error").text == "", "the models page's error cleared")
        tab(drv, "chat")
        wait(drv, lambda d: el(d, "#chat-error").text == "", "the chat page's error cleared")


# ---------------------------------------------------------------------------------------------- 10. tokens
def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model_name="{MODEL}"' in line)


def _feed_tokens(server) -> int:
    doc = httpx.get(server.url + "/console/api/stats", headers=server.headers, timeout=10).json()
    return doc["samples"][-1]["engines"][MODEL]["tokens_total"]


def test_the_output_token_count_is_the_one_metrics_shows_after_aborted_requests(console_server):
    for _ in range(3):  # a client that goes away mid-stream
        with httpx.stream("POST", console_server.url + "/v1/chat/completions", headers=console_server.headers,
                          timeout=60, json={"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                                            "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
    deadline = time.time() + 10
    while time.time() < deadline:
        shown, exposed = _feed_tokens(console_server), _metric(console_server, "strata:generation_tokens_total")
        if shown == exposed:
            break
        time.sleep(0.25)
    assert shown == exposed


# ---------------------------------------------------------------------------------------------- 11. INT64/UINT64
def test_int64_and_uint64_values_past_2_53_are_exact(console_server, browser):
    _repo(console_server, "py_wide", "load")
    try:
        with page(browser, console_server) as drv:
            live(drv)
            tab(drv, "tensors")
            wait(drv, lambda d: "py_wide" in [o.text for o in Select(el(d, "#tensor-model")).options], "py_wide")
            Select(el(drv, "#tensor-model")).select_by_value("py_wide")
            wait(drv, lambda d: d.find_elements(By.CSS_SELECTOR, '.tensor-input[data-name="U"]'), "the form")
            for name, shape, data in (("A", "[2]", "[9007199254740993, -9223372036854775807]"),
                                      ("U", "[1]", "[18446744073709551615]")):
                box = el(drv, f'.tensor-input[data-name="{name}"]')
                _fill(box, ".shape", shape)
                _fill(box, ".data", data)
            el(drv, "#tensor-infer").click()
            wait(drv, lambda d: "U_OUT" in el(d, "#tensor-output").text, "the infer result")
            out = el(drv, "#tensor-output").text
            assert "[9007199254740994,-9223372036854775806]" in out, out
            assert "[18446744073709551615]" in out, out
    finally:
        _repo(console_server, "py_wide", "unload")
