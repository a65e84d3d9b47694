"""The structured-output fields of an OpenAI request -> one ``GuidedDecodingParams`` (or None), validated here so
a bad schema, regex or grammar is a 400 naming the field, before anything reaches the engine.

Accepted, as vLLM does: ``response_format`` ``{"type": "json_object"}`` / ``{"type": "json_schema", "json_schema":
{"schema": ...}}`` (both routes), the extras ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and the newer ``structured_outputs`` object (``{"json": ...}``, ``{"regex": ...}``,
``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": true}``). At most one of them per request.
"""
from __future__ import annotations

import json
from typing import Any

from strataserve.api.errors import bad_request
from strataserve.types.sampling import GuidedDecodingParams
from strataserve.grammar import check_guided

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(rf: Any) -> GuidedDecodingParams | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GuidedDecodingParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format type 'json_schema' needs json_schema.schema", param="response_format")
    return GuidedDecodingParams(json=rf.json_schema.schema_)


def _from_extras(body: Any) -> list[tuple[str, GuidedDecodingParams]]:
    found = []
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad_request(f"guided_json is not valid JSON: {exc}", param="guided_json") from None
        found.append(("guided_json", GuidedDecodingParams(json=schema)))
    if body.guided_regex is not None:
        found.append(("guided_regex", GuidedDecodingParams(regex=body.guided_regex)))
    if body.guided_choice is not None:
        if not body.guided_choice:
            raise bad_request("guided_choice needs at least one choice", param="guided_choice")
        found.append(("guided_choice", GuidedDecodingParams(choice=body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GuidedDecodingParams(grammar=body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.items() if k in _STRUCTURED_KEYS and v not in (None, False)}
        if len(given) != 1:
            raise bad_request(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KEYS)}",
                              param="structured_outputs")
        found.append(("structured_outputs", GuidedDecodingParams(**given)))
    return found


def guided_params(body: Any) -> GuidedDecodingParams | None:
    """The request's output constraint, or None. Raises a 400 ``APIError`` for conflicting or invalid ones."""
    found = _from_extras(body)
    rf = _from_response_format(body.response_format)
    if rf is not None:
        found.insert(0, ("response_format", rf))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one output constraint, not several ({names})", param=found[1][0])
    param, spec = found[0]
    validate(spec, param)
    return spec


def validate(spec: GuidedDecodingParams, param: str) -> None:
    try:
        check_guided(spec)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
