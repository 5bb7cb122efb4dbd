"""One loop doing both jobs, prefill and decode, on the same model and the same cores.

Two schedules (--prefill-chunk-tokens):
  chunked (default, as vLLM's and Sarathi-Serve's): every step is one forward pass carrying every
          running decode plus at most `chunk_tokens` prompt tokens, so a long prompt is spread
          over several steps and the streams beside it keep getting tokens;
  plain   (0): a whole prefill batch when one waits, then a decode step for all.
Prefill writes its KV straight into the paged cache, the in-process equivalent of the handoff.
"""

import threading
import time
from dataclasses import dataclass, field

from pdserve import metrics
from pdserve.core.block_pool import BlockPool, BlockTable
from pdserve.core.decode_scheduler import DecodeScheduler
from pdserve.core.engine_loop import EngineLoop
from pdserve.core.paged_cache import PagedCache, PromptChunk
from pdserve.core.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.core.request import GenerateSpec
from pdserve.core.sampling import sample
from pdserve.core.sequence import Emission, Sequence, Sink
from pdserve.models.loading import ServedModel
from pdserve.settings import ColocatedSettings
from pdserve.services.colocated.chunks import Chunk, ChunkQueue


@dataclass
class Handle:
    """One request inside the engine: its blocks, its prefill (job or chunks), then its sequence."""

    spec: GenerateSpec
    table: BlockTable
    sink: Sink
    job: PrefillJob | None = None
    sequence: Sequence | None = None
    timing: PrefillTiming | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    enqueued_at: float = field(default_factory=time.perf_counter)
    first_chunk_at: float | None = None


