"""config.pbtxt / JSON text ⇄ the `ModelConfig` protobuf (parsing, Triton-only fields, Triton's JSON form).

`config.py` turns the parsed message into a validated `ModelSpec`; this file only deals with text.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from strataserve.types import model_config_pb2 as pb
from strataserve.modelserver.config import ConfigError

log = logging.getLogger(__name__)

# Triton fields that tune Triton itself (TensorRT accelerators, warm-up, cache, agents...): a Triton model folder
# keeps working, the blocks are skipped with a warning. Fields that change what a model computes are refused.
IGNORED_FIELDS = ("optimization", "model_warmup", "model_operations", "model_repository_agents", "response_cache",
                  "model_metrics", "metric_tags", "cc_model_filenames")
UNSUPPORTED_FIELDS = {
    "sequence_batching": "sequence batching (stateful models) is not supported by strataserve",
    "batch_input": "batch inputs (ragged batching) are not supported by strataserve",
    "batch_output": "batch outputs (ragged batching) are not supported by strataserve",
}


def parse_pbtxt(text: str, source: str | Path) -> pb.ModelConfig:
    msg = pb.ModelConfig()
    text, ignored = strip_ignored_fields(text)
    if ignored:
        log.warning("%s: ignoring Triton-only fields %s", source, sorted(set(ignored)))
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        # e.g. '3:1 : Message type "strata.modelconfig.ModelConfig" has no field named "optimisation".'
        field_name = _field_from_parse_error(str(e), text)
        if field_name in UNSUPPORTED_FIELDS:
            raise ConfigError(source, field_name, UNSUPPORTED_FIELDS[field_name]) from None
        hint = f" (data types: {', '.join(pb.DataType.keys()[1:])})" if "DataType" in str(e) else ""
        raise ConfigError(source, field_name, f"cannot parse: {e}{hint}") from None
    return msg


def strip_ignored_fields(text: str) -> tuple[str, list[str]]:
    """Blank out top-level `IGNORED_FIELDS` blocks (newlines kept, so parse errors keep their line numbers)."""
    out, ignored, depth, i, n = [], [], 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#" or c in "\"'":
            j = _skip_token(text, i)
            out.append(text[i:j])
            i = j
            continue
        if c in "{[<":
            depth += 1
        elif c in "}]>":
            depth -= 1
        elif depth == 0 and (c.isalpha() or c == "_") and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = _IDENT.match(text, i)
            j = m.end()
            if m.group(1) in IGNORED_FIELDS and j < n and text[j] in "{[<":
                end = _block_end(text, j)
                ignored.append(m.group(1))
                out.append(re.sub(r"[^\n]", " ", text[i:end]))
                i = end
                continue
            out.append(m.group(1))
            i += len(m.group(1))
            continue
        out.append(c)
        i += 1
    return "".join(out), ignored


_IDENT = re.compile(r"([A-Za-z_]\w*)\s*:?\s*")


def _skip_token(text: str, i: int) -> int:
    """End of the comment or quoted string starting at i."""
    if text[i] == "#":
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _block_end(text: str, i: int) -> int:
    depth = 0
    while i < len(text):
        c = text[i]
        if c == "#" or c in "\"'":
            i = _skip_token(text, i)
            continue
        depth += c in "{[<"
        depth -= c in "}]>"
        i += 1
        if depth == 0:
            return i
    return i


def parse_json_override(text: str, source: str) -> pb.ModelConfig:
    """A Triton-style `config` load parameter: the model's whole config as JSON. Triton-only blocks
    (`IGNORED_FIELDS`, which Triton's own config JSON carries) are skipped with a warning, as in config.pbtxt."""
    msg = pb.ModelConfig()
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            ignored = sorted(k for k in doc if k in IGNORED_FIELDS)
            if ignored:
                log.warning("%s: ignoring Triton-only fields %s", source, ignored)
                doc = {k: v for k, v in doc.items() if k not in IGNORED_FIELDS}
            unsupported = next((k for k in doc if k in UNSUPPORTED_FIELDS and doc[k]), None)
            if unsupported is not None:
                raise ConfigError(source, unsupported, UNSUPPORTED_FIELDS[unsupported])
            doc = {k: v for k, v in doc.items() if k not in UNSUPPORTED_FIELDS}  # empty: Triton prints them
        json_format.ParseDict(doc, msg)
    except (json_format.ParseError, json.JSONDecodeError) as e:
        raise ConfigError(source, "config", f"cannot parse the JSON config override: {e}") from None
    return msg


def _field_from_parse_error(message: str, text: str) -> str:
    m = re.search(r'no field named "?([\w.]+)', message) or re.search(r"for field ([\w.]+)", message)
    if m:
        return m.group(1)
    pos = re.match(r"(\d+):(\d+)", message)  # the field name just before the bad value
    if pos:
        lines = text.splitlines()
        row, col = int(pos.group(1)) - 1, int(pos.group(2)) - 1
        if 0 <= row < len(lines):
            m = re.search(r"(\w+)\s*:\s*\[?\s*$", lines[row][:col])
            if m:
                return m.group(1)
    return "<syntax>"


def config_to_json(cfg: pb.ModelConfig) -> dict:
    """Triton's JSON form of a config: proto field names, defaults printed, 64-bit integers as numbers."""
    d = json_format.MessageToDict(
        cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _ints_as_numbers(d, cfg.DESCRIPTOR)


_INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _ints_as_numbers(value, descriptor):
    # MessageToDict writes int64 as strings (JSON precision rule); Triton's config JSON uses numbers.
    if not isinstance(value, dict) or descriptor is None:
        return value
    out = {}
    for key, v in value.items():
        fd = descriptor.fields_by_name.get(key)
        if fd is None:
            out[key] = v
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            val_fd = fd.message_type.fields_by_name["value"]
            out[key] = {k: _convert(x, val_fd) for k, x in v.items()}
        elif isinstance(v, list):
            out[key] = [_convert(x, fd) for x in v]
        else:
            out[key] = _convert(v, fd)
    return out


def _convert(v, fd):
    if fd.type in _INT64_TYPES and isinstance(v, str):
        return int(v)
    if fd.message_type is not None:
        return _ints_as_numbers(v, fd.message_type)
    return v
