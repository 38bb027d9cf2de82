"""The ``routecore serve`` configuration: a YAML file, validated at start.

Every error names the bad key (``pools[1].endpoints[0]: ...``) and never
repeats an API key. See ``examples/routecore.yaml`` for a complete file::

    server: {port, api_port, metrics_port, host, key_header, strip_headers, failure_mode,
             default_pool, grace_s, state_file, worker_threads, unix_socket, unix_socket_mode}
    limits: {max_body_bytes, max_message_bytes, request_timeout_s, default_max_tokens,
             image_tokens, audio_tokens, tokenize_inline_bytes, body_timeout_s,
             max_buffered_bytes, max_streams_per_connection, max_connections}
    router: {policy, compress_band, prefix_block_size, fallbacks, saturation, objectives}
    scrape: {enabled, interval_s, timeout_s, unhealthy_after, stale_after, max_page_bytes,
             max_series, engines: {KIND: {waiting, running, kv_usage, adapters}}}
    admission: {backend, quotas, entitlements, default_max_tokens, window_s, redis}
    pools: [{name, max_context, budget, queue_limit, endpoints: ["ip:port", ...], engine,
             models, adapters, role, roles: {"ip:port": ROLE},
             disaggregation: {decider, threshold}}]
    tenants: [{name, api_keys: [...], expires_at, entitlement}]
    models: [{name, tokenizer, chat_template, bos_token, eos_token}]
    kv_events: {block_size, seed, capacity_blocks, stale_after_s, max_message_bytes,
                max_batch_events, max_batch_blocks,
                endpoints: {"ip:port": {zmq, topic, replay}}}
    autoscale: {period_s, window_s, sub_windows, quantile, scale_down_delay_s, max_step_up,
                max_step_up_percent, max_step_down, max_step_down_percent, queue_drain_s,
                forecast_s, pools: [{name, min_endpoints, max_endpoints, slo_ttft_s, slo_tpot_s,
                         profile, context, entitlements}]}
    flow_control: {enabled, bands: [{name, share, max_requests, max_bytes, ttl_s, fairness,
                   ordering}], classes, default_band, max_requests, max_bytes, ttl_s,
                   saturation: {detector, max_waiting, max_kv_usage, max_in_flight}}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routecore._core import (
    MAX_TOKENS,
    Autoscaler,
    EndpointPicker,
    Entitlement,
    FlowQueue,
    Pool,
    Profile,
    Quota,
    Tokenizer,
)
from routecore.admission import (
    FAILURE_MODES,
    MAX_BOUND,
    REDIS_OPTIONS,
    URL_SCHEMES,
    admission_from_config,
    check_renamed,
)
from routecore.profiles import DEFAULT_PRESET, PRESETS, profile_from_dict

#: What an endpoint does in a prefill/decode disaggregated pool (``role``,
#: ``roles``): llm-d's ``llm-d.ai/role`` words, ``both`` for its ``prefill-decode``.
ROLES = ("prefill", "decode", "both")
#: Whether a request is prefilled apart (``disaggregation.decider``), see
#: docs/disaggregation.md; ``uncached-tokens`` and ``prefill-load`` take a ``threshold``.
DECIDERS = ("always", "never", "uncached-tokens", "prefill-load")
#: Who sends a split request's two upstream requests (``disaggregation.handoff``):
#: ``header`` llm-d's sidecar (``x-prefiller-host-port``), ``vllm`` / ``sglang``
#: routecore itself, in that engine's handshake (docs/disaggregation.md).
HANDOFFS = ("header", "vllm", "sglang")

#: How the endpoint inside a pool is picked (``router.policy``): the endpoint
#: picker's presets, see docs/picker.md.
POLICIES = (
    "prefix+queue+kv",
    "queue+kv",
    "prefix",
    "precise-prefix",
    "precise-prefix+queue+kv",
    "least-request",
    "vtc",
    "random",
    "round-robin",
)
#: The metric names read from each kind of engine (``scrape.engines``): for each
#: quantity the first name on the page is read.
ENGINE_METRICS: dict[str, dict[str, Any]] = {
    "vllm": {
        "waiting": ["vllm:num_requests_waiting"],
        "running": ["vllm:num_requests_running"],
        "kv_usage": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        "adapters": "vllm:lora_requests_info",
    },
    "sglang": {
        "waiting": ["sglang:num_queue_reqs"],
        "running": ["sglang:num_running_reqs"],
        "kv_usage": ["sglang:token_usage"],
        "adapters": None,
    },
}
ADMISSION_BACKENDS = ("memory", "redis")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class ServerConfig:
    #: Envoy's ext_proc and grpc.health.v1 (the Rust data plane).
    port: int = 9002
    #: The RouteCore API (Route / Feedback / Plan) and its grpc.health.v1.
    api_port: int = 9003
    #: Prometheus /metrics, served by the data plane: 9464, the OpenTelemetry
    #: Prometheus exporter's port (9090 is Prometheus's own).
    metrics_port: int = 9464
    host: str = "127.0.0.1"
    #: The request header that carries the tenant's API key (never sent on to
    #: the engines).
    key_header: str = "x-api-key"
    #: More request headers removed before a request leaves for its engine.
    strip_headers: tuple[str, ...] = ()
    #: "open": on an internal failure route to ``default_pool``; "closed": answer 503.
    failure_mode: str = "closed"
    #: The pool for bodyless requests and fail-open routing (default: the first pool).
    default_pool: str = ""
    #: Seconds open streams get to finish at shutdown (SIGTERM). Left out: until
    #: the last one ends, at most ``limits.request_timeout_s`` (a rolling restart
    #: cuts no stream).
    grace_s: float | None = None
    #: Where the learned calibrator is kept across restarts ("" = not kept): read at
    #: start, written (atomically) at shutdown.
    state_file: str = ""
    #: Threads of the data plane's runtime.
    worker_threads: int = 2
    #: ext_proc also on this Unix socket ("": TCP only), for an Envoy on the same
    #: host (examples/envoy-uds.yaml): its directory must exist; a stale socket
    #: there is replaced; removed at shutdown.
    unix_socket: str = ""
    #: The socket's permissions: "0600" (routecore's user) or "0660" (and its group).
    unix_socket_mode: str = "0600"


@dataclass(frozen=True)
class Limits:
    #: Largest request body the ext_proc server accumulates (413 above).
    max_body_bytes: int = 4 << 20
    #: Largest gRPC message the server accepts.
    max_message_bytes: int = 8 << 20
    #: A request whose response never comes back is released after this long.
    request_timeout_s: float = 600.0
    #: The output bound assumed for requests that set no max_tokens.
    default_max_tokens: int = 4096
    #: Prompt tokens charged per image part (OpenAI's cost of a 1024x1024
    #: high-detail image); set it to your vision model's count.
    image_tokens: int = 765
    #: Prompt tokens charged per audio part (30 s at Qwen2-Audio's 40 ms per token).
    audio_tokens: int = 750
    #: A body this long or longer whose model has a tokenizer is tokenized off the
    #: data plane's event loop (shorter ones inline: the hand-off would cost more).
    tokenize_inline_bytes: int = 512
    #: A stream not routed this long after it opened (its headers and whole
    #: body received) is refused with 408.
    body_timeout_s: float = 60.0
    #: Bytes all ext_proc streams may buffer together (request bodies being
    #: received, response bodies read for their usage); a body past it: 503.
    max_buffered_bytes: int = 256 << 20
    #: ext_proc streams open at once on one connection; past it: RESOURCE_EXHAUSTED.
    max_streams_per_connection: int = 1024
    #: Connections to the ext_proc port open at once; past it a new one is closed.
    max_connections: int = 64


@dataclass(frozen=True)
class RouterConfig:
    #: How the endpoint inside the chosen pool is picked (a preset of the
    #: endpoint picker; the default scores prefix match, queue depth and KV use).
    policy: str = "prefix+queue+kv"
    #: Compress-and-route band gamma >= 1 (FleetOpt section 5): a prompt whose
    #: L_total is within gamma * B of a smaller pool's budget B is compressed
    #: to fit it. None: off.
    compress_band: float | None = None
    #: Bytes of prompt text (or token ids) per block hash of the prefix plugin.
    prefix_block_size: int = 128
    #: Endpoints offered to Envoy after the chosen one, for its retries.
    fallbacks: int = 2
    #: An endpoint whose queue is above ``max_waiting`` or whose KV-cache use
    #: is above ``max_kv_usage`` is saturated (the GIE's defaults).
    max_waiting: float = 5.0
    max_kv_usage: float = 0.8
    #: Priority by objective name (``x-llm-d-inference-objective``); a
    #: request with a negative priority is sheddable: 429 when every endpoint
    #: is saturated.
    objectives: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ScrapeConfig:
    """The endpoints' Prometheus metrics, scraped by the data plane."""

    #: Off: endpoints are never scraped, always taken as healthy, their state unknown.
    enabled: bool = True
    interval_s: float = 0.05
    #: A scrape not answered within this is a failure.
    timeout_s: float = 0.5
    #: Failed scrapes in a row that make an endpoint unhealthy (K).
    unhealthy_after: int = 3
    #: Intervals after which a scraped value counts as unknown.
    stale_after: int = 4
    #: A larger metrics page is a failure.
    max_page_bytes: int = 4 << 20
    #: A page with more series of the metrics read is a failure (too large).
    max_series: int = 1000
    #: Metric names by engine kind (defaults: :data:`ENGINE_METRICS`).
    engines: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(ENGINE_METRICS))


