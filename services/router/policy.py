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


# How many more streams than the least busy decode a prefix holder may have and still be
# preferred: a few streams more cost each of them a little per step, while a decode without the
# prefix needs it handed off or computed again. Past this, load wins, and the other instance
# soon holds the prefix too.
DECODE_BALANCE_STREAMS = 8


class Loaded(Protocol):
    address: str
    free_blocks: int  # decode: blocks free in its pool, as last reported
    running: int  # decode: sequences it is decoding, as last reported
    queued_tokens: int  # prefill: prompt tokens sent by this router, not yet answered
    streams: int  # decode: requests this router has reserved room for there, not yet ended


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
    """Instances believed to hold a long prefix of the prompt first, so that requests sharing a
    system prompt meet their cached KV, but not at any load: otherwise the first instance to hold
    a popular prefix would get every request that shares it.

    Prefill: fewest tokens to compute before this prompt's first token, its queue plus the
    prompt's part it does not hold; a holder wins unless its queue is longer than another's by
    more than the prefix it saves. Decode: the holder of the longest prefix first, unless it has
    more than DECODE_BALANCE_STREAMS streams beyond the least busy instance; within that,
    least-loaded's order. SGLang's cache-aware router balances the same way, with thresholds."""

    def __init__(self, role: str, index: PrefixIndex) -> None:
        self._role, self._index, self._fallback = role, index, LeastLoaded(role)

    def order(self, instances: list, request: Routed | None, avoid: Collection[str]) -> list:
        ordered = self._fallback.order(instances, request, ())
        if request is not None and request.prefix_keys and ordered:
            keys = request.prefix_keys
            cached = {i.address: self._index.cached_tokens(keys, i.address) for i in ordered}
            if self._role == "prefill":
                ordered.sort(key=lambda i: i.queued_tokens - cached[i.address])
            else:
                least = min(i.streams for i in ordered)
                ordered.sort(
                    key=lambda i: (
                        0 if i.streams - least > DECODE_BALANCE_STREAMS else -cached[i.address]
                    )
                )
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
