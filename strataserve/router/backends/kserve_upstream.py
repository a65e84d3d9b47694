"""An upstream KServe v2 server (NVIDIA Triton, another strata) behind the router, with replicas.

Both of our KServe fronts (HTTP and gRPC) decode a request into an ``InferRequest``; this backend sends it
upstream over HTTP with every tensor in the binary extension and decodes the answer, so ``tritonclient`` sees
an upstream model exactly as it sees a local one. Metadata, config and statistics are fetched from the upstream
with the model renamed to the name this server gives it. A replica that could not be reached is marked down and
the next one tried; a call dropped after it was sent is retried once on another replica (``upstream_retry.py``);
no replica left is UNAVAILABLE (503) naming the model.
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError
from strataserve.router.config import KServeUpstream
from strataserve.router.kserve_client import HEADER_LENGTH, decode_response, encode_request, error_from_status
from strataserve.router.backends.upstream import UpstreamBackend
from strataserve.router.backends.upstream_retry import Outliers, after_connection_error
from strataserve.router.replicas import Replica
from strataserve.router.types import ModelCard, Payload


class KServeUpstreamBackend(UpstreamBackend):
    payload = Payload.TENSORS

    def __init__(self, spec: KServeUpstream, *, health_interval_s: float = 2.0) -> None:
        super().__init__(spec.name, spec.url, gpu_cost_per_hour=spec.gpu_cost_per_hour,
                         connect_timeout_s=spec.connect_timeout_s, health_interval_s=health_interval_s)
        self.spec = spec
        self.health_path = f"/v2/models/{spec.remote_name}/ready"
        self.outliers = Outliers()

    def card(self) -> ModelCard:
        return ModelCard(self.name, Payload.TENSORS, "upstream-kserve", self.ready(), self.unavailable_reason(),
                         extra=self.listing(self.spec.remote_name))

    # ------------------------------------------------------------------ wire
    def _path(self, version: str, tail: str = "") -> str:
        v = f"/versions/{version}" if version else ""
        return f"/v2/models/{self.spec.remote_name}{v}{tail}"

    async def _call(self, method: str, path: str, body: bytes | None = None,
                    headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
        """One call, tried on replicas as ``upstream_retry.py`` says for connection failures (a KServe error
        status is the model's answer, returned as it is)."""
        tried: list[Replica] = []
        retried = False  # the one retry of a request an upstream may have seen
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.spec.connect_timeout_s,
                                        sock_read=self.spec.timeout_s)
        while True:
            r = self.replicas.choose(None, exclude=tuple(tried))
            if r is None:
                raise ModelServerError("unavailable", self.replicas.unavailable_message())
            tried.append(r)
            r.outstanding += 1
            try:
                async with self.session.request(method, r.url + path, data=body, headers=headers,
                                                timeout=timeout) as resp:
                    answer = resp.status, await resp.read(), resp.headers
                self.outliers.succeeded(r)
                return answer
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                what = after_connection_error(exc, r, self.outliers)
                if what == "next":
                    continue
                if what == "timeout":  # no answer in timeout_s: its slowness, not retried
                    raise self._timeout() from None
                # dropped: retried once elsewhere (a request that kills its server reaches two replicas, not all)
                if retried or self.replicas.choose(None, exclude=tuple(tried)) is None:
                    raise ModelServerError("bad_gateway", f"model '{self.name}': the upstream server closed the "
                                           f"connection without answering ({type(exc).__name__})") from None
                retried = True
            except asyncio.TimeoutError:
                raise self._timeout() from None
            finally:
                r.outstanding -= 1

    def _timeout(self) -> ModelServerError:
        return ModelServerError("deadline_exceeded", f"model '{self.name}': the upstream server did not answer "
                                f"within {self.spec.timeout_s:g} s")

    async def _get_json(self, path: str) -> Any:
        status, body, _ = await self._call("GET", path)
        if status != 200:
            raise error_from_status(status, body, self.name)
        return msgspec.json.decode(body)

    # ------------------------------------------------------------------ the model-server surface
    async def model_metadata(self, version: str = "") -> dict:
        doc = await self._get_json(self._path(version))
        doc["name"] = self.name
        return doc

    async def model_config(self, version: str = "") -> dict:
        doc = await self._get_json(self._path(version, "/config"))
        if isinstance(doc, dict):
            doc["name"] = self.name
        return doc

    async def model_ready(self, version: str = "") -> bool:
        try:
            status, _, _ = await self._call("GET", self._path(version, "/ready"))
        except ModelServerError:
            return False
        return status == 200

    async def statistics(self, version: str = "") -> dict:
        doc = await self._get_json(self._path(version, "/stats"))
        for entry in doc.get("model_stats", []):
            entry["name"] = self.name
        return doc

    async def infer(self, request: InferRequest) -> InferResponse:
        body, hlen = encode_request(request)
        status, data, headers = await self._call("POST", self._path(request.model_version, "/infer"), body,
                                                 {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(hlen)})
        if status != 200:
            raise error_from_status(status, data, self.name)
        return decode_response(data, headers.get(HEADER_LENGTH), self.name)
