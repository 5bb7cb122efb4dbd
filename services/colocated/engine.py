"""One loop doing both jobs: each step runs a prefill batch (if any waits) then a decode step.

The prefill writes its KV straight into the paged cache, the in-process equivalent of the handoff.
"""

import threading
from dataclasses import dataclass, field

from pdserve import metrics
from pdserve.core.block_pool import BlockPool, BlockTable
from pdserve.core.decode_scheduler import DecodeScheduler
from pdserve.core.engine_loop import EngineLoop
from pdserve.core.paged_cache import PagedCache
from pdserve.core.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.core.request import GenerateSpec
from pdserve.core.sequence import Emission, Sequence, Sink
from pdserve.models.loading import ServedModel
from pdserve.settings import ColocatedSettings


@dataclass
class Handle:
    """One request inside the engine: its blocks, its prefill job, then its sequence."""

    spec: GenerateSpec
    table: BlockTable
    sink: Sink
    job: PrefillJob | None = None
    sequence: Sequence | None = None
    timing: PrefillTiming | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class ColocatedEngine:
    def __init__(self, served: ServedModel, settings: ColocatedSettings) -> None:
        d, p = settings.decode, settings.prefill
        self.pool = BlockPool(d.num_blocks, d.block_size)
        self.cache = PagedCache(served.config, d.num_blocks, d.block_size)
        self.prefill = PrefillScheduler(served.model, p.max_batch_size, p.max_batch_tokens)
        self.decode = DecodeScheduler(served.model, served.tokenizer, self.cache, d.max_batch)
        self.loop = EngineLoop("colocated-engine", self.step, self.has_work, self.decode.fail_all)

    def has_work(self) -> bool:
        return self.prefill.has_work or self.decode.has_work

    def step(self) -> None:
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

    def submit(self, spec: GenerateSpec, sink: Sink) -> Handle:
        """Reserves room (PoolExhausted when there is none) and queues the prompt."""
        handle = Handle(spec, self.pool.reserve(spec.max_total_tokens), sink)
        handle.job = PrefillJob(spec, lambda layer, k, v: self._store(handle, layer, k, v),
                                on_done=lambda token, timing: self._prefilled(handle, token, timing),
                                on_error=lambda msg: self._failed(handle, msg))
        self.prefill.add(handle.job)
        self.loop.wake()
        return handle

    def abort(self, handle: Handle) -> None:
        with handle.lock:
            handle.cancelled = True
            if self.prefill.remove(handle.job):  # never ran: nothing else will free its blocks
                handle.table.release()
                return
            # Running (then _prefilled sees `cancelled` and frees) or already decoding.
            handle.job.cancelled = True
            if handle.sequence is not None:
                self.decode.abort(handle.sequence)
        self.loop.wake()

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
        handle.table.release()
        handle.sink(Emission((), "", error=message))
