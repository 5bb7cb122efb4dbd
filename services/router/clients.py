"""Who a request comes from, and what one client may take: API keys and per-client limits.

A client is its API key when the router has keys (`--api-key`, one or several, comma-separated),
else the address it connects from. Keys are named by their position ("key #2"), so no key is ever
logged or shown. The limits bound each client on its own, so that no one caller can take the
router's queue or its decode capacity from the others:

- streams open at once (--max-streams-per-client);
- tokens per second, prompt and generated alike (--max-tokens-per-second-per-client): a token
  bucket that a request may overdraw; the client's next request is refused until the bucket has
  refilled to zero. A request is never cut once admitted.
"""

import contextlib
import functools
import hashlib
import hmac
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.services.router.errors import RouterError

# How many seconds of its rate a client may save up, and so spend at once.
BURST_SECONDS = 2.0
# Past this many clients remembered, those with nothing open and a full bucket are forgotten.
CLIENTS_REMEMBERED = 1024


class ApiKeys:
    """The keys of `--api-key` ("" for none), compared in constant time."""

    def __init__(self, raw: str) -> None:
        keys = [k.strip() for k in raw.split(",") if k.strip()]
        self._bearers = [f"Bearer {k}".encode() for k in keys]
        # Each key's prefix-cache salt comes from the key itself: it follows the key wherever
        # the key sits in the list, and no one without the key can compute it.
        self._salts = {
            f"key #{i}": hashlib.blake2b(k.encode(), digest_size=16, person=b"pdserve-key").digest()
            for i, k in enumerate(keys, start=1)
        }

    @property
    def required(self) -> bool:
        return bool(self._bearers)

    def client_of(self, authorization: str) -> str | None:
        """'key #i' for the key this `Authorization` value carries, or None. Every key is
        compared, whichever matches, so the time taken says nothing about which is close."""
        given = authorization.encode()
        found = None
        for i, bearer in enumerate(self._bearers, start=1):
            if hmac.compare_digest(given, bearer) and found is None:
                found = f"key #{i}"
        return found

    def cache_salt(self, client: str) -> bytes:
        """The prefix-cache salt of a client (services/router/server.py): its key's, or, for a
        client known by its address, a digest of the address."""
        salt = self._salts.get(client)
        if salt is None:
            salt = hashlib.blake2b(client.encode(), digest_size=16, person=b"pdserve-addr").digest()
        return salt


def grpc_peer_host(peer: str) -> str:
    """The host of a grpc peer string: ipv4:1.2.3.4:5 -> 1.2.3.4, ipv6:[::1]:5 -> ::1."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer  # unix: and the like name the socket, which is as close as it gets


@dataclass
class _Client:
    streams: int = 0
    tokens: float = 0.0  # the bucket; negative when overdrawn
    refilled_at: float = field(default_factory=time.monotonic)


class ClientLimits:
    """Per-client streams and token rate; 0 switches a limit off."""

    def __init__(self, max_streams: int, tokens_per_second: float) -> None:
        self.max_streams, self.rate = max_streams, tokens_per_second
        self._clients: dict[str, _Client] = {}

    @contextlib.contextmanager
    def admitted(self, client: str, prompt_tokens: int) -> Iterator[Callable[[int], None]]:
        """Admits one request of `client` for as long as the block runs, or raises RouterError
        RESOURCE_EXHAUSTED naming the limit the client is at. Yields the function that charges
        the request's further tokens to the client; its prompt is charged here."""
        if len(self._clients) > CLIENTS_REMEMBERED:
            self._forget_idle()
        state = self._clients.setdefault(client, _Client(tokens=self.rate * BURST_SECONDS))
        self._refill(state)
        if self.max_streams and state.streams >= self.max_streams:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client!r} has {state.streams} streams open, the most one client may "
                f"have (--max-streams-per-client {self.max_streams})",
            )
        if self.rate and state.tokens < 0:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client!r} is over its token rate (--max-tokens-per-second-per-client "
                f"{self.rate:g}); try again in {-state.tokens / self.rate:.1f} s",
            )
        state.streams += 1
        spend = functools.partial(self._spend, state)
        spend(prompt_tokens)
        try:
            yield spend
        finally:
            state.streams -= 1

    def _spend(self, state: _Client, tokens: int) -> None:
        if self.rate:
            self._refill(state)
            state.tokens -= tokens

    def _refill(self, state: _Client) -> None:
        now = time.monotonic()
        burst = self.rate * BURST_SECONDS
        state.tokens = min(burst, state.tokens + (now - state.refilled_at) * self.rate)
        state.refilled_at = now

    def _forget_idle(self) -> None:
        for name, state in list(self._clients.items()):
            self._refill(state)
            if state.streams == 0 and state.tokens >= self.rate * BURST_SECONDS:
                del self._clients[name]
