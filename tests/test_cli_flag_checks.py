"""`strata serve` refuses a flag given without the one it needs (exit 2, a sentence naming the missing flag) rather
than starting a server that ignores it or fails every request; and its help describes --host / --port."""
from __future__ import annotations

import re

import pytest
from rich.console import Console

from strataserve import cli
from strataserve.assets import DEMO_MODEL_DIR
from strataserve.cli import _serve_options, build_parser


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(stderr=True, width=300))


def test_auto_tool_choice_without_a_parser_is_refused_before_any_engine_starts(monkeypatch, capsys):
    """vLLM: '--enable-auto-tool-choice requires --tool-call-parser'. It used to start, then 400 every request
    with tools, blaming flags the user had given."""
    import strataserve.engine.mp_client as mp_client

    def no_spawn(*args, **kwargs):
        raise AssertionError("an engine process was started for a command line that is refused")

    monkeypatch.setattr(mp_client, "MPCoreClient", no_spawn)
    assert cli.main(["serve", str(DEMO_MODEL_DIR), "--enable-auto-tool-choice", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--enable-auto-tool-choice needs --tool-call-parser" in err
    assert _options([str(DEMO_MODEL_DIR), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) is not None


def test_auto_tool_choice_of_a_config_entry_needs_a_parser_from_the_entry_or_the_flag(tmp_path, capsys):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"models:\n  - {{name: a, path: {DEMO_MODEL_DIR}, enable_auto_tool_choice: true}}\n")
    assert _options(["--config", str(cfg)]) is None
    assert "model 'a': enable_auto_tool_choice" in capsys.readouterr().err
    (spec,) = _options(["--config", str(cfg), "--tool-call-parser", "hermes"]).llms  # the flag is its default
    assert (spec.tool_call_parser, spec.enable_auto_tool_choice) == ("hermes", True)
    cfg.write_text(f"models:\n  - {{name: a, path: {DEMO_MODEL_DIR}, tool_call_parser: mistral}}\n")
    (spec,) = _options(["--config", str(cfg), "--enable-auto-tool-choice"]).llms
    assert (spec.tool_call_parser, spec.enable_auto_tool_choice) == ("mistral", True)


@pytest.mark.parametrize("flags", [["--model-control-mode", "explicit"], ["--model-control-mode", "poll"],
                                   ["--repository-poll-secs", "5"], ["--repository-poll-secs", "1"],
                                   ["--load-model", "m"]])
def test_repository_flags_without_a_repository_are_refused(flags, tmp_path, capsys):
    assert _options(flags) is None
    err = capsys.readouterr().err
    assert flags[0] in err and "give --model-repository too" in err
    (tmp_path / "repo").mkdir()
    assert _options([*flags, "--model-repository", str(tmp_path / "repo")]) is not None
    assert cli.main(["serve", *flags, "--grpc-port", "0"]) == 2  # the exit status of a refused command line


def test_a_config_files_repository_satisfies_the_repository_flags(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\n")
    opts = _options(["--config", str(cfg), "--model-control-mode", "poll", "--repository-poll-secs", "3"])
    assert (opts.model_control_mode, opts.repository_poll_s) == ("poll", 3.0)
    assert _options(["--config", str(cfg)]).repository_poll_s == 1.0  # the flag's default, unset
    cfg.write_text(f"models:\n  - {{name: a, path: {DEMO_MODEL_DIR}}}\n")  # no repository anywhere
    assert _options(["--config", str(cfg), "--model-control-mode", "explicit"]) is None
    assert "give --model-repository too (or model_repository in the config)" in capsys.readouterr().err
    assert _options(["--config", str(cfg)]) is not None


def test_host_and_port_help_say_what_they_are_and_their_default(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    host = re.search(r"--host HOST (.*?) --port", text).group(1)
    port = re.search(r"--port PORT (.*?) --api-key", text).group(1)
    assert "listen" in host and "(default: 0.0.0.0)" in host
    assert "HTTP port" in port and "(default: 8000)" in port
    poll = re.search(r"--repository-poll-secs S (.*?) --load-model", text).group(1)
    assert poll.count("(default") == 1 and "default: 1)" in poll
