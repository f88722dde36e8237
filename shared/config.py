"""Typed settings, one object per service, every field overridable from the environment.

SERVICE is one of PREFILL, RELAY, MD, ROUTER. A field every service has (`CommonSettings`:
NATS URL, secret, model, engine, ...) is read from `PDD_<FIELD>` for all services at once and
from `PDD_<SERVICE>_<FIELD>` for one service; the service's own variable wins. A field only one
service has is read from `PDD_<SERVICE>_<FIELD>` alone. Nested model and engine fields use a
double underscore. E.g. `PDD_NATS_URL=nats://...` (every service), `PDD_MD_NATS_URL=nats://...`
(MD only, over the former), `PDD_RELAY_CATCHUP_THRESHOLD=64`, `PDD_MODEL__PATH=model.gguf`,
`PDD_MD_MODEL__PRESET=small`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any, Literal, get_args

from pydantic import AliasChoices, BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

COMMON_PREFIX = "PDD_"
NESTED_DELIMITER = "__"


def default_instance() -> str:
    """hostname-pid. The hostname alone is equal across hosts that share it (two network
    namespaces on one machine, cloned VMs) and across two instances of a role on one host; the
    pid tells them apart, and a restarted process, whose KV cache is gone, comes back as a new
    instance instead of one that claims the old one's cache. `pdd up` numbers its instances;
    set PDD_<SERVICE>_INSTANCE for a name that lasts across restarts."""
    return f"{socket.gethostname()}-{os.getpid()}"


def advertise_field(prefix: str) -> Any:
    """An address peers dial, None by default, read from PDD_<SERVICE>_ADVERTISE or the older
    PDD_<SERVICE>_ADVERTISE_ADDRESS (the first wins)."""
    return Field(
        default=None, validation_alias=AliasChoices(f"{prefix}ADVERTISE", f"{prefix}ADVERTISE_ADDRESS")
    )


TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # the tool-call formats the router reads


class ModelSettings(BaseModel):
    """Which weights to run and where. `path` wins over `preset`; with neither, the embedded
    default model (SmolLM2-135M-Instruct, a GGUF file the install step puts in the environment)."""

    path: str | None = None  # a local Hugging Face directory or a .gguf file
    preset: str | None = None  # seeded random weights (tests, benchmarks): tiny | small | medium
    # The model id clients name (/v1/models, requests' `model`); default: `path` as given (the
    # default model: HuggingFaceTB/SmolLM2-135M-Instruct; a preset: its own id, e.g. tiny-s0).
    served_model_name: str | None = None
    # auto: float32 on the CPU; on a GPU the checkpoint's dtype (bfloat16 for a GGUF). Or
    # float32 | bfloat16 | float16.
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:N
    seed: int = 0  # seed of the preset's deterministic weights


EngineKind = Literal["pdd", "vllm"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)


def engine_unavailable(kind: str) -> str | None:
    """Why this environment cannot run an engine of `kind`; None when it can. vLLM is an
    optional extra: its engine runs where `vllm` imports (pip install 'pdd[vllm]')."""
    if kind == "pdd":
        return None
    if kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return (
                "the vLLM engine needs vLLM, which is not installed in this environment "
                "(pip install 'pdd[vllm]', or run pdd in vLLM's own virtualenv: docs/vllm.md)"
            )
        return None
    return f"unknown engine {kind!r} (engines: {', '.join(ENGINE_KINDS)})"


class EngineSettings(BaseModel):
    """Which engine, its paged KV pool and batching limits."""

    # The engine behind the seam (shared/engine/seam.py): "pdd" (this package's own) or "vllm"
    # (vLLM's v1 engine, shared/vllm/engine.py; where vLLM is not installed a service given it
    # exits 2 at start).
    kind: EngineKind = "pdd"
    block_size: int = 16
    # The KV pool's size, as vLLM sizes its own: on the CPU kv_cache_space_gib (vLLM's
    # VLLM_CPU_KVCACHE_SPACE, 4 GiB unless set); on CUDA gpu_memory_utilization of the device's
    # memory, less what is in use once the weights are loaded. Either is overridden by
    # kv_memory_mb (a size) or kv_memory_fraction (a share of the memory available at start).
    kv_cache_space_gib: float = Field(4.0, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_memory_mb: float | None = None
    kv_memory_fraction: float | None = None
    max_num_seqs: int = 64  # running sequences per step
    max_batched_tokens: int = 2048  # tokens per forward (prefill chunks + decodes)
    # Most tokens of one sequence in a forward: a longer prompt is computed in chunks of this
    # many, several sequences' chunks sharing a forward (0 = up to max_batched_tokens).
    chunk_tokens: int = Field(0, ge=0)
    # Longest sequence (prompt + output); None: the model's context length (capped at a sliding
    # window), as vLLM's --max-model-len. More than the model allows is refused at start.
    max_model_len: int | None = Field(None, ge=2)
    # Attention over the paged cache: "paged" (C++ kernel reading blocks in place, CPU),
    # "reference" (gather + SDPA, any device), "auto" = paged where it can run.
    attention_backend: Literal["auto", "paged", "reference"] = "auto"
    # Linear layers: "panel" (fp32 weights in 32-column panels for the C++ kernel, the rest as
    # packed), "packed" (weights pre-packed for oneDNN at load, CPU), "torch" (F.linear),
    # "auto" = panel for fp32, else packed, where they can run.
    linear_backend: Literal["auto", "panel", "packed", "torch"] = "auto"
    # RMSNorm (with its residual add), RoPE, SwiGLU's silu x up and the KV writes: "fused"
    # (one C++ call each, CPU), "torch" (tensor ops), "auto" = fused where it can run.
    small_ops: Literal["auto", "fused", "torch"] = "auto"
    # With one torch thread: low-priority threads that join the panel products, paged
    # attention and a long step's fused small ops on cores nobody else is using at that moment
    # (shared/model/kernels/helpers.h; one set per process); 0 = none.
    helper_threads: int = Field(0, ge=0, le=64)
    helper_nice: int = Field(10, ge=0, le=19)  # their niceness: they give way to normal threads


class RdmaSettings(BaseModel):
    """The optional RDMA path for prefill's KV to main decode (Mooncake Transfer Engine, the
    `rdma` extra): P writes the blocks MD lacks straight into MD's KV pool. Both ends must turn it
    on; the TCP bulk channel stays the default and the fallback (engine missing, refused, failed)."""

    protocol: str = "rdma"  # "rdma" on RoCE / InfiniBand NICs; "tcp" runs the same engine over sockets
    device: str = ""  # the NIC(s) for protocol rdma, e.g. "mlx5_0" or "mlx5_0,mlx5_1"; "" = every one found
    host: str | None = None  # the address peers reach this engine at; None: this host's (MD: its bulk host)
    staging_mb: float = 64.0  # prefill's registered buffer the blocks are written from
    control_timeout_s: float = 10.0  # each offer / verdict exchange with MD over NATS
    # MD keeps slots it offered (and never saw written) out of use this long after the request
    # ends, so a late one-sided write cannot land in a block reused by another request.
    quarantine_s: float = 60.0


class CommonSettings(BaseSettings):
    """What every service has. A service class sets only its own `env_prefix` (the nested
    delimiter and extra="ignore" are inherited); `PDD_<FIELD>` fills these fields in every
    service, below the service's own `PDD_<SERVICE>_<FIELD>`."""

    model_config = SettingsConfigDict(
        env_prefix=COMMON_PREFIX, env_nested_delimiter=NESTED_DELIMITER, extra="ignore"
    )

    nats_url: str = "tls://127.0.0.1:4222"
    instance: str = Field(default_factory=default_instance)  # unique per DC; `pdd up` numbers them
    datacenter: str = "dc-a"
    secret: str | None = None  # key of the local KV path, prefill <-> relay (required there, or secret_file)
    secret_file: str | None = None  # a file holding `secret` (what `pdd up` passes)
    tls_ca: str | None = None  # the private CA's certificate (required)
    tls_cert: str | None = None  # this service's certificate (required): also its NATS user
    tls_key: str | None = None  # its private key (required)
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    kv_transport: str = (
        "tcp"  # WAN KV from prefill to main decode: "tcp" (bulk channel) | "rdma" (see RdmaSettings)
    )
    rdma: RdmaSettings = Field(default_factory=RdmaSettings)
    request_timeout_s: float = 120.0  # hard bound on any single request
    orphan_after_s: float = 4.0  # a router silent this long is gone: its requests are orphans, dropped
    drain_timeout_s: float = 30.0  # engine services, on SIGTERM: longest wait for the requests held to end
    engine_call_timeout_s: float = 30.0  # longest wait for one command on the engine thread
    torch_threads: int = 0  # intra-op threads of this service's engine; 0 = torch's default
    metrics_port: int | None = None  # Prometheus /metrics port of a non-router service; None = off
    metrics_host: str = "127.0.0.1"  # address the /metrics server binds to
    # Engines on one host (`pdd up` on one machine): a directory they share, where prefill
    # publishes the prompt tokens it has not computed yet (its running step's included), and a
    # decoder gives way from when those go above give_way_above_tokens (a burst, not three
    # prompts that came together) until they are gone, up to give_way_max_s in a row
    # (shared/serving/host_share.py); None = hosts of their own, nothing shared.
    host_share_dir: str | None = None
    give_way_above_tokens: int = Field(default=768, ge=0)
    give_way_max_s: float = Field(default=0.5, ge=0)
    # Start even when an address given to peers is loopback while its listener expects peers
    # from other hosts (shared/advertise.py); a warning instead of exit 2.
    advertise_loopback_ok: bool = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        own_env = _EngineKindEnv(settings_cls)
        # Built on CommonSettings, not settings_cls: PDD_<FIELD> never sets a service's own field.
        common_env = _EngineKindEnv(
            CommonSettings, env_prefix=COMMON_PREFIX, env_nested_delimiter=NESTED_DELIMITER
        )
        return init_settings, own_env, common_env, dotenv_settings, file_secret_settings


