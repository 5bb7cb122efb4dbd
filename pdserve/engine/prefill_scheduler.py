"""Batched prefill: waiting prompts are run together, up to a batch size and a token budget.

Each job gets its own slice of every layer's K and V as soon as the layer is computed (so a
transfer can start while later layers run), then its first token. Jobs wait in one line per
client (pdserve/core/fair_lines.py), so a batch is filled by turns: one client's burst of long
prompts cannot make another client's prompt wait behind all of it. With a prefix cache
(prefill_prefix.py), each prompt is computed from the end of its longest cached prefix, and the
token budget counts only the tokens computed.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.cancellations import Cancellations
from pdserve.core.block_pool import BlockTable
from pdserve.core.fair_lines import FairLines
from pdserve.core.picked import Pick
from pdserve.engine.prefill_prefix import CachedPrompt, PrefixCachedPrefill
from pdserve.core.request import GenerateSpec
from pdserve.engine.sampling import first_draw, sample
from pdserve.models.protocol import CausalLM


@dataclass(frozen=True)
class PrefillTiming:
    queue_seconds: float
    prefill_seconds: float
    batch_size: int
    batch_tokens: int
    finished_at: float  # time.perf_counter() when the batch's compute ended
    cached_tokens: int = 0  # of this prompt, taken from the prefix cache rather than computed


@dataclass
class PrefillJob:
    spec: GenerateSpec
    # Called with (layer, K, V) of this prompt's positions [send_from, prompt length), each
    # [tokens, heads, head_dim].
    on_layer_kv: Callable[[int, torch.Tensor, torch.Tensor], None]
    on_done: Callable[[Pick, PrefillTiming], None]  # the first token
    on_error: Callable[[str], None]
    send_from: int = 0  # the KV of earlier positions is not wanted (decode holds it already)
    client: str = ""  # whose turn it takes in the queue (the router's name for its client)
    enqueued_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # written by the engine thread only (PrefillScheduler.cancel)
    table: BlockTable | None = None  # its room in the prefix cache's pool, while it runs

    @property
    def cached_tokens(self) -> int:
        return self.table.cached_tokens if self.table else 0

    def hand_out(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.cancelled:
            self.on_layer_kv(layer, k, v)


class PrefillScheduler:
    def __init__(
        self,
        model: CausalLM,
        max_batch_size: int,
        max_batch_tokens: int,
        ending: frozenset[int],
        prefix: PrefixCachedPrefill | None = None,
    ) -> None:
        """`ending`: the model's end-of-sequence token ids, which min_tokens holds back."""
        self.model, self.prefix, self.ending = model, prefix, ending
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self._waiting: FairLines[PrefillJob] = FairLines()
        self._running: list[PrefillJob] = []  # the batch of the current step
        self._lock = threading.Lock()
        self.cancels: Cancellations[PrefillJob] = Cancellations()

    def add(self, job: PrefillJob) -> None:
        with self._lock:
            self._waiting.append(job.client, job)

    def remove(self, job: PrefillJob) -> bool:
        """Takes a job out of the queue if it has not started; True if it was waiting."""
        with self._lock:
            return self._waiting.remove(job)

    def cancel(self, job: PrefillJob) -> None:
        """Any thread: the job is dropped at the next step if it waits, and hands out no more KV
        from then on if it runs (a pass in progress finishes its layers). The caller wakes the
        engine loop."""
        self.cancels.ask(job)

    def apply_cancels(self) -> None:
        """Engine thread, between passes: the only writer of `cancelled`."""
        for job in self.cancels.take():
            job.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self.cancels.pending

    @property
    def has_jobs(self) -> bool:
        """Jobs wait (has_work is also true while only cancels do)."""
        return bool(self._waiting)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def queued_tokens(self) -> int:
        with self._lock:
            return sum(job.spec.prompt_len for job in self._waiting)

    def fail_all(self, message: str) -> None:
        """Fails every waiting job and the batch in progress (the engine loop itself failed)."""
        with self._lock:
            jobs = [*self._running, *self._waiting.clear()]
        for job in jobs:
            job.on_error(message)

    def step(self) -> PrefillTiming | None:
        batch = self._running = self.schedule()
        if not batch:
            return None
        start = time.perf_counter()
        try:
            logits = self._forward(batch)
            first = sample(logits, [first_draw(j.spec) for j in batch], self.ending)
        except Exception as exc:  # the batch fails, the engine keeps serving
            for job in batch:
                job.on_error(f"prefill failed: {exc}")
            return None
        finished = time.perf_counter()
        tokens = sum(j.spec.prompt_len - j.cached_tokens for j in batch)
        for job, pick in zip(batch, first, strict=True):
            job.on_done(
                pick,
                PrefillTiming(
                    start - job.enqueued_at,
                    finished - start,
                    len(batch),
                    tokens,
                    finished,
                    job.cached_tokens,
                ),
            )
        return PrefillTiming(0.0, finished - start, len(batch), tokens, finished)

    def _forward(self, batch: list[PrefillJob]) -> torch.Tensor:
        """The last position's logits of each prompt: from their cached prefixes when they have
        room in the prefix cache (all do, or a lone one that never fits there), else whole."""
        if self.prefix is not None and batch[0].table is not None:
            prompts = []
            for j in batch:
                assert j.table is not None, "schedule() gives every job of a cached batch a table"
                prompts.append(
                    CachedPrompt(j.spec.prompt_token_ids, j.table, j.send_from, j.hand_out)
                )
            return self.prefix.run(prompts)
        return self.model.prefill_packed(
            [list(j.spec.prompt_token_ids) for j in batch], self._fan_out(batch)
        )

    def schedule(self) -> list[PrefillJob]:
        """Jobs by turns within the batch size and token budget; always one if any wait.
        With a prefix cache, each job gets its room there first, and its cached prefix costs
        nothing against the budget; a job the pool cannot hold waits for the next batch, unless
        it is the first, which then runs alone without the cache."""
        batch: list[PrefillJob] = []
        self.apply_cancels()
        with self._lock:
            try:
                self._fill(batch)
            except BaseException:  # a bug in the pool: put the jobs back rather than lose them
                for job in reversed(batch):
                    if job.table is not None:
                        job.table.release()
                        job.table = None
                    self._waiting.put_back(job.client, job)
                raise
        return batch

    def _fill(self, batch: list[PrefillJob]) -> None:
        """schedule()'s loop, under its lock: moves jobs from the queue into `batch`."""
        tokens = 0
        while self._waiting and len(batch) < self.max_batch_size:
            job = self._waiting.peek()
            assert job is not None  # the queue is not empty
            if job.cancelled:
                self._waiting.pop()
                continue
            job.table = (
                self.prefix.reserve(job.spec.prompt_token_ids, job.spec.cache_salt)
                if self.prefix
                else None
            )
            cost = job.spec.prompt_len - job.cached_tokens
            uncached = self.prefix is not None and job.table is None
            if batch and (tokens + cost > self.max_batch_tokens or uncached):
                if job.table is not None:  # it waits for the next batch, holding nothing
                    job.table.release()
                    job.table = None
                return
            batch.append(self._waiting.pop()[1])
            tokens += cost
            if uncached:  # alone, whole: the pool cannot hold it even empty
                return

    @staticmethod
    def _fan_out(batch: list[PrefillJob]) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        bounds, start = [], 0
        for job in batch:
            bounds.append((job, start, start + job.spec.prompt_len))
            start += job.spec.prompt_len

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for job, lo, hi in bounds:
                job.hand_out(layer, k[lo + job.send_from : hi], v[lo + job.send_from : hi])

        return on_layer
