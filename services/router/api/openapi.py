"""What /openapi.json says about the completion endpoints. Their handlers read the raw
body themselves (under size and time limits), so the request bodies are declared here
rather than inferred from the handlers' parameters."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .response_schemas import ErrorResponse
from .schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "invalid request, or an OpenAI field this server does not implement",
    401: "missing or wrong API key (only when keys are configured)",
    404: "unknown model",
    408: "the request body did not arrive in time",
    411: "no Content-Length and not chunked",
    413: "request body too large",
    429: "too many requests in flight and waiting; see Retry-After",
    502: "a serving instance failed the request",
    503: "no instance can take the request",
    504: "no progress before the timeout",
}


def completion_docs(request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """Route keyword arguments declaring a completion endpoint's bodies."""
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": REF.format(model=request.__name__)}}},
    }
    sse = {"schema": {"type": "string", "description": "with stream=true: SSE chunks, then `data: [DONE]`"}}
    responses: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": sse}}}
    responses.update({status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()})
    return {"response_model": response, "openapi_extra": {"requestBody": body}, "responses": responses}


def install_openapi(app: FastAPI) -> None:
    """app.openapi() also publishes the request body models the routes refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                model_schema = model.model_json_schema(ref_template=REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
