"""``strata serve``'s flags that need another flag: refused at start-up with exit 2 and a sentence naming the
missing one (as vLLM and Triton refuse them), rather than a server that ignores a flag or fails every request."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strataserve.api.server import ServeOptions


def _repository_flags(args: argparse.Namespace) -> list[str]:
    """The repository flags given on the command line (each means nothing without a model repository)."""
    strict = getattr(args, "strict_readiness", None)  # None: not given
    return [flag for flag, given in (("--load-model", bool(args.load_model)),
                                     ("--model-control-mode", args.model_control_mode not in (None, "none")),
                                     ("--repository-poll-secs", args.repository_poll_secs is not None),
                                     ("--strict-readiness" if strict else "--no-strict-readiness",
                                      strict is not None)) if given]


def _named(flags: list[str]) -> str:
    listed = flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"
    return f"{listed} {'applies' if len(flags) == 1 else 'apply'} to"


def flag_error(args: argparse.Namespace) -> str | None:
    """A flag given without the one it needs: refused at start (as vLLM and Triton do), not silently ignored.
    With --config, the file may supply what is missing: ``options_error`` checks the merged options then."""
    names = args.served_model_name or []
    if len(set(names)) < len(names):
        return f"--served-model-name {' '.join(names)}: a name is given twice"
    if args.config is not None:
        return None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return ("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral: the model "
                "family's tool-call format)")
    flags = _repository_flags(args)
    if flags and args.model_repository is None:
        return f"{_named(flags)} repository models: give --model-repository too"
    return None


def options_error(args: argparse.Namespace, options: ServeOptions) -> str | None:
    """The checks of ``flag_error`` on a config file's options (its entries and model_repository included)."""
    for spec in options.llms:
        if spec.enable_auto_tool_choice and spec.tool_call_parser is None:
            return (f"model {spec.name!r}: enable_auto_tool_choice (--enable-auto-tool-choice) needs a "
                    "tool_call_parser (the entry's key or --tool-call-parser)")
    flags = _repository_flags(args)
    if flags and not options.model_repository:
        return f"{_named(flags)} repository models: give --model-repository too (or model_repository in the config)"
    return None


def repository_override(args: argparse.Namespace, config_repository: str | None) -> str | None:
    """A warning where --model-repository and the config's model_repository differ: the flag wins (a typed flag
    wins over the file), but until that rule covered every repository key the file's won, so say which is served."""
    flag = args.model_repository
    if flag is None or config_repository is None or os.path.realpath(flag) == os.path.realpath(config_repository):
        return None
    return (f"serving --model-repository {flag}, not the config's model_repository {config_repository} (a flag "
            "typed on the command line wins over the file)")
