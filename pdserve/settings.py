"""Every service's settings: one frozen dataclass each, defaults overridable by PDSERVE_* variables.

This is the only module that reads the environment. The command line (pdserve.cli) shows each
setting as a flag whose default comes from here, so `--help` tells what is in force.
"""

import os
from dataclasses import dataclass, field

from pdserve.faults import Faults

ENV_PREFIX = "PDSERVE_"


def env(name: str, default):
    """PDSERVE_<NAME> converted to the type of `default`, or `default` when unset."""
    raw = os.environ.get(ENV_PREFIX + name)
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, list):
        return [item.strip() for item in raw.split(",") if item.strip()]
    return type(default)(raw)


@dataclass(frozen=True)
class CommonSettings:
    host: str = "0.0.0.0"
    port: int = 0
    metrics_port: int = 0  # 0: no metrics endpoint
    instance: str = ""  # name in logs and responses; defaults to <role>@<host>:<port>
    grace_seconds: float = 10.0
    torch_threads: int = 0  # 0: torch's default
    faults: Faults = field(default_factory=Faults)  # tests only: PDSERVE_FAULTS


@dataclass(frozen=True)
class DecodeSettings:
    common: CommonSettings
    num_blocks: int = 2048
    block_size: int = 16
    max_batch: int = 64
    lease_ttl_seconds: float = 30.0

    def __post_init__(self) -> None:
        _positive(num_blocks=self.num_blocks, block_size=self.block_size, max_batch=self.max_batch,
                  lease_ttl_seconds=self.lease_ttl_seconds)


@dataclass(frozen=True)
class PrefillSettings:
    common: CommonSettings
    max_batch_size: int = 8
    max_batch_tokens: int = 4096
    chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        _positive(max_batch_size=self.max_batch_size, max_batch_tokens=self.max_batch_tokens,
                  chunk_bytes=self.chunk_bytes)


@dataclass(frozen=True)
class RouterSettings:
    common: CommonSettings
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    max_queue: int = 256
    queue_timeout_seconds: float = 30.0
    max_attempts: int = 3  # handoff attempts per request before UNAVAILABLE
    request_timeout_seconds: float = 600.0  # deadline for a request whose client set none

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode address")
        _positive(max_queue=self.max_queue, queue_timeout_seconds=self.queue_timeout_seconds,
                  max_attempts=self.max_attempts,
                  request_timeout_seconds=self.request_timeout_seconds)


@dataclass(frozen=True)
class ColocatedSettings:
    common: CommonSettings
    decode: DecodeSettings
    prefill: PrefillSettings


def _positive(**values) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
