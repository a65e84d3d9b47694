"""One precedence rule for the repository settings of `strata serve --config` (vLLM's, and most CLIs'): a flag typed
on the command line wins over the config file's key, the file's key wins over the built-in default, and a key set in
the file applies wherever the repository comes from (the file or --model-repository). A key that needs a repository,
set where there is none, is refused as its flag is. The last test starts one real `strata serve --config`."""
from __future__ import annotations

import httpx
import pytest
from _model_repos import add_python_text
from rich.console import Console
from router_servers import Proc, free_port, write_config

from strataserve.api.server import ServeOptions
from strataserve.cli import _serve_options, build_parser
from strataserve.router.config import parse_config

UPSTREAM = {"name": "up", "upstream": "openai", "url": "http://127.0.0.1:9"}  # never called: options only


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(stderr=True, width=300))


def _settings(opts) -> tuple:
    return opts.model_repository, opts.model_control_mode, opts.repository_poll_s, opts.strict_readiness


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "repo").mkdir()
    return str(tmp_path / "repo")


FILE_KEYS = {"model_control_mode": "poll", "repository_poll_secs": 5, "strict_readiness": False}


@pytest.mark.parametrize("flags,field,expected", [
    (["--model-control-mode", "explicit"], "model_control_mode", "explicit"),
    (["--model-control-mode", "none"], "model_control_mode", "none"),  # typed, even as the default's value
    (["--repository-poll-secs", "0.5"], "repository_poll_s", 0.5),
    (["--repository-poll-secs", "1"], "repository_poll_s", 1.0),
    (["--strict-readiness"], "strict_readiness", True),
])
@pytest.mark.parametrize("repo_in_file", [True, False])
def test_a_typed_flag_wins_over_the_files_key(tmp_path, repo, flags, field, expected, repo_in_file):
    doc = {**FILE_KEYS, **({"model_repository": repo} if repo_in_file else {"models": [UPSTREAM]})}
    cfg = write_config(tmp_path / "router.yaml", doc)
    argv = ["--config", str(cfg), *flags, *([] if repo_in_file else ["--model-repository", repo])]
    opts = _options(argv)
    assert getattr(opts, field) == expected
    # the keys whose flag was not typed keep the file's value
    others = {"model_control_mode": "poll", "repository_poll_s": 5.0, "strict_readiness": False}
    others.pop(field)
    assert {k: getattr(opts, k) for k in others} == others


def test_the_files_keys_apply_to_a_repository_from_the_command_line(tmp_path, repo):
    """They were silently dropped unless the file also named model_repository."""
    cfg = write_config(tmp_path / "router.yaml", {"models": [UPSTREAM], **FILE_KEYS})
    assert _settings(_options(["--config", str(cfg), "--model-repository", repo])) == (repo, "poll", 5.0, False)


def test_an_untyped_flag_falls_back_to_the_file_then_the_default(tmp_path, repo):
    cfg = write_config(tmp_path / "router.yaml", {"model_repository": repo, **FILE_KEYS})
    assert _settings(_options(["--config", str(cfg)])) == (repo, "poll", 5.0, False)
    cfg = write_config(tmp_path / "router.yaml", {"model_repository": repo})
    assert _settings(_options(["--config", str(cfg)])) == (repo, "none", 1.0, True)
    cfg = write_config(tmp_path / "router.yaml", {"models": [UPSTREAM]})
    assert _settings(_options(["--config", str(cfg), "--model-repository", repo])) == (repo, "none", 1.0, True)
    assert _settings(_options(["--model-repository", repo])) == (repo, "none", 1.0, True)  # no file at all


def test_model_repository_flag_wins_with_a_warning_when_they_differ(tmp_path, repo, capsys):
    (tmp_path / "other").mkdir()
    cfg = write_config(tmp_path / "router.yaml", {"model_repository": str(tmp_path / "other")})
    assert _options(["--config", str(cfg), "--model-repository", repo]).model_repository == repo
    err = capsys.readouterr().err
    assert "warning:" in err and f"serving --model-repository {repo}" in err and str(tmp_path / "other") in err
    assert _options(["--config", str(cfg), "--model-repository", str(tmp_path / "other")]) is not None
    assert "warning" not in capsys.readouterr().err  # the same folder: nothing to say


@pytest.mark.parametrize("keys,named", [
    ({"model_control_mode": "poll"}, "model_control_mode applies"),
    ({"model_control_mode": "explicit"}, "model_control_mode applies"),
    ({"repository_poll_secs": 2}, "repository_poll_secs applies"),
    ({"model_control_mode": "poll", "repository_poll_secs": 2}, "model_control_mode and repository_poll_secs apply"),
])
def test_a_repository_key_without_any_repository_is_refused(tmp_path, repo, keys, named, capsys):
    cfg = write_config(tmp_path / "router.yaml", {"models": [UPSTREAM], **keys})
    assert _options(["--config", str(cfg)]) is None
    assert f"{named} to repository models: add model_repository to the config (or --model-repository)" \
        in capsys.readouterr().err
    assert _options(["--config", str(cfg), "--model-repository", repo]) is not None


def test_control_mode_none_in_the_file_needs_no_repository(tmp_path):
    cfg = write_config(tmp_path / "router.yaml", {"models": [UPSTREAM], "model_control_mode": "none"})
    opts = _options(["--config", str(cfg)])
    assert opts.model_repository is None and opts.model_control_mode == "none"


def test_from_config_reads_an_absent_or_none_option_as_untyped(repo):
    config = parse_config({"model_repository": repo, **FILE_KEYS})
    opts = ServeOptions.from_config(config, lambda entry: None, model_repository=None)
    assert _settings(opts) == (repo, "poll", 5.0, False)
    opts = ServeOptions.from_config(config, lambda entry: None, model_control_mode="explicit", repository_poll_s=0.5,
                                    strict_readiness=True)
    assert _settings(opts) == (repo, "explicit", 0.5, True)
    with pytest.raises(ValueError, match="strict_readiness applies to repository models"):
        ServeOptions.from_config(parse_config({"models": [UPSTREAM], "strict_readiness": True}), lambda entry: None)


def test_a_typed_control_mode_wins_on_a_running_server(tmp_path):
    """End to end: the file says explicit (nothing loads at start); --model-control-mode none loads every model."""
    repo = tmp_path / "repo"
    add_python_text(repo)
    cfg = write_config(tmp_path / "router.yaml", {"model_repository": str(repo), "model_control_mode": "explicit"})
    srv = Proc(["--config", str(cfg), "--model-control-mode", "none"], free_port(), tmp_path / "server.log")
    srv.start("/v2/health/ready")  # strict readiness: ready once every model that should load has
    try:
        assert httpx.get(srv.url + "/v2/models/py_text/ready", timeout=10).status_code == 200, srv.log_tail()
    finally:
        srv.stop()
