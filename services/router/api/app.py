"""The router's HTTP API: OpenAI-compatible completions with SSE streaming."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.bus.messages import Role, TraceQuery
from shared.telemetry import metrics
from shared.telemetry.span_bus import ask, is_trace_id, merge
from shared.telemetry.span_store import default_trace_dir, find_trace_id, load_trace
from shared.telemetry.tracing import extract
from shared.telemetry.waterfall import trace_to_json

from ..core.errors import APIError, error_body
from ..service import RouterCore
from .auth import ApiKeys
from .body import read_body
from .detokenizer import Detokenizer
from .drain import Drain, DrainGate
from .gate import QUEUED_S, Gate
from .http_admission import Admission
from .http_settings import HttpSettings
from .openai_request import describe, parse_request
from .openapi import completion_docs, install_openapi
from .parallel import child_params, open_children
from .parallel_sse import ParallelSSEResponse
from .response_schemas import ChatCompletionResponse, CompletionResponse
from .responses import SSEResponse, output_options, rest_of_ended
from .resume import HEADER as LAST_EVENT_ID
from .resume import EventId, parse_event_id
from .schemas import ChatCompletionRequest, CompletionRequest
from .tokenize_api import tokenize_api
from .tool_request import default_parser
from .whole_response import complete

api = APIRouter()
STARTED = int(time.time())  # the models' `created`


def create_app(core_factory, http: HttpSettings | None = None) -> FastAPI:
    """core_factory() -> (RouterCore, tokenizer, max_model_len, closer); awaited at startup.
    `http`: API keys and request limits (the defaults: no keys, bounded everything)."""
    http = http or HttpSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        core, tokenizer, max_model_len, closer = await core_factory()
        _track_maps(core)
        app.state.core, app.state.tokenizer, app.state.max_model_len = core, tokenizer, max_model_len
        app.state.tool_parser = tool_parser(core, tokenizer)
        try:
            yield
        finally:
            await closer()

    app = FastAPI(title="pdd router", lifespan=lifespan)
    app.state.http = http
    app.state.drain = Drain()  # begun on SIGTERM (services/router/main.py)
    app.add_middleware(
        Gate,
        keys=ApiKeys(http.api_keys),
        admission=Admission(http.max_in_flight, http.max_waiting, http.max_wait_s),
    )
    app.add_middleware(DrainGate, drain=app.state.drain)  # outermost: before the key check
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)
    app.include_router(api)
    app.include_router(tokenize_api)
    install_openapi(app)
    return app


def tool_parser(core: RouterCore, tokenizer) -> str:
    """The format of the model's tool calls: --tool-call-parser, else what its chat template teaches."""
    template = getattr(tokenizer, "chat_template", None)
    return core.settings.tool_call_parser or default_parser(template.source if template else None)


def _track_maps(core: RouterCore) -> None:
    """The router's per-request and per-instance maps, as pdd_open_entries{service="router"}."""
    metrics.track("router", "streams", lambda: len(core.streams))
    metrics.track("router", "attempts", lambda: len(core.attempts))
    metrics.track("router", "stale_aborted", lambda: len(core.stale_aborted))
    metrics.track("router", "strays", lambda: len(core.strays))
    metrics.track("router", "registry_reports", lambda: len(core.registry))
    metrics.track("router", "prefix_index_instances", lambda: len(core.index))


async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(describe(exc.errors())), status_code=400)


async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)


async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _core(request: Request) -> RouterCore:
    return request.app.state.core


@api.get("/health")
async def health(request: Request) -> JSONResponse:
    core = _core(request)
    ready = core.ready()
    if request.app.state.drain.draining:  # load balancers: send nothing more here
        return JSONResponse({"status": "draining", "instances": ready}, status_code=503)
    ok = core.nc.is_connected and ready[Role.PREFILL] > 0 and ready[Role.MAIN_DECODE] > 0
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "instances": ready}, status_code=200 if ok else 503
    )


@api.get("/v1/models")
async def models(request: Request) -> dict:
    """In vLLM's shape: its clients read `root` and `max_model_len`."""
    core = _core(request)
    card = {
        "id": core.served_model_name,
        "object": "model",
        "created": STARTED,
        "owned_by": "pdd",
        "root": core.settings.model.path or core.served_model_name,
        "parent": None,
        "max_model_len": request.app.state.max_model_len,
    }
    return {"object": "list", "data": [card]}


@api.get("/v1/instances")
async def instances(request: Request) -> dict:
    """Live instances and their KV block usage, from their load reports; `set_aside`: why an
    instance gets no work (a peer refused its identity), else null."""
    core = _core(request)
    registry, aside = core.registry, core.set_aside.instances
    return {
        f"{role.value}/{r.instance}": {
            "running": r.running,
            "waiting": r.waiting,
            "used_blocks": r.used_blocks,
            "free_blocks": r.free_blocks,
            "num_blocks": r.num_blocks,
            "address": r.address,
            "held": len(r.held),
            "draining": r.draining,
            "set_aside": a.reason if (a := aside.get((role, r.instance))) else None,
        }
        for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)
        for r in registry.alive(role)
    }


