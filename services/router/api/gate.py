"""In front of every endpoint: the API key check (all but GET /health), then admission
control for the completion endpoints. Plain ASGI, so a streamed response keeps its slot
until its last byte is sent."""

from __future__ import annotations

import math
import time

from fastapi.responses import JSONResponse

from shared.telemetry import metrics

from ..core.errors import error_body
from .auth import ApiKeys
from .http_admission import Admission, Overloaded

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
QUEUED_S = "queued_s"  # request.state: how long an admitted request waited for its slot


def _authorization(scope) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == b"authorization"), None)


def _unauthorized(authorization: bytes | None) -> JSONResponse:
    message = (
        "incorrect API key provided"
        if authorization
        else ("no API key provided: send it as 'Authorization: Bearer <key>'")
    )
    return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401)


class Gate:
    def __init__(self, app, keys: ApiKeys, admission: Admission):
        self.app, self.keys, self.admission = app, keys, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        open_path = scope["method"] == "GET" and scope["path"] == "/health"
        authorization = _authorization(scope)
        if not open_path and not self.keys.allows(authorization):
            return await _unauthorized(authorization)(scope, receive, send)
        if scope["path"] not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        arrived = time.monotonic()
        try:
            await self.admission.acquire()
        except Overloaded as e:
            metrics.REQUESTS.labels(pipeline="none", outcome="rejected").inc()
            body = error_body(
                f"the server is busy ({e}); retry later", type_="rate_limit_error", code="rate_limit_exceeded"
            )
            retry = str(max(1, math.ceil(self.admission.max_wait_s)))
            return await JSONResponse(body, 429, headers={"Retry-After": retry})(scope, receive, send)
        scope.setdefault("state", {})[QUEUED_S] = time.monotonic() - arrived  # (request.state)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release()