@dataclass(frozen=True)
class AdmissionConfig:
    """Quota admission (``routecore.admission_from_config``); off without entitlements."""

    backend: str = "memory"
    #: The mapping handed to ``admission_from_config`` (quotas, entitlements, ...).
    spec: dict[str, Any] = field(default_factory=dict)
    #: Service class by entitlement name.
    service_classes: dict[str, str] = field(default_factory=dict)

    @property
    def entitlements(self) -> tuple[str, ...]:
        return tuple(self.service_classes)


@dataclass(frozen=True)
class PoolConfig:
    name: str
    max_context: int
    budget: int | None = None
    queue_limit: int | None = None
    #: "ip:port" of every endpoint serving the pool (may be empty: 503 until filled).
    endpoints: tuple[str, ...] = ()
    #: The engine kind of its endpoints: whose metric names are scraped.
    engine: str = "vllm"
    #: Models and LoRA adapters the pool serves (a request's ``model``); both
    #: empty: any model. A model no pool serves is a 404.
    models: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    #: Prefill/decode disaggregation: every endpoint's role (``role``, or its
    #: entry in ``roles``), and the decider with its threshold (None: ``never``
    #: when every endpoint is ``both``, else ``always``).
    role: str = "both"
    roles: dict[str, str] = field(default_factory=dict)
    decider: str | None = None
    threshold: float | None = None
    #: How a split request travels (``disaggregation.handoff``, HANDOFFS), how
    #: long routecore waits for a prefill it sends, whether a vLLM prefill
    #: answer must carry ``kv_transfer_params``, and the SGLang prefill
    #: engines' bootstrap port (None: the engines' default).
    handoff: str = "header"
    prefill_timeout_s: float = 30.0
    require_kv_transfer_params: bool = True
    bootstrap_port: int | None = None

    def to_pool(self) -> Pool:
        """The core's :class:`routecore.Pool` (which checks budget <= max_context)."""
        return Pool(self.name, self.max_context, self.budget, self.queue_limit)


@dataclass(frozen=True)
class TenantConfig:
    name: str
    #: SHA-256 digests of the tenant's API keys (the keys themselves are not kept).
    key_digests: tuple[bytes, ...] = field(repr=False)
    #: Unix time after which the tenant's keys are refused with 403.
    expires_at: float | None = None
    #: The service class of the tenant's entitlement ("none" without one): a metrics label.
    service_class: str = "none"
    #: The admission entitlement the tenant's requests are charged to (None: not admitted
    #: through admission control).
    entitlement: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """A model whose prompts are counted exactly: requests whose ``model`` is ``name``."""

    name: str
    #: Its Hugging Face ``tokenizer.json`` (absolute path).
    tokenizer: str
    #: Its chat template's Jinja source (read from the ``chat_template`` file), or None:
    #: then a chat counts the tokens of its texts, without the template's.
    chat_template: str | None = field(default=None, repr=False)
    #: The special tokens the template writes (the model's ``tokenizer_config.json``'s).
    bos_token: str | None = None
    eos_token: str | None = None
    #: The tokenizer, loaded once while validating; the data plane is handed this one.
    loaded: Tokenizer | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class KvEventSource:
    """Where one endpoint's engine publishes its KV-cache events (vLLM's
    ``--kv-events-config``: ``endpoint``, ``topic``, ``replay_endpoint``)."""

    endpoint: str
    #: The engine's ZeroMQ PUB address, ``tcp://host:port``.
    zmq: str
    topic: str = ""
    #: The engine's replay ROUTER address (None: sequence gaps are not replayed).
    replay: str | None = None


