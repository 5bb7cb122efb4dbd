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
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.rpc.tls import peer_host as grpc_peer_host  # noqa: F401 (services/router/server.py)
from pdserve.services.router.errors import RouterError

# How many seconds of its rate a client may save up, and so spend at once.
BURST_SECONDS = 2.0
# Past this many clients remembered, those with nothing open and a full bucket are forgotten.
CLIENTS_REMEMBERED = 1024


# A --prefix-cache-secret-file shorter than this is too easy to guess.
MIN_SECRET_BYTES = 16


class ApiKeys:
    """The keys of `--api-key` ("" for none), compared in constant time."""

    def __init__(self, raw: str) -> None:
        self.keys = [k.strip() for k in raw.split(",") if k.strip()]
        self._keys = [k.encode() for k in self.keys]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def client_of(self, authorization: str) -> str | None:
        """'key #i' for the key this `Authorization` value carries, or None. Every key is
        compared, whichever matches, so the time taken says nothing about which is close."""
        given = _bearer_credentials(authorization)
        found = None
        for i, key in enumerate(self._keys, start=1):
            if hmac.compare_digest(given, key) and found is None:
                found = f"key #{i}"
        return found


class CacheSalts:
    """Each client's prefix-cache salt (services/router/server.py), which decode and prefill
    match cached prefixes by. No one but the client's own router may be able to compute it:
    whoever can, can ask decode directly which prompts are cached under it, or commit KV there.

    - A client known by its API key: a digest of the key, which only that client and the
      routers hold; it follows the key wherever the key sits in the list.
    - A client known by its address: a digest of the address keyed by the routers' secret
      (--prefix-cache-secret-file), since anyone knows an address.
    """

    def __init__(self, keys: ApiKeys, secret: bytes) -> None:
        self._secret = secret
        self._by_key = {
            f"key #{i}": hashlib.blake2b(k.encode(), digest_size=16, person=b"pdserve-key").digest()
            for i, k in enumerate(keys.keys, start=1)
        }

    def of(self, client: str) -> bytes:
        salt = self._by_key.get(client)
        if salt is None:
            salt = hashlib.blake2b(
                client.encode(), digest_size=16, key=self._secret, person=b"pdserve-addr"
            ).digest()
        return salt


def load_salt_secret(path: str) -> bytes:
    """The secret of --prefix-cache-secret-file (32 bytes digested from the file), or a fresh
    random one when no file is named. Raises ValueError naming what is wrong with the file."""
    if not path:
        return secrets.token_bytes(32)
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--prefix-cache-secret-file {path}: {exc.strerror}") from None
    if len(content.strip()) < MIN_SECRET_BYTES:
        raise ValueError(
            f"--prefix-cache-secret-file {path}: at least {MIN_SECRET_BYTES} secret bytes are "
            f"needed, it has {len(content.strip())}"
        )
    return hashlib.blake2b(content.strip(), digest_size=32, person=b"pdserve-secret").digest()


def _bearer_credentials(authorization: str) -> bytes:
    """The credentials of `Bearer <credentials>`, or b"" for any other scheme or none. The scheme
    is matched without regard to case (RFC 7235, 2.1: `bearer` and `BEARER` are Bearer), and may
    be followed by several spaces. A header's bytes that are not UTF-8 reach here as surrogate
    escapes (aiohttp's decoding), which encode back to those same bytes; any other surrogate
    cannot be part of a key."""
    scheme, _, credentials = authorization.partition(" ")
    if not (scheme.isascii() and scheme.lower() == "bearer"):
        return b""
    try:
        return credentials.lstrip(" ").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b""


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
