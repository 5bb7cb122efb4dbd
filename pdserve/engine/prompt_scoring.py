"""Log-probabilities of a prompt's own tokens: how likely the model finds each token after the
ones before it. OpenAI's `echo` with `logprobs` asks for them; evaluation harnesses score a text
this way (lm-evaluation-harness's local-completions).

A score runs on the engine thread, between batches, through the model's contiguous path: it needs
the logits of every position, which the batched paths do not keep.
"""

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.core.picked import TokenLogprobs
from pdserve.engine.sampling import logprobs_of
from pdserve.models.protocol import CausalLM

# Logits of this many positions at a time: [256, vocab] in float32 is 50 MB for SmolLM2's 49,152
# tokens, where a whole 8k-token prompt at once would be 1.6 GB.
SCORE_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ScoreJob:
    prompt: tuple[int, ...]
    top: int
    on_done: Callable[[list[TokenLogprobs]], None]  # called on the engine thread
    on_error: Callable[[str], None]


def prompt_logprobs(model: CausalLM, prompt: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Entry i is prompt[i + 1]'s log-probability after prompt[: i + 1], under the raw logits,
    with the `top` most likely tokens at that position."""
    cache: list = []
    scored: list[TokenLogprobs] = []
    for start in range(0, len(prompt) - 1, SCORE_CHUNK_TOKENS):
        piece = list(prompt[start : start + SCORE_CHUNK_TOKENS])
        logits = model.forward_contiguous(piece, cache).double()
        targets = prompt[start + 1 : start + 1 + len(piece)]
        scored += [logprobs_of(row, t, top) for row, t in zip(logits, targets, strict=False)]
    return scored


class ScoreQueue:
    """Scores waiting for the engine thread; any thread adds, the engine thread runs them."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._jobs: deque[ScoreJob] = deque()
        self._lock = threading.Lock()

    def add(self, job: ScoreJob) -> None:
        with self._lock:
            self._jobs.append(job)

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def run_next(self) -> None:
        """Engine thread: scores the oldest job; a failure is that job's, not the engine's."""
        with self._lock:
            if not self._jobs:
                return
            job = self._jobs.popleft()
        try:
            with torch.inference_mode():
                scored = prompt_logprobs(self.model, job.prompt, job.top)
        except Exception as exc:
            job.on_error(f"scoring failed: {exc}")
            return
        job.on_done(scored)

    def fail_all(self, message: str) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.on_error(message)

    async def score(
        self, prompt: tuple[int, ...], top: int, wake: Callable[[], None]
    ) -> list[TokenLogprobs]:
        """From the event loop: queues the prompt, wakes the engine (`wake`) and waits for its
        scores. Raises RuntimeError with the engine's message when scoring failed."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: object) -> None:
            loop.call_soon_threadsafe(_set_once, done, result)

        self.add(ScoreJob(prompt, top, settle, lambda message: settle(RuntimeError(message))))
        wake()
        result = await done
        if isinstance(result, RuntimeError):
            raise result
        return result


def _set_once(future: asyncio.Future, result: object) -> None:
    if not future.done():  # the caller may have left (cancelled) first
        future.set_result(result)