@dataclass(frozen=True)
class KvEventsConfig:
    """The precise prefix index fed by the engines' KV events
    (docs/precise-prefix.md); off without sources."""

    #: The engines' KV block size, in tokens (vLLM's ``--block-size``).
    block_size: int = 16
    #: Seed of routecore's block hashes of the events' token ids.
    seed: int = 0
    #: Blocks kept per endpoint.
    capacity_blocks: int = 1 << 18
    #: With a replay address: an endpoint whose engine neither publishes nor answers a
    #: replay this long falls back to the approximate index (None: only a lost connection).
    stale_after_s: float | None = None
    #: A peer's ZeroMQ message (and frame) over this cuts its connection before allocation.
    max_message_bytes: int = 16 << 20
    #: A batch with more events, or more block hashes, is refused whole (the endpoint cleared).
    max_batch_events: int = 1 << 17
    max_batch_blocks: int = 1 << 18
    sources: tuple[KvEventSource, ...] = ()

    def spec(self) -> dict[str, Any] | None:
        if not self.sources:
            return None
        return {
            "block_size": self.block_size,
            "seed": self.seed,
            "capacity_blocks": self.capacity_blocks,
            "stale_after_s": self.stale_after_s,
            "max_message_bytes": self.max_message_bytes,
            "max_batch_events": self.max_batch_events,
            "max_batch_blocks": self.max_batch_blocks,
            "sources": [
                {"endpoint": s.endpoint, "zmq": s.zmq, "topic": s.topic, "replay": s.replay}
                for s in self.sources
            ],
        }


# -- flow_control ------------------------------------------------------------

#: Flow control's bands when ``flow_control.bands`` is not given: one per
#: service class of the token-pool paper, its class weight as its share,
#: shared among flows by the token-pool debt (``routecore.FlowQueue()``'s).
FLOW_BANDS = tuple(
    {"name": name, "share": share, "fairness": "debt"}
    for name, share in (
        ("dedicated", 1000.0),
        ("guaranteed", 1000.0),
        ("elastic", 100.0),
        ("spot", 1.0),
        ("preemptible", 0.1),
    )
)
FLOW_DETECTORS = ("utilization", "concurrency")
FLOW_QUEUE_KEYS = {"bands", "classes", "default_band", "max_requests", "max_bytes", "ttl_s"}


@dataclass(frozen=True)
class FlowControlConfig:
    """``flow_control``: a saturated pool holds requests in priority bands
    instead of refusing them or sending them to a saturated engine (see
    docs/server.md, "Flow control"). None queue: off."""

    #: The queue of each pool, as ``routecore.FlowQueue`` takes it (checked).
    queue: dict[str, Any] | None = None
    #: When a pool has room: the GIE's utilization detector by default.
    detector: str = "utilization"
    max_waiting: float = 5.0
    max_kv_usage: float = 0.8
    max_in_flight: int = 100

    def spec(self) -> dict[str, Any] | None:
        if self.queue is None:
            return None
        return {
            "queue": self.queue,
            "saturation": {
                "detector": self.detector,
                "max_waiting": self.max_waiting,
                "max_kv_usage": self.max_kv_usage,
                "max_in_flight": self.max_in_flight,
            },
        }


