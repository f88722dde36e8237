"""End to end against real processes (`pdd up`: two NATS servers joined by a gateway
across the WAN emulator, prefill, relay, main decode, router): every pipeline gives
exactly the single-process engine's tokens."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import time

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, SamplingParams
from shared.model.describe import describe_model
from tests.polling import wait_until

MD_READY_TIMEOUT_S = 5.0
# The `small` preset: its KV (16 KB/token) takes long enough to cross a capped link that the
# relay really runs ahead of MD (the `tiny` model decodes thousands of tokens a second).
PRESET = "small"
SLOW_MBPS = 80.0  # 600 prompt tokens ≈ 9.8 MB ≈ 1 s on the wire, well under MD_READY_TIMEOUT_S
# The relay is paced (the PDD_RELAY_MIN_STEP_S test knob, docs/testing.md): N relayed tokens
# take at least N * RELAY_STEP_S on any host, so whether the relay is still decoding when MD
# takes over (or when MD's deadline passes) is set by the test, not by this host's speed.
# MD, unpaced, decodes what is left once it has taken over.
RELAY_STEP_S = 0.04
RELAYED_TOKENS = 120  # >= 4.8 s on the paced relay: MD takes over (its KV crosses in ~1 s)


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_RELAY_MD_READY_TIMEOUT_S": str(MD_READY_TIMEOUT_S),
        "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "20",
    }
    sysm = start_system(
        tmp_path_factory.mktemp("pdd"), env, delay_ms=10, bandwidth_mbps=1000, model_preset=PRESET
    )
    yield sysm
    sysm.stop()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(ModelSettings(preset=PRESET), EngineSettings(kv_memory_mb=64))


def ref_tokens(engine: LLMEngine, prompt: list[int], **params) -> list[int]:
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(**params))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.rid == rid and o.token_id is not None:
                out.append(o.token_id)
    return out


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 3) % 250 for i in range(n)]


def complete(system: RunningSystem, prompt: list[int], **body) -> httpx.Response:
    payload = {"prompt": prompt, "temperature": 0, **body}
    return httpx.post(f"{system.router_url}/v1/completions", json=payload, timeout=120)


def wait_idle(system: RunningSystem, timeout: float = 20.0) -> dict:
    """Until every service reports zero referenced KV blocks and no running request; the
    instances still busy at the deadline ({} once idle)."""
    busy: dict = {}

    def idle() -> bool:
        busy.clear()
        busy.update(
            {k: v for k, v in system.instances().items() if v["used_blocks"] or v["running"] or v["waiting"]}
        )
        return not busy

    with contextlib.suppress(TimeoutError):
        wait_until(idle, timeout, 0.3)
    return busy


def test_p_md_matches_single_engine(system, reference):
    prompt = prompt_of(70, salt=1)
    r = complete(system, prompt, max_tokens=24, ignore_eos=True, pdd={"pipeline": "p-md"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-pdd-pipeline"] == "p-md"
    assert body["pdd"]["pipeline"] == "p-md" and body["pdd"]["rld_tokens"] == 0
    assert body["pdd"]["md_tokens"] == 23  # prefill sampled the first
    assert body["pdd"]["instances"] == {"prefill": "0", "relay": None, "main_decode": "0"}
    assert body["choices"][0]["token_ids"] == ref_tokens(reference, prompt, max_tokens=24, ignore_eos=True)


def relayed(system, prompt: list[int], catchup_threshold: int):
    """A P→RLD→MD completion of RELAYED_TOKENS over a slow bulk link: the relay decodes while
    the KV crosses (≈ 1 s), and cannot end the request first."""
    with system.shaped("bulk", bandwidth_mbps=SLOW_MBPS):
        r = complete(
            system,
            prompt,
            max_tokens=RELAYED_TOKENS,
            ignore_eos=True,
            pdd={"pipeline": "p-rld-md", "catchup_threshold": catchup_threshold},
        )
    assert r.status_code == 200, r.text
    return r


def test_relay_one_shot_matches(system, reference):
    prompt = prompt_of(600, salt=2)
    r = relayed(system, prompt, catchup_threshold=10_000)
    stats = r.json()["pdd"]
    assert r.headers["x-pdd-pipeline"] == "p-rld-md"
    assert stats["handoff_mode"] == "one-shot"
    assert stats["rld_tokens"] > 0 and stats["md_tokens"] > 0
    assert stats["handoff_batches"] == 1
    assert stats["instances"] == {"prefill": "0", "relay": "0", "main_decode": "0"}
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(
        reference, prompt, max_tokens=RELAYED_TOKENS, ignore_eos=True
    )


def test_relay_catch_up_several_batches_matches(system, reference):
    prompt = prompt_of(600, salt=3)
    r = relayed(system, prompt, catchup_threshold=1)
    stats = r.json()["pdd"]
    assert stats["handoff_mode"] == "catch-up"
    assert stats["pipeline"] == "p-rld-md"
    assert stats["handoff_batches"] >= 2
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(
        reference, prompt, max_tokens=RELAYED_TOKENS, ignore_eos=True
    )


def test_anomalous_short_output_finishes_on_relay_and_md_drops(system, reference):
    # The bulk link is cut, so MD cannot get ready before the relay ends the 6 tokens (on a
    # capped link that would be a race); the relay ends them long before MD's deadline.
    prompt = prompt_of(600, salt=4)
    with system.shaped("bulk", cut=True):
        r = complete(system, prompt, max_tokens=6, ignore_eos=True, pdd={"pipeline": "p-rld-md"})
    assert r.status_code == 200, r.text
    assert r.json()["pdd"]["pipeline"] == "rld-only"
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(reference, prompt, max_tokens=6, ignore_eos=True)
    assert f"request {r.headers['x-request-id']}: MD not ready" not in system.log("relay")  # not the fallback
    assert wait_idle(system) == {}


# The relay must still be decoding when MD's deadline fires: CUT_TOKENS paced steps take at
# least 10 s, twice the deadline, however fast the host.
CUT_TOKENS = 250
assert CUT_TOKENS * RELAY_STEP_S >= 2 * MD_READY_TIMEOUT_S


def assert_wan_cut_falls_back_to_relay(system: RunningSystem, reference: LLMEngine, salt: int) -> None:
    prompt = prompt_of(300, salt=salt)
    with system.shaped("bulk", cut=True):
        r = complete(system, prompt, max_tokens=CUT_TOKENS, ignore_eos=True, pdd={"pipeline": "p-rld-md"})
    assert r.status_code == 200, r.text
    assert r.json()["pdd"]["pipeline"] == "rld-only"
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(
        reference, prompt, max_tokens=CUT_TOKENS, ignore_eos=True
    )
    assert f"request {r.headers['x-request-id']}: MD not ready in time" in system.log(
        "relay"
    )  # the fallback ran
    assert wait_idle(system) == {}


def test_wan_cut_falls_back_to_relay(system, reference):
    assert_wan_cut_falls_back_to_relay(system, reference, salt=5)


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
def test_seeded_sampling_is_identical_across_pipelines(system, reference, pipeline):
    prompt = prompt_of(600, salt=6)
    params = dict(max_tokens=RELAYED_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    bandwidth = SLOW_MBPS if pipeline == "p-rld-md" else 1000.0  # the relay must run ahead
    with system.shaped("bulk", bandwidth_mbps=bandwidth):
        r = complete(system, prompt, **params, pdd={"pipeline": pipeline})
    assert r.status_code == 200, r.text
    assert r.json()["pdd"]["pipeline"] == pipeline
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(reference, prompt, **params)


def test_prefix_held_by_md_is_not_resent(system):
    base = prompt_of(320, salt=7)  # 20 full blocks
    first = complete(system, base, max_tokens=4, pdd={"pipeline": "p-md"})
    assert first.status_code == 200, first.text
    block_bytes_total = first.json()["pdd"]["wan_bytes"]
    assert block_bytes_total > 0
    per_block = block_bytes_total / 20
    second = complete(system, base + prompt_of(64, salt=8), max_tokens=4, pdd={"pipeline": "p-md"})
    assert second.status_code == 200, second.text
    stats = second.json()["pdd"]
    assert stats["wan_bytes"] == 4 * per_block  # only the 4 new full blocks crossed
    assert abs(stats["prefix_hit_rate"] - 320 / 384) < 1e-3


def test_concurrent_streams_complete_in_order(system, reference):
    prompts = [prompt_of(20 + 9 * i, salt=20 + i) for i in range(32)]
    expected = [ref_tokens(reference, p, max_tokens=12, ignore_eos=True) for p in prompts]

    def stream(i: int) -> list[int]:
        toks: list[int] = []
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{system.router_url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            done = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    toks.extend(chunk["choices"][0]["token_ids"])
            assert done
        return toks

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(stream, range(32)))
    assert got == expected


def test_client_disconnect_frees_blocks_everywhere(system):
    body = {
        "prompt": prompt_of(200, salt=9),
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "pdd": {"pipeline": "p-rld-md"},
    }
    with system.shaped("bulk", bandwidth_mbps=SLOW_MBPS / 4):
        with httpx.stream("POST", f"{system.router_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 5:
                    break  # hang up mid-stream
    assert wait_idle(system) == {}


@pytest.mark.parametrize(
    "payload, status, message, param",
    [
        (b"{not json", 400, "request body is not valid JSON", None),
        (b"[1, 2]", 400, "request body must be a JSON object", None),
        (json.dumps({"prompt": "hi", "model": "nope"}).encode(), 404, "model 'nope' does not exist", "model"),
        (
            json.dumps({"prompt": "x" * 5000, "max_tokens": 10}).encode(),
            400,
            "prompt (5000 tokens) plus max_tokens (10) exceeds the context limit",
            "prompt",
        ),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature:", None),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens:", None),
        (json.dumps({"prompt": [1, 2, 999999]}).encode(), 400, "prompt token ids must be in [0, ", "prompt"),
        (json.dumps({"prompt": ""}).encode(), 400, "prompt is empty", "prompt"),
        (json.dumps({"max_tokens": 3}).encode(), 400, "prompt: Field required", None),
        (json.dumps({"prompt": "hi", "pdd": {"pipeline": "rld-only"}}).encode(), 400, "pdd.pipeline:", None),
    ],
)
def test_bad_input_is_a_clear_4xx(system, payload, status, message, param):
    r = httpx.post(
        f"{system.router_url}/v1/completions",
        content=payload,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]  # OpenAI's error shape
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_system_keeps_serving_after_bad_input(system, reference):
    prompt = prompt_of(40, salt=11)
    r = complete(system, prompt, max_tokens=8, ignore_eos=True)
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(reference, prompt, max_tokens=8, ignore_eos=True)


def test_chat_matches_the_single_engine_on_the_chat_layout(system, reference):
    models = httpx.get(f"{system.router_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [reference.model_id]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello €"}]
    r = httpx.post(
        f"{system.router_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": reference.model_id,
            "messages": messages,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    # The chat layout is plain and model-agnostic: each message under its role, then the assistant's turn.
    tokenizer = describe_model(ModelSettings(preset=PRESET)).tokenizer
    prompt = tokenizer.encode("<|system|>\nbe brief\n<|user|>\nhello €\n<|assistant|>\n")
    expected = ref_tokens(reference, prompt, max_tokens=12, ignore_eos=True)
    assert body["object"] == "chat.completion" and body["id"] == r.headers["x-request-id"]
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(expected)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 12,
        "total_tokens": len(prompt) + 12,
    }


def test_bulk_link_dropped_mid_transfer_is_resent_unseen_by_the_client(system, reference):
    prompt = prompt_of(600, salt=12)  # ≈ 9.8 MB of KV: ≈ 4 s on a 20 Mbit/s link
    params = dict(max_tokens=24, ignore_eos=True)
    links = f"{system.wan_url}/links"
    with (
        system.shaped("bulk", bandwidth_mbps=SLOW_MBPS / 4),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        start = httpx.get(links, timeout=10).json()["bulk"]["bytes_up"]
        reply = pool.submit(complete, system, prompt, **params, pdd={"pipeline": "p-md"})

        def underway() -> bool:  # a MiB crossed, and the request still waits for the rest
            assert not reply.done(), "the request ended before its transfer was seen"
            return httpx.get(links, timeout=10).json()["bulk"]["bytes_up"] - start >= 1 << 20

        wait_until(underway, 30, what="the transfer under way")
        try:
            system.wan("bulk", cut=True, cut_mode="drop")  # resets the transfer's connection
            time.sleep(1.0)  # the fault itself: the link stays down this long
        finally:
            system.wan("bulk", cut=False)
        r = reply.result(timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["pdd"]["pipeline"] == "p-md"
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(reference, prompt, **params)
    assert f"kv transfer of {r.headers['x-request-id']}" in system.log("prefill")  # the drop hit it


def ref_logprobs(engine: LLMEngine, prompt: list[int], **params) -> tuple[list[int], list, list]:
    """The single-process engine's tokens, their logprobs and the prompt's (when asked)."""
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(**params))
    toks, lps, prompt_lps = [], [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.rid == rid and o.token_id is not None:
                toks.append(o.token_id)
                lps.append(o.logprobs)
                prompt_lps = o.prompt_logprobs or prompt_lps
    return toks, lps, prompt_lps


def openai_completion(client, prompt: list[int], pipeline: str, *, catchup: int, **kw) -> tuple[dict, dict]:
    """(choice, pdd summary) through the openai client, streamed or not."""
    extra = {"ignore_eos": True, "pdd": {"pipeline": pipeline, "catchup_threshold": catchup}}
    if not kw.get("stream"):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body=extra, **kw)
        return r.choices[0].model_dump(), r.model_extra["pdd"]
    choice: dict = {"text": "", "token_ids": [], "logprobs": {k: [] for k in LEGACY_LOGPROB_KEYS}}
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body=extra, **kw)
    )
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == kw["max_tokens"]
    )  # include_usage
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        choice["text"] += c.text
        choice["token_ids"] += c.model_extra["token_ids"]
        for k in LEGACY_LOGPROB_KEYS:
            choice["logprobs"][k] += getattr(c.logprobs, k) if c.logprobs else []
    return choice, chunks[-2].model_extra["pdd"]


LEGACY_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
MODEL = describe_model(ModelSettings(preset=PRESET)).model_id


@pytest.mark.parametrize(
    "salt, pipeline, expect, catchup, link, kw",
    [
        (60, "p-md", "p-md", 10_000, dict(bandwidth_mbps=1000.0), dict(max_tokens=16, logprobs=5, echo=True)),
        # The relay decodes while the prompt's KV crosses (200 tokens ≈ 3.3 MB: ≈ 0.3 s at 80 Mbit/s)
        # and cannot finish first: 120 paced steps take at least 4.8 s.
        (
            61,
            "p-rld-md",
            "p-rld-md",
            10_000,
            dict(bandwidth_mbps=SLOW_MBPS),
            dict(max_tokens=120, logprobs=3),
        ),
        (
            62,
            "p-rld-md",
            "p-rld-md",
            1,
            dict(bandwidth_mbps=SLOW_MBPS),
            dict(max_tokens=120, logprobs=2, echo=True),
        ),
        (
            63,
            "p-rld-md",
            "rld-only",  # the link is cut: the relay ends the 5 tokens before MD can get ready
            10_000,
            dict(cut=True),
            dict(max_tokens=5, logprobs=4, stream=True, stream_options={"include_usage": True}),
        ),
    ],
)
def test_openai_client_logprobs_match_single_engine(
    system, reference, salt, pipeline, expect, catchup, link, kw
):
    import openai

    from services.router.api.logprobs_format import LogprobsFormatter, prompt_entries

    client = openai.OpenAI(base_url=f"{system.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    prompt = prompt_of(200, salt=salt)
    with system.shaped("bulk", **link):
        choice, pdd = openai_completion(client, prompt, pipeline, catchup=catchup, **kw)
    assert pdd["pipeline"] == expect
    if expect == "p-rld-md":
        assert pdd["handoff_mode"] == ("catch-up" if catchup == 1 else "one-shot") and pdd["rld_tokens"] > 0
    echo, top = kw.get("echo", False), kw["logprobs"]
    toks, lps, prompt_lps = ref_logprobs(
        reference,
        prompt,
        max_tokens=kw["max_tokens"],
        ignore_eos=True,
        logprobs=top,
        prompt_logprobs=top if echo else None,
    )
    assert choice["token_ids"] == toks
    tokenizer = describe_model(ModelSettings(preset=PRESET)).tokenizer
    ids, entries = (prompt + toks, prompt_entries(len(prompt), prompt_lps) + lps) if echo else (toks, lps)
    expected = LogprobsFormatter(tokenizer, chat=False)(ids, entries)
    assert_same_logprobs(choice["logprobs"], expected, first_output=len(prompt) if echo else 0)
    assert choice["text"] == (tokenizer.decode(prompt) if echo else "") + tokenizer.decode(toks)


# Logprobs agree to this, not bit for bit: an instance that takes a request over recomputes the
# prompt's last partial block and the tokens handed to it as one multi-token pass, where the
# single engine computed them as part of the whole prompt and as one-token steps; CPU fp32 GEMM
# is not batch-invariant (the same row differs in its last bits with the number of rows), so
# values of magnitude ~20 move by up to ~10 fp32 ulps. Tokens, prompt logprobs and the first
# token's are exact.
LOGPROB_TOL = dict(rel_tol=0.0, abs_tol=1e-4)


def assert_same_logprobs(got: dict, expected: dict, first_output: int) -> None:
    """Same tokens and offsets; logprobs within LOGPROB_TOL (else where and by how much)."""
    assert (got["tokens"], got["text_offset"]) == (expected["tokens"], expected["text_offset"])
    bad = []
    for i, (g, e) in enumerate(zip(got["token_logprobs"], expected["token_logprobs"], strict=True)):
        g_top, e_top = got["top_logprobs"][i] or {}, expected["top_logprobs"][i] or {}
        pairs = [(g, e)] + [(g_top.get(k), v) for k, v in e_top.items()]
        if g_top.keys() != e_top.keys() or not all(
            a == b or (a is not None and b is not None and math.isclose(a, b, **LOGPROB_TOL))
            for a, b in pairs
        ):
            bad.append((i - first_output, pairs[0]))
    assert not bad, f"logprobs differ at output positions (negative: prompt) {bad[:5]} ({len(bad)} in all)"


def test_openai_client_chat_stream_logprobs(system):
    import openai

    client = openai.OpenAI(base_url=f"{system.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=3,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    entries = [
        e for c in chunks[:-1] for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])
    ]
    assert len(entries) == 6
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0] <= 0
        assert e.bytes == list(e.token.encode())


# vLLM's sampling fields together: each is history-dependent (penalties over the prompt and the
# output) or position-dependent (min_tokens), so an instance that takes a request over by its
# token IDs must process its logits as the single engine did.
PROCESSED = dict(
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    min_p=0.05,
    top_k=-1,
    min_tokens=30,
)


@pytest.mark.parametrize(
    "salt, pipeline, catchup, bandwidth, sampled",
    [
        (70, "p-md", 10_000, 1000.0, False),
        (71, "p-rld-md", 10_000, SLOW_MBPS, False),  # one-shot
        (72, "p-rld-md", 1, SLOW_MBPS, True),  # catch-up, seeded
        (73, "p-rld-md", 10_000, SLOW_MBPS, True),  # one-shot, seeded
    ],
)
def test_penalties_bias_and_min_p_are_exact_across_handoffs(
    system, reference, salt, pipeline, catchup, bandwidth, sampled
):
    prompt = prompt_of(200, salt=salt)
    params = dict(PROCESSED, max_tokens=120, ignore_eos=True)
    params |= dict(temperature=0.8, seed=99) if sampled else dict(temperature=0)
    want = ref_tokens(reference, prompt, **params, logit_bias={prompt[5]: 3.0, 17: -50.0})
    with system.shaped("bulk", bandwidth_mbps=bandwidth):
        r = complete(
            system,
            prompt,
            **params,
            logit_bias={str(prompt[5]): 3.0, "17": -50.0},
            pdd={"pipeline": pipeline, "catchup_threshold": catchup},
        )
    assert r.status_code == 200, r.text
    pdd = r.json()["pdd"]
    assert pdd["pipeline"] == pipeline
    if pipeline == "p-rld-md":
        assert pdd["rld_tokens"] > 0 and pdd["handoff_mode"] == ("catch-up" if catchup == 1 else "one-shot")
    assert r.json()["choices"][0]["token_ids"] == want
    assert want != ref_tokens(
        reference,
        prompt,
        max_tokens=120,
        ignore_eos=True,
        **(dict(temperature=0.8, seed=99) if sampled else {}),
    )  # the fields changed the output


def test_min_tokens_and_stop_token_ids_across_a_handoff(system, reference):
    prompt = prompt_of(200, salt=74)
    plain = ref_tokens(reference, prompt, max_tokens=120, ignore_eos=True)
    stop = plain[3]  # a token the output has early: min_tokens keeps it off until 40 tokens
    params = dict(max_tokens=120, stop_token_ids=[stop], min_tokens=40)
    want = ref_tokens(reference, prompt, **params)
    assert len(want) > 40 and stop not in want[:40]
    with system.shaped("bulk", bandwidth_mbps=SLOW_MBPS):
        r = complete(system, prompt, **params, pdd={"pipeline": "p-rld-md"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == (
        "stop" if want[-1] == stop else "length"
    )


# An output long enough (about 150 tokens of the byte tokenizer) that the handoff lands inside it.
NUMBERS = {
    "type": "object",
    "properties": {
        "numbers": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["numbers"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "salt, pipeline, catchup, bandwidth",
    [
        (80, "p-md", 10_000, 1000.0),
        (81, "p-rld-md", 10_000, SLOW_MBPS),  # one-shot
        (82, "p-rld-md", 1, SLOW_MBPS),  # catch-up
    ],
)
def test_structured_output_valid_and_exact_when_the_grammar_crosses_a_handoff(
    system, reference, salt, pipeline, catchup, bandwidth
):
    import jsonschema_rs

    prompt = prompt_of(600, salt=salt)
    constraint = {"json": NUMBERS, "disable_any_whitespace": True}
    structured = {"kind": "json", "spec": NUMBERS, "disable_any_whitespace": True}
    want = ref_tokens(reference, prompt, max_tokens=400, structured=structured)
    with system.shaped("bulk", bandwidth_mbps=bandwidth):
        r = complete(
            system,
            prompt,
            max_tokens=400,
            structured_outputs=constraint,
            pdd={"pipeline": pipeline, "catchup_threshold": catchup},
        )
    assert r.status_code == 200, r.text
    body = r.json()
    if pipeline == "p-rld-md":  # the relay's matcher state was rebuilt on MD from its tokens
        assert body["pdd"]["pipeline"] == "p-rld-md" and body["pdd"]["rld_tokens"] > 0
        assert body["pdd"]["md_tokens"] > 0
    choice = body["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "stop"
    jsonschema_rs.validate(NUMBERS, json.loads(choice["text"]))
