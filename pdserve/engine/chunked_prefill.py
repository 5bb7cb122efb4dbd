"""Prefill inside a decode loop: prompts go through in the same forward pass as the running
decodes (as vLLM's and Sarathi-Serve's chunked prefill). Long prompts go in pieces, at most
`budget` of their tokens per step, so a long prompt never stalls the streams beside it for longer
than one such piece; shorter prompts go whole, at most `step_budget` prompt tokens a step.

The colocated engine runs every prompt this way. The decode service runs short prompts this way
when the router sends them there (conditional disaggregation), instead of over a handoff.

A Handle is one request inside an engine: its blocks, its prefill, then its sequence. Its first
token starts the sequence in the decode scheduler; a handle cancelled on the way gives its
blocks back wherever it is. The engine thread alone changes a handle once it is queued: a
cancel from another thread is a message it carries out between steps (cancellations.py).
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve import metrics
from pdserve.core.block_pool import BlockTable
from pdserve.core.picked import Pick
from pdserve.engine.cancellations import Cancellations
from pdserve.engine.decode_scheduler import DecodeScheduler, decodings
from pdserve.engine.model_runner import ModelRunner, PromptPiece
from pdserve.engine.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.engine.sampling import first_draw
from pdserve.core.request import GenerateSpec
from pdserve.engine.sequence import Emission, Sequence, Sink


@dataclass
class Handle:
    """One request inside the engine: its blocks, its prefill (job or chunks), then its sequence."""

    spec: GenerateSpec
    table: BlockTable
    sink: Sink
    job: PrefillJob | None = None  # the colocated engine's unchunked schedule only
    sequence: Sequence | None = None
    timing: PrefillTiming | None = None
    cancelled: bool = False  # written by the engine thread only
    enqueued_at: float = field(default_factory=time.perf_counter)
    first_chunk_at: float | None = None


@dataclass
class _Waiting:
    handle: Handle
    done: int = 0  # prompt positions already prefilled (or handed out this step)


@dataclass(frozen=True)
class Chunk:
    handle: Handle
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == self.handle.spec.prompt_len


class ChunkQueue:
    """Prompts waiting for chunked prefill, first come first served, each with its progress.

    `add` may be called from any thread; `take` (engine thread) hands out the next prompt
    positions within a token budget: the head prompt's next piece, then the following prompts'.
    Only the engine thread drops a prompt (cancelled or failed)."""

    def __init__(self) -> None:
        self._waiting: deque[_Waiting] = deque()
        self._lock = threading.Lock()

    def add(self, handle: Handle) -> None:
        """Queues the prompt from its first position not already cached in its table."""
        with self._lock:
            self._waiting.append(_Waiting(handle, done=handle.table.cached_tokens))

    def drop(self, handle: Handle) -> None:
        """Forgets a prompt however far it got (engine thread, on cancel or failure)."""
        with self._lock:
            for item in [i for i in self._waiting if i.handle is handle]:
                self._waiting.remove(item)

    def drain(self) -> list[Handle]:
        """Every waiting prompt, taken out of the queue."""
        with self._lock:
            handles = [item.handle for item in self._waiting]
            self._waiting.clear()
        return handles

    @property
    def has_work(self) -> bool:
        return bool(self._waiting)

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def take(self, step_tokens: int, long_tokens: int) -> list[Chunk]:
        """The next prompt pieces, first come first served, at most `step_tokens` in all.

        A prompt of at most `long_tokens` goes whole if the step has room. The pieces of longer
        prompts share `long_tokens` between them: those are the prompts chunking exists for,
        and together they hold a step for at most that many tokens. A completed prompt leaves."""
        chunks: list[Chunk] = []
        step_left, long_left = step_tokens, long_tokens
        with self._lock:
            for item in list(self._waiting):
                if step_left <= 0:
                    break
                prompt_len = item.handle.spec.prompt_len
                piece = min(prompt_len - item.done, step_left)
                if prompt_len > long_tokens:
                    piece = min(piece, long_left)
                    long_left -= piece
                if piece == 0:
                    continue  # the long prompts' share is spent; shorter ones behind may go
                chunks.append(Chunk(item.handle, item.done, item.done + piece))
                step_left -= piece
                item.done += piece
                if item.done == prompt_len:
                    self._waiting.remove(item)
        return chunks


class ChunkedPrefill:
    """Steps that carry every running decode plus the next prompt pieces: at most `step_budget`
    prompt tokens, of which the pieces of long prompts take at most `budget` while decodes run.

    `service` labels the metrics. `add` and `abort` may be called from any thread; `step` only
    from the engine thread, which carries out the cancels at its top."""

    def __init__(
        self,
        runner: ModelRunner,
        decode: DecodeScheduler,
        budget: int,
        service: str,
        jobs: PrefillScheduler | None = None,
        step_budget: int = 0,
    ) -> None:
        """`jobs`: where handles with a `job` wait (the colocated engine's unchunked schedule).
        `budget`: the chunk, the most of long prompts a step with decodes carries.
        `step_budget`: the most prompt tokens of any step (at least `budget`)."""
        self.runner, self.decode, self.jobs = runner, decode, jobs
        self.budget, self.service = budget, service
        self.step_budget = max(budget, step_budget)
        self.chunks = ChunkQueue()
        self.cancels: Cancellations[Handle] = Cancellations()

    @property
    def has_work(self) -> bool:
        return self.chunks.has_work or self.cancels.pending

    def add(self, handle: Handle) -> None:
        self.chunks.add(handle)

    def step(self) -> None:
        """cancels -> schedule (decodes + prompt chunks) -> one forward -> sample decodes and
        first tokens."""
        self.apply_cancels()
        batch = self.decode.schedule()
        # The chunk bounds how long a long prompt keeps the running streams from their next
        # token. Splitting a short prompt would not shorten that wait, only repeat it (every step
        # also runs the decodes) and delay its first token, so short prompts go whole, and a
        # step without decodes keeps no one waiting: a burst of prompts starts together.
        long_tokens = self.budget if batch else self.step_budget
        chunks = self.chunks.take(self.step_budget, long_tokens)
        for chunk in chunks:
            chunk.handle.first_chunk_at = chunk.handle.first_chunk_at or time.perf_counter()
        if not batch and not chunks:
            return
        start = time.perf_counter()
        try:
            logits = self._forward(batch, chunks)
        except Exception as exc:  # the prompts in this step fail; the loop fails the decodes
            for chunk in chunks:
                self.failed(chunk.handle, f"prefill failed: {exc}")
            raise
        self.decode.postprocess(batch, logits[: len(batch)])
        self._first_tokens([c for c in chunks if c.completes], logits[len(batch) :], start)
        metrics.DECODE_BATCH.labels(self.service).observe(len(batch))
        metrics.STEP_SECONDS.labels(self.service, "mixed").observe(time.perf_counter() - start)

    def _forward(self, batch: list[Sequence], chunks: list[Chunk]):
        """One pass over each decode's newest token and every chunk's prompt tokens; logits only
        for the decodes and for the last token of each prompt that completes."""
        pieces = [
            PromptPiece(c.handle.table, c.handle.spec.prompt_token_ids, c.start, c.end)
            for c in chunks
        ]
        return self.runner.run(decodings(batch), pieces)

    def _first_tokens(self, completed: list[Chunk], logits, started: float) -> None:
        if not completed:
            return
        firsts = self.runner.sample(logits, [first_draw(c.handle.spec) for c in completed])
        finished = time.perf_counter()
        for chunk, first in zip(completed, firsts, strict=True):
            h = chunk.handle
            began = h.first_chunk_at
            assert began is not None  # step() noted it before the prompt's first chunk ran
            timing = PrefillTiming(
                began - h.enqueued_at,
                finished - began,
                len(completed),
                h.spec.prompt_len,
                finished,
            )
            metrics.TOKENS.labels(self.service, "prompt").inc(h.spec.prompt_len)
            self.prefilled(h, first, timing)

    def prefilled(self, handle: Handle, first: Pick, timing: PrefillTiming) -> None:
        """Engine thread: the prompt's first token; the sequence starts decoding, unless it was
        cancelled."""
        handle.timing = timing
        if handle.cancelled:
            handle.table.release()
            return
        handle.table.prompt_written = True

        def created(seq: Sequence) -> None:
            handle.sequence = seq  # before the first emission, which a service thread may read

        self.decode.start(handle.spec, handle.table, handle.sink, first, created)

    def failed(self, handle: Handle, message: str) -> None:
        self.chunks.drop(handle)
        handle.table.release()
        handle.sink(Emission((), "", error=message))

    def fail_all(self, message: str) -> None:
        """The engine loop failed: every prompt still waiting or part-way ends with `message`,
        and the running decodes too."""
        for handle in self.chunks.drain():
            self.failed(handle, message)
        self.decode.fail_all(message)

    def abort(self, handle: Handle) -> None:
        """Any thread: cancels the handle at the next step, however far it got. The caller
        wakes the engine loop."""
        self.cancels.ask(handle)

    def apply_cancels(self) -> None:
        """Engine thread, between passes: each cancelled handle gives its blocks back where it
        is (queued or part-way through its prompt), or its sequence leaves the decode batch."""
        for handle in self.cancels.take():
            if handle.cancelled:
                continue
            handle.cancelled = True
            if handle.sequence is not None:
                self.decode.abort(handle.sequence)  # leaves at this step's scheduling
            elif handle.job is None:  # a prompt queued or part-way: nothing else frees it
                self.chunks.drop(handle)
                handle.table.release()
            elif self.jobs is not None and self.jobs.remove(handle.job):  # it never ran
                handle.table.release()
