"""One loop doing both jobs, prefill and decode, on the same model and the same cores.

Two schedules (--prefill-chunk-tokens):
  chunked (default, as vLLM's and Sarathi-Serve's): every step is one forward pass carrying every
          running decode plus at most `chunk_tokens` tokens of prompts longer than that, so a
          long prompt is spread over several steps and the streams beside it keep getting
          tokens; shorter prompts go whole, and a step with no decode to carry takes any
          prompt, up to `step_prompt_tokens` (--step-prompt-tokens) in all;
  plain   (0): a whole prefill batch when one waits, then a decode step for all.
Prefill writes its KV straight into the paged cache, the in-process equivalent of the handoff.
"""

from pdserve import metrics
from pdserve.core.block_pool import BlockPool
from pdserve.core.client_shares import ClientShares
from pdserve.engine.chunked_prefill import ChunkedPrefill, Handle
from pdserve.engine.decode_scheduler import DecodeScheduler
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.paged_cache import PagedCache
from pdserve.engine.prefill_scheduler import PrefillJob, PrefillScheduler
from pdserve.engine.prompt_scoring import ScoreQueue
from pdserve.core.request import GenerateSpec
from pdserve.engine.sequence import Sink
from pdserve.models.loading import ServedModel
from pdserve.settings import ColocatedSettings


class ColocatedEngine:
    def __init__(self, served: ServedModel, settings: ColocatedSettings) -> None:
        d, p = settings.decode, settings.prefill
        self.model = served.built
        self.pool = BlockPool(d.num_blocks, d.block_size)
        self.client_shares = ClientShares(d.num_blocks)  # --max-pool-share-per-client
        self.client_share = d.max_pool_share_per_client
        self.cache = PagedCache(served.config, d.num_blocks, d.block_size)
        ending = served.tokenizer.eos_token_ids
        self.prefill = PrefillScheduler(self.model, p.max_batch_size, p.max_batch_tokens, ending)
        runner = ModelRunner(self.model, self.cache, ending)
        self.decode = DecodeScheduler(runner, served.tokenizer, d.max_batch)
        self.chunk_tokens = settings.chunk_tokens
        self.chunked = ChunkedPrefill(
            runner,
            self.decode,
            settings.chunk_tokens,
            "colocated",
            jobs=self.prefill,
            step_budget=settings.step_prompt_tokens,
        )
        self.scores = ScoreQueue(self.model)  # echo's prompt logprobs, between steps
        self.loop = EngineLoop("colocated-engine", self.step, self.has_work, self._crashed)

    def has_work(self) -> bool:
        busy = self.prefill.has_work or self.chunked.has_work or self.decode.has_work
        return busy or self.scores.pending

    @property
    def queue_depth(self) -> int:
        return self.prefill.queue_depth + self.chunked.chunks.depth

    def step(self) -> None:
        self.scores.run_next()
        if self.chunk_tokens:
            self.chunked.step()
        else:
            self._plain_step()

    def _plain_step(self) -> None:
        """The chapter's loop: a prefill batch if one waits, then one decode step for all."""
        self.chunked.apply_cancels()
        if self.prefill.has_work:
            timing = self.prefill.step()
            if timing is not None:
                metrics.PREFILL_BATCH.labels("colocated").observe(timing.batch_size)
                metrics.STEP_SECONDS.labels("colocated", "prefill").observe(timing.prefill_seconds)
        stats = self.decode.step()
        if stats is not None:
            metrics.DECODE_BATCH.labels("colocated").observe(stats.batch_size)
            metrics.STEP_SECONDS.labels("colocated", "decode").observe(stats.seconds)

    def submit(self, spec: GenerateSpec, sink: Sink) -> Handle:
        """Reserves room within the client's share (PoolExhausted, ClientLimit among them,
        when there is none) and queues the prompt. From one thread only (the event loop's)."""
        table = self.client_shares.reserve(self.pool, spec, self.client_share)
        handle = Handle(spec, table, sink)
        if self.chunk_tokens:
            self.chunked.add(handle)
        else:
            handle.job = PrefillJob(
                spec,
                lambda layer, k, v: self._store(handle, layer, k, v),
                on_done=lambda first, timing: self.chunked.prefilled(handle, first, timing),
                on_error=lambda msg: self.chunked.failed(handle, msg),
            )
            self.prefill.add(handle.job)
        self.loop.wake()
        return handle

    def abort(self, handle: Handle) -> None:
        """Any thread: the handle's blocks go back at the next step, however far it got."""
        self.chunked.abort(handle)
        self.loop.wake()

    def _store(self, handle: Handle, layer: int, k, v) -> None:
        handle.table.ensure(handle.spec.prompt_len)
        self.cache.write(layer, handle.table.slots(0, handle.spec.prompt_len), k, v)

    def _crashed(self, message: str) -> None:
        self.scores.fail_all(message)
        self.chunked.fail_all(message)
