"""Every service's settings: one frozen dataclass each, each setting defined once.

A setting is a dataclass field made with `setting()`: its name, type, default and help text. From
that one definition come its flag (`--max-decode-batch`), its environment variable
(PDSERVE_MAX_DECODE_BATCH), its line in `pdserve serve ROLE --help` and its row in the table of
docs/containers.md (`python -m pdserve.settings` prints it). Adding a setting is one edit here.

This is the only module that reads the environment. A variable sets a flag's default, so a flag
given on the command line wins, and `--help` shows the value in force. An empty variable counts as
unset, so docker-compose.yml can pass `${PDSERVE_X:-}` through without repeating the default.
"""

import argparse
import os
import sys
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import ClassVar, Protocol, get_type_hints

from pdserve.core.config import (
    AUTO_WEIGHTS,
    NUMERICS,
    Q4_KERNEL_CHOICES,
    STEP_OPS_CHOICES,
    WEIGHT_FORMATS,
)
from pdserve.faults import Faults

ENV_PREFIX = "PDSERVE_"
DEFAULT_PORTS = {"router": 50051, "prefill": 50052, "decode": 50053, "colocated": 50051}
DTYPES = ("", "bfloat16", "float16", "float32")
# Prefill's prefix cache cuts prompts into blocks of this many tokens, decode's default
# --block-size, so that by default both caches find the same prefixes (the router's index of
# what prefill holds uses decode's block size).
PREFILL_BLOCK_TOKENS = 16
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def setting(default, help: str, flag: str | None = None, secret: bool = False):
    """A settings field that carries its help text.

    `flag` names the flag, and so the variable, where the field's name would be ambiguous on a
    command line shared with other services' settings (DecodeSettings.max_batch is
    --max-decode-batch, since the colocated service also has a prefill batch).
    """
    metadata = {"help": help, "flag": flag, "secret": secret}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CommonSettings:
    TITLE: ClassVar[str] = "server"

    model: str = setting(
        "smollm2-135m-instruct",
        "the model to serve: a checkpoint directory (config.json, *.safetensors, tokenizer.json), "
        "a .gguf file, or a built-in name (smollm2-135m-instruct, tinygpt)",
    )
    dtype: str = setting(
        "", "weights and KV dtype: bfloat16, float16 or float32; empty for the checkpoint's own"
    )
    weights: str = setting(
        AUTO_WEIGHTS,
        "how the linear layers hold their weights: dense (in --dtype), int8 (one byte a "
        "weight, any Llama-family checkpoint), q4 (4-bit groups of 32; a Q4_1 GGUF's own "
        "blocks, as llama.cpp reads them), or auto: q4 for a bfloat16 model from a Q4_1 GGUF "
        "(the default model), else dense. Prefill and decode must agree: it is part of the "
        "model's fingerprint",
    )
    numerics: str = setting(
        "fast",
        "fast: each pass takes its fastest kernels, so a request's tokens can change with the "
        "batch it shares, the path it takes (prefilled apart, locally, in chunks) and after a "
        "migration; invariant: every sum in an order fixed by positions alone, so they cannot, "
        "at a cost (docs/measurements.md). Every service must agree: it is part of the "
        "model's fingerprint",
    )
    q4_kernel: str = setting(
        "auto",
        "what multiplies q4 layers: torch (torch's int4 kernel), native (pdserve's AVX2 "
        "kernel on llama.cpp's own Q4_1 bytes, activations rounded to 8 bits as llama.cpp "
        "does; built by scripts/install.sh, needs AVX2, FMA and F16C), or auto: native "
        "wherever it runs, else torch (native was the faster on the AVX2 and the AVX-512 CPUs "
        "measured). Every service must agree: it is part of the model's fingerprint, so name "
        "the kernel where prefill and decode run on different kinds of CPU",
    )
    step_ops: str = setting(
        "auto",
        "how a step's work besides the matrices runs: native (pdserve's fused ops: each norm, "
        "RoPE and the paged decode attention one call per layer, reading the cache in its own "
        "dtype; built by scripts/install.sh, x86-64 with AVX2), torch (torch's own ops), or "
        "auto: native where it runs, for fast numerics in float32 or bfloat16, else torch. "
        "Every service must agree: it is part of the model's fingerprint",
    )
    host: str = setting(
        "127.0.0.1",
        "address to listen on (gRPC, metrics and the KV data plane); 0.0.0.0 for every "
        "interface, which needs --tls-* or --insecure",
    )
    port: int = setting(0, "gRPC port, 0 picks a free one")
    metrics_port: int = setting(0, "Prometheus /metrics HTTP port, 0 for none")
    instance: str = setting("", "name in logs and responses; empty for role@host:port")
    grace_seconds: float = setting(
        10.0, "on SIGTERM, how long in-flight requests may take to finish"
    )
    cpus: str = setting(
        "",
        "CPUs this service may run on, as Linux lists them (e.g. 0 or 0-1,3); empty for all "
        "the process was given. Prefill and decode pinned apart do not slow each other",
    )
    torch_threads: int = setting(0, "threads for torch; 0 for one per CPU the service may use")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    tls_cert: str = setting("", "PEM certificate of this service's role (pdserve certs makes them)")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_ca: str = setting(
        "", "PEM CA that signs every peer; with --tls-cert and --tls-key, turns on mutual TLS"
    )
    insecure: bool = setting(
        False, "allow plaintext on an address other than loopback (a warning names the port)"
    )
    max_concurrent_rpcs: int = setting(
        1024, "calls this service runs at once; beyond it gRPC answers RESOURCE_EXHAUSTED"
    )
    max_connection_age_seconds: float = setting(
        1800.0,
        "clients must reconnect (and show their certificate again) after this long; calls in "
        "progress get 900 s more to finish. 0: connections live as long as their clients",
    )
    otlp_endpoint: str = setting(
        "",
        "OpenTelemetry: the OTLP/gRPC collector (host:port, plaintext) to export this service's "
        "traces to, one trace per request across router, prefill and decode; empty (default): "
        "no tracing, and nothing of OpenTelemetry is loaded",
    )
    # Not a flag: fault injection is for tests only and must never be on by accident.
    faults: Faults = field(default_factory=Faults)  # PDSERVE_FAULTS

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a checkpoint, a .gguf file or a built-in model")
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "weights", (AUTO_WEIGHTS, *WEIGHT_FORMATS))
        _one_of(self, "numerics", NUMERICS)
        _one_of(self, "q4_kernel", Q4_KERNEL_CHOICES)
        _one_of(self, "step_ops", STEP_OPS_CHOICES)
        _one_of(self, "log_level", LOG_LEVELS, self.log_level.upper())
        parse_cpu_list(self.cpus)  # ValueError on a malformed list
        if self.otlp_endpoint:
            _host_port(self, "otlp_endpoint", self.otlp_endpoint)
        if self.max_connection_age_seconds < 0:
            raise ValueError("--max-connection-age-seconds must be 0 (no limit) or positive")


