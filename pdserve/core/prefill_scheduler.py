"""Batched prefill: waiting prompts are run together, up to a batch size and a token budget.

Each job gets its own slice of every layer's K and V as soon as the layer is computed (so a
transfer can start while later layers run), then its first token.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.core.request import GenerateSpec
from pdserve.core.sampling import sample
from pdserve.models.protocol import CausalLM


@dataclass(frozen=True)
class PrefillTiming:
    queue_seconds: float
    prefill_seconds: float
    batch_size: int
    batch_tokens: int
    finished_at: float  # time.perf_counter() when the batch's compute ended


@dataclass
class PrefillJob:
    spec: GenerateSpec
    # Called with (layer, K, V) of this prompt, each [prompt tokens, heads, head_dim].
    on_layer_kv: Callable[[int, torch.Tensor, torch.Tensor], None]
    on_done: Callable[[int, PrefillTiming], None]
    on_error: Callable[[str], None]
    enqueued_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False


class PrefillScheduler:
    def __init__(self, model: CausalLM, max_batch_size: int, max_batch_tokens: int) -> None:
        self.model = model
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self._waiting: deque[PrefillJob] = deque()
        self._running: list[PrefillJob] = []  # the batch of the current step
        self._lock = threading.Lock()

    def add(self, job: PrefillJob) -> None:
        with self._lock:
            self._waiting.append(job)

    def remove(self, job: PrefillJob) -> bool:
        """Takes a job out of the queue if it has not started; True if it was waiting."""
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                return True
            return False

    @property
    def has_work(self) -> bool:
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
            jobs, self._waiting = [*self._running, *self._waiting], deque()
        for job in jobs:
            job.on_error(message)

    def step(self) -> PrefillTiming | None:
        batch = self._running = self.schedule()
        if not batch:
            return None
        start = time.perf_counter()
        try:
            logits = self.model.prefill_packed(
                [list(j.spec.prompt_token_ids) for j in batch], self._fan_out(batch)
            )
            first = sample(
                logits,
                [j.spec.sampling for j in batch],
                [j.spec.sampling.first_step for j in batch],
            )
        except Exception as exc:  # the batch fails, the engine keeps serving
            for job in batch:
                job.on_error(f"prefill failed: {exc}")
            return None
        finished = time.perf_counter()
        tokens = sum(j.spec.prompt_len for j in batch)
        for job, token in zip(batch, first, strict=True):
            job.on_done(
                token,
                PrefillTiming(
                    start - job.enqueued_at, finished - start, len(batch), tokens, finished
                ),
            )
        return PrefillTiming(0.0, finished - start, len(batch), tokens, finished)

    def schedule(self) -> list[PrefillJob]:
        """FIFO jobs within the batch size and token budget; always at least one if any wait."""
        batch: list[PrefillJob] = []
        tokens = 0
        with self._lock:
            while self._waiting and len(batch) < self.max_batch_size:
                job = self._waiting[0]
                if job.cancelled:
                    self._waiting.popleft()
                    continue
                if batch and tokens + job.spec.prompt_len > self.max_batch_tokens:
                    break
                batch.append(self._waiting.popleft())
                tokens += job.spec.prompt_len
        return batch

    @staticmethod
    def _fan_out(batch: list[PrefillJob]) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        bounds, start = [], 0
        for job in batch:
            bounds.append((job, start, start + job.spec.prompt_len))
            start += job.spec.prompt_len

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for job, lo, hi in bounds:
                if not job.cancelled:
                    job.on_layer_kv(layer, k[lo:hi], v[lo:hi])

        return on_layer