class _EngineKindEnv(EnvSettingsSource):
    """PDD_ENGINE=pdd|vllm (or PDD_<ROLE>_ENGINE) names the engine's kind: `engine` is also the
    engine's nested settings (PDD_ENGINE__KV_MEMORY_MB), so a bare word there is engine.kind."""

    def _load_env_vars(self) -> dict[str, str | None]:
        env = dict(super()._load_env_vars())
        key = f"{self.env_prefix}engine".lower()
        if (value := env.get(key)) is not None and not value.lstrip().startswith("{"):
            env[f"{key}{NESTED_DELIMITER}kind"] = env.pop(key)
        return env


class PrefillSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="PDD_PREFILL_")

    # Tokens of one prompt per forward: KV blocks stream after each chunk, while the rest of the
    # prompt is computed. Prompts waiting together share a forward (up to the engine's
    # max_batched_tokens), so a burst's last prompt does not wait for a forward each (0 = no cap).
    prefill_chunk: int = 256
    # tcp://host:port of the WAN link every tcp:// KV peer (a main decoder) is dialed through,
    # naming the peer in a first line (shared/wan/via.py); None = dial peers directly.
    bulk_via: str | None = None
    # A KV group of at least bulk_parallel_min_mib is split along its layers over this many
    # connections to its main decoder (1: never split): one TCP stream's window or one lossy
    # path then does not cap a long, fat WAN link (shared/kv/pool.py, whose defaults these are).
    bulk_parallel: int = Field(default=4, ge=1, le=16)
    bulk_parallel_min_mib: float = Field(default=16.0, ge=0)
    # How KV crosses the WAN to a main decoder (shared/kv/codec.py): "exact" (the engine's
    # bytes) or a lossy codec, "int8" | "fp8" (~4x fewer bytes than fp32, ~2x than bf16) or
    # "int4" (~8x / ~4x). The local path to the relay is always exact; a lossy codec takes TCP
    # even where kv_transport is "rdma".
    wan_kv_codec: Literal["exact", "int8", "fp8", "int4"] = "exact"


class RelaySettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="PDD_RELAY_", populate_by_name=True)

    # Local fast path from prefill; "{instance}" becomes this instance's id, so replicas that
    # share a socket directory (compose) each get their own socket.
    local_address: str = "unix:///tmp/pdd-relay-{instance}.sock"
    # What prefill dials for it; None: local_address, with a wildcard host as this host's IP.
    advertise_address: str | None = advertise_field("PDD_RELAY_")
    catchup_threshold: int = 64  # pending tokens above which handoff goes in batches
    catchup_load: int = 4  # running requests at or above which RLD prefers one-shot
    catchup_max_rounds: int = 4  # catch-up batches before the final one, whatever remains
    md_ready_timeout_s: float = 30.0  # after this, RLD finishes the request itself
    kv_import_wait_s: float = 20.0  # longest wait for free KV blocks to take prefill's stream
    # Test knob (0 = off): each decode step takes at least this long, so a test that needs the
    # relay still decoding when MD takes over (or when MD's deadline passes) has it on any
    # host, instead of asking for an output long enough on this one (docs/testing.md).
    min_step_s: float = Field(default=0.0, ge=0)

    def model_post_init(self, _context: object) -> None:
        self.local_address = self.local_address.replace("{instance}", self.instance)


class MainDecodeSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="PDD_MD_", populate_by_name=True)

    datacenter: str = "dc-b"
    bulk_address: str = "tcp://127.0.0.1:7400"  # where MD listens for KV
    # What P dials (PDD_MD_ADVERTISE); None: bulk_address, with a wildcard host (0.0.0.0, ::)
    # as this host's IP. Never loopback while bulk_address expects other hosts (shared/advertise.py).
    advertise_address: str | None = advertise_field("PDD_MD_")
    # A prepare whose KV does not fit now waits, first come first served, for blocks to free
    # up; past either bound MD answers busy. Keep admission_wait_s under the router's
    # prepare_timeout_s.
    admission_wait_s: float = 20.0
    admission_queue_max: int = 256
    # A prompt block already crossing the WAN for another request is waited for, not asked for
    # again (off only to measure what that saves). A request whose own KV is in waits for such
    # blocks while the transfers carrying them make progress; once none lands a block for
    # shared_kv_stall_s it computes them in its extend pass.
    share_in_flight: bool = True
    shared_kv_stall_s: float = Field(default=2.0, gt=0)


