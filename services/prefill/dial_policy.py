"""Which addresses prefill may connect to, decided before it connects to any of them.

A Prefill call says where its KV goes: a decode instance's gRPC address and, optionally, the
lease's data endpoint. Whoever can call Prefill could name any host and port there, and use
prefill to reach services it cannot reach itself. So:

- the decode address must be one of --decode-allow (names resolved again every second), or, when
  there is no list, on loopback and answering as a decode: prefill asks it which data planes it
  offers (below) before anything of the request is sent there, so a local port that is not a
  pdserve decode never receives a lease id or KV, and every such port gets the same answer;
- a data endpoint's host must be empty or that decode address's own host, and its port one that
  this decode instance itself offers. Prefill asks it (DecodeService.GetDataEndpoints, over the
  gRPC channel to the address just allowed, and with mTLS verified as the decode role) and keeps
  the answer for a while. The data plane's port cannot simply be allow-listed: decode picks a free
  one by default.

Each refusal follows from the request, the list and the allowed decode's own answer. With a
list, no address is tried to reach it; without one, the only thing an unlisted loopback port
receives is that one question, of fixed bytes, and every port that gives no decode's answer (none
listening, another service, a service of another kind) gets the same refusal.
"""

import asyncio
import math
import time
from collections.abc import Callable

import grpc

from pdserve.kv import data_endpoints
from pdserve.core.shown import shown
from pdserve.kv.sink import KvTransferFailed
from pdserve.rpc.discovery import resolve
from pdserve.rpc.errors import ServiceError
from pdserve.rpc.tls import is_loopback
from pdserve.v1 import pdserve_pb2 as pb

# --decode-allow names are resolved again after this long, so scaled replicas are allowed.
ALLOWED_DECODES_TTL_SECONDS = 1.0
# What a decode instance offers is asked again after this long...
OFFERED_TTL_SECONDS = 10.0
# ...or sooner, for an endpoint it did not offer when asked this long ago: a restarted decode
# offers a new port, and a caller must not be able to make prefill ask on every call.
OFFERED_RECHECK_SECONDS = 1.0
ASK_TIMEOUT_SECONDS = 2.0
MAX_REMEMBERED_DECODES = 64  # as many as prefill keeps channels to


class DialPolicy:
    def __init__(
        self, decode_allow: list[str], channel_to: Callable[[str], grpc.aio.Channel]
    ) -> None:
        self._decode_allow, self._channel_to = decode_allow, channel_to
        self._allowed: set[str] = set()  # --decode-allow, resolved
        self._allowed_at = -math.inf
        self._offered: dict[str, tuple[float, set[tuple[str, int]]]] = {}

    async def check_decode(self, address: str) -> None:
        """Raises ServiceError unless this prefill may send KV to the decode at `address`:
        PERMISSION_DENIED for an address the list (or, without one, loopback) does not admit;
        UNAVAILABLE, the same whatever listens there, for an unlisted loopback address that does
        not answer as a decode (a decode that is down answers so too, and the router retries)."""
        refusal = await self._decode_refusal(address)
        if refusal:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if self._decode_allow:
            return
        try:
            await self._offers(address, recheck=False)
        except KvTransferFailed:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"decode address {shown(address)} did not answer as a pdserve decode "
                "(DecodeService.GetDataEndpoints); without --decode-allow, this prefill sends KV "
                "only to a loopback address that does",
            ) from None

    async def _decode_refusal(self, address: str) -> str:
        """Why this prefill may not send KV to the decode at `address`, or ""."""
        if self._decode_allow:
            now = time.monotonic()
            if now - self._allowed_at > ALLOWED_DECODES_TTL_SECONDS:
                found = await asyncio.gather(*map(resolve, self._decode_allow))
                self._allowed, self._allowed_at = set().union(*found), now
            if address in self._allowed:
                return ""
            return f"decode address {shown(address)} is not one of this prefill's --decode-allow"
        if is_loopback(host_of(address)):
            return ""
        return (
            f"decode address {shown(address)} is not on loopback, and this prefill names no "
            "--decode-allow instances"
        )

    async def data_plane(self, decode_address: str, endpoint: pb.DataEndpoint) -> tuple[str, int]:
        """The (host, port) to dial for `endpoint` of the (allowed) decode at `decode_address`.
        Raises ServiceError PERMISSION_DENIED when that decode does not offer it, and
        KvTransferFailed UNAVAILABLE when the decode cannot be asked."""
        host = host_of(decode_address)
        if endpoint.host not in ("", host):
            raise _refused(endpoint, f"its host is not decode {shown(decode_address)}'s")
        wanted = (host, endpoint.port)
        if wanted not in await self._offers(decode_address, recheck=False):
            if wanted not in await self._offers(decode_address, recheck=True):
                raise _refused(endpoint, f"decode {shown(decode_address)} does not offer it")
        return wanted

    async def _offers(self, address: str, recheck: bool) -> set[tuple[str, int]]:
        """The (host, port) of each TCP data plane the decode at `address` says it listens on."""
        now = time.monotonic()
        asked_at, offered = self._offered.get(address, (-math.inf, set()))
        age = now - asked_at
        if age < OFFERED_TTL_SECONDS and not (recheck and age > OFFERED_RECHECK_SECONDS):
            return offered
        try:
            endpoints = await data_endpoints.fetch(self._channel_to(address), ASK_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferFailed(
                "UNAVAILABLE",
                f"could not ask decode {shown(address)} which data planes it offers: "
                f"{exc.code().name}: {exc.details()}",
            ) from None
        host = host_of(address)
        offered = {(e.host or host, e.port) for e in endpoints if e.transport == "tcp"}
        self._remember(address, now, offered)
        return offered

    def _remember(self, address: str, now: float, offered: set[tuple[str, int]]) -> None:
        self._offered.pop(address, None)
        if len(self._offered) >= MAX_REMEMBERED_DECODES:  # forget the oldest address
            self._offered.pop(next(iter(self._offered)))
        self._offered[address] = (now, offered)


def _refused(endpoint: pb.DataEndpoint, why: str) -> ServiceError:
    where = shown(f"{endpoint.host}:{endpoint.port}" if endpoint.host else f":{endpoint.port}")
    return ServiceError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"data endpoint {where} is not dialled: {why} (checked before any connection)",
    )


def host_of(address: str) -> str:
    """The host of host:port ([v6]:port too), where a data endpoint without a host lives."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host
