"""JSON-schema refusals of ``strataserve.grammar``: what xgrammar 0.2.9 compiles but would not hold its output to
(each refused case is shown to let an invalid output through), and what it does enforce (accepted). Plus the
tokenizer vocabulary the grammar engine sees: special tokens never spell a grammar's literal text."""
from __future__ import annotations

import json

import pytest

from _tiny_models import EOS_ID, IM_END_ID, make_tiny_tokenizer
from strataserve.grammar import build_grammar, check_guided, tokenizer_info
from strataserve.types.sampling import GuidedDecodingParams

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

# schema -> (where the 400 points, a word of the reason, an output xgrammar's own grammar accepts that breaks it)
REFUSED = {
    "lookahead": ({"type": "string", "pattern": "^(?=b)[a-z]{1,4}$"}, "#/pattern", "Lookahead", '"abc"'),
    "negative lookahead, nested": (
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?!a)[a-c]{2}$"}},
         "required": ["s"], "additionalProperties": False}, "#/properties/s/pattern", "Lookahead", '{"s": "ab"}'),
    "lookahead patternProperties key": (
        {"type": "object", "patternProperties": {"^(?=x)[a-z]$": {"type": "integer"}}, "additionalProperties": False,
         "minProperties": 1}, "#/patternProperties", "Lookahead", '{"a": 1}'),
    "required outside properties, additionalProperties false": (
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False}, "#/required", "unsatisfiable", '{"b": 1}'),
    "required outside properties": (
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": {"type": "integer"}}, "#/required", "'a'", '{"b": 1}'),
    "required matched by patternProperties": (
        {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "required": ["x1"],
         "additionalProperties": False}, "#/required", "'x1'", "{}"),
    "multipleOf 0.5 on a number": ({"type": "number", "multipleOf": 0.5}, "#/multipleOf", "0.5", "1.0009"),
    "integer multipleOf on a number": ({"type": "number", "multipleOf": 3}, "#/multipleOf", "3", "4"),
    "multipleOf 0.5 on an integer": ({"type": "integer", "multipleOf": 0.5}, "#/multipleOf", "0.5", "1"),
    "external $ref": ({"$ref": "http://example.com/s.json"}, "#/$ref", "example.com", '"x"'),
    "relative-file $ref in $defs": ({"type": "array", "items": {"$ref": "#/$defs/a"}, "maxItems": 1,
                                     "$defs": {"a": {"$ref": "other.json#/b"}}}, "#/$defs/a/$ref", "other.json",
                                    '["x"]'),
    "anchor $ref": ({"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "#/$ref", "#foo",
                    '"x"'),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_schemas_xgrammar_would_not_enforce_are_refused(name):
    schema, where, why, invalid_output = REFUSED[name]
    # the reason for the refusal: xgrammar's own grammar for the schema lets an invalid output through
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), invalid_output)
    with pytest.raises(ValueError) as ei:
        build_grammar(GuidedDecodingParams(json=schema))
    msg = str(ei.value)
    assert f"{where}" in msg and why in msg, msg
    with pytest.raises(ValueError):
        check_guided(GuidedDecodingParams(json=json.dumps(schema)))  # the text form is checked as well


ACCEPTED = {
    "integer multipleOf": ({"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 10}, "6", "4"),
    "integral float multipleOf on an integer": ({"type": "integer", "multipleOf": 2.0}, "4", "3"),
    "local $ref": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, "1", '"x"'),
    "recursive '#' ref": ({"type": "array", "items": {"$ref": "#"}, "maxItems": 2}, "[[]]", "1"),
    "required in properties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                               '{"a": 1}', "{}"),
    "plain pattern and patternProperties": (
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{1,3}\\d$"}},
         "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "required": ["s"]}, '{"s": "ab1"}', '{"s": "1"}'),
    "required on a non-object type": ({"type": "string", "required": ["a"], "maxLength": 3}, '"ab"', "1"),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_schemas_xgrammar_enforces_are_accepted(name):
    schema, valid, invalid = ACCEPTED[name]
    g = build_grammar(GuidedDecodingParams(json=schema))
    assert accepts(g, valid) and not accepts(g, invalid)


def test_special_tokens_never_spell_grammar_text():
    """guided_choice=["<|im_end|>"]: xgrammar reads no special tokens from a byte-level tokenizer, so the special
    token itself matched the text (and skip_special_tokens then dropped it); with ``tokenizer_info`` the text is
    spelled with ordinary tokens, and the stop token still ends the grammar."""
    tok = make_tiny_tokenizer(512)
    info = tokenizer_info(tok, 512, [EOS_ID])
    assert list(info.stop_token_ids) == [EOS_ID]
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "<|im_end|>" | "ok"')
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, 512)
    matcher.fill_next_token_bitmask(mask)
    allowed = {i for i in range(512) if (int(mask[0, i // 32]) >> (i % 32)) & 1}
    assert IM_END_ID not in allowed and EOS_ID not in allowed
    assert tok.convert_tokens_to_ids("<") in allowed
    spelled = tok.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True)
    assert IM_END_ID not in spelled and all(matcher.accept_token(t) for t in spelled)
    assert matcher.accept_token(EOS_ID) and matcher.is_terminated()
    assert tok.decode(spelled, skip_special_tokens=True) == "<|im_end|>"
