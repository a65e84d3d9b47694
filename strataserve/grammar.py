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


def tokenizer_info(hf: Any, vocab_size: int, stop_token_ids: Sequence[int] | None) -> Any:
    """xgrammar's ``TokenizerInfo`` of a Hugging Face tokenizer in which its special tokens (``<|im_end|>``,
    ``[TOOL_CALLS]``...) spell nothing: a grammar's literal text is then written with ordinary tokens. xgrammar
    reads no special tokens from these tokenizers, so ``guided_choice=["<|im_end|>"]`` was matched by the special
    token itself, which ``skip_special_tokens`` then drops from the output (empty text). The stop tokens stay stop
    tokens (they end the grammar)."""
    xgr = load_xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = set(getattr(hf, "all_special_ids", ()) or ())
    special.update(i for i, tok in (getattr(hf, "added_tokens_decoder", None) or {}).items()
                   if getattr(tok, "special", False))
    if not special:
        return info
    # xgrammar's decoded bytes, as a raw vocabulary, are the same tokenizer; an empty entry is a special token
    vocab = [b"" if i in special else piece for i, piece in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=list(info.stop_token_ids), add_prefix_space=info.add_prefix_space)


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
#: refused, so "valid against the schema" holds for every schema that is accepted (``_unenforced_value``: the
#: keywords it enforces only for some values)
_UNENFORCED = ("allOf", "not", "contains", "minContains", "maxContains", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "additionalItems")


def unenforced_keyword(schema: Any, where: str = "#") -> str | None:
    """Where ``schema`` asks for something xgrammar would not hold its output to, as "#/path: what and why", else
    None. Checks keyword names and, where xgrammar enforces a keyword only in part, its value."""
    if not isinstance(schema, dict):
        return None
    held = "is not supported (the output could not be held to it)"
    for key in _UNENFORCED:
        if key in schema:
            return f"{where}: {key} {held}"
    if schema.get("uniqueItems") is True:
        return f"{where}: uniqueItems {held}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"{where}: pattern with minLength / maxLength {held}: the lengths are not enforced beside a pattern"
    found = _unenforced_value(schema, where)
    if found:
        return found
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


def _unenforced_value(schema: dict[str, Any], where: str) -> str | None:
    """The keywords xgrammar 0.2.9 takes but enforces only for some values (each found by feeding its matcher
    outputs that break the schema)."""
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        bad = _regex_problem(pattern)
        if bad:
            return f"{where}/pattern: regex {pattern!r} is not supported ({bad})"
    if isinstance(schema.get("patternProperties"), dict):
        for key in schema["patternProperties"]:
            bad = _regex_problem(key)
            if bad:
                return f"{where}/patternProperties: regex {key!r} is not supported ({bad})"
    for key in _REFS:
        ref = schema.get(key)
        if isinstance(ref, str) and (key != "$ref" or not (ref == "#" or ref.startswith("#/"))):
            return (f"{where}/{key}: {ref!r} is not supported (only local JSON-pointer references, '#' or '#/...', "
                    "are resolved; an external one or an anchor would let any value through)")
    multiple = schema.get("multipleOf")
    if multiple is not None and not _integer_multiple(schema.get("type"), multiple):
        return (f"{where}/multipleOf: {multiple!r} is not supported (only an integer multipleOf on type 'integer' "
                "is enforced; on a number it would let any value through)")
    required, properties, types = schema.get("required"), schema.get("properties"), schema.get("type", "object")
    if isinstance(required, list) and "object" in (types if isinstance(types, list) else [types]):
        known = properties if isinstance(properties, dict) else {}
        for name in required:
            if isinstance(name, str) and name not in known:
                if schema.get("additionalProperties") is False and not schema.get("patternProperties"):
                    return (f"{where}/required: property {name!r} is unsatisfiable (additionalProperties is false "
                            "and it is not in properties)")
                return (f"{where}/required: property {name!r} outside properties is not supported (only a property "
                        "declared in properties, beside required, is made required)")
    return None


#: references xgrammar resolves only as local JSON pointers ("#", "#/$defs/x"): an "http://..." or "other.json#"
#: ref, an anchor ("#foo") or a dynamic / recursive ref compiles to "any value"
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


def _integer_multiple(types: Any, multiple: Any) -> bool:
    """xgrammar enforces multipleOf only with an integral value on integers (a number's is ignored)."""
    type_list = types if isinstance(types, list) else [types]
    integral = (isinstance(multiple, int) and not isinstance(multiple, bool)
                or isinstance(multiple, float) and multiple.is_integer())
    return integral and "integer" in type_list and "number" not in type_list


def _regex_problem(pattern: str) -> str | None:
    """Why xgrammar's regex compiler refuses ``pattern``, else None. Its JSON-schema converter skips what it cannot
    do (a lookahead, with a log line) and so would not enforce the pattern; guided_regex refuses the same text."""
    try:
        load_xgrammar().Grammar.from_regex(pattern)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for what it cannot parse
        return _reason(exc).removeprefix("Regex parsing error at ")
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
            raise ValueError(f"invalid guided decoding json: {found}; express the constraint otherwise or check it "
                             "after generation")
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