UNCAPPED_BANDWIDTH_BPS = 100e9 / 8  # an uncapped link's prior: a datacenter NIC's 100 Gbit/s


class RouterSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="PDD_ROUTER_")

    host: str = "127.0.0.1"
    port: int = 8000
    # Estimated WAN time of the KV MD lacks, behind everything queued on the line toward it
    # (all MDs behind that line), above which the relay is used.
    wan_time_threshold_s: float = 0.5
    # Admission to the line. The gap budget: the longest the missing KV (behind the line's
    # queue) may take to reach MD on P→MD, where the user waits for MD's second token. Past
    # it the request needs a relay; when every relay is full (relay_max_requests running or
    # held, or too few free KV blocks for the prompt) it waits at the router, planned again
    # every line_replan_s, and gets a 429 (Retry-After) after line_wait_s or when
    # line_wait_max requests wait already. A fleet with no relay that could take it is not held.
    line_budget_s: float = Field(default=2.0, ge=0)
    relay_max_requests: int = Field(default=64, ge=1)  # a relay's engine max_num_seqs by default
    line_wait_s: float = Field(default=5.0, ge=0)
    line_wait_max: int = Field(default=256, ge=0)
    line_replan_s: float = Field(default=0.25, gt=0)  # (loads and the line's queue are reported every 0.5 s)
    # Prior for the link estimator, bytes/s; 0 is an uncapped link (`pdd up --bandwidth-mbps 0`),
    # taken as UNCAPPED_BANDWIDTH_BPS until transfers are measured.
    default_bandwidth_bps: float = Field(default=1e9 / 8, ge=0)
    default_rtt_s: float = 0.03
    max_tokens_default: int | None = None  # a request without max_tokens: None = the rest of the context
    # The format of the model's tool calls (vLLM's --tool-call-parser): hermes (`<tool_call>`
    # JSON: Qwen2.5/3, Hermes, SmolLM) | llama3_json; "": what the chat template teaches.
    tool_call_parser: Literal["", "hermes", "llama3_json"] = ""  # (TOOL_CALL_PARSERS)
    # SSE `id:` fields (what a stream resumes from, by Last-Event-ID): "asked" = on the streams
    # of clients that send `Accept: text/event-stream` (EventSource does) or a Last-Event-ID;
    # "always" = every stream. Not by default: common OpenAI clients (vLLM's and SGLang's
    # benchmark clients among them) take every SSE line or event for a `data:` line.
    sse_event_ids: Literal["asked", "always"] = "asked"
    # MD's answer to prepare: one WAN round trip, plus up to MD's admission_wait_s (20 s)
    # when its KV memory is taken. Also bounds prefill's answer to the submit.
    prepare_timeout_s: float = 30.0
    token_timeout_s: float = 30.0  # longest silence between two token events of a request
    # GET /v1/traces asks these DCs' engine instances for their spans (comma-separated), and
    # waits at most trace_gather_timeout_s for the answers; a DC that does not answer is listed.
    trace_datacenters: str = "dc-a,dc-b"
    trace_gather_timeout_s: float = Field(default=2.0, gt=0)
    lost_after_s: float = 1.0  # an instance silent this long (heartbeats every 0.25 s) is lost
    # Once a stream's tokens flow, its producer is judged on them as well as on its heartbeats
    # (a step every tens of ms): with neither a listing nor a token for this long, it moves.
    streaming_lost_after_s: float = 0.6
    # The instances' cache events are numbered; a lost one (or a restart) makes the router ask
    # that instance for its whole cache. Besides, every instance is asked this often (a safety net).
    kv_snapshot_every_s: float = 60.0
    kv_snapshot_timeout_s: float = 2.0  # an instance's answer to a snapshot request; then it is asked again
    gap_timeout_s: float = 1.0  # a token missing this long while later ones arrived: it was lost
    stall_timeout_s: float = 10.0  # no token this long once tokens flowed: the request moves
    migration_limit: int = 3  # moves by token IDs per request before it fails
    migration_wait_s: float = 2.0  # how long a move waits for a live instance to take the request
    resume_timeout_s: float = 3.0  # an instance's answer to a resume request
    forget_after_s: float = 60.0  # an instance silent this long has left: its entries are dropped
    # Which instance serves a request: the lowest cost, in seconds (services/router/routing/policy.py).
    #   MD: overlap_weight × WAN seconds to send the KV that MD lacks (at the bandwidth measured
    #       toward it, behind the KV already queued on it) + load_weight × load × R_md
    #   P:  prefill_weight × prompt tokens that P has not cached + load_weight × load × R_p
    # load is in requests (held or running, plus those sent since the instance's last report,
    # plus the share of its KV pool in use); R_md is this request's whole KV over the WAN at
    # default_bandwidth_bps, R_p its whole prefill. So load_weight is a fraction: with 0.05 a
    # session's MD keeps its next turn (h: the share of the prompt only it holds) while it runs
    # fewer than 20h more requests than another MD, whatever the model's KV size; the load
    # bound (balance_factor) keeps that from growing a hot spot. Raise it to spread requests
    # more; lower it (or raise overlap_weight) to keep sessions on the instance holding their prefix.
    overlap_weight: float = 1.0  # per second of WAN transfer
    load_weight: float = 0.05  # one request of load, as a share of the request's own cost
    prefill_weight: float = 1e-4  # seconds per prompt token prefill computes (1e-4: 10k tokens/s)
    # Bounded load: an instance whose load with the request would exceed balance_factor × the
    # mean load of its role's live instances (+ 2 requests), now or by its recent share of this
    # router's requests (a count halving every 20 s), is not chosen while another is.
    balance_factor: float = 1.5

    @field_validator("default_bandwidth_bps")
    @classmethod
    def _uncapped(cls, v: float) -> float:
        return v or UNCAPPED_BANDWIDTH_BPS


SETTINGS: dict[str, type[CommonSettings]] = {
    "prefill": PrefillSettings,
    "relay": RelaySettings,
    "main_decode": MainDecodeSettings,
    "router": RouterSettings,
}
# Env prefix of each service's settings, by service name (the launcher sets its variables with it).
ENV_PREFIX = {name: cls.model_config["env_prefix"] for name, cls in SETTINGS.items()}
