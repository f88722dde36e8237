"""vLLM's metrics (the names, labels and buckets of vLLM v1's PrometheusStatLogger), beside
pdd's own `pdd_*` ones, so that dashboards and alerts written for vLLM work on pdd unchanged.

Labels as vLLM's: `model_name` (the served model name, what /v1/models lists) and `engine`
(here the pdd instance id). Who exports what (docs/operating.md has the table):
- every engine service (prefill, relay, main decode) its scheduler and cache figures,
  `EngineMetrics.update` from each heartbeat's EngineStats;
- the router the request-level ones, as the client sees them (`RequestMetrics`): a request
  passes through several engines, but only the router knows its whole latency and outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:  # (the engine's package imports torch: this module does not need it)
    from shared.engine.outputs import EngineStats

LABELS = ("model_name", "engine")
# vLLM's FinishReason strings: every one is a series from the start (0 until it happens).
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's token-count buckets are 1, 2, 5, 10, ... up to the model's context length; these go on
# to 10^6 for any model (the same boundaries below the context length, none ever filled above).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# ---- engine services ---------------------------------------------------------------------
RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", LABELS)
WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS)
KV_CACHE_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS)
GPU_CACHE_USAGE = Gauge(  # vLLM's older name of the same figure (deprecated there in 0.9), on any device
    "vllm:gpu_cache_usage_perc",
    "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
    LABELS,
)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", LABELS
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS
)
PREEMPTIONS = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS)

# ---- the router ----------------------------------------------------------------------------
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS)
REQUEST_SUCCESS = Counter(
    "vllm:request_success", "Count of successfully processed requests.", (*LABELS, "finished_reason")
)
TTFT = Histogram(
    "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
    buckets=TTFT_BUCKETS,
)  # fmt: skip
ITL = Histogram(
    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
    buckets=ITL_BUCKETS,
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN = Histogram(  # vLLM's older name of the same figure (deprecated there in 0.11)
    "vllm:time_per_output_token_seconds",
    "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
    LABELS,
    buckets=ITL_BUCKETS,
)
REQUEST_TPOT = Histogram(
    "vllm:request_time_per_output_token_seconds",
    "Histogram of time_per_output_token_seconds per request.",
    LABELS,
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
REQUEST_PROMPT_TOKENS = Histogram(
    "vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS, buckets=TOKEN_COUNT_BUCKETS
)
REQUEST_GENERATION_TOKENS = Histogram(
    "vllm:request_generation_tokens", "Number of generation tokens processed.", LABELS,
    buckets=TOKEN_COUNT_BUCKETS,
)  # fmt: skip
REQUEST_MAX_NUM_GENERATION_TOKENS = Histogram(
    "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
    LABELS, buckets=TOKEN_COUNT_BUCKETS,
)  # fmt: skip
REQUEST_PARAMS_N = Histogram(
    "vllm:request_params_n", "Histogram of the n request parameter.", LABELS, buckets=(1, 2, 5, 10, 20)
)
REQUEST_PARAMS_MAX_TOKENS = Histogram(
    "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", LABELS,
    buckets=TOKEN_COUNT_BUCKETS,
)  # fmt: skip
PREFILL_TIME = Histogram(
    "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
DECODE_TIME = Histogram(
    "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
INFERENCE_TIME = Histogram(
    "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
QUEUE_TIME = Histogram(
    "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip


def kv_cache_usage(stats: EngineStats) -> float:
    """The fraction of the KV pool's blocks in use (0..1), as vLLM's kv_cache_usage_perc."""
    return stats.used_blocks / stats.num_blocks if stats.num_blocks else 0.0


class EngineMetrics:
    """One engine's scheduler and cache figures under vLLM's names. The engine's counts are
    cumulative since it started; each update adds what they grew by since the last."""

    def __init__(self, model_name: str, engine: str) -> None:
        labels = (model_name, engine)
        self.running, self.waiting = RUNNING.labels(*labels), WAITING.labels(*labels)
        self.kv_usage = (KV_CACHE_USAGE.labels(*labels), GPU_CACHE_USAGE.labels(*labels))
        self.queries, self.hits = PREFIX_CACHE_QUERIES.labels(*labels), PREFIX_CACHE_HITS.labels(*labels)
        self.preemptions = PREEMPTIONS.labels(*labels)
        self._seen = (0, 0, 0)  # (queried tokens, hit tokens, preemptions) counted so far

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        for gauge in self.kv_usage:
            gauge.set(kv_cache_usage(stats))
        now = (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.preemptions)
        for counter, new, old in zip(
            (self.queries, self.hits, self.preemptions), now, self._seen, strict=True
        ):
            counter.inc(max(0, new - old))
        self._seen = now


@dataclass(frozen=True)
class FinishedRequest:
    """What the router knows of a request (one choice of it) when it ends."""

    reason: str  # one of FINISH_REASONS (anything else is counted as "error")
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int | None  # its max_tokens parameter
    prefill_s: float  # from dispatch to its first token (or to its end, without one)
    decode_s: float  # from its first token to its end (0 without one)
    e2e_s: float  # from arrival to its end, the wait for admission included


class RequestMetrics:
    """The request-level figures under vLLM's names, observed where the router sees them."""

    def __init__(self, model_name: str, engine: str) -> None:
        labels = (model_name, engine)
        self.success = {r: REQUEST_SUCCESS.labels(*labels, r) for r in FINISH_REASONS}
        self.prompt_tokens, self.generation_tokens = (
            PROMPT_TOKENS.labels(*labels),
            GENERATION_TOKENS.labels(*labels),
        )
        self.ttft, self.tpot, self.e2e = (
            TTFT.labels(*labels),
            REQUEST_TPOT.labels(*labels),
            E2E.labels(*labels),
        )
        self.itl = (ITL.labels(*labels), TIME_PER_OUTPUT_TOKEN.labels(*labels))
        self.queue = QUEUE_TIME.labels(*labels)
        self.prefill, self.decode = PREFILL_TIME.labels(*labels), DECODE_TIME.labels(*labels)
        self.inference = INFERENCE_TIME.labels(*labels)
        self.prompt_lengths = REQUEST_PROMPT_TOKENS.labels(*labels)
        self.generation_lengths = REQUEST_GENERATION_TOKENS.labels(*labels)
        self.max_generation = REQUEST_MAX_NUM_GENERATION_TOKENS.labels(*labels)
        self.n, self.max_tokens = REQUEST_PARAMS_N.labels(*labels), REQUEST_PARAMS_MAX_TOKENS.labels(*labels)

    def admitted(self, wait_s: float, n: int, max_tokens: int) -> None:
        """A request (of `n` choices, each of at most `max_tokens`) got its slot after waiting
        `wait_s` in the router's admission queue; each choice is one of vLLM's requests."""
        for _ in range(n):
            self.queue.observe(wait_s)
        self.n.observe(n)
        self.max_generation.observe(max_tokens)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def next_tokens(self, gap_s: float) -> None:
        """Tokens after the first arrived `gap_s` after the request's previous ones."""
        for family in self.itl:
            family.observe(gap_s)

    def time_per_output_token(self, tpot_s: float) -> None:
        """A finished request's (last token - first token) / (output tokens - 1)."""
        self.tpot.observe(tpot_s)

    def finished(self, req: FinishedRequest) -> None:
        self.success[req.reason if req.reason in self.success else "error"].inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(req.generation_tokens)
        self.prompt_lengths.observe(req.prompt_tokens)
        self.generation_lengths.observe(req.generation_tokens)
        if req.max_tokens is not None:
            self.max_tokens.observe(req.max_tokens)
        self.e2e.observe(req.e2e_s)
        self.prefill.observe(req.prefill_s)
        self.decode.observe(req.decode_s)
        self.inference.observe(req.prefill_s + req.decode_s)