KV_TRANSPORTS = ("auto", "tcp", "grpc")
ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware")  # services/router/policy.py
PREFIX_CACHE_SCOPES = ("client", "shared")
KV_COMPRESSIONS = ("none", "int8")


@dataclass(frozen=True)
class DecodeSettings:
    TITLE: ClassVar[str] = "decode pool"

    common: CommonSettings
    num_blocks: int = setting(2048, "KV blocks in the pool")
    block_size: int = setting(16, "tokens per KV block")
    max_batch: int = setting(64, "sequences decoded together per step", flag="max-decode-batch")
    lease_ttl_seconds: float = setting(30.0, "an uncommitted reservation expires after this long")
    lease_first_chunk_seconds: float = setting(
        20.0, "a reservation that has received no KV chunk after this long expires"
    )
    max_pending_lease_share: float = setting(
        0.5,
        "share of the pool's blocks that reservations still waiting for their KV may hold "
        "together; beyond it a reservation is refused (RESOURCE_EXHAUSTED), so callers that "
        "reserve and never send KV cannot take every block. It is split between the callers "
        "holding such reservations, and a caller's share between the clients it names (the "
        "router's), so that one client's burst cannot fill the router's share",
    )
    max_pool_share_per_client: float = setting(
        0.9,
        "share of the pool's blocks that one client's requests (an API key at the router, "
        "else an address) may hold together, waiting for KV, decoding, or prefilled on this "
        "instance; beyond it that client waits for room (RESOURCE_EXHAUSTED to the router, "
        "which queues it) while the rest is left for other clients, so that one client's burst "
        "cannot make another wait for its streams to end. 1: no share kept back",
    )
    max_kv_streams: int = setting(
        0,
        "DecodeService.PushKv streams received at once; more are refused at once "
        "(RESOURCE_EXHAUSTED). It must be below --max-concurrent-rpcs, which PushKv shares with "
        "the router's calls, so that KV streams cannot take every one of them. 0: a quarter of "
        "--max-concurrent-rpcs (at least 1)",
    )
    kv_first_frame_seconds: float = setting(
        10.0,
        "a PushKv stream whose first message has not arrived this long after the call began is "
        "ended (DEADLINE_EXCEEDED; prefill opens the call with its first chunk ready); a whole "
        "stream may last at most --lease-ttl-seconds",
    )
    max_kv_connections: int = setting(
        256,
        "connections the TCP data plane holds open at once; more are refused "
        "(RESOURCE_EXHAUSTED) as they connect",
    )
    max_kv_connections_per_peer: int = setting(
        64,
        "connections the TCP data plane holds open at once from one address (a prefill "
        "instance opens one per KV handoff in flight, up to its --max-concurrent-prefills)",
    )
    kv_data_port: int = setting(
        0,
        "port of the TCP data plane that receives KV, offered with every lease; 0: any free "
        "port, -1: no data plane (KV over DecodeService.PushKv only)",
    )
    prefix_cache: bool = setting(
        True,
        "decode service: keep the full KV blocks of finished prompts, found again by a hash "
        "chain over their tokens, and evicted least recently used first when the pool needs "
        "room; a prompt it prefills itself starts after its longest cached prefix",
    )
    local_prefill_chunk_tokens: int = setting(
        256,
        "decode service: prompt tokens per step when it prefills a short prompt itself (the "
        "router's --local-prefill-tokens), carried in the same forward pass as the running "
        "decodes, so they wait at most one such step",
    )

    def __post_init__(self) -> None:
        _positive(
            self,
            "num_blocks",
            "block_size",
            "max_batch",
            "lease_ttl_seconds",
            "lease_first_chunk_seconds",
            "local_prefill_chunk_tokens",
            "kv_first_frame_seconds",
            "max_kv_connections",
            "max_kv_connections_per_peer",
        )
        if self.max_kv_streams < 0:
            raise ValueError(f"--max-kv-streams {self.max_kv_streams}: expected 0 or positive")
        if 0 < self.common.max_concurrent_rpcs <= self.max_kv_streams:
            raise ValueError(
                f"--max-kv-streams {self.max_kv_streams} must be below --max-concurrent-rpcs "
                f"{self.common.max_concurrent_rpcs}, or KV streams could lock the router out"
            )
        if not 0 < self.max_pending_lease_share <= 1:
            raise ValueError(
                f"--max-pending-lease-share {self.max_pending_lease_share}: expected (0, 1]"
            )
        if not 0 < self.max_pool_share_per_client <= 1:
            raise ValueError(
                f"--max-pool-share-per-client {self.max_pool_share_per_client}: expected (0, 1]"
            )
        if not -1 <= self.kv_data_port <= 65535:
            raise ValueError(f"--kv-data-port {self.kv_data_port}: expected -1, 0 or a port")

    @property
    def kv_stream_limit(self) -> int:
        """--max-kv-streams, with 0 resolved against --max-concurrent-rpcs."""
        return self.max_kv_streams or max(1, self.common.max_concurrent_rpcs // 4)


@dataclass(frozen=True)
class PrefillSettings:
    TITLE: ClassVar[str] = "prefill batching"

    common: CommonSettings
    max_batch_size: int = setting(8, "prompts per prefill batch", flag="max-prefill-batch")
    max_batch_tokens: int = setting(
        4096, "prompt tokens per prefill batch", flag="max-prefill-tokens"
    )
    decode_allow: list[str] = setting(
        [],
        "decode instances this prefill may send KV to, host:port (a name counts for every "
        "address it resolves to, as the router's --decode); empty: loopback addresses that "
        "answer as a decode (asked before anything of the request is sent). A Prefill call "
        "naming any other address is refused before a connection is tried",
    )
    max_concurrent_prefills: int = setting(
        64, "Prefill calls in progress at once; more get RESOURCE_EXHAUSTED"
    )
    max_queued_prompt_tokens: int = setting(
        65536, "prompt tokens waiting for a prefill batch; more get RESOURCE_EXHAUSTED"
    )
    push_timeout_seconds: float = setting(
        120.0, "a KV push whose caller set no deadline gives up after this long"
    )
    # 1 MiB: gRPC streams moved these ~5x faster than 64 KiB pieces (2-vCPU VM, grpcio 1.85).
    chunk_bytes: int = setting(1 << 20, "largest KV chunk sent to decode (at most 4 MiB)")
    kv_transport: str = setting(
        "auto",
        "how KV goes to decode: auto (the lease's TCP data plane when decode offers one, else "
        "gRPC), tcp (the data plane, or the request fails), grpc (DecodeService.PushKv)",
    )

    prefix_cache_tokens: int = setting(
        16384,
        "prefill service: prompt tokens of KV kept in its own prefix cache (a hash chain over "
        "16-token blocks, least recently used evicted first), so a prompt starts computing after "
        "its longest cached prefix; also the room its batches are computed in. 0: no cache",
    )

    kv_compression: str = setting(
        "none",
        "KV on the wire: none (exact), or int8 (lossy: a scale per token and head, about 0.53x "
        "the bytes of bf16 KV and 0.27x of fp32; see docs/handoff.md)",
    )

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_batch_size",
            "max_batch_tokens",
            "chunk_bytes",
            "max_concurrent_prefills",
            "max_queued_prompt_tokens",
            "push_timeout_seconds",
        )
        if self.prefix_cache_tokens != 0 and self.prefix_cache_tokens < PREFILL_BLOCK_TOKENS:
            raise ValueError(
                f"--prefix-cache-tokens {self.prefix_cache_tokens}: 0 (no cache), or at least "
                f"one block of {PREFILL_BLOCK_TOKENS}"
            )
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(
                f"--kv-compression {self.kv_compression!r}: expected one of "
                f"{', '.join(KV_COMPRESSIONS)}"
            )
        if self.chunk_bytes > 4 << 20:  # gRPC messages are capped at 8 MiB (rpc/server.py)
            raise ValueError(f"--chunk-bytes {self.chunk_bytes}: at most {4 << 20}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"--kv-transport {self.kv_transport!r}: expected one of {', '.join(KV_TRANSPORTS)}"
            )
        _host_ports(self, "decode_allow")