@api.get("/v1/traces/{trace_or_request_id}")
async def get_trace(request: Request, trace_or_request_id: str) -> JSONResponse:
    """One request's spans from every service of both datacenters: this host's span store,
    plus what each DC's engine instances answer from theirs over the bus (span_bus.py)."""
    core = _core(request)
    directory = default_trace_dir()
    rid = "" if is_trace_id(trace_or_request_id) else trace_or_request_id
    tid = trace_or_request_id.lower() if not rid else await asyncio.to_thread(find_trace_id, directory, rid)
    local = await asyncio.to_thread(load_trace, directory, tid) if tid else []
    dcs = {d.strip() for d in core.settings.trace_datacenters.split(",") if d.strip()}
    dcs.add(core.settings.datacenter)
    live = {
        f"{role.value}/{r.instance}"
        for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)
        for r in core.registry.alive(role)
    }
    # Known here: ask by trace id (exact); else each store finds the request's trace itself.
    query = TraceQuery(trace_id=tid or "", request_id="" if tid else rid)
    replies = await ask(core.nc, dcs, query, live, core.settings.trace_gather_timeout_s)
    gathered = merge(local, replies, dcs, live, request_id="" if tid else rid)
    if not gathered.spans:
        message = f"no trace for '{trace_or_request_id}' in {directory} or any datacenter's store"
        if gathered.missing:
            message += f" ({', '.join(gathered.missing)} did not answer)"
        return JSONResponse(error_body(message, type_="not_found"), status_code=404)
    return JSONResponse({**trace_to_json(gathered.spans), **gathered.summary()})


@api.get("/metrics")
async def prometheus() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@api.post("/v1/completions", **completion_docs(CompletionRequest, CompletionResponse))
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


@api.post("/v1/chat/completions", **completion_docs(ChatCompletionRequest, ChatCompletionResponse))
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


async def _serve(request: Request, chat: bool) -> Response:
    core, tokenizer, http = _core(request), request.app.state.tokenizer, request.app.state.http
    raw = await read_body(request, http.max_body_bytes, http.body_timeout_s)
    parsed = parse_request(
        raw,
        chat,
        model_id=core.served_model_name,
        tokenizer=tokenizer,
        max_model_len=request.app.state.max_model_len,
        max_tokens_default=core.settings.max_tokens_default,
        tool_parser=request.app.state.tool_parser,
    )
    resume = _resume_point(request, parsed) if parsed.body.stream else None
    if resume is not None:
        if resume.phase:  # it had every token and the last chunk: only the end is left
            opts = output_options(parsed, tokenizer)
            return rest_of_ended(resume, len(parsed.prompt_ids), opts, core.served_model_name)
        await core.abandon(resume.rid)  # its first run, wherever it is left, is dropped now
    params = child_params(parsed.params, parsed.n) if parsed.n > 1 else [parsed.params]
    try:
        streams = await open_children(
            core, parsed.prompt_ids, params, parsed.body.pdd, extract(dict(request.headers))
        )
    except APIError:
        metrics.REQUESTS.labels(pipeline="none", outcome="rejected").inc()
        raise
    queued_s = getattr(request.state, QUEUED_S, 0.0)
    for stream in streams:
        stream.queued_s = queued_s
    core.vllm.admitted(queued_s, len(streams), parsed.params.max_tokens)
    try:
        first = streams[0]
        headers = {"x-request-id": first.rid, "x-pdd-pipeline": first.decision.pipeline.value}
        if first.traceparent:
            headers["traceparent"] = first.traceparent
        detoks = [Detokenizer(tokenizer, parsed.params.stop, parsed.params.min_tokens) for _ in streams]
        opts = output_options(parsed, tokenizer)
        if parsed.body.stream and len(streams) > 1:
            return ParallelSSEResponse(core, streams, detoks, opts, headers)  # it releases the streams
        if parsed.body.stream:
            ids = _wants_event_ids(request, core.settings.sse_event_ids)
            return SSEResponse(core, first, detoks[0], opts, headers, resume, ids)  # it releases the stream
        return await complete(request, core, streams, detoks, opts, headers)  # so does complete
    except BaseException:
        for stream in streams:
            core.release(stream)  # failed before either took them over
        raise


def _wants_event_ids(request: Request, setting: str) -> bool:
    """Whether this stream's events carry `id:` fields (RouterSettings.sse_event_ids)."""
    asked = "text/event-stream" in request.headers.get("accept", "") or LAST_EVENT_ID in request.headers
    return setting == "always" or asked


def _resume_point(request: Request, parsed) -> EventId | None:
    """The client's Last-Event-ID: it continues a stream it had (resume.py). Its seed is the
    run's, so that the run gives the tokens the client has."""
    value = request.headers.get(LAST_EVENT_ID)
    if not value:
        return None
    if parsed.n > 1 or (parsed.tools is not None and parsed.tools.parses):
        raise APIError(
            "Last-Event-ID resumes a stream of one choice without tool parsing (n = 1, no tools)",
            400,
            "invalid_request_error",
        )
    try:
        point = parse_event_id(value)
    except ValueError as e:
        raise APIError(
            f"Last-Event-ID {value!r} is not one of this server's event ids ({e})",
            400,
            "invalid_request_error",
        ) from e
    if parsed.params.seed is not None and parsed.params.seed != point.seed:
        raise APIError(
            "Last-Event-ID does not match this request (another seed)",
            409,
            "invalid_request_error",
            code="resume_mismatch",
        )
    parsed.params.seed = point.seed
    return point