def _flow_control(raw: Any) -> FlowControlConfig:
    """``flow_control``, checked by the queue itself (errors name the key:
    ``flow_control.bands[1].max_requests``); absent or ``enabled: false``: off."""
    f = _section(raw, "flow_control", FLOW_QUEUE_KEYS | {"enabled", "saturation"})
    enabled = _bool(f, "enabled", "flow_control", raw is not None)
    where = "flow_control.saturation"
    sat = _section(f.get("saturation"), where, {"detector", *RANGES[where]})
    d = FlowControlConfig
    sat_fields = {
        "detector": _str(sat, "detector", where, d.detector, FLOW_DETECTORS),
        **_numbers(sat, where, where, d),
    }
    queue = {k: v for k, v in f.items() if k in FLOW_QUEUE_KEYS}
    queue.setdefault("bands", [dict(b) for b in FLOW_BANDS])
    try:
        FlowQueue(queue)
    except ValueError as e:
        msg = str(e)
        raise ConfigError(
            "flow_control" + msg[len("flow") :]
            if msg.startswith("flow")
            else f"flow_control: {msg}"
        ) from None
    return FlowControlConfig(queue=queue if enabled else None, **sat_fields)


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaling from the capacity model (docs/autoscale.md): on with an
    ``autoscale`` section naming at least one pool."""

    #: The section as the core's autoscaler takes it (``profile`` taken out,
    #: ``context`` filled in from the pool), checked by building one.
    config: dict[str, Any]
    #: One engine profile per scaled pool, in order.
    profiles: tuple[Profile, ...]
    #: Per scaled pool: its entitlements' ``tokens_per_s`` summed (the sizing's floor).
    promised_tokens_per_s: tuple[float, ...]

    def spec(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "profiles": [p.fields() for p in self.profiles],
            "promised_tokens_per_s": list(self.promised_tokens_per_s),
        }


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    limits: Limits
    router: RouterConfig
    admission: AdmissionConfig
    pools: tuple[PoolConfig, ...]
    tenants: tuple[TenantConfig, ...]
    models: tuple[ModelConfig, ...] = ()
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    autoscale: AutoscaleConfig | None = None
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"unknown pool {name!r}")

    def spec_json(self) -> str:
        """The data plane's configuration (``routecore.DataPlane``), as JSON.

        API keys travel as their SHA-256 digests only.
        """
        return json.dumps(
            {
                "server": {
                    "key_header": self.server.key_header,
                    "strip_headers": list(self.server.strip_headers),
                    "failure_mode": self.server.failure_mode,
                    "default_pool": self.server.default_pool,
                },
                "limits": {
                    "max_body_bytes": self.limits.max_body_bytes,
                    "max_message_bytes": self.limits.max_message_bytes,
                    "request_timeout_s": self.limits.request_timeout_s,
                    "default_max_tokens": self.limits.default_max_tokens,
                    "image_tokens": self.limits.image_tokens,
                    "audio_tokens": self.limits.audio_tokens,
                    "tokenize_inline_bytes": self.limits.tokenize_inline_bytes,
                    "body_timeout_s": self.limits.body_timeout_s,
                    "max_buffered_bytes": self.limits.max_buffered_bytes,
                    "max_streams_per_connection": self.limits.max_streams_per_connection,
                    "max_connections": self.limits.max_connections,
                },
                "router": {
                    "policy": self.router.policy,
                    "compress_band": self.router.compress_band,
                    "prefix_block_size": self.router.prefix_block_size,
                    "fallbacks": self.router.fallbacks,
                    "saturation": {
                        "max_waiting": self.router.max_waiting,
                        "max_kv_usage": self.router.max_kv_usage,
                    },
                    "objectives": self.router.objectives,
                },
                "scrape": {
                    "enabled": self.scrape.enabled,
                    "interval_s": self.scrape.interval_s,
                    "timeout_s": self.scrape.timeout_s,
                    "unhealthy_after": self.scrape.unhealthy_after,
                    "stale_after": self.scrape.stale_after,
                    "max_page_bytes": self.scrape.max_page_bytes,
                    "max_series": self.scrape.max_series,
                    "engines": self.scrape.engines,
                },
                "pools": [
                    {
                        "name": p.name,
                        "max_context": p.max_context,
                        "budget": p.budget,
                        "queue_limit": p.queue_limit,
                        "endpoints": list(p.endpoints),
                        "engine": p.engine,
                        "models": list(p.models),
                        "adapters": list(p.adapters),
                        "role": p.role,
                        "roles": p.roles,
                        "disaggregation": None
                        if p.decider is None
                        else {
                            "decider": p.decider,
                            "threshold": p.threshold,
                            "handoff": p.handoff,
                            "prefill_timeout_s": p.prefill_timeout_s,
                            "require_kv_transfer_params": p.require_kv_transfer_params,
                            "bootstrap_port": p.bootstrap_port,
                        },
                    }
                    for p in self.pools
                ],
                "tenants": [
                    {
                        "name": t.name,
                        "key_digests": [d.hex() for d in t.key_digests],
                        "expires_at": t.expires_at,
                        "service_class": t.service_class,
                        "entitlement": t.entitlement,
                    }
                    for t in self.tenants
                ],
                "admission": self.admission.spec if self.admission.entitlements else None,
                "models": [
                    {
                        "name": m.name,
                        "tokenizer": m.tokenizer,
                        "chat_template": m.chat_template,
                        "bos_token": m.bos_token,
                        "eos_token": m.eos_token,
                    }
                    for m in self.models
                ],
                "kv_events": self.kv_events.spec(),
                "autoscale": self.autoscale.spec() if self.autoscale else None,
                "flow_control": self.flow_control.spec(),
            }
        )

    def tokenizers(self) -> dict[str, Tokenizer]:
        """The models' loaded tokenizers by model name (``DataPlane.start(tokenizers=...)``)."""
        return {m.name: m.loaded for m in self.models if m.loaded is not None}

    def key_index(self) -> dict[bytes, TenantConfig]:
        """Tenant by API-key digest (see :func:`find_tenant`)."""
        return {d: t for t in self.tenants for d in t.key_digests}


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def find_tenant(index: dict[bytes, TenantConfig], key: str | bytes) -> TenantConfig | None:
    """The tenant holding ``key``, or None.

    The key is hashed first, so the lookup's timing depends on the digest, not
    on how many leading characters of a real key were guessed; the final
    comparison is constant-time (``hmac.compare_digest``).
    """
    digest = key_digest(key)
    tenant = index.get(digest)
    if tenant is None:
        return None
    return tenant if any(hmac.compare_digest(digest, d) for d in tenant.key_digests) else None


def _section(raw: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}: unknown key (expected one of {sorted(allowed)})")
    return raw


REQUIRED = object()


# -- numbers: one rule per number, every range in the table RANGES -----------


@dataclass(frozen=True)
class Rule:
    """What a number of the file may be: its types, its range and the words
    an error says of it; a float rule reads an integer as a float."""

    types: tuple[type, ...]
    lo: float
    hi: float
    expected: str
    as_float: bool = False


def integer(lo: int, hi: int) -> Rule:
    """An integer in ``[lo, hi]``."""
    return Rule((int,), lo, hi, f"an integer in [{lo}, {hi}]")


def number(lo: float, hi: float) -> Rule:
    """A number (an integer or a float, read as a float) in ``[lo, hi]``."""
    return Rule((int, float), lo, hi, f"a number in [{lo}, {hi}]", as_float=True)


#: An integer >= 0 whose range a core checks (naming the key): autoscale's counts.
COUNT = Rule((int,), 0, math.inf, "an integer >= 0")
#: A finite number whose range a core checks (naming the key).
FINITE = Rule((int, float), -sys.float_info.max, sys.float_info.max, "a finite number")

#: A TCP port to connect to (an endpoint's, a ZeroMQ peer's, a bootstrap port).
PORT = integer(1, 65535)
#: A port to listen on (0: any free one).
LISTEN_PORT = integer(0, 65535)
#: When an endpoint is saturated: ``router.saturation`` and ``flow_control.saturation``.
SATURATION: dict[str, Rule] = {"max_waiting": number(0.0, 1e9), "max_kv_usage": number(0.0, 1.0)}

