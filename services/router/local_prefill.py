"""Conditional disaggregation: which prompts are prefilled on the decode instance itself.

A handoff has a price that computing locally does not: the fixed cost of the extra hop (the
Prefill call, the lease, the data-plane connection, the commit) and the part of the KV transfer
that prefill's compute does not hide. Prefilling on decode instead costs that instance the
compute, during which its running streams wait (at most one step of
--local-prefill-chunk-tokens at a time).

For a prompt of n tokens, with prefill taking c seconds per token, the handoff exposing e seconds
per token beyond the compute (what the link adds: KV bytes per token over its bandwidth, less the
overlap) and a fixed handoff overhead h:

    remote, beyond the compute prefill does anyway:  h + n * e
    local, the compute decode takes on:              n * c

so local wins while n * (c - e) < h. When the link exposes more per token than computing it
costs (e >= c: a slow link), local always wins, and LOCAL_CAP_TOKENS bounds the threshold so that
decode is not turned into a prefill instance.

`--local-prefill-tokens auto` measures c, e and h from the requests that did go through a
prefill instance (each reply carries its compute time and handoff figures; h is the router's
time to first token less queueing, compute and exposed handoff) and keeps the threshold current.
A number fixes it; 0 turns it off.
"""

import logging
import math

from pdserve import metrics
from pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)

LOCAL_CAP_TOKENS = 512  # the most that auto sends to decode, however slow the link
MIN_SAMPLES = 8  # remote requests measured before auto moves anything
SMOOTHING = 0.1  # weight of each new sample in the moving averages


class LocalPrefill:
    def __init__(self, setting: str) -> None:
        self.auto = setting == "auto"
        self.fixed = 0 if self.auto else int(setting)
        self.samples = 0
        self.compute_per_token = 0.0  # c
        self.exposed_per_token = 0.0  # e
        self.overhead = 0.0  # h
        self.handoff_bytes_per_second = 0.0  # shown in the log, for the reader
        self._shown = -1
        metrics.LOCAL_PREFILL_THRESHOLD.labels("router").set(self.threshold())

    def here(self, prompt_tokens: int) -> bool:
        """Whether a prompt of this length is prefilled on decode."""
        return prompt_tokens <= self.threshold()

    def decide(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a prompt is prefilled on decode, where decode is believed to hold
        `cached_tokens` of it already; counts the decision with its reason."""
        here = self.here(prompt_tokens - cached_tokens)
        if here:
            reason = "below_threshold" if self.here(prompt_tokens) else "prefix_cached"
        elif not self.auto and self.fixed == 0:
            reason = "local_prefill_off"
        elif self.auto and self.samples < MIN_SAMPLES:
            reason = "measuring"
        else:
            reason = "above_threshold"
        metrics.PREFILL_DECISIONS.labels("router", "decode" if here else "prefill", reason).inc()
        return here

    def threshold(self) -> int:
        if not self.auto:
            return self.fixed
        if self.samples < MIN_SAMPLES:
            return 0
        saved_per_token = self.compute_per_token - self.exposed_per_token
        if saved_per_token <= 0:
            return LOCAL_CAP_TOKENS  # the link adds more per token than computing it costs
        return min(LOCAL_CAP_TOKENS, math.floor(self.overhead / saved_per_token))

    def observe(
        self, prompt_tokens: int, sent_tokens: int, reply: pb.PrefillResponse, ttft: float
    ) -> None:
        """Learns from one request that went through a prefill instance: `sent_tokens` of its
        prompt were handed off (decode's prefix cache held the rest), and `ttft` is the router's
        time to first token for it. Prefill computed the tokens its own cache did not hold."""
        computed = prompt_tokens - reply.cached_tokens
        if not self.auto or reply.prefill_seconds <= 0 or computed <= 0 or sent_tokens <= 0:
            return
        handoff = reply.handoff
        samples = (
            reply.prefill_seconds / computed,
            handoff.exposed_seconds / sent_tokens,
            max(ttft - reply.queue_seconds - reply.prefill_seconds - handoff.exposed_seconds, 0),
            (handoff.wire_bytes or handoff.bytes) / handoff.seconds if handoff.seconds else 0.0,
        )
        weight = 1.0 if self.samples == 0 else SMOOTHING
        self.compute_per_token += weight * (samples[0] - self.compute_per_token)
        self.exposed_per_token += weight * (samples[1] - self.exposed_per_token)
        self.overhead += weight * (samples[2] - self.overhead)
        self.handoff_bytes_per_second += weight * (samples[3] - self.handoff_bytes_per_second)
        self.samples += 1
        metrics.LOCAL_PREFILL_THRESHOLD.labels("router").set(self.threshold())
        metrics.MEASURED_PREFILL_RATE.labels("router").set(1 / self.compute_per_token)
        metrics.MEASURED_HANDOFF_RATE.labels("router").set(self.handoff_bytes_per_second)
        self._log_change()

    def _log_change(self) -> None:
        threshold = self.threshold()
        if self.samples >= MIN_SAMPLES and abs(threshold - self._shown) > max(4, self._shown // 4):
            log.info(
                "local prefill threshold now %d tokens: prefill %.3f ms/token, handoff exposes "
                "%.3f ms/token (%.1f MB/s), handoff overhead %.1f ms; from %d requests",
                threshold,
                self.compute_per_token * 1e3,
                self.exposed_per_token * 1e3,
                self.handoff_bytes_per_second / 1e6,
                self.overhead * 1e3,
                self.samples,
            )
            self._shown = threshold
