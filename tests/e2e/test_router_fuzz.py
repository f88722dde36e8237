"""Property-based fuzzing of the router's HTTP API from its own /openapi.json, on a real
system (`pdd up`): schema-conforming and schema-violating requests to every operation.
No request may get a 5xx, every error has OpenAI's error shape, and the system serves
exactly as before afterwards."""

from __future__ import annotations

import copy
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pdd.system import RunningSystem, start_system

CASES = 400
MAX_TOKENS = 48  # per generated completion: the fuzz run stays short
MAX_N = 2  # choices per generated request, likewise


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    sysm = start_system(tmp_path_factory.mktemp("pdd"), {"PDD_ROUTER_TOKEN_TIMEOUT_S": "20"}, delay_ms=1)
    yield sysm
    sysm.stop()


def greedy_tokens(system: RunningSystem) -> list[int]:
    body = {"prompt": [5, 9, 14, 3, 77, 120], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{system.router_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def fuzzable(schema: dict, served: str) -> dict:
    """The router's schema with max_tokens and n bounded and `model` the served name (another name is
    a 404, checked elsewhere; random names would keep most cases from serving). A copy: the
    router's own is unchanged."""
    schema = copy.deepcopy(schema)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [served]}
        max_tokens = schema["components"]["schemas"][name]["properties"]["max_tokens"]
        for option in max_tokens["anyOf"]:
            if option.get("type") == "integer":
                option["maximum"] = MAX_TOKENS
        schema["components"]["schemas"][name]["properties"]["n"]["maximum"] = MAX_N
    return schema


def has_error_shape(response: requests.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def test_generated_requests_never_get_a_5xx(system):
    before = greedy_tokens(system)
    published = httpx.get(f"{system.router_url}/openapi.json", timeout=10).json()
    served = httpx.get(f"{system.router_url}/v1/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(fuzzable(published, served))
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    statuses: list[int] = []
    bad: list[str] = []
    session = requests.Session()

    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        derandomize=True,  # cases seeded from the test, not the clock
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def run(case) -> None:
        response = case.call(base_url=system.router_url, session=session, timeout=60)
        statuses.append(response.status_code)
        if response.status_code >= 500 or (response.status_code >= 400 and not has_error_shape(response)):
            bad.append(
                f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code} {response.text[:200]}"
            )

    run()
    assert len(statuses) >= CASES * 5 // 6
    assert bad == []
    # The fuzzing reached real serving, not only errors: 24 of these 400 fixed cases were served
    # in the last run, 37 to 48 of 600 before (many positive cases are 400s by rules the schema
    # cannot say: content null only on an assistant message with tool_calls, tool_choice only
    # with tools, best_of equal to n). The floor is well under that: it asserts reach, not a figure.
    assert sum(s == 200 for s in statuses) >= CASES // 40, Counter(statuses)
    assert greedy_tokens(system) == before