@dataclass(frozen=True)
class RouterSettings:
    TITLE: ClassVar[str] = "routing"

    common: CommonSettings
    prefill: list[str] = setting(
        [f"127.0.0.1:{DEFAULT_PORTS['prefill']}"],
        "prefill instances, host:port; a host with several addresses counts as several instances",
    )
    decode: list[str] = setting(
        [f"127.0.0.1:{DEFAULT_PORTS['decode']}"], "decode instances, host:port"
    )
    max_queue: int = setting(
        256, "requests that may wait for decode room; more get RESOURCE_EXHAUSTED"
    )
    max_queue_share_per_client: float = setting(
        0.5,
        "share of --max-queue that one client (an API key, or else an address) may have waiting "
        "for decode room; more of its requests get RESOURCE_EXHAUSTED (HTTP 429), so that one "
        "client's burst cannot fill the queue. Clients take turns at the room that frees (round "
        "robin over per-client lines), so one waits behind another's burst for one turn, not "
        "for all of it",
    )
    queue_timeout_seconds: float = setting(
        30.0, "longest wait for decode room, and for a prefill call (--prefill-calls-per-instance)"
    )
    prefill_calls: int = setting(
        64,
        "Prefill calls this router keeps in progress at one prefill instance; more wait in line "
        "(clients taking turns, as for decode room) instead of failing. Set it to that "
        "instance's --max-concurrent-prefills, divided by the routers that share it",
        flag="prefill-calls-per-instance",
    )
    max_migrations: int = setting(
        2,
        "times a request whose decode instance fails mid-stream moves to another pair and "
        "continues from its next token (token-identical: the prompt plus the tokens sent are "
        "prefilled again); 0: it ends with UNAVAILABLE",
    )
    routing_policy: str = setting(
        "round-robin",
        "the order in which instances are tried: round-robin; least-loaded (decode: most "
        "free KV blocks, then fewest running sequences, from GetPoolStats every second; "
        "prefill: fewest prompt tokens this router has in flight there); or prefix-aware "
        "(the decode and the prefill instance believed to hold the longest cached prefix of "
        "the prompt first, unless it is busier than another by more than the prefix saves; "
        "then least-loaded; with --local-prefill-tokens, only the part uncached on decode "
        "counts against it)",
    )
    prefix_cache_scope: str = setting(
        "client",
        "whose cached prompt prefixes a request may reuse, on decode and prefill: client (only "
        "its own client's, the client being its API key, else its address; so no client can "
        "tell from its time to first token what another sent), or shared (every client's: "
        "more hits, for clients that trust one another)",
    )
    prefix_cache_secret_file: str = setting(
        "",
        "a file of at least 16 secret bytes that keys the prefix-cache salt of each client known "
        "by its address (without --api-key), so that no one else can compute it and probe or "
        "fill that client's cached prefixes; give every router the same file so that a client "
        "keeps its salt whichever router it reaches. Empty: a secret made at start, this "
        "router's own",
    )
    max_attempts: int = setting(
        3,
        "handoff attempts per request; a request is retried on another instance only while "
        "no token has reached the client",
    )
    request_timeout_seconds: float = setting(
        600.0,
        "deadline of a request whose client set none; a client's own deadline is kept when shorter",
    )
    http_port: int = setting(
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health; docs/api.md), on --host beside gRPC; 0 turns it off",
    )
    api_key: str = setting(
        "",
        "one or more API keys, comma-separated. When set, gRPC Generate and the HTTP API's /v1/* "
        "require 'authorization: Bearer <key>', and each key is one client for the per-client "
        "limits. Set it through the variable rather than the flag, which other users can read "
        "in the process list",
        secret=True,
    )
    local_prefill_tokens: str = setting(
        "0",
        "prompts of at most this many tokens are prefilled on the decode instance itself, with "
        "no KV handoff (conditional disaggregation); 'auto' derives the threshold from the "
        "measured prefill speed, handoff bandwidth and handoff overhead (services/router/"
        "local_prefill.py); 0: every prompt goes to a prefill instance",
    )
    max_streams_per_client: int = setting(
        256,
        "requests one client (an API key, or else an address) may have open at once; more get "
        "RESOURCE_EXHAUSTED (HTTP 429). 0: no limit",
    )
    max_tokens_per_second_per_client: float = setting(
        0.0,
        "prompt plus generated tokens per second one client may use, with 2 s of it saved up for "
        "a burst; a client over it is refused until it is under again. 0: no limit, since a "
        "sane rate depends on the model and the hardware",
    )

    def __post_init__(self) -> None:
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"--routing-policy {self.routing_policy!r}: expected one of "
                f"{', '.join(ROUTING_POLICIES)}"
            )
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"--prefix-cache-scope {self.prefix_cache_scope!r}: expected one of "
                f"{', '.join(PREFIX_CACHE_SCOPES)}"
            )
        if not self.prefill or not self.decode:
            raise ValueError(
                "the router needs at least one prefill and one decode address (--prefill, --decode)"
            )
        _host_ports(self, "prefill", "decode")
        _positive(
            self,
            "max_queue",
            "queue_timeout_seconds",
            "prefill_calls",
            "max_attempts",
            "request_timeout_seconds",
        )
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port {self.http_port}: expected 0 (off) or a port")
        if self.local_prefill_tokens != "auto" and not self.local_prefill_tokens.isdigit():
            raise ValueError(
                f"--local-prefill-tokens {self.local_prefill_tokens!r}: expected 'auto' or a "
                "number of tokens (0: off)"
            )
        for name in ("max_streams_per_client", "max_tokens_per_second_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_described(self, name)} must be 0 (no limit) or positive")
        if not 0 < self.max_queue_share_per_client <= 1:
            raise ValueError(
                f"--max-queue-share-per-client {self.max_queue_share_per_client}: expected (0, 1]"
            )

    @property
    def max_queue_per_client(self) -> int:
        """Requests one client may have waiting: --max-queue-share-per-client of --max-queue."""
        return max(1, int(self.max_queue_share_per_client * self.max_queue))


