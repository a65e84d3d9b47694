"""Which model, version and route a KServe v2 per-model HTTP path names, for model names that hold slashes.

A model served under its folder path ("models/llama", "/models/llama") is listed by the repository index with
its slashes, and tritonclient puts the name in the URL with ``quote(name)``, which keeps them. So the path is
read from its end: the last segment is the route (``ready``, ``config``, ``stats``; ``infer``, ``generate``,
``generate_stream``; none = metadata), then an optional ``versions/{v}``, and everything before that is the
name. A slash sent as ``%2F`` stays inside its segment (the raw path is split before it is decoded), so a name
that itself ends in a route word or in ``versions/N`` is still reachable when its slashes are encoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from starlette.requests import Request

MODELS_PREFIX = "/v2/models/"
REPOSITORY_PREFIX = "/v2/repository/models/"
GET_ROUTES = frozenset({"ready", "config", "stats"})
POST_ROUTES = frozenset({"infer", "generate", "generate_stream"})
TRACE = "trace/setting"  # Triton's per-model trace extension, which this server lacks: named in the 404


@dataclass(frozen=True)
class ModelPath:
    name: str
    version: str  # "" = the server's choice (latest / policy)
    route: str  # one of GET_ROUTES / POST_ROUTES / TRACE, or "" for model metadata


def split_model_path(rest: str) -> ModelPath | None:
    """``rest``: the raw (still percent-encoded) path after ``/v2/models/``. None: no model named in it."""
    segments = rest.split("/")
    route = ""
    if len(segments) > 2 and "/".join(segments[-2:]) == TRACE:
        route = TRACE
        del segments[-2:]
    elif len(segments) > 1 and (segments[-1] in GET_ROUTES or segments[-1] in POST_ROUTES):
        route = segments.pop()
    version = ""
    if len(segments) > 2 and segments[-2] == "versions" and segments[-1]:
        version = unquote(segments.pop())
        segments.pop()
    name = "/".join(unquote(s) for s in segments)
    return ModelPath(name, version, route) if name else None


def split_repository_path(rest: str) -> tuple[str, str] | None:
    """(name, "load" | "unload") of the raw path after ``/v2/repository/models/``; None: not one of those."""
    name, _, verb = rest.rpartition("/")
    name = unquote(name)
    return (name, verb) if name and verb in ("load", "unload") else None


def raw_rest(request: Request, prefix: str = MODELS_PREFIX) -> str:
    """The encoded part of the request path after ``prefix`` (the decoded path has lost ``%2F``)."""
    raw = request.scope.get("raw_path")
    if raw:
        text = raw.decode("latin-1").split("?", 1)[0]
        at = text.find(prefix)
        if at >= 0:
            return text[at + len(prefix):]
    return quote(request.path_params.get("rest", ""))  # no raw path (some test clients): slashes are literal
