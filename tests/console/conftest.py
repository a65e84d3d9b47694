"""One `strata serve` of the demo model (with a GPU price, so the cost metric has values) plus a model repository
in explicit control mode, behind an API key; and one headless Chromium (Debian's `chromium` driven by
`chromium-driver` through selenium) at 1280x800 shared by the browser tests. A failing test leaves a screenshot
under tests/artifacts/."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from _model_repos import add_python_scale, write_python_model
from console_consts import API_KEY, ARTIFACTS, MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_servers import Proc, free_port, write_config  # noqa: E402

from strataserve.assets import DEMO_MODEL_DIR  # noqa: E402



# "py_wide": A INT64 [-1] -> A_OUT = A + 1, U UINT64 [-1] -> U_OUT = U (values past 2^53 for the Tensors page)
PY_WIDE = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                u = pb_utils.get_input_tensor_by_name(r, "U").as_numpy()
                out.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("A_OUT", (a + 1).astype(np.int64)), pb_utils.Tensor("U_OUT", u.astype(np.uint64))]))
            return out
"""


@pytest.fixture(scope="package")
def console_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    repo = tmp / "repo"
    add_python_scale(repo)
    write_python_model(repo, "py_wide", PY_WIDE, """
        name: "py_wide"
        backend: "python"
        max_batch_size: 0
        input [ { name: "A" data_type: TYPE_INT64 dims: [ -1 ] }, { name: "U" data_type: TYPE_UINT64 dims: [ -1 ] } ]
        output [ { name: "A_OUT" data_type: TYPE_INT64 dims: [ -1 ] }, { name: "U_OUT" data_type: TYPE_UINT64 dims: [ -1 ] } ]
    """)
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