@dataclass(frozen=True)
class ColocatedSettings:
    TITLE: ClassVar[str] = "colocated scheduling"

    common: CommonSettings
    decode: DecodeSettings
    prefill: PrefillSettings
    chunk_tokens: int = setting(
        256,
        "chunked prefill (as vLLM's and Sarathi-Serve's schedulers do): each step carries "
        "every running decode plus at most this many tokens of prompts longer than this, so a "
        "long prompt is spread over several steps; 0 for the plain loop (a whole prefill batch, "
        "then a decode step)",
        flag="prefill-chunk-tokens",
    )
    step_prompt_tokens: int = setting(
        2048,
        "the most prompt tokens one chunked step carries: shorter prompts go whole within it, "
        "and a step with no decode in it takes this much of any prompt, so prompts that arrive "
        "together start together (vLLM's CPU server caps every step at 2048 tokens); below "
        "--prefill-chunk-tokens it is that",
        flag="step-prompt-tokens",
    )
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API, as the router serves it (docs/api.md), on "
        "--host beside gRPC; 0 (default) turns it off",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port {self.http_port}: expected 0 (off) or a port")
        if self.chunk_tokens < 0:
            raise ValueError(
                f"--prefill-chunk-tokens (PDSERVE_PREFILL_CHUNK_TOKENS) must be >= 0, "
                f"got {self.chunk_tokens}"
            )
        if self.step_prompt_tokens < 0:
            raise ValueError(
                f"--step-prompt-tokens (PDSERVE_STEP_PROMPT_TOKENS) must be >= 0, "
                f"got {self.step_prompt_tokens}"
            )


