"""The web console in a real headless Chromium against a live `strata serve` (demo model + a model repository in
explicit mode, behind an API key). The tests run in file order on one page, as a person would use it: key,
chat, stop, models, tensors, then the dashboard. Each page's screenshot (1280x800) goes to tests/artifacts/ui/
(and to docs/ui/ with STRATA_UI_DOCS=1, which is how docs/ui.md's pictures are made)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from console_consts import API_KEY, ARTIFACTS, MODEL
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

DOCS_UI = Path(__file__).resolve().parents[2] / "docs" / "ui"
WAIT_S = 30


def snap(drv, name: str) -> None:
    out = ARTIFACTS / "ui"
    out.mkdir(parents=True, exist_ok=True)
    drv.save_screenshot(str(out / f"{name}.png"))
    if os.environ.get("STRATA_UI_DOCS") == "1":
        DOCS_UI.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / f"{name}.png", DOCS_UI / f"{name}.png")


def wait(drv, cond, what: str, timeout: float = WAIT_S):
    # The pages re-render their tables and lists: an element can go stale between finding and reading it.
    return WebDriverWait(drv, timeout, poll_frequency=0.1, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(lambda d: cond(d), message=what)


def el(drv, css: str):
    return drv.find_element(By.CSS_SELECTOR, css)


def tab(drv, page: str) -> None:
    el(drv, f'#tabs button[data-page="{page}"]').click()
    wait(drv, lambda d: el(d, f"#page-{page}").is_displayed(), f"page {page} shown")


def number(drv, css: str) -> int:
    return int(el(drv, css).text.replace(",", ""))


def latest(server) -> dict:
    doc = httpx.get(server.url + "/console/api/stats", headers=server.headers, timeout=10).json()
    return doc["samples"][-1]


def test_page_is_open_but_data_needs_the_key(console_server):
    url = console_server.url
    page = httpx.get(url + "/", timeout=10)
    assert page.status_code == 200 and "strataserve console" in page.text
    assert httpx.get(url + "/console/static/vendor/uPlot.iife.min.js", timeout=10).status_code == 200
    for path in ("/console/api/stats", "/console/api/models"):
        assert httpx.get(url + path, timeout=10).status_code == 401
    doc = httpx.get(url + "/console/api/models", headers=console_server.headers, timeout=10).json()
    assert [m["name"] for m in doc["models"]] == [MODEL]
    assert doc["repository"]["control_mode"] == "explicit"
    bad = httpx.get(url + "/console/api/stats?since=x", headers=console_server.headers, timeout=10)
    assert bad.status_code == 400 and "since" in bad.json()["error"]["message"]


def test_key_dialog_then_live_dashboard(console_server, browser):
    browser.get(console_server.url + "/")
    wait(browser, lambda d: el(d, "#keybox").is_displayed(), "the key dialog")
    el(browser, "#key").send_keys("wrong-key")
    el(browser, "#keyform button").click()
    wait(browser, lambda d: "refused" in el(d, "#key-error").text, "the refusal of a wrong key")
    el(browser, "#key").send_keys(API_KEY)
    el(browser, "#keyform button").click()
    wait(browser, lambda d: el(d, "#conn").text == "live", "the dashboard feed")
    assert not el(browser, "#keybox").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('strata-api-key')") == API_KEY
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart .uplot canvas")) == 8, "8 charts")
    assert not el(browser, "#tab-speech").is_displayed()  # no speech model is served


def test_chat_streams_the_reply_and_the_token_counter_moves(console_server, browser):
    before = number(browser, "#c-tokens")
    tab(browser, "chat")
    wait(browser, lambda d: MODEL in [o.text for o in Select(el(d, "#chat-model")).options], "the model list")
    temp = el(browser, "#chat-temperature")
    temp.clear()
    temp.send_keys("0")
    maxt = el(browser, "#chat-max-tokens")
    maxt.clear()
    maxt.send_keys("40")
    el(browser, "#chat-input").send_keys("Tell me about the sea.")
    el(browser, "#chat-send").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
         and el(d, ".msg.assistant").text.strip(), "the streamed reply")
    wait(browser, lambda d: el(d, "#chat-send").is_enabled(), "the end of the reply")
    reply = el(browser, ".msg.assistant").text
    assert "TTFT" in el(browser, "#chat-stats").text and "tokens/s" in el(browser, "#chat-stats").text
    # The reply the page assembled from the stream is the one the server gives for the same greedy request.
    ref = httpx.post(console_server.url + "/v1/chat/completions", headers=console_server.headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
        "top_p": 1, "max_tokens": 40}).json()
    assert reply.strip() == ref["choices"][0]["message"]["content"].strip()
    snap(browser, "chat")
    tab(browser, "dashboard")
    wait(browser, lambda d: number(d, "#c-tokens") > before, "the token counter to move")


def test_stop_aborts_the_request_on_the_server(console_server, browser):
    tab(browser, "chat")
    el(browser, "#chat-clear").click()
    maxt = el(browser, "#chat-max-tokens")
    maxt.clear()
    maxt.send_keys("950")
    el(browser, "#chat-ignore-eos").click()  # so the reply runs until stopped, not until the model's EOS
    before = latest(console_server)["series"][f"{MODEL}/default"]
    aborted_before, errors_before = before["aborted"], before["errors"]
    el(browser, "#chat-input").send_keys("Write a long story.")
    el(browser, "#chat-send").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
         and el(d, ".msg.assistant").text.strip(), "the first streamed tokens")
    el(browser, "#chat-stop").click()
    wait(browser, lambda d: "stopped" in el(d, ".msg.assistant").get_attribute("class"), "the stopped reply")
    shown = int(el(browser, "#chat-stats").text.split("·")[1].split()[0])
    assert 0 < shown < 950

    def settled(_d) -> bool:
        # A sample taken after the router recorded the request as aborted (not ok, not an error), with nothing left
        # running.
        s = latest(console_server)
        row = s["series"][f"{MODEL}/default"]
        return (row["aborted"] == aborted_before + 1 and row["errors"] == errors_before
                and s["running"] == s["inflight"] == 0)

    wait(browser, settled, "the request recorded as aborted and the server's running count back to 0")
    el(browser, "#chat-ignore-eos").click()
    tab(browser, "dashboard")
    wait(browser, lambda d: el(d, "#c-running").text == "0", "the page's running count at 0")
    # Nothing generates any more: the engine's token count stands still (it was aborted, not left running).
    tokens = latest(console_server)["engines"][MODEL]["tokens_total"]
    time.sleep(1.5)
    assert latest(console_server)["engines"][MODEL]["tokens_total"] == tokens


def _repo_state(server, name: str) -> str:
    index = httpx.post(server.url + "/v2/repository/index", headers=server.headers, json={}, timeout=10).json()
    return next(m["state"] for m in index if m["name"] == name)


def _row_button(drv, name: str):
    return el(drv, f'#repo-table tr[data-model="{name}"] button')


def test_load_a_repository_model_then_infer_from_its_metadata_form_then_unload(console_server, browser):
    tab(browser, "models")
    wait(browser, lambda d: _row_button(d, "py_scale").text == "Load", "py_scale listed as not loaded")
    _row_button(browser, "py_scale").click()
    wait(browser, lambda d: _row_button(d, "py_scale").text == "Unload", "py_scale loaded", timeout=60)
    assert _repo_state(console_server, "py_scale") == "READY"
    snap(browser, "models")

    tab(browser, "tensors")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '.tensor-input[data-name="IN"]'), "the IN form")
    box = el(browser, '.tensor-input[data-name="IN"]')
    assert box.get_attribute("data-datatype") == "FP32"
    assert box.find_element(By.CSS_SELECTOR, ".shape").get_attribute("value") == "[1,3]"  # -1 batch dim -> 1
    x = np.array([[0.5, -2.0, 4.0]], dtype=np.float32)
    data = box.find_element(By.CSS_SELECTOR, ".data")
    data.clear()
    data.send_keys(str(x.tolist()))
    el(browser, "#tensor-infer").click()
    wait(browser, lambda d: "OUT FP32" in el(d, "#tensor-output").text, "the infer result")
    out_line = el(browser, "#tensor-output").text.split("OUT FP32 [1, 3]\n")[1].splitlines()[0]
    np.testing.assert_allclose(np.array(eval(out_line), dtype=np.float32), (x * 3 - 1).ravel())
    snap(browser, "tensors")

    tab(browser, "models")
    wait(browser, lambda d: _row_button(d, "py_scale").text == "Unload", "the Unload button")
    _row_button(browser, "py_scale").click()
    wait(browser, lambda d: _row_button(d, "py_scale").text == "Load", "py_scale unloaded", timeout=60)
    assert _repo_state(console_server, "py_scale") != "READY"


def test_dashboard_shows_the_traffic(console_server, browser):
    tab(browser, "dashboard")
    wait(browser, lambda d: number(d, "#c-ok") >= 2, "the ok requests counted")
    wait(browser, lambda d: number(d, "#c-aborted") >= 1, "the aborted request counted")
    assert number(browser, "#c-errors") == 0  # Stop is the client's choice, not an error
    Select(el(browser, "#series-filter")).select_by_value(f"{MODEL}/default")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart .uplot canvas")) == 8, "charts redrawn")
    Select(el(browser, "#series-filter")).select_by_value("")
    time.sleep(1.2)  # one more sample drawn before the picture
    snap(browser, "dashboard")
