"""The router's HTTP front door on a real system (`pdd up`) started with API keys and a
small admission limit: keys, 429 under overload, bounded body reading, bad input turned
into OpenAI-style 4xx errors, and the OpenAPI schema's request and response bodies."""

from __future__ import annotations

import json
import select
import socket

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from services.router.api.response_schemas import ChatCompletionResponse, CompletionResponse

KEYS = ("key-a", "key-b")  # key-b comes from PDD_API_KEY
AUTH = {"authorization": f"Bearer {KEYS[0]}"}
MAX_IN_FLIGHT, MAX_WAITING = 2, 2
BODY_TIMEOUT_S = 4
MAX_BODY = 8 << 20  # the default
PROMPT = [7, 31, 4, 99, 12, 250, 3]


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_ROUTER_API_KEYS": KEYS[0],
        "PDD_API_KEY": KEYS[1],
        "PDD_ROUTER_MAX_IN_FLIGHT": str(MAX_IN_FLIGHT),
        "PDD_ROUTER_MAX_WAITING": str(MAX_WAITING),
        "PDD_ROUTER_MAX_WAIT_S": "120",
        "PDD_ROUTER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "20",
    }
    sysm = start_system(tmp_path_factory.mktemp("pdd"), env, delay_ms=1)
    yield sysm
    sysm.stop()


def post(system: RunningSystem, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(f"{system.router_url}{path}", content=content, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # OpenAI's error shape
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == type_
    return err


# ---- raw HTTP/1.1, for bodies that arrive late, partly or never ------------------------------
def connect(system: RunningSystem) -> socket.socket:
    host, port = system.router_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: router", "content-type: application/json", "connection: close"]
    lines += [f"{k}: {v}" for k, v in {**AUTH, **headers}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed, as the router's JSON answers are)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def chunked(data: bytes, size: int) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size]) for i in range(0, len(data), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


# ---- API keys ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/instances"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/nowhere"),
    ],
)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {KEYS[0]}", KEYS[0], f"Bearer {KEYS[0]}x"]
)
def test_every_endpoint_but_health_needs_a_key(system, method, path, authorization):
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.request(
        method, f"{system.router_url}{path}", headers=headers, json={"prompt": "hi"}, timeout=30
    )
    assert assert_error(r, 401)["code"] == "invalid_api_key"


