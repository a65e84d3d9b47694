"""The client side of KServe v2 over HTTP, for upstream servers (Triton, another strata): an ``InferRequest``
to a request body with every tensor in Triton's binary extension, and a response body back to an
``InferResponse``. The tensor layouts are the server's (``api/kserve_tensors.py``), so both sides agree."""
from __future__ import annotations

from typing import Any

import msgspec

from strataserve.api.kserve_codec import json_dumps
from strataserve.api.kserve_tensors import tensor_from_json, tensor_from_raw, tensor_to_raw
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor, ModelServerError

HEADER_LENGTH = "Inference-Header-Content-Length"

_STATUS_CODES = {400: "invalid_argument", 404: "not_found", 429: "resource_exhausted", 503: "unavailable",
                 504: "deadline_exceeded"}


def encode_request(req: InferRequest) -> tuple[bytes, int]:
    """Body and JSON-header length of an infer request whose inputs and outputs all travel as binary."""
    params: dict[str, Any] = dict(req.parameters)
    if req.priority:
        params["priority"] = req.priority
    if req.timeout_us is not None:
        params["timeout"] = req.timeout_us
    blobs: list[bytes] = []
    inputs = []
    for t in req.inputs:
        raw = tensor_to_raw(t)
        blobs.append(raw)
        inputs.append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                       "parameters": {**t.parameters, "binary_data_size": len(raw)}})
    doc: dict[str, Any] = {"inputs": inputs}
    if req.id is not None:
        doc["id"] = req.id
    if req.requested_outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": True}} for n in req.requested_outputs]
    else:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    header = json_dumps(doc)
    return header + b"".join(blobs), len(header)


def decode_response(body: bytes, header_length: str | None, model_name: str) -> InferResponse:
    """An upstream's infer response (JSON, or JSON header + binary outputs) as ``model_name``'s response."""
    hlen = int(header_length) if header_length is not None else len(body)
    if not 0 <= hlen <= len(body):
        raise ModelServerError("bad_gateway", f"model '{model_name}': the upstream sent a malformed response")
    try:
        doc = msgspec.json.decode(body[:hlen])
    except msgspec.DecodeError as exc:
        raise ModelServerError("bad_gateway", f"model '{model_name}': the upstream response is not JSON: {exc}")
    blob = memoryview(body)[hlen:]
    pos = 0
    outputs: list[InferTensor] = []
    for item in doc.get("outputs") or []:
        params = dict(item.get("parameters") or {})
        size = params.pop("binary_data_size", None)
        if size is not None:
            outputs.append(tensor_from_raw(item["name"], item["datatype"], item["shape"], blob[pos:pos + size],
                                           params))
            pos += size
        else:
            outputs.append(tensor_from_json(item["name"], item["datatype"], item["shape"], item.get("data"), params))
    return InferResponse(model_name=model_name, model_version=str(doc.get("model_version", "")), id=doc.get("id"),
                         outputs=outputs, parameters=dict(doc.get("parameters") or {}))


def error_from_status(status: int, body: bytes, model_name: str) -> ModelServerError:
    """An upstream error answer as the error our fronts report (status kept where it is the client's)."""
    try:
        doc = msgspec.json.decode(body)
        msg = doc.get("error", body.decode(errors="replace")) if isinstance(doc, dict) else str(doc)
    except msgspec.DecodeError:
        msg = body[:500].decode(errors="replace")
    code = _STATUS_CODES.get(status)
    if code is None:
        return ModelServerError("bad_gateway", f"model '{model_name}': the upstream server answered {status}: {msg}")
    return ModelServerError(code, f"model '{model_name}' (upstream): {msg}")
