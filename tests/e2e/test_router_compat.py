"""What clients written for vLLM and OpenAI rely on, on a real `pdd up` serving an exported
checkpoint (save_hf with the byte tokenizer's files) over an uncapped WAN (--bandwidth-mbps 0):
max_completion_tokens, /v1/models in vLLM's shape, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from services.router.api.openai_request import chat_prompt
from services.router.api.schemas import ChatMessage
from shared.engine import LLMEngine, SamplingParams
from shared.model.export_hf import save_hf
from tests.engine_util import make_engine

KEY = "compat-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = [7, 31, 4, 99, 12, 250, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    engine = make_engine()
    return save_hf(engine.model, tmp_path_factory.mktemp("ckpt") / "tiny-hf", byte_tokenizer=True), engine


@pytest.fixture(scope="module")
def system(tmp_path_factory, checkpoint) -> RunningSystem:
    path, _ = checkpoint
    sysm = start_system(
        tmp_path_factory.mktemp("pdd"), bandwidth_mbps=0, delay_ms=1, model_path=str(path), api_keys=(KEY,)
    )
    yield sysm
    sysm.stop()


def post(system: RunningSystem, path: str, body: dict | bytes) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{system.router_url}{path}", headers=AUTH, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    return err


def greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("ref", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    engine.release("ref")
    return out


def test_the_checkpoint_is_served_over_an_uncapped_wan_with_the_engines_greedy_tokens(system, checkpoint):
    _, engine = checkpoint
    r = post(
        system, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy(engine, PROMPT, 12)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_max_completion_tokens_limits_the_output(system, path):
    body = {"max_completion_tokens": 5, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": PROMPT}
    r = post(system, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def test_max_tokens_and_max_completion_tokens_agree_or_are_a_400(system):
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    r = post(system, "/v1/chat/completions", chat | {"max_tokens": 3, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    err = assert_error(
        post(system, "/v1/chat/completions", chat | {"max_tokens": 3, "max_completion_tokens": 4}),
        400,
        "max_completion_tokens",
    )
    assert "max_tokens" in err["message"] and "differ" in err["message"]
    assert_error(post(system, "/v1/chat/completions", chat | {"max_completion_tokens": 0}), 400)


def test_models_are_listed_in_vllms_shape(system, checkpoint):
    path, _ = checkpoint
    r = httpx.get(f"{system.router_url}/v1/models", headers=AUTH, timeout=10)
    (card,) = r.json()["data"]
    assert card["root"] == str(path) and card["max_model_len"] > 0 and card["object"] == "model"
    assert card["id"] == str(path)  # the served name: by default the model path as given


def test_tokenize_a_prompt_and_messages_as_completions_would_run_them(system):
    text = "héllo, wörld ✓"
    r = post(system, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (
        body["tokens"] == list(text.encode())
        and body["count"] == len(body["tokens"])
        and body["max_model_len"] > 0
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    r = post(system, "/tokenize", {"messages": messages})
    layout = chat_prompt([ChatMessage.model_validate(m) for m in messages])  # what the template writes
    assert r.json()["tokens"] == list(layout.encode())


def test_detokenize_gives_back_the_text(system):
    text = "naïve café 日本"
    r = post(system, "/detokenize", {"tokens": list(text.encode())})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, None),  # neither prompt nor messages
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/tokenize", b"{not json", 400, None),
        ("/tokenize", b"[1, 2]", 400, None),
        ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, None),
        ("/detokenize", {}, 400, None),
    ],
)
def test_bad_tokenize_requests_are_clear_4xx(system, path, body, status, param):
    err = assert_error(post(system, path, body), status, param)
    if status == 404:
        assert err["code"] == "model_not_found"


def test_tokenize_needs_the_key(system):
    r = httpx.post(f"{system.router_url}/tokenize", json={"prompt": "a"}, timeout=10)
    assert r.status_code == 401


def _events(system: RunningSystem, headers: dict) -> list[str]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{system.router_url}/v1/completions", json=body, headers={**AUTH, **headers}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        return [e for e in r.read().decode().split("\n\n") if e.strip()]


def test_a_plain_stream_is_data_lines_only_and_an_event_stream_client_gets_ids(system):
    """vLLM's and SGLang's benchmark clients strip `data: ` off each event and parse the rest
    as JSON: an `id:` line breaks them. A client asking for an event stream gets the ids."""
    plain = _events(system, {})
    assert plain[-1] == "data: [DONE]" and len(plain) >= 3
    assert all(e.startswith("data: ") and "\n" not in e for e in plain)
    with_ids = _events(system, {"accept": "text/event-stream"})
    assert with_ids[-1] == "data: [DONE]" and len(with_ids) == len(plain)
    assert all(e.startswith("id: ") and e.split("\n")[1].startswith("data: ") for e in with_ids[:-1])