def test_health_is_open_and_either_key_is_accepted(system):
    assert httpx.get(f"{system.router_url}/health", timeout=10).status_code == 200
    for key in KEYS:
        r = post(
            system, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, {"authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200, r.text
    assert httpx.get(f"{system.router_url}/v1/models", headers=AUTH, timeout=10).status_code == 200


# ---- admission control --------------------------------------------------------------------------
def test_overload_is_a_429_and_every_admitted_request_completes(system):
    """Requests whose bodies are still on the way hold their slots: two run, two wait, and
    the fifth is turned away; once the bodies arrive, all four admitted ones are served."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).encode()
    expected = post(system, "/v1/completions", body).json()["choices"][0]["token_ids"]
    socks = [connect(system) for _ in range(MAX_IN_FLIGHT + MAX_WAITING + 1)]
    try:
        for sock in socks:
            sock.sendall(request_head("/v1/completions", {"content-length": str(len(body))}) + body[:10])
        answered, _, _ = select.select(socks, [], [], 30)
        assert len(answered) == 1, "exactly one request is beyond the limits"
        status, headers, raw = read_response(answered[0])
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
        admitted = [s for s in socks if s is not answered[0]]
        for sock in admitted:
            sock.sendall(body[10:])
        for sock in admitted:
            status, _, raw = read_response(sock)
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["token_ids"] == expected
    finally:
        for sock in socks:
            sock.close()


# ---- the request body ---------------------------------------------------------------------------
def test_content_length_over_the_limit_is_413_before_the_body_is_read(system):
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {"content-length": str(MAX_BODY + 1)}))  # and no body
        status, _, raw = read_response(sock)  # had the router waited for the body, this would be a 408
    assert status == 413 and "over 8388608 bytes" in json.loads(raw)["error"]["message"]


def test_chunked_body_is_capped_as_it_arrives(system):
    big = b'{"prompt": "' + b"x" * MAX_BODY + b'"}'
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {"transfer-encoding": "chunked"}))
        try:
            sock.sendall(chunked(big, 1 << 16))
        except OSError:
            pass  # the router answered and closed while the rest was still on its way
        status, _, raw = read_response(sock)
    assert status == 413, raw


def test_chunked_body_within_the_limit_is_served(system):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3}).encode()
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {"transfer-encoding": "chunked"}) + chunked(body, 5))
        status, _, raw = read_response(sock)
    assert status == 200, raw
    assert len(json.loads(raw)["choices"][0]["token_ids"]) == 3


def test_a_body_without_length_is_411(system):
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {}))
        status, _, raw = read_response(sock)
    assert status == 411 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_a_body_that_stops_arriving_is_408(system):
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {"content-length": "100"}) + b'{"prompt": ')
        status, _, raw = read_response(sock)  # after the router's body timeout
    assert status == 408 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_a_body_that_trickles_in_is_408_at_the_whole_body_deadline(system):
    """Every byte comes well within the deadline, the body as a whole does not: the router
    answers 408 while the client is still sending."""
    trickle_s = 0.5
    with connect(system) as sock:
        sock.sendall(request_head("/v1/completions", {"content-length": "1000"}) + b'{"prompt": "')
        for _ in range(int(6 * BODY_TIMEOUT_S / trickle_s)):  # the body would need 500 s
            answered, _, _ = select.select([sock], [], [], trickle_s)
            if answered:
                break
            sock.sendall(b"x")
        assert answered, "no answer while the body was still arriving"
        status, _, raw = read_response(sock)
    assert status == 408 and "did not arrive within" in json.loads(raw)["error"]["message"]


# ---- bad input: a 4xx naming the problem, never a 5xx -------------------------------------------
def completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 3, **fields}).encode()


CHAT = '{"messages": [{"role": "user", "content": %s}], "max_tokens": 3}'


@pytest.mark.parametrize(
    "path, payload, message",
    [
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 3}', "not valid JSON"),
        ("/v1/completions", b'{"prompt": ["a\\udfffb"], "max_tokens": 3}', "not valid JSON"),
        ("/v1/chat/completions", (CHAT % '"\\ud800"').encode(), "not valid JSON"),
        ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', "not valid JSON"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"]}', "not valid JSON"),
        ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', "not valid JSON"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "not valid JSON"),
        ("/v1/completions", b'{"prompt": ' * 50_000, "not valid JSON"),
        ("/v1/completions", b'{"prompt": "\xff"}', "not valid JSON"),
        ("/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), "stop must be up to 4"),
        ("/v1/completions", completion(stop="x" * 257), "at most 256 characters"),
        ("/v1/completions", completion(top_k=10**30), "top_k:"),
        ("/v1/completions", completion(seed=2**64), "seed:"),
        ("/v1/completions", completion(pdd={"catchup_threshold": 10**30}), "pdd.catchup_threshold:"),
        ("/v1/chat/completions", (CHAT % "[1]").encode(), "messages.0.content:"),
    ],
)
def test_bad_input_is_a_400_not_a_500(system, path, payload, message):
    err = assert_error(post(system, path, payload), 400)
    assert message in err["message"]


UNSUPPORTED = [
    ("best_of", 3),  # (n is 1)
    ("suffix", "tail"),
    ("use_beam_search", True),
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("chat_template", "{{ messages }}"),
    ("no_such_field", 1),
    ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}),
    ("response_format", {"type": "structural_tag"}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", UNSUPPORTED)
def test_an_unimplemented_openai_field_is_a_400_naming_it(system, path, field, value):
    base = (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    err = assert_error(post(system, path, {**base, "max_tokens": 3, field: value}), 400)
    assert err["param"] == field and err["code"] == "unsupported_parameter" and f"'{field}'" in err["message"]


@pytest.mark.parametrize(
    "field, value",
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required")],
)
def test_tools_are_chats_only(system, field, value):
    err = assert_error(post(system, "/v1/completions", {"prompt": "hi", "max_tokens": 3, field: value}), 400)
    assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_unimplemented_fields_at_their_neutral_values_are_fine(system):
    neutral = {
        "logprobs": None,
        "top_logprobs": 0,
        "echo": False,
        "best_of": 1,
        "n": 1,
        "logit_bias": {},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0,
        "min_tokens": 0,
        "top_k": -1,
        "stop_token_ids": [],
        "skip_special_tokens": True,
        "user": "someone",
        "suffix": None,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    plain = post(system, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    r = post(system, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **neutral})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


# ---- the OpenAPI schema ---------------------------------------------------------------------------
def resolve(spec: dict, ref: str) -> dict:
    node = spec
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


@pytest.mark.parametrize(
    "path, request_model, response_model",
    [
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ],
)
def test_openapi_declares_the_request_and_response_bodies(system, path, request_model, response_model):
    spec = httpx.get(f"{system.router_url}/openapi.json", headers=AUTH, timeout=10).json()
    op = spec["paths"][path]["post"]
    request_ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert request_ref.endswith("/" + request_model) and op["requestBody"]["required"]
    request = resolve(spec, request_ref)
    assert {"max_tokens", "temperature", "stop", "stream"} <= set(request["properties"])
    assert ("prompt" if request_model == "CompletionRequest" else "messages") in request["required"]
    ok = op["responses"]["200"]["content"]
    assert (
        ok["application/json"]["schema"]["$ref"].endswith("/" + response_model) and "text/event-stream" in ok
    )
    assert op["responses"]["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    refs = set(_refs(spec))
    assert refs and all(resolve(spec, ref) for ref in refs)  # every reference resolves


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_real_responses_match_the_declared_models(system):
    r = post(system, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    assert r.status_code == 200, r.text
    CompletionResponse.model_validate(r.json())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    r = post(system, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    ChatCompletionResponse.model_validate(r.json())


# ---- n > 1 and tools (the system serves the tiny random-weights preset) ----------------------
def stream_events(system: RunningSystem, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{system.router_url}{path}", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in e for e in events), events
    return events


def test_n_choices_are_the_requests_with_seed_plus_i(system):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 1234}
    r = post(system, "/v1/completions", {**body, "n": 2})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1]
    alone = [post(system, "/v1/completions", {**body, "seed": 1234 + i}).json()["choices"][0] for i in (0, 1)]
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in alone]
    assert alone[0]["token_ids"] != alone[1]["token_ids"]  # (the seeds differ: so do the samples)
    assert got["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 16,
        "total_tokens": len(PROMPT) + 16,
    }
    assert len(got["pdd"]["choices"]) == 2
    CompletionResponse.model_validate(got)


def test_greedy_n_streams_identical_choices_by_index(system):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = post(system, "/v1/chat/completions", {**body, "n": 2}).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert texts[0] == texts[1] and len(texts) == 2
    events = stream_events(system, "/v1/chat/completions", {**body, "n": 2, "best_of": 2})
    streamed = ["", ""]
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts
    assert events[-1]["usage"]["completion_tokens"] == 12


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_required_tool_choice_returns_a_valid_call_whole_and_streamed(system):
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [TOOL],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 7,
    }
    r = post(system, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Oslo") and args["unit"] in ("c", "f")
    ChatCompletionResponse.model_validate(r.json())
    # The same request streamed, read by OpenAI's own client and its stream accumulator: the
    # call's deltas (a first with id, type and name, then argument fragments) make the same call.
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = openai.OpenAI(base_url=f"{system.router_url}/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    state, fields = ChatCompletionStreamState(), {k: v for k, v in body.items() if k != "seed"}
    for chunk in client.chat.completions.create(model=None, stream=True, seed=7, **fields):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    (streamed_call,) = streamed.message.tool_calls
    assert streamed.finish_reason == "tool_calls" and streamed_call.function.name == "get_weather"
    assert json.loads(streamed_call.function.arguments) == args and streamed_call.id.startswith(
        "chatcmpl-tool-"
    )


def test_n_children_after_the_first_reuse_its_prompt_kv(system):
    prompt = [(7 * k) % 250 + 3 for k in range(96)]  # six full blocks
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True, "n": 3}
    r = post(system, "/v1/completions", body)
    assert r.status_code == 200, r.text
    first, *others = r.json()["pdd"]["choices"]
    assert first["wan_bytes"] > 0 and len(others) == 2
    for child in others:  # routed as hits on the first child's MD: nothing more crosses the WAN
        assert child["prefix_hit_rate"] == 1.0 and child["pipeline"] == "p-md"
        assert (
            child["wan_bytes"] == 0 and child["instances"]["main_decode"] == first["instances"]["main_decode"]
        )
