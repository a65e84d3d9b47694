"""``strict_readiness`` in a router config file (Triton's --strict-readiness, on by default): the file may turn it
off, the command line's --[no-]strict-readiness wins over the file when given, a value that is not a boolean is
a ConfigError naming the key, and the key without any model repository is refused (as the flag is). The last test
starts real `strata serve --config` processes over a repository with a model that fails to load and reads
/v2/health/ready."""
from __future__ import annotations

import httpx
import pytest
from _model_repos import add_python_text
from rich.console import Console
from router_servers import Proc, free_port, write_config

from strataserve.cli import _serve_options, build_parser
from strataserve.router.config import ConfigError, parse_config


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(stderr=True, width=300))


def test_the_key_parses_and_defaults_to_on(tmp_path):
    base = {"model_repository": str(tmp_path)}
    assert parse_config(base).strict_readiness is True
    assert parse_config({**base, "strict_readiness": False}).strict_readiness is False
    assert parse_config({**base, "strict_readiness": True}).strict_readiness is True


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, [True]])
def test_a_value_that_is_not_a_boolean_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError) as err:
        parse_config({"model_repository": str(tmp_path), "strict_readiness": value}, "router.yaml")
    assert "router.yaml: strict_readiness: must be true or false" in str(err.value)


def test_file_value_applies_and_an_explicit_flag_wins(tmp_path):
    (tmp_path / "repo").mkdir()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\nstrict_readiness: false\n")
    assert _options(["--config", str(cfg)]).strict_readiness is False
    assert _options(["--config", str(cfg), "--strict-readiness"]).strict_readiness is True
    assert _options(["--config", str(cfg), "--no-strict-readiness"]).strict_readiness is False
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\nstrict_readiness: true\n")
    assert _options(["--config", str(cfg)]).strict_readiness is True
    assert _options(["--config", str(cfg), "--no-strict-readiness"]).strict_readiness is False
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\n")  # unset in the file: Triton's default, on
    assert _options(["--config", str(cfg)]).strict_readiness is True


def test_the_key_needs_a_model_repository(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    cfg = tmp_path / "router.yaml"
    cfg.write_text("models:\n  - {name: up, upstream: openai, url: 'http://127.0.0.1:9'}\nstrict_readiness: false\n")
    assert _options(["--config", str(cfg)]) is None
    assert "strict_readiness applies to repository models: add model_repository" in capsys.readouterr().err
    # a repository from the command line serves it
    assert _options(["--config", str(cfg), "--model-repository", str(tmp_path / "repo")]).strict_readiness is False


def _ready(srv: Proc) -> int:
    return httpx.get(srv.url + "/v2/health/ready", timeout=10).status_code


def test_a_config_file_turns_strict_readiness_off_on_a_running_server(tmp_path):
    repo = tmp_path / "repo"
    add_python_text(repo)  # loads
    (repo / "broken" / "1").mkdir(parents=True)  # no model.onnx: its load fails, so strict readiness says 503
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 2\n')
    cfg = write_config(tmp_path / "router.yaml", {"model_repository": str(repo), "strict_readiness": False})
    for extra, status in (([], 200), (["--strict-readiness"], 503)):
        srv = Proc(["--config", str(cfg), *extra], free_port(), tmp_path / "server.log")
        srv.start()  # /health: up whatever the readiness
        try:
            assert httpx.get(srv.url + "/v2/models/py_text/ready", timeout=10).status_code == 200
            assert _ready(srv) == status, (extra, srv.log_tail())
        finally:
            srv.stop()
