"""Our grpc_service.proto must match the public protocol that tritonclient was generated from.

Both define `inference.*` messages, which cannot live in one protobuf descriptor pool, so each side's
descriptors are dumped in its own subprocess and compared here: every message, field name, number, type and
label we define must be the same in tritonclient's; the service must have the same methods and streaming.
"""

from __future__ import annotations

import json
import subprocess
import sys

_DUMP = r"""
import json, sys, importlib
mods = sys.argv[1:]
files = [importlib.import_module(m).DESCRIPTOR for m in mods]
out = {"messages": {}, "methods": {}}
def walk(m, prefix):
    name = prefix + m.name
    out["messages"][name] = {
        f.name: [f.number, f.type, f.is_repeated,
                 (f.message_type.name if f.message_type else f.enum_type.name if f.enum_type else "")]
        for f in m.fields
    }
    for n in m.nested_types:
        walk(n, name + ".")
for fd in files:
    for m in fd.message_types_by_name.values():
        walk(m, "")
    for s in fd.services_by_name.values():
        for meth in s.methods:
            out["methods"][s.full_name + "/" + meth.name] = [
                meth.input_type.name, meth.output_type.name, meth.client_streaming, meth.server_streaming]
print(json.dumps(out))
"""


def _dump(*modules: str) -> dict:
    res = subprocess.run([sys.executable, "-c", _DUMP, *modules], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_grpc_service_matches_tritonclient():
    ours = _dump("strataserve.api.proto.grpc_service_pb2", "strataserve.types.model_config_pb2")
    theirs = _dump("tritonclient.grpc.service_pb2", "tritonclient.grpc.model_config_pb2")
    required = {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
        "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
        "RepositoryModelUnload",
    }
    ours_methods = {k.split("/")[1] for k in ours["methods"]}
    assert required <= ours_methods
    for key, sig in ours["methods"].items():
        assert key.startswith("inference.GRPCInferenceService/")
        assert theirs["methods"][key] == sig, key
    assert len(ours["messages"]) > 40
    for name, fields in ours["messages"].items():
        assert name in theirs["messages"], f"message {name} is not in the public protocol"
        for fname, spec in fields.items():
            assert theirs["messages"][name].get(fname) == spec, f"{name}.{fname}: ours {spec}, theirs {theirs['messages'][name].get(fname)}"