class ColocatedEngine:
    def __init__(self, served: ServedModel, settings: ColocatedSettings) -> None:
        d, p = settings.decode, settings.prefill
        self.model = served.built
        self.pool = BlockPool(d.num_blocks, d.block_size)
        self.cache = PagedCache(served.config, d.num_blocks, d.block_size)
        self.prefill = PrefillScheduler(self.model, p.max_batch_size, p.max_batch_tokens)
        self.decode = DecodeScheduler(self.model, served.tokenizer, self.cache, d.max_batch)
        self.chunk_tokens = settings.chunk_tokens
        self.chunks = ChunkQueue()
        self.loop = EngineLoop("colocated-engine", self.step, self.has_work, self._crashed)

    def has_work(self) -> bool:
        return self.prefill.has_work or self.chunks.has_work or self.decode.has_work

    @property
    def queue_depth(self) -> int:
        return self.prefill.queue_depth + self.chunks.depth

    def step(self) -> None:
        if self.chunk_tokens:
            self._chunked_step()
        else:
            self._plain_step()

    def _plain_step(self) -> None:
        """The chapter's loop: a prefill batch if one waits, then one decode step for all."""
        if self.prefill.has_work:
            timing = self.prefill.step()
            if timing is not None:
                metrics.PREFILL_BATCH.labels("colocated").observe(timing.batch_size)
                metrics.STEP_SECONDS.labels("colocated", "prefill").observe(timing.prefill_seconds)
        stats = self.decode.step()
        if stats is not None:
            metrics.DECODE_BATCH.labels("colocated").observe(stats.batch_size)
            metrics.STEP_SECONDS.labels("colocated", "decode").observe(stats.seconds)

    def _chunked_step(self) -> None:
        """schedule (decodes + prompt chunks) -> one forward -> sample decodes and first tokens."""
        batch = self.decode.schedule()
        chunks = [c for c in self.chunks.take(self.chunk_tokens) if self._claim(c)]
        if not batch and not chunks:
            return
        start = time.perf_counter()
        try:
            logits = self._forward(batch, chunks)
        except Exception as exc:  # the prompts in this step fail; the loop fails the decodes
            for chunk in chunks:
                self._failed(chunk.handle, f"prefill failed: {exc}")
            raise
        self.decode.postprocess(batch, logits[: len(batch)])
        self._first_tokens([c for c in chunks if c.completes], logits[len(batch) :], start)
        metrics.DECODE_BATCH.labels("colocated").observe(len(batch))
        metrics.STEP_SECONDS.labels("colocated", "mixed").observe(time.perf_counter() - start)

    def _forward(self, batch: list[Sequence], chunks: list[Chunk]):
        """One pass over each decode's newest token and every chunk's prompt tokens; logits only
        for the decodes and for the last token of each prompt that completes."""
        tokens = [s.tokens[-1] for s in batch]
        positions = [s.cached_tokens for s in batch]
        rows = list(range(len(batch)))
        for chunk in chunks:
            chunk.handle.table.ensure(chunk.end)
            tokens += chunk.handle.spec.prompt_token_ids[chunk.start : chunk.end]
            positions += range(chunk.start, chunk.end)
            if chunk.completes:
                rows.append(len(tokens) - 1)
        view = self.cache.step_view(
            [s.table for s in batch],
            [s.cached_tokens for s in batch],
            [PromptChunk(c.handle.table, c.start, c.end) for c in chunks],
        )
        return self.model.decode_paged(tokens, positions, view, rows)

    def _claim(self, chunk: Chunk) -> bool:
        """True when the chunk's prompt is still wanted (and notes when its prefill began); a
        prompt cancelled after its first chunk is dropped here, on the engine thread."""
        handle = chunk.handle
        with handle.lock:
            if handle.cancelled:
                self.chunks.drop(handle)
                handle.table.release()
                return False
            handle.first_chunk_at = handle.first_chunk_at or time.perf_counter()
            return True

    def _first_tokens(self, completed: list[Chunk], logits, started: float) -> None:
        if not completed:
            return
        firsts = sample(
            logits,
            [c.handle.spec.sampling for c in completed],
            [c.handle.spec.sampling.first_step for c in completed],
        )
        finished = time.perf_counter()
        for chunk, token in zip(completed, firsts, strict=True):
            h = chunk.handle
            began = h.first_chunk_at
            assert began is not None  # _claim noted it before the prompt's first chunk ran
            timing = PrefillTiming(
                began - h.enqueued_at,
                finished - began,
                len(completed),
                h.spec.prompt_len,
                finished,
            )
            metrics.TOKENS.labels("colocated", "prompt").inc(h.spec.prompt_len)
            self._prefilled(h, token, timing)

    def submit(self, spec: GenerateSpec, sink: Sink) -> Handle:
        """Reserves room (PoolExhausted when there is none) and queues the prompt."""
        handle = Handle(spec, self.pool.reserve(spec.max_total_tokens), sink)
        if self.chunk_tokens:
            self.chunks.add(handle, spec.prompt_len)
        else:
            handle.job = PrefillJob(
                spec,
                lambda layer, k, v: self._store(handle, layer, k, v),
                on_done=lambda token, timing: self._prefilled(handle, token, timing),
                on_error=lambda msg: self._failed(handle, msg),
            )
            self.prefill.add(handle.job)
        self.loop.wake()
        return handle

    def abort(self, handle: Handle) -> None:
        with handle.lock:
            handle.cancelled = True
            if self._take_back(handle):  # never ran: nothing else will free its blocks
                handle.table.release()
                return
            # Prefilling (the engine thread sees `cancelled` and frees) or already decoding.
            if handle.job is not None:
                handle.job.cancelled = True
            if handle.sequence is not None:
                self.decode.abort(handle.sequence)
        self.loop.wake()

    def _take_back(self, handle: Handle) -> bool:
        if handle.job is not None:
            return self.prefill.remove(handle.job)
        return self.chunks.remove(handle)

    def _store(self, handle: Handle, layer: int, k, v) -> None:
        handle.table.ensure(handle.spec.prompt_len)
        self.cache.write(layer, handle.table.slots(0, handle.spec.prompt_len), k, v)

    def _prefilled(self, handle: Handle, token: int, timing: PrefillTiming) -> None:
        with handle.lock:
            handle.timing = timing
            if handle.cancelled:
                handle.table.release()
                return
            handle.sequence = self.decode.start(handle.spec, handle.table, handle.sink, token)

    def _failed(self, handle: Handle, message: str) -> None:
        self.chunks.drop(handle)
        handle.table.release()
        handle.sink(Emission((), "", error=message))

    def _crashed(self, message: str) -> None:
        self.decode.fail_all(message)
