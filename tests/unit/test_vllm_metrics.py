"""vLLM's metric names beside pdd's: what a scrape shows after an engine's stats and a
request's life (the same names, labels and buckets as vLLM v1's PrometheusStatLogger)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import REGISTRY

from pdd.top import parse_metrics
from services.router.adapter.request_metrics import finished
from services.router.core.request_stream import RequestStream
from services.router.routing.policy import RouteDecision
from shared.bus.messages import Pipeline
from shared.config import ModelSettings
from shared.engine import SamplingParams
from shared.engine.outputs import EngineStats
from shared.model.source import DEFAULT_SERVED_NAME, served_name
from shared.telemetry.metrics import metrics_text
from shared.telemetry.vllm_metrics import EngineMetrics, FinishedRequest, RequestMetrics

STATS = EngineStats(
    num_blocks=200,
    free_blocks=150,
    used_blocks=50,
    cached_blocks=10,
    running=3,
    waiting=2,
    held=0,
    prefilled=0,
    pinned_blocks=0,
    preemptions=1,
    kv_bytes_per_token=64,
    computed_tokens=900,
    prefix_hit_tokens=256,
    prefix_query_tokens=1000,
    pending_tokens=0,
)


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_engine_figures_are_gauges_and_counters_that_grow_by_the_engines_own_counts() -> None:
    labels = {"model_name": "m-engine", "engine": "p0"}
    figures = EngineMetrics("m-engine", "p0")
    figures.update(STATS)
    assert _value("vllm:num_requests_running", **labels) == 3
    assert _value("vllm:num_requests_waiting", **labels) == 2
    assert _value("vllm:kv_cache_usage_perc", **labels) == 0.25
    assert _value("vllm:gpu_cache_usage_perc", **labels) == 0.25  # vLLM's older name
    assert _value("vllm:prefix_cache_queries_total", **labels) == 1000
    assert _value("vllm:prefix_cache_hits_total", **labels) == 256
    assert _value("vllm:num_preemptions_total", **labels) == 1
    later = dataclasses.replace(
        STATS, running=0, used_blocks=0, prefix_query_tokens=1500, prefix_hit_tokens=300
    )
    figures.update(later)
    figures.update(later)  # nothing new: the counters stay
    assert _value("vllm:num_requests_running", **labels) == 0
    assert _value("vllm:kv_cache_usage_perc", **labels) == 0
    assert _value("vllm:prefix_cache_queries_total", **labels) == 1500
    assert _value("vllm:prefix_cache_hits_total", **labels) == 300


def test_request_figures_count_by_finish_reason_with_vllms_buckets() -> None:
    labels = {"model_name": "m-router", "engine": "r0"}
    req = RequestMetrics("m-router", "r0")
    # every finish reason is a series before any request ends (rate() over it has data)
    for reason in ("stop", "length", "abort", "error"):
        assert _value("vllm:request_success_total", **labels, finished_reason=reason) == 0
    req.admitted(0.0, n=2, max_tokens=3)
    req.first_token(0.03)
    req.next_tokens(0.02)
    req.next_tokens(0.06)
    req.time_per_output_token(0.04)
    req.finished(FinishedRequest("length", 7, 3, 3, prefill_s=0.03, decode_s=0.08, e2e_s=0.2))
    req.finished(FinishedRequest("no-such-reason", 7, 0, 3, prefill_s=0.1, decode_s=0.0, e2e_s=0.1))
    assert _value("vllm:request_success_total", **labels, finished_reason="length") == 1
    assert _value("vllm:request_success_total", **labels, finished_reason="error") == 1
    assert _value("vllm:prompt_tokens_total", **labels) == 14
    assert _value("vllm:generation_tokens_total", **labels) == 3
    assert _value("vllm:time_to_first_token_seconds_bucket", **labels, le="0.04") == 1
    assert _value("vllm:time_to_first_token_seconds_bucket", **labels, le="0.02") == 0
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert _value(f"{name}_count", **labels) == 2
        assert _value(f"{name}_bucket", **labels, le="0.025") == 1
    assert _value("vllm:request_time_per_output_token_seconds_count", **labels) == 1
    assert _value("vllm:e2e_request_latency_seconds_bucket", **labels, le="0.3") == 2
    assert _value("vllm:request_queue_time_seconds_count", **labels) == 2  # one per choice
    assert _value("vllm:request_params_n_bucket", **labels, le="2.0") == 1
    assert _value("vllm:request_params_n_bucket", **labels, le="1.0") == 0
    assert _value("vllm:request_max_num_generation_tokens_count", **labels) == 1
    assert _value("vllm:request_params_max_tokens_count", **labels) == 2
    # token counts in vLLM's 1-2-5 buckets
    assert _value("vllm:request_prompt_tokens_bucket", **labels, le="5.0") == 0
    assert _value("vllm:request_prompt_tokens_bucket", **labels, le="10.0") == 2
    assert _value("vllm:request_generation_tokens_bucket", **labels, le="2.0") == 1
    assert _value("vllm:request_generation_tokens_bucket", **labels, le="5.0") == 2
    assert _value("vllm:request_inference_time_seconds_sum", **labels) == pytest.approx(0.21)
    assert _value("vllm:request_decode_time_seconds_sum", **labels) == pytest.approx(0.08)
    # the exposition carries the ':' names, and pdd top's parser reads them back
    samples = parse_metrics(metrics_text()[0].decode())
    assert samples[("vllm:generation_tokens_total", frozenset(labels.items()))] == 3


def test_a_finished_choice_in_vllms_phases() -> None:
    params = SamplingParams(max_tokens=5)
    stream = RequestStream("r", [1, 2, 3], RouteDecision(Pipeline.P_MD, 0.0, 0, 0.0), "0", params=params)
    stream.created, stream.queued_s = 100.0, 0.5
    got = finished(stream, "abort", now=100.2)  # no token yet: all of it was prefill
    assert (got.prompt_tokens, got.generation_tokens, got.max_tokens) == (3, 0, 5)
    assert (got.prefill_s, got.decode_s, got.e2e_s) == pytest.approx((0.2, 0.0, 0.7))
    stream.first_token_at = 100.3
    got = finished(stream, "length", now=101.0)
    assert (got.prefill_s, got.decode_s, got.e2e_s) == pytest.approx((0.3, 0.7, 1.5))


def test_served_name_is_what_the_api_lists() -> None:
    assert served_name(ModelSettings(), "weights-id") == DEFAULT_SERVED_NAME
    assert served_name(ModelSettings(preset="tiny"), "tiny-s0") == "tiny-s0"
    assert served_name(ModelSettings(path="/models/x"), "w") == "/models/x"
    assert served_name(ModelSettings(preset="tiny", served_model_name="chat"), "tiny-s0") == "chat"