#: Every number of the file by section (``pools`` for each ``pools[i]``): its
#: kind and range, written once. A section's numbers are read in this order.
RANGES: dict[str, dict[str, Rule]] = {
    "server": {
        "port": LISTEN_PORT,
        "api_port": LISTEN_PORT,
        "metrics_port": LISTEN_PORT,
        "grace_s": number(0.0, 86400.0),
        "worker_threads": integer(1, 256),
    },
    "limits": {
        "max_body_bytes": integer(1, 64 << 20),
        "max_message_bytes": integer(1024, 256 << 20),
        "request_timeout_s": number(0.001, 86400.0),
        "default_max_tokens": integer(1, MAX_TOKENS),
        "image_tokens": integer(0, MAX_TOKENS),
        "audio_tokens": integer(0, MAX_TOKENS),
        "tokenize_inline_bytes": integer(0, 1 << 40),
        "body_timeout_s": number(0.001, 86400.0),
        "max_buffered_bytes": integer(1, 1 << 40),
        "max_streams_per_connection": integer(1, 1 << 20),
        "max_connections": integer(1, 1 << 20),
    },
    "router": {
        "compress_band": number(1.0, 100.0),
        "prefix_block_size": integer(1, 1 << 20),
        "fallbacks": integer(0, 64),
    },
    "router.saturation": SATURATION,
    # Any objective name: its priority.
    "router.objectives": {"*": integer(-1000, 1000)},
    "scrape": {
        "interval_s": number(0.001, 3600.0),
        "timeout_s": number(0.001, 60.0),
        "unhealthy_after": integer(1, 1000),
        "stale_after": integer(1, 1000),
        "max_page_bytes": integer(1024, 1 << 30),
        "max_series": integer(1, 10_000_000),
    },
    "admission": {"default_max_tokens": integer(1, MAX_TOKENS), "window_s": number(0.001, 86400.0)},
    "admission.redis": {
        "lease_s": number(0.001, 1e6),
        "unavailable_retry_s": number(0.001, 3600.0),
        "socket_timeout_s": number(0.001, 60.0),
        "max_window_entries": integer(1, MAX_BOUND),
        "max_window_entries_per_quota": integer(1, MAX_BOUND),
        "max_void_markers": integer(1, MAX_BOUND),
        "flush_timeout_s": number(0.0, 3600.0),
    },
    "pools": {
        "max_context": integer(1, MAX_TOKENS),
        "budget": integer(1, MAX_TOKENS),
        "queue_limit": integer(0, 1 << 30),
    },
    "pools.disaggregation": {
        "threshold": number(0.0, 1e12),
        "prefill_timeout_s": number(1e-3, 3600.0),
        "bootstrap_port": PORT,
    },
    "tenants": {"expires_at": number(0.0, 1e11)},
    "kv_events": {
        "block_size": integer(1, 1 << 16),
        "seed": integer(0, (1 << 64) - 1),
        "capacity_blocks": integer(1, 1 << 26),
        "stale_after_s": number(0.001, 86400.0),
        "max_message_bytes": integer(1 << 10, 1 << 30),
        "max_batch_events": integer(1, 1 << 24),
        "max_batch_blocks": integer(1, 1 << 24),
    },
    "flow_control.saturation": {**SATURATION, "max_in_flight": integer(1, 1 << 30)},
    "autoscale": {
        "period_s": FINITE,
        "window_s": FINITE,
        "sub_windows": COUNT,
        "quantile": FINITE,
        "scale_down_delay_s": FINITE,
        "max_step_up": COUNT,
        "max_step_up_percent": FINITE,
        "max_step_down": COUNT,
        "max_step_down_percent": FINITE,
        "queue_drain_s": FINITE,
        "forecast_s": FINITE,
        "max_forecast_ratio": FINITE,
    },
    "autoscale.pools": {
        "min_endpoints": COUNT,
        "max_endpoints": COUNT,
        "slo_ttft_s": FINITE,
        "slo_tpot_s": FINITE,
        "context": COUNT,
    },
}


def _read(raw: dict[str, Any], key: str, where: str, rule: Rule, default: Any) -> Any:
    """``raw[key]`` checked by ``rule``; missing: ``default`` (``REQUIRED``: an
    error; None: null is allowed too)."""
    if key not in raw:
        if default is REQUIRED:
            raise ConfigError(f"{where}.{key}: required")
        return default
    v = raw[key]
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, rule.types) or not rule.lo <= v <= rule.hi:
        raise ConfigError(f"{where}.{key}: expected {rule.expected}, got {v!r}")
    return float(v) if rule.as_float else v


def _number(raw: dict[str, Any], key: str, where: str, section: str, default: Any) -> Any:
    """``raw[key]`` checked by its rule in ``RANGES[section]`` (``*``: any key)."""
    rules = RANGES[section]
    return _read(raw, key, where, rules.get(key) or rules["*"], default)


def _numbers(
    raw: dict[str, Any], where: str, section: str, defaults: Any = None, **given: Any
) -> dict[str, Any]:
    """Every number of ``RANGES[section]`` in ``raw``, checked, by key: missing,
    the one in ``given``, else the default of the dataclass ``defaults`` (None:
    optional)."""
    base = vars(defaults) if defaults is not None else {}
    out = {}
    for key, rule in RANGES[section].items():
        default = given[key] if key in given else base.get(key)
        out[key] = (
            _read(raw, key, where, rule, default) if key in raw or default is REQUIRED else default
        )
    return out


def _str(raw: dict[str, Any], key: str, where: str, default: str, choices=None) -> str:
    v = raw.get(key, default)
    if not isinstance(v, str) or (choices is not None and v not in choices):
        expected = f"one of {list(choices)}" if choices is not None else "a string"
        raise ConfigError(f"{where}.{key}: expected {expected}, got {v!r}")
    return v


def _bool(raw: dict[str, Any], key: str, where: str, default: bool) -> bool:
    v = raw.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}.{key}: expected true or false, got {v!r}")
    return v


def _is_port(text: str) -> bool:
    """``text`` is a TCP port to connect to, in decimal (:data:`PORT`)."""
    return text.isdigit() and PORT.lo <= int(text) <= PORT.hi


def _endpoint(v: Any, where: str) -> str:
    host, sep, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if not sep or not host or not _is_port(port):
        raise ConfigError(f"{where}: expected 'ip:port', got {v!r}")
    return v


def _list(raw: dict[str, Any], key: str, where: str) -> list[Any]:
    v = raw.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(f"{where}.{key}: expected a list, got {type(v).__name__}")
    return v


def _names(raw: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """A list of distinct non-empty strings."""
    items = _list(raw, key, where)
    for j, v in enumerate(items):
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}.{key}[{j}]: expected a non-empty string, got {v!r}")
    if len(set(items)) != len(items):
        raise ConfigError(f"{where}.{key}: a name is listed twice")
    return tuple(items)


