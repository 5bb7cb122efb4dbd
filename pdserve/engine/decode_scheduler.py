"""Continuous batching: every step decodes one token for every running sequence.

New sequences join between steps (up to max_batch running); finished and aborted ones leave and
give their blocks back. `start` and `abort` may be called from any thread; `step` only from the
engine thread, which alone marks a sequence aborted (cancellations.py).

The batch is shared between clients (GenerateSpec.client). Sequences waiting to join take turns
by client (fair_lines.py). And when every slot is taken while a client with fewer running
sequences than its share (max_batch / the clients running or waiting) waits, the client running
the most gives back its newest sequence, which waits, its blocks kept, to rejoin: a burst of one
client's streams would otherwise hold every slot until they end, and another client's stream
would get its first token (prefill's) and then nothing for as long. Alone, a client has every
slot.
"""

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pdserve.core.block_pool import BlockTable
from pdserve.core.fair_lines import FairLines
from pdserve.core.picked import Pick
from pdserve.core.request import GenerateSpec
from pdserve.engine.cancellations import Cancellations
from pdserve.engine.model_runner import Decoding, ModelRunner
from pdserve.engine.sampling import Draw
from pdserve.engine.sequence import Sequence, Sink
from pdserve.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class DecodeStepStats:
    batch_size: int
    seconds: float


class DecodeScheduler:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, max_batch: int) -> None:
        self.runner, self.tokenizer, self.max_batch = runner, tokenizer, max_batch
        self.running: list[Sequence] = []
        self._joining: FairLines[Sequence] = FairLines()  # by client, with their turns
        self._lock = threading.Lock()
        self.cancels: Cancellations[Sequence] = Cancellations()

    def start(
        self,
        spec: GenerateSpec,
        table: BlockTable,
        sink: Sink,
        first: Pick,
        created: Callable[[Sequence], None] = lambda seq: None,
    ) -> Sequence:
        """A sequence whose prompt KV is in `table`, beginning with prefill's first token; it
        joins at the next step, unless that token already ended it (then its blocks go back).
        With n > 1, its forks join too, before that token can release the table they share.
        `created` sees the sequence before its first emission, so that whoever reads an
        emission can already find the sequence it came from."""
        seq = Sequence(spec, table, sink, self.tokenizer)
        seq.forks = [self._fork(seq, index) for index in range(1, spec.sampling.n)]
        created(seq)
        seq.append(first)
        if seq.done:
            table.release()
        with self._lock:
            for joining in seq.completions:
                if not joining.done:
                    self._joining.append(spec.client, joining)
        return seq

    def _fork(self, first: Sequence, index: int) -> Sequence:
        """Completion `index` of `first`'s request: the prompt's blocks shared, its own seed."""
        table = self.runner.fork(first.table)
        return Sequence(
            first.spec.completion(index), table, first.sink, self.tokenizer, index=index
        )

    def abort(self, seq: Sequence) -> None:
        """Any thread: the sequence and its forks leave at the next step boundary (their blocks
        are freed then). The caller wakes the engine loop."""
        for each in seq.completions:
            if not each.done:
                self.cancels.ask(each)

    @property
    def has_work(self) -> bool:
        return bool(self.running or len(self._joining)) or self.cancels.pending

    @property
    def size(self) -> int:
        """Sequences running or about to join. A finished or aborted one is not counted, though
        it stays in `running` until the step's end: a finished sequence's blocks are back before
        its last emission, and pool stats read at that instant must not count it as running."""
        with self._lock:
            joining = sum(not s.done for s in self._joining)
        return joining + sum(not s.done for s in list(self.running))

    def step(self) -> DecodeStepStats | None:
        batch = self.schedule()
        if not batch:
            return None
        start = time.perf_counter()
        logits = self.runner.run(decodings(batch))
        self.postprocess(batch, logits)
        return DecodeStepStats(len(batch), time.perf_counter() - start)

    def schedule(self) -> list[Sequence]:
        """The sequences that decode one token this step (joining ones admitted first)."""
        self._admit()
        return self.running

    def postprocess(self, batch: list[Sequence], logits) -> None:
        """Samples each sequence's token from its row of `logits`, then lets finished ones go."""
        picks = self.runner.sample(logits, [_draw(s) for s in batch])
        for seq, pick in zip(batch, picks, strict=True):
            if not seq.aborted:
                seq.append(pick)
        self._leave()

    def fail_all(self, message: str) -> None:
        """Ends every sequence with an error (the model step itself failed)."""
        self._admit_all()
        for seq in self.running:
            seq.fail(message)
        self._leave()

    def _admit(self) -> None:
        for seq in self.cancels.take():  # the engine thread is the only writer of `aborted`
            seq.aborted = True
        self._leave()
        with self._lock:
            # Aborted sequences still waiting to join leave now.
            for seq in [s for s in self._joining if s.done]:
                self._joining.remove(seq)
                seq.table.release()
            self._share_full_batch()
            while len(self._joining) and len(self.running) < self.max_batch:
                self.running.append(self._joining.pop()[1])
        for seq in self.running:
            seq.table.ensure(len(seq.tokens))

    def _share_full_batch(self) -> None:
        """While every slot is taken and a waiting client runs fewer sequences than its share,
        the client running the most (above its share) gives its newest sequence back to its
        line, and the waiting one's first sequence takes the slot."""
        while len(self.running) >= self.max_batch and len(self._joining):
            running: Counter[Hashable] = Counter(s.spec.client for s in self.running)
            share = max(1, self.max_batch // len(set(running) | set(self._joining.clients())))
            under = [c for c in self._joining.clients() if running[c] < share]
            heaviest, most = running.most_common(1)[0]
            if not under or most <= share:
                return
            paused = next(s for s in reversed(self.running) if s.spec.client == heaviest)
            self.running = [s for s in self.running if s is not paused]  # not by value
            self._joining.put_back(heaviest, paused)
            self.running.append(self._joining.pop_from(min(under, key=running.__getitem__)))

    def _admit_all(self) -> None:
        with self._lock:
            self.running.extend(self._joining.clear())

    def _leave(self) -> None:
        leaving = [s for s in self.running if s.done]
        for seq in leaving:
            seq.table.release()
        gone = set(map(id, leaving))
        self.running = [s for s in self.running if id(s) not in gone]


def _draw(seq: Sequence) -> Draw:
    """A running sequence's next draw: its step counts every token it has output, moves
    included."""
    return Draw(seq.spec.sampling, seq.spec.sampling.first_step + seq.generated, seq.tokens)


def decodings(batch: list[Sequence]) -> list[Decoding]:
    """What the runner needs of each running sequence: its newest token and where it goes."""
    return [Decoding(s.table, s.tokens[-1], s.cached_tokens) for s in batch]