class SettingsClass(Protocol):
    """What every settings class above has: the title of its --help group."""

    TITLE: ClassVar[str]


# The settings each role shows as flags, in --help order.
ROLE_SETTINGS: dict[str, tuple[type[SettingsClass], ...]] = {
    "router": (CommonSettings, RouterSettings),
    "prefill": (CommonSettings, PrefillSettings),
    "decode": (CommonSettings, DecodeSettings),
    "colocated": (CommonSettings, DecodeSettings, PrefillSettings, ColocatedSettings),
}


def _positive(settings, *names: str) -> None:
    for name in names:
        if getattr(settings, name) <= 0:
            raise ValueError(
                f"{_described(settings, name)} must be positive, got {getattr(settings, name)}"
            )


def _host_ports(settings, *names: str) -> None:
    """Each address of a list setting is host:port, checked at start (not at the first call)."""
    for name in names:
        for value in getattr(settings, name):
            _host_port(settings, name, value)


def _host_port(settings, name: str, value: str) -> None:
    try:
        parse_host_port(value)
    except ValueError as exc:
        raise ValueError(f"{_described(settings, name)}: {exc}") from None


def parse_host_port(value: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' -> (host, port); ValueError saying what is wrong."""
    host, colon, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not colon or not host or (":" in host and not bracketed):
        raise ValueError(f"{value!r} is not host:port (an IPv6 host goes in brackets: [::1]:50052)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def _one_of(settings, name: str, choices: tuple, value=None) -> None:
    value = getattr(settings, name) if value is None else value
    if value not in choices:
        raise ValueError(
            f"{_described(settings, name)} must be one of "
            f"{', '.join(map(repr, choices))}; got {value!r}"
        )


def _described(settings, name: str) -> str:
    """A setting as its user set it: by flag or variable, which may differ from the field name."""
    f = next(f for f in fields(settings) if f.name == name)
    return f"{flag_name(f)} ({env_name(f)})"


# --- Names: each derived from the field, so a setting never spells them out. ---


def settings_fields(cls) -> list[Field]:
    """The fields of `cls` made with `setting()`: the ones shown as flags."""
    return [f for f in fields(cls) if "help" in f.metadata]


def _option(f: Field) -> str:
    return (f.metadata["flag"] or f.name).replace("_", "-")


def flag_name(f: Field) -> str:
    return "--" + _option(f)


def env_name(f: Field) -> str:
    return ENV_PREFIX + _option(f).replace("-", "_").upper()


def _dest(f: Field) -> str:
    return _option(f).replace("-", "_")


def _default(f: Field):
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f"setting {f.name} has no default"
    return f.default_factory()


def _raw_env(name: str) -> str | None:
    """The variable's text; None when unset or empty (empty means "use the default")."""
    return os.environ.get(name) or None


def env(name: str, default):
    """PDSERVE_<NAME> converted to the type of `default`, or `default` when unset.

    For flags outside the services' settings (the client's --address); settings use add_flags.
    """
    raw = _raw_env(ENV_PREFIX + name)
    if raw is None:
        return default
    if isinstance(default, list):
        return _split(raw)
    return _converter(type(default), ENV_PREFIX + name)(raw)


def _split(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


# --- Settings <-> command line ---


def _converter(kind: type, variable: str):
    """Text to `kind`, failing with a message that names where the text may have come from."""

    def convert(text: str):
        try:
            return _BOOLS[text.lower()] if kind is bool else kind(text)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a' if kind is not int else 'an'} {kind.__name__} "
                f"(from the flag or {variable})"
            ) from None

    convert.__name__ = kind.__name__
    return convert


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(value)
    return str(value) if value != "" else '""'


def _help(f: Field, default, raw: str | None, listed: bool) -> str:
    """The help text, ending with the variable and the value in force; % escaped for argparse."""
    variable = env_name(f) + (", comma-separated" if listed else "")
    if f.metadata.get("secret"):  # --help must not print a key to whoever can run it
        in_force = "set" if (raw or default) else "not set"
    else:
        in_force = (
            f"default {_shown(default)}" if raw is None else f"now {raw}, from the environment"
        )
    return f"{f.metadata['help']} ({variable}; {in_force})".replace("%", "%%")


def _argument(kind, f: Field, default) -> dict:
    """add_argument options for one setting; the variable, when set, replaces the default."""
    raw, listed = _raw_env(env_name(f)), kind == list[str]
    options: dict[str, object] = {
        "dest": _dest(f),
        "metavar": _dest(f).upper(),
        "help": _help(f, default, raw, listed),
    }
    if listed:  # comma-separated in the variable, separate words on the command line
        return options | {"nargs": "+", "default": default if raw is None else _split(raw)}
    if kind is bool:  # --insecure alone means true; --insecure false is accepted too
        options |= {"nargs": "?", "const": True}
    # A text default is converted by argparse only when the flag is absent, so a bad variable is
    # an error (exit 2, with usage) only for the command that uses it, and a flag overrides it.
    return options | {
        "type": _converter(kind, env_name(f)),
        "default": default if raw is None else raw,
    }


def add_flags(parser, cls, defaults: dict | None = None, only: tuple[str, ...] | None = None):
    """Adds a flag for each setting of `cls` (or for the named ones) to an argparse parser/group.

    `defaults` replaces a setting's default, for a value that depends on the role (the port).
    """
    kinds = get_type_hints(cls)
    for f in settings_fields(cls):
        if only is None or f.name in only:
            default = (defaults or {}).get(f.name, _default(f))
            parser.add_argument(flag_name(f), **_argument(kinds[f.name], f, default))


def add_role_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of `pdserve serve ROLE`, one argument group per settings class."""
    for cls in ROLE_SETTINGS[role]:
        add_flags(parser.add_argument_group(cls.TITLE), cls, {"port": DEFAULT_PORTS[role]})


def from_args(cls, args: argparse.Namespace, **given):
    """`cls` from parsed flags; `given` supplies the fields that are not flags (common)."""
    return cls(**{f.name: getattr(args, _dest(f)) for f in settings_fields(cls)}, **given)


def settings_from_args(role: str, args: argparse.Namespace):
    """The settings object `services.<role>.server.serve` takes. ValueError when one is invalid."""
    common = from_args(CommonSettings, args, faults=Faults.parse(_raw_env("PDSERVE_FAULTS") or ""))
    if role == "colocated":
        return from_args(
            ColocatedSettings,
            args,
            common=common,
            decode=from_args(DecodeSettings, args, common=common),
            prefill=from_args(PrefillSettings, args, common=common),
        )
    service = {"router": RouterSettings, "prefill": PrefillSettings, "decode": DecodeSettings}
    return from_args(service[role], args, common=common)


def as_flags(cls, args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """Command-line words that hand these settings' parsed values on to a child process."""
    words = []
    for f in settings_fields(cls):
        if f.name in names:
            value = getattr(args, _dest(f))
            words += [flag_name(f), *(value if isinstance(value, list) else [str(value)])]
    return words


# --- Documentation ---


def _roles_of(cls) -> str:
    roles = [role for role, classes in ROLE_SETTINGS.items() if cls in classes]
    return "all" if len(roles) == len(ROLE_SETTINGS) else ", ".join(roles)


def _documented_default(f: Field) -> str:
    if f.name == "port":  # the one default that depends on the role
        return ", ".join(f"{role} {port}" for role, port in DEFAULT_PORTS.items())
    return f"`{_shown(_default(f))}`"


def parse_cpu_list(text: str) -> set[int]:
    """'0-1,3' -> {0, 1, 3}; '' -> the empty set (no pinning)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(
                f"--cpus (PDSERVE_CPUS): {part!r} is not a CPU number or range like 0-3"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"--cpus (PDSERVE_CPUS): bad range {part!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def settings_table() -> str:
    """The Markdown table of every setting, as docs/containers.md holds it."""
    lines = ["| variable | flag | services | default | |", "|---|---|---|---|---|"]
    for cls in (CommonSettings, DecodeSettings, PrefillSettings, RouterSettings, ColocatedSettings):
        for f in settings_fields(cls):
            lines.append(
                f"| `{env_name(f)}` | `{flag_name(f)}` | {_roles_of(cls)} | "
                f"{_documented_default(f)} | {f.metadata['help']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(settings_table())