#: An HTTP header name (RFC 9110 token, lower case).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def _header_names(raw: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """Header names, lower-cased; pseudo-headers and ``host`` (which Envoy never
    lets an external processor remove) are refused."""
    names = []
    for j, v in enumerate(_list(raw, key, where)):
        name = v.lower() if isinstance(v, str) else None
        if name is None or not _HEADER_NAME.fullmatch(name) or name == "host":
            raise ConfigError(
                f"{where}.{key}[{j}]: expected a header name (not a pseudo-header or host), "
                f"got {v!r}"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


def _zmq(raw: dict[str, Any], key: str, where: str, required: bool) -> str | None:
    v = raw.get(key)
    if v is None and not required:
        return None
    host, sep, port = v[len("tcp://") :].rpartition(":") if isinstance(v, str) else ("", "", "")
    if (
        not isinstance(v, str)
        or not v.startswith("tcp://")
        or not sep
        or not host
        or not _is_port(port)
    ):
        raise ConfigError(f"{where}.{key}: expected a ZeroMQ address 'tcp://host:port', got {v!r}")
    return v


def _kv_events(raw: Any, pools: tuple[PoolConfig, ...]) -> KvEventsConfig:
    k = _section(raw, "kv_events", {*RANGES["kv_events"], "endpoints"})
    endpoints = k.get("endpoints", {})
    if not isinstance(endpoints, dict):
        raise ConfigError(
            "kv_events.endpoints: expected a mapping of endpoint to its event source, "
            f"got {type(endpoints).__name__}"
        )
    known = {e for p in pools for e in p.endpoints}
    sources = []
    for name, raw_source in endpoints.items():
        where = f"kv_events.endpoints[{name!r}]"
        if name not in known:
            raise ConfigError(f"{where}: not an endpoint of any pool")
        src = _section(raw_source, where, {"zmq", "topic", "replay"})
        zmq = _zmq(src, "zmq", where, required=True)
        assert zmq is not None
        sources.append(
            KvEventSource(
                endpoint=name,
                zmq=zmq,
                topic=_str(src, "topic", where, ""),
                replay=_zmq(src, "replay", where, required=False),
            )
        )
    return KvEventsConfig(
        **_numbers(k, "kv_events", "kv_events", KvEventsConfig), sources=tuple(sources)
    )


def _pools(raw_list: list[Any], engines: dict[str, Any]) -> tuple[PoolConfig, ...]:
    if not raw_list:
        raise ConfigError("pools: at least one pool is required")
    pools, seen = [], set()
    keys = {"name", *RANGES["pools"], "endpoints", "engine"}
    for i, raw in enumerate(raw_list):
        where = f"pools[{i}]"
        raw = _section(raw, where, keys | {"models", "adapters", "role", "roles", "disaggregation"})
        name = _str(raw, "name", where, "")
        if not name or name in seen:
            raise ConfigError(f"{where}.name: expected a unique non-empty name, got {name!r}")
        seen.add(name)
        endpoints = [
            _endpoint(e, f"{where}.endpoints[{j}]")
            for j, e in enumerate(_list(raw, "endpoints", where))
        ]
        if len(set(endpoints)) != len(endpoints):
            raise ConfigError(f"{where}.endpoints: an endpoint is listed twice")
        pool = PoolConfig(
            name=name,
            **_numbers(raw, where, "pools", PoolConfig, max_context=REQUIRED),
            endpoints=tuple(endpoints),
            engine=_str(raw, "engine", where, "vllm", tuple(engines)),
            models=_names(raw, "models", where),
            adapters=_names(raw, "adapters", where),
            **_disaggregation(raw, where, endpoints),
        )
        try:
            pool.to_pool()
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from e
        if pool.endpoints:
            try:  # The core's checks of the roles and the decider (docs/disaggregation.md).
                EndpointPicker(
                    list(pool.endpoints),
                    "least-request",
                    roles={e: pool.roles.get(e, pool.role) for e in pool.endpoints},
                    decider=pool.decider,
                    threshold=pool.threshold,
                )
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e
        pools.append(pool)
    return tuple(pools)


def _disaggregation(raw: dict[str, Any], where: str, endpoints: list[str]) -> dict[str, Any]:
    """A pool's ``role``, ``roles`` and ``disaggregation`` keys."""
    roles = _mapping(raw.get("roles"), f"{where}.roles")
    for name in roles:
        if name not in endpoints:
            raise ConfigError(f"{where}.roles: {name!r} is not an endpoint of the pool")
        _str(roles, name, f"{where}.roles", "both", ROLES)
    here = f"{where}.disaggregation"
    keys = {"decider", "handoff", "require_kv_transfer_params", *RANGES["pools.disaggregation"]}
    d = _section(raw.get("disaggregation"), here, keys)
    decider = None
    if d:
        decider = _str(d, "decider", here, "", DECIDERS)
    return {
        "role": _str(raw, "role", where, "both", ROLES),
        "roles": dict(roles),
        "decider": decider,
        "handoff": _str(d, "handoff", here, "header", HANDOFFS),
        "require_kv_transfer_params": _bool(d, "require_kv_transfer_params", here, True),
        **_numbers(d, here, "pools.disaggregation", PoolConfig),
    }


def _tenants(raw_list: list[Any], admission: AdmissionConfig) -> tuple[TenantConfig, ...]:
    tenants, names, digests = [], set(), set()
    for i, raw in enumerate(raw_list):
        where = f"tenants[{i}]"
        raw = _section(raw, where, {"name", "api_keys", "expires_at", "entitlement"})
        name = _str(raw, "name", where, "")
        if not name or name in names:
            raise ConfigError(f"{where}.name: expected a unique non-empty name, got {name!r}")
        names.add(name)
        keys = _list(raw, "api_keys", where)
        if not keys:
            raise ConfigError(f"{where}.api_keys: at least one key is required")
        tenant_digests = []
        for j, k in enumerate(keys):
            if not isinstance(k, str) or not 8 <= len(k) <= 4096:
                # The value is never echoed: it may be a real key with a typo.
                raise ConfigError(f"{where}.api_keys[{j}]: expected a string of 8 to 4096 chars")
            d = key_digest(k)
            if d in digests:
                raise ConfigError(f"{where}.api_keys[{j}]: key already belongs to a tenant")
            digests.add(d)
            tenant_digests.append(d)
        entitlement = raw.get("entitlement")
        if entitlement is not None and entitlement not in admission.entitlements:
            raise ConfigError(
                f"{where}.entitlement: {entitlement!r} is not an admission.entitlements name"
            )
        tenants.append(
            TenantConfig(
                name=name,
                key_digests=tuple(tenant_digests),
                expires_at=_number(raw, "expires_at", where, "tenants", None),
                service_class=admission.service_classes.get(entitlement, "none"),
                entitlement=entitlement,
            )
        )
    return tuple(tenants)


