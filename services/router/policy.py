"""Routing policies: in which order the router tries the instances of a role for one request.

The instance set (backends.py) does discovery and health; a policy only orders the usable
instances it is given, from the load figures the set keeps on each: for decode, its pool's free
blocks and running sequences (from a GetPoolStats every refresh); for prefill, the prompt tokens
this router has sent it and not yet seen answered; for prefix-aware, which instance is believed
to hold the longest prefix of this prompt in its prefix cache (prefix_index.py). Instances in `avoid` (which
just failed this request) always go last. Chosen with --routing-policy.
"""

import itertools
from collections.abc import Collection
from typing import Protocol

from pdserve.services.router.prefix_index import PrefixIndex


class Loaded(Protocol):
    address: str
    free_blocks: int  # decode: blocks free in its pool, as last reported
    running: int  # decode: sequences it is decoding, as last reported
    queued_tokens: int  # prefill: prompt tokens sent by this router, not yet answered


class Routed(Protocol):
    """What a policy may know of the request it orders instances for."""

    prefix_keys: list[bytes]  # the prompt's full-block keys (prefix_index.py); [] when unused


class RoutingPolicy(Protocol):
    def order(self, instances: list, request: Routed | None, avoid: Collection[str]) -> list: ...


class RoundRobin:
    """Rotates the start, so that successive requests spread evenly whatever the load."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, instances: list, request: Routed | None, avoid: Collection[str]) -> list:
        if not instances:
            return []
        start = next(self._turn) % len(instances)
        return _avoided_last(instances[start:] + instances[:start], avoid)


class LeastLoaded:
    """Decode: most free KV blocks first, then fewest running sequences. Prefill: fewest prompt
    tokens in flight. Ties keep round-robin's rotation, so equal instances still share work."""

    def __init__(self, role: str) -> None:
        self._role, self._rotation = role, RoundRobin()

    def order(self, instances: list, request: Routed | None, avoid: Collection[str]) -> list:
        rotated = self._rotation.order(instances, request, ())
        return _avoided_last(sorted(rotated, key=self._load), avoid)  # sorted() is stable

    def _load(self, instance: Loaded) -> tuple[int, ...]:
        if self._role == "decode":
            return (-instance.free_blocks, instance.running)
        return (instance.queued_tokens,)


class PrefixAware:
    """The instance believed to hold the longest prefix of the prompt first, then by
    least-loaded's order; so requests sharing a system prompt meet their cached KV: on decode,
    which then needs only the rest handed off, and on prefill, which then computes only the
    rest."""

    def __init__(self, role: str, index: PrefixIndex) -> None:
        self._index, self._fallback = index, LeastLoaded(role)

    def order(self, instances: list, request: Routed | None, avoid: Collection[str]) -> list:
        ordered = self._fallback.order(instances, request, ())
        if request is not None and request.prefix_keys:
            keys = request.prefix_keys
            ordered.sort(key=lambda i: -self._index.cached_tokens(keys, i.address))
        return _avoided_last(ordered, avoid)


def make_policy(name: str, role: str, index: PrefixIndex) -> RoutingPolicy:
    if name == "least-loaded":
        return LeastLoaded(role)
    if name == "prefix-aware":
        return PrefixAware(role, index)
    return RoundRobin()


def _avoided_last(instances: list, avoid: Collection[str]) -> list:
    return [i for i in instances if i.address not in avoid] + [
        i for i in instances if i.address in avoid
    ]
