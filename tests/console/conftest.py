"""One `strata serve` of the demo model (with a GPU price, so the cost metric has values) plus a model repository
in explicit control mode, behind an API key; and one headless Chromium (Debian's `chromium` driven by
`chromium-driver` through selenium) at 1280x800 shared by the browser tests. A failing test leaves a screenshot
under tests/artifacts/."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from _model_repos import add_python_scale
from console_consts import API_KEY, ARTIFACTS, MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_servers import Proc, free_port, write_config  # noqa: E402

from strataserve.assets import DEMO_MODEL_DIR  # noqa: E402



@pytest.fixture(scope="package")
def console_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    repo = tmp / "repo"
    add_python_scale(repo)
    cfg = write_config(tmp / "console.yaml", {
        "models": [{"name": MODEL, "path": str(DEMO_MODEL_DIR), "device": "cpu", "dtype": "float32",
                    "kv_cache_memory_gib": 0.02, "max_model_len": 1024, "gpu_cost_per_hour": 2.5}],
        "model_repository": str(repo), "model_control_mode": "explicit"})
    srv = Proc(["--config", str(cfg), "--api-key", API_KEY], free_port(), tmp / "server.log")
    srv.headers = {"Authorization": f"Bearer {API_KEY}"}
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.fail("the console tests need Debian's `chromium` and `chromium-driver` packages "
                    "(.ci/run installs them: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=opts)
    # The page's own viewport is 1280x800 (the window also holds the browser's frame).
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    yield drv
    drv.quit()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call" and rep.failed and "browser" in item.fixturenames:
        drv = item.funcargs.get("browser")
        if drv is not None:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            drv.save_screenshot(str(ARTIFACTS / f"{item.name}.png"))
    return rep