def _models(raw_list: list[Any]) -> tuple[ModelConfig, ...]:
    """Checks every model's tokenizer and chat template by loading them (once: the
    loaded tokenizer is what the data plane uses)."""
    models, names = [], set()
    for i, raw in enumerate(raw_list):
        where = f"models[{i}]"
        raw = _section(raw, where, {"name", "tokenizer", "chat_template", "bos_token", "eos_token"})
        name = _str(raw, "name", where, "")
        if not name or name in names:
            raise ConfigError(f"{where}.name: expected a unique non-empty name, got {name!r}")
        names.add(name)
        if "tokenizer" not in raw:
            raise ConfigError(f"{where}.tokenizer: required (the path of a tokenizer.json)")
        path = Path(_str(raw, "tokenizer", where, "")).resolve()
        template = None
        if raw.get("chat_template") is not None:
            template_path = _str(raw, "chat_template", where, "")
            try:
                template = Path(template_path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{where}.chat_template: cannot read {template_path}: {e}") from e
        special = {
            key: _str(raw, key, where, "")
            for key in ("bos_token", "eos_token")
            if raw.get(key) is not None
        }
        try:
            loaded = Tokenizer(path, chat_template=template, **special)
        except ValueError as e:
            # The core's message starts with the key at fault: tokenizer, chat_template,
            # bos_token or eos_token.
            raise ConfigError(f"{where}.{e}") from e
        models.append(
            ModelConfig(
                name=name, tokenizer=str(path), chat_template=template, loaded=loaded, **special
            )
        )
    return tuple(models)


def _redis(raw: dict[str, Any]) -> None:
    """Checks ``admission.redis`` (given keys only: RedisAdmission has the defaults)."""
    where = "admission.redis"
    if "url" in raw:
        url = _str(raw, "url", where, "")
        if not url.startswith(URL_SCHEMES):
            raise ConfigError(f"{where}.url: expected a redis://, rediss:// or unix:// URL")
    if "prefix" in raw and not _str(raw, "prefix", where, ""):
        raise ConfigError(f"{where}.prefix: must not be empty")
    _str(raw, "failure_mode", where, "closed", FAILURE_MODES)
    _numbers(
        raw,
        where,
        where,
        lease_s=300.0,
        unavailable_retry_s=1.0,
        socket_timeout_s=0.5,
        max_window_entries=1024,
        max_window_entries_per_quota=16384,
        max_void_markers=1024,
        flush_timeout_s=5.0,
    )


def _renamed(raw: dict[str, Any], where: str) -> None:
    try:
        check_renamed(raw, where)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _admission(raw: Any) -> AdmissionConfig:
    """Checks every quota and entitlement by building it (the core validates)."""
    if isinstance(raw, dict):
        _renamed(raw, "admission.")
    a = _section(
        raw,
        "admission",
        {"backend", "quotas", "entitlements", "default_max_tokens", "window_s", "redis"},
    )
    backend = _str(a, "backend", "admission", "memory", ADMISSION_BACKENDS)
    classes = {}
    for key, cls in (("quotas", Quota), ("entitlements", Entitlement)):
        for i, item in enumerate(_list(a, key, "admission")):
            if not isinstance(item, dict):
                raise ConfigError(f"admission.{key}[{i}]: expected a mapping")
            if key == "entitlements":
                _renamed(item, f"admission.{key}[{i}].")
            try:
                cls(**item)
            except (TypeError, ValueError, KeyError) as e:
                raise ConfigError(f"admission.{key}[{i}]: {e}") from e
            if key == "entitlements":
                classes[item["name"]] = item["service_class"]
    redis = _section(
        a.get("redis"),
        "admission.redis",
        set(REDIS_OPTIONS),
    )
    if backend == "redis" and not redis.get("url"):
        raise ConfigError("admission.redis.url: required when admission.backend is 'redis'")
    _redis(redis)
    _numbers(a, "admission", "admission", default_max_tokens=4096, window_s=60.0)
    try:  # cross-references (an entitlement's quota) are checked by a trial build in memory
        if classes:
            admission_from_config({**a, "backend": "memory"}).close()
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"admission: {e}") from e
    return AdmissionConfig(backend=backend, spec=dict(a), service_classes=classes)


def _metric_names(raw: Any, where: str, base: dict[str, Any] | None) -> dict[str, Any]:
    """One engine kind's metric names: given keys over ``base`` (all required without)."""
    raw = _section(raw, where, {"waiting", "running", "kv_usage", "adapters"})
    out = dict(base or {})
    for key in ("waiting", "running", "kv_usage"):
        if key in raw:
            out[key] = list(_names(raw, key, where))
            if not out[key]:
                raise ConfigError(f"{where}.{key}: at least one metric name is required")
        elif base is None:
            raise ConfigError(f"{where}.{key}: required")
    if "adapters" in raw:
        v = raw["adapters"]
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(f"{where}.adapters: expected a metric name or null, got {v!r}")
        out["adapters"] = v
    out.setdefault("adapters", None)
    return out


def _autoscale(
    raw: Any, pools: tuple[PoolConfig, ...], admission: AdmissionConfig
) -> AutoscaleConfig | None:
    """The ``autoscale`` section (None when absent): each pool a pool of the
    file, its profile a preset name or a mapping of Profile fields, its
    entitlements admission's; the rest checked by building the core's
    autoscaler, whose errors name the key."""
    if raw is None:
        return None
    a = dict(_section(raw, "autoscale", {*RANGES["autoscale"], "pools"}))
    _numbers(a, "autoscale", "autoscale")
    rates = {e["name"]: float(e["tokens_per_s"]) for e in admission.spec.get("entitlements", ())}
    out, profiles, promised = [], [], []
    for i, item in enumerate(_list(a, "pools", "autoscale")):
        where = f"autoscale.pools[{i}]"
        keys = {*RANGES["autoscale.pools"], "name", "profile", "entitlements"}
        p = dict(_section(item, where, keys))
        _numbers(p, where, "autoscale.pools")
        name = _str(p, "name", where, "", [q.name for q in pools])
        profile = p.pop("profile", DEFAULT_PRESET)
        try:
            if isinstance(profile, str):
                if profile not in PRESETS:
                    raise ValueError(f"expected one of {sorted(PRESETS)} or a mapping")
                profile = PRESETS[profile]()
            elif isinstance(profile, dict):
                profile = profile_from_dict(profile)
            else:
                raise ValueError("expected a preset name or a mapping of Profile fields")
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{where}.profile: {e}") from e
        entitlements = _names(p, "entitlements", where)
        for e in entitlements:
            if e not in rates:
                raise ConfigError(f"{where}.entitlements: {e!r} is not an admission entitlement")
        p.setdefault("context", next(q.max_context for q in pools if q.name == name))
        out.append(p)
        profiles.append(profile)
        promised.append(sum(rates[e] for e in entitlements))
    if not out:
        raise ConfigError("autoscale.pools: name at least one pool")
    config = {**a, "pools": out}
    try:
        Autoscaler(config, profiles, now=0.0)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(str(e)) from e
    return AutoscaleConfig(config, tuple(profiles), tuple(promised))


