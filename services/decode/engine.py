"""The decode engine: the KV pool, the paged cache and the continuous-batching loop over them.

Prompts the router sends here to be prefilled (conditional disaggregation) go through the same
loop in pieces of --local-prefill-chunk-tokens, beside the running decodes."""

import logging

from pdserve import metrics

from pdserve.core.block_pool import BlockPool
from pdserve.core.picked import Pick
from pdserve.engine.chunked_prefill import ChunkedPrefill, Handle
from pdserve.engine.decode_scheduler import DecodeScheduler
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.paged_cache import PagedCache
from pdserve.engine.sequence import Sequence
from pdserve.models.loading import ServedModel
from pdserve.settings import DecodeSettings
from pdserve.kv.leases import Lease

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, served: ServedModel, settings: DecodeSettings) -> None:
        self.config = served.config
        self.pool = BlockPool(settings.num_blocks, settings.block_size, settings.prefix_cache)
        self.cache = PagedCache(self.config, settings.num_blocks, settings.block_size)
        runner = ModelRunner(served.built, self.cache, served.tokenizer.eos_token_ids)
        self.scheduler = DecodeScheduler(runner, served.tokenizer, settings.max_batch)
        self.local = ChunkedPrefill(
            runner, self.scheduler, settings.local_prefill_chunk_tokens, "decode"
        )
        self.faults = settings.common.faults
        self.steps = 0
        self.loop = EngineLoop(
            "decode-engine",
            self._step,
            lambda: self.scheduler.has_work or self.local.has_work,
            self.local.fail_all,
        )

    def _step(self) -> None:
        if self.local.has_work:
            self.local.step()  # the running decodes, plus the next pieces of local prompts
        else:
            stats = self.scheduler.step()
            if stats is None:
                return
            metrics.DECODE_BATCH.labels("decode").observe(stats.batch_size)
            metrics.STEP_SECONDS.labels("decode", "decode").observe(stats.seconds)
        self.steps += 1
        self.faults.after_decode_step(self.steps)

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def start_sequence(self, lease: Lease, first: Pick) -> Sequence:
        """Turns a committed lease into a running sequence that begins with prefill's token."""
        seq = self.scheduler.start(lease.spec, lease.table, lease.sink, first)
        self.loop.wake()
        return seq

    def prefill_here(self, handle: Handle) -> None:
        """Queues a prompt whose blocks `handle` holds; its sequence starts at its first token."""
        self.local.add(handle)
        self.loop.wake()

    def abort_local(self, handle: Handle) -> None:
        """However far the handle got (waiting, prefilling, decoding), its blocks go back."""
        self.local.abort(handle)
        self.loop.wake()

    def abort(self, seq: Sequence) -> None:
        """The sequence and its forks (the request's other completions) leave."""
        if not all(each.done for each in seq.completions):
            self.scheduler.abort(seq)
            self.loop.wake()
