"""Output constraints as grammars: a ``GuidedDecodingParams`` compiled to an xgrammar ``Grammar``.

Neutral ground: the API checks a request's constraint at the door with it (a bad schema is a 400 naming the field)
and the engine builds its matchers from the same grammars (``engine/structured_output.py``).
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, Callable, Sequence

from strataserve.types.sampling import GuidedDecodingParams


def load_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # an optional extra: say how to get it
        raise ValueError(f"structured outputs need xgrammar ({exc}): pip install 'strataserve[structured]'") from None
    return xgrammar


#: ``json_object`` (OpenAI's response_format): any JSON object, written compactly as a schema's output is (xgrammar's
#: built-in JSON grammar takes any value, arrays and numbers too, with any whitespace)
ANY_OBJECT = '{"type": "object"}'


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(spec: GuidedDecodingParams) -> Any:
    """The xgrammar ``Grammar`` of a spec (no tokenizer needed). Raises ValueError saying what is wrong with it."""
    g = load_xgrammar().Grammar
    schema = lambda text: g.from_json_schema(text, any_whitespace=False)  # noqa: E731
    return _by_kind(spec, schema, lambda: schema(ANY_OBJECT), g.from_regex, g.from_ebnf)


def compile_spec(compiler: Any, spec: GuidedDecodingParams) -> Any:
    """``spec`` compiled by an xgrammar ``GrammarCompiler``, from its source text. Not ``compile_grammar`` of
    ``build_grammar``'s ``Grammar``: that prints the grammar and parses it again, and the printed ``"\\x85c"``
    (U+0085, then "c") reads back as U+085C (xgrammar 0.2.9), so a choice or an enum with such text would be
    unreachable and the output something else."""
    c = compiler
    schema = lambda text: c.compile_json_schema(text, any_whitespace=False)  # noqa: E731
    return _by_kind(spec, schema, lambda: schema(ANY_OBJECT), c.compile_regex, c.compile_grammar)


#: schema keywords xgrammar 0.2 compiles but does not enforce (its output can break them with finish "stop"):
#: refused, so "valid against the schema" holds for every schema that is accepted
_UNENFORCED = ("allOf", "not", "contains", "minContains", "maxContains", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "additionalItems")


def unenforced_keyword(schema: Any, where: str = "#") -> str | None:
    """Where ``schema`` uses a keyword xgrammar would not enforce, as "#/path: keyword", else None."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema:
            return f"{where}: {key}"
    if schema.get("uniqueItems") is True:
        return f"{where}: uniqueItems"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"{where}: pattern with minLength / maxLength (the lengths are not enforced beside a pattern)"
    children = [(f"{where}/{k}/{n}", sub) for k in _SUBSCHEMA_MAPS if isinstance(schema.get(k), dict)
                for n, sub in schema[k].items()]
    children += [(f"{where}/{k}/{i}", sub) for k in _SUBSCHEMA_LISTS if isinstance(schema.get(k), list)
                 for i, sub in enumerate(schema[k])]
    children += [(f"{where}/{k}", schema[k]) for k in _SUBSCHEMAS if k in schema]
    if isinstance(schema.get("items"), list):
        children += [(f"{where}/items/{i}", sub) for i, sub in enumerate(schema["items"])]
    for path, sub in children:
        found = unenforced_keyword(sub, path)
        if found:
            return found
    return None


def _by_kind(spec: GuidedDecodingParams, json_schema: Callable[[Any], Any], json_object: Callable[[], Any],
             regex: Callable[[str], Any], ebnf: Callable[[str], Any]) -> Any:
    """The one of these builders that ``spec``'s kind calls for, applied to its source (a choice as EBNF)."""
    kind = spec.kind
    if kind == "json":
        try:
            found = unenforced_keyword(json.loads(spec.json) if isinstance(spec.json, str) else spec.json)
        except ValueError:
            found = None  # not JSON: the compiler says so below
        if found:
            raise ValueError(f"invalid guided decoding json: {found} is not supported (the output could not be held "
                             "to it); express the constraint otherwise or check it after generation")
    try:
        if kind == "json":
            return json_schema(spec.json)
        if kind == "json_object":
            return json_object()
        if kind == "regex":
            return regex(spec.regex)
        return ebnf(choice_grammar(spec.choice or []) if kind == "choice" else spec.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError for bad input
        raise ValueError(f"invalid guided decoding {kind}: {_reason(exc)}") from None


#: xgrammar's C++ log prefix, "[02:07:08] /project/cpp/json_schema_converter.cc:5088: ": its clock and source
#: path say nothing to the caller
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")


def _reason(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0])[:300]


def check_guided(spec: GuidedDecodingParams | None) -> None:
    """Validate a spec at the edge (API process / offline front end) so a bad schema is a 400, not a core error.
    A spec already found valid is not compiled again (the API checks it, then its engine front end does)."""
    if spec is None:
        return
    key = json.dumps([spec.kind, spec.json, spec.regex, spec.choice, spec.grammar], sort_keys=True, default=str)
    if key in _VALID:
        _VALID.move_to_end(key)
        return
    build_grammar(spec)
    _VALID[key] = None
    if len(_VALID) > _VALID_MAX:
        _VALID.popitem(last=False)


_VALID: OrderedDict[str, None] = OrderedDict()  # recently validated specs (LRU); only valid ones are kept
_VALID_MAX = 256