def _scrape(raw: Any) -> ScrapeConfig:
    s = _section(raw, "scrape", {"enabled", *RANGES["scrape"], "engines"})
    enabled = _bool(s, "enabled", "scrape", True)
    engines = dict(ENGINE_METRICS)
    for kind, names in _section(
        s.get("engines"), "scrape.engines", set(s.get("engines") or {})
    ).items():
        engines[kind] = _metric_names(names, f"scrape.engines.{kind}", ENGINE_METRICS.get(kind))
    return ScrapeConfig(
        enabled=enabled, **_numbers(s, "scrape", "scrape", ScrapeConfig), engines=engines
    )


def _mapping(raw: Any, where: str) -> dict[str, Any]:
    """A mapping with any non-empty string keys."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: expected non-empty names, got {key!r}")
    return raw


def _objectives(raw: Any) -> dict[str, int]:
    objectives = _mapping(raw, "router.objectives")
    for name in objectives:
        _number(objectives, name, "router.objectives", "router.objectives", REQUIRED)
    return dict(objectives)


def parse_config(raw: Any) -> Config:
    """A validated :class:`Config` from the parsed YAML document."""
    top = _section(
        raw,
        "config",
        {
            "server",
            "limits",
            "router",
            "scrape",
            "admission",
            "pools",
            "tenants",
            "models",
            "kv_events",
            "autoscale",
            "flow_control",
        },
    )
    scrape = _scrape(top.get("scrape"))
    s = _section(
        top.get("server"),
        "server",
        {
            *RANGES["server"],
            "host",
            "key_header",
            "strip_headers",
            "failure_mode",
            "default_pool",
            "state_file",
            "unix_socket",
            "unix_socket_mode",
        },
    )
    if type(s.get("unix_socket_mode")) is int:  # YAML reads an unquoted 0660 as octal
        s = {**s, "unix_socket_mode": f"0{s['unix_socket_mode']:o}"}
    pools = _pools(_list(top, "pools", "config"), scrape.engines)
    server = ServerConfig(
        **_numbers(s, "server", "server", ServerConfig),
        host=_str(s, "host", "server", ServerConfig.host),
        key_header=_str(s, "key_header", "server", ServerConfig.key_header).lower(),
        strip_headers=_header_names(s, "strip_headers", "server"),
        failure_mode=_str(s, "failure_mode", "server", "closed", FAILURE_MODES),
        default_pool=_str(s, "default_pool", "server", pools[0].name, [p.name for p in pools]),
        state_file=_str(s, "state_file", "server", ""),
        unix_socket=_str(s, "unix_socket", "server", ""),
        unix_socket_mode=_str(s, "unix_socket_mode", "server", "0600", ["0600", "0660"]),
    )
    if not server.key_header:
        raise ConfigError("server.key_header: must not be empty")
    lim = _section(top.get("limits"), "limits", set(RANGES["limits"]))
    limits = Limits(**_numbers(lim, "limits", "limits", Limits))
    if limits.max_buffered_bytes < limits.max_body_bytes:
        raise ConfigError(
            "limits.max_buffered_bytes: must be at least limits.max_body_bytes "
            f"({limits.max_body_bytes}), or no body that large could be received"
        )
    r = _section(
        top.get("router"),
        "router",
        {"policy", "compress_band", "prefix_block_size", "fallbacks", "saturation", "objectives"},
    )
    sat = _section(r.get("saturation"), "router.saturation", set(SATURATION))
    router = RouterConfig(
        policy=_str(r, "policy", "router", RouterConfig.policy, tuple(POLICIES)),
        **_numbers(r, "router", "router", RouterConfig),
        **_numbers(sat, "router.saturation", "router.saturation", RouterConfig),
        objectives=_objectives(r.get("objectives")),
    )
    admission = _admission(top.get("admission"))
    flow_control = _flow_control(top.get("flow_control"))
    if (
        flow_control.queue is not None
        and flow_control.detector == "utilization"
        and not scrape.enabled
    ):
        raise ConfigError(
            "flow_control.saturation.detector: utilization reads the scraped queue and KV use, "
            "and scrape.enabled is false (every request would wait): use concurrency"
        )
    return Config(
        server=server,
        limits=limits,
        router=router,
        admission=admission,
        pools=pools,
        tenants=_tenants(_list(top, "tenants", "config"), admission),
        models=_models(_list(top, "models", "config")),
        scrape=scrape,
        kv_events=_kv_events(top.get("kv_events"), pools),
        autoscale=_autoscale(top.get("autoscale"), pools, admission),
        flow_control=flow_control,
    )


#: What PyYAML quotes of the file in its messages that may be shown: one or
#: two characters ('\\t', ']') and its token names ('<block end>').
_SAFE_QUOTE = re.compile(r"'(.{0,2}|<[a-z ]+>)'")


def _yaml_error(e: Exception) -> str:
    """A YAML error without any text of the file: PyYAML's message quotes
    the lines around the error (a snippet) and names in it (an alias, a tag),
    which on or next to an ``api_keys`` line is a key. What is kept: the
    description, with any quoted text but a character or a token name
    elided, and the line and column."""
    import yaml

    if not isinstance(e, yaml.MarkedYAMLError):
        return type(e).__name__

    def redact(text: str) -> str:
        return re.sub(
            r"'[^'\n]*'", lambda m: m[0] if _SAFE_QUOTE.fullmatch(m[0]) else "'...'", text
        )

    parts = [
        redact(text) + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
        for text, mark in ((e.context, e.context_mark), (e.problem, e.problem_mark))
        if text
    ]
    return ", ".join(parts)


def _yaml_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML
    keeps the last one silently: a second ``api_keys`` would drop the keys of
    the first)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                        continue
                    key = self.construct_object(key_node)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            "found a key given twice",
                            key_node.start_mark,
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def load_config(path: str | Path) -> Config:
    """Reads and validates a YAML configuration file. No error shows the
    file's text (:func:`_yaml_error`)."""
    import yaml

    try:
        raw = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_yaml_loader())
    except yaml.YAMLError as e:
        # Not chained: the original's message quotes the file.
        raise ConfigError(f"{path}: not valid YAML: {_yaml_error(e)}") from None
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
