"""``--repository-poll-secs`` (Triton's flag; ``repository_poll_secs`` in a router config): the poll mode's scan
interval reaches the model server, and a bad value is refused at the command line."""
from __future__ import annotations

import pytest
from rich.console import Console

from strataserve.cli import _serve_options, build_parser


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(quiet=True))


def test_flag_and_config_key_set_the_scan_interval(tmp_path):
    (tmp_path / "repo").mkdir()
    repo = str(tmp_path / "repo")
    opts = _options(["--model-repository", repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.25"])
    assert opts.repository_poll_s == 0.25 and opts.model_control_mode == "poll"
    assert _options(["--model-repository", repo]).repository_poll_s == 1.0  # Triton's default is 15 s; ours 1 s
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model_repository: {repo}\nmodel_control_mode: poll\nrepository_poll_secs: 5\n")
    assert _options(["--config", str(cfg)]).repository_poll_s == 5.0
    cfg.write_text(f"model_repository: {repo}\nrepository_poll_secs: 0\n")
    assert _options(["--config", str(cfg)]) is None  # refused (with a message naming the key)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_bad_interval_is_refused(value, capsys):
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["serve", "--repository-poll-secs", value])
    assert err.value.code == 2 and "--repository-poll-secs" in capsys.readouterr().err


def test_control_flags_apply_to_a_config_files_repository_and_win_over_its_keys(tmp_path):
    """A config naming a repository but no control mode keeps --model-control-mode / --load-model (they were
    dropped for the file's default "none", so unload refused with advice the user had already followed); a typed
    flag also wins over the file's own key (the file's used to win)."""
    (tmp_path / "repo").mkdir()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\n")
    opts = _options(["--config", str(cfg), "--model-control-mode", "explicit", "--load-model", "m"])
    assert opts.model_control_mode == "explicit" and opts.load_models == ("m",)
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\nmodel_control_mode: poll\n")
    assert _options(["--config", str(cfg), "--model-control-mode", "explicit"]).model_control_mode == "explicit"
    assert _options(["--config", str(cfg)]).model_control_mode == "poll"
