"""One sequence being decoded, and what it reports as it goes.

Life cycle in a decode pool:  joining -> running -> finished | aborted.
A sequence enters with its prompt's KV already in its block table and the first token (sampled by
prefill); every step appends one token. Its blocks go back to the pool when it leaves, however it
leaves (a finished one's before its last emission); the engine thread does that, never a gRPC
thread, since a step may be writing to them.

A request's further completions (n > 1) are forks of its first sequence: each shares the prompt's
blocks, enters with the prompt's last token as its newest and no output, and draws its first
token in its first decode step, with its own seed.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from pdserve.core.block_pool import BlockTable
from pdserve.core.picked import Pick, TokenLogprobs
from pdserve.engine.output_text import OutputText
from pdserve.core.request import GenerateSpec
from pdserve.models.tokenizer import Tokenizer


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"


@dataclass(frozen=True)
class Emission:
    """What a sequence produced in one step; `finish_reason` or `error` is set on the last one."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    index: int = 0  # which of the request's completions (SamplingSpec.n) it belongs to


Sink = Callable[[Emission], None]


@dataclass
class Sequence:
    spec: GenerateSpec
    table: BlockTable
    sink: Sink
    tokenizer: Tokenizer
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    finish_reason: FinishReason | None = None
    aborted: bool = False
    index: int = 0  # which of the request's completions it is
    # The request's further completions, when this is its first (index 0) and n > 1.
    forks: list["Sequence"] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.spec.prompt_token_ids)
        self._text = OutputText(
            self.tokenizer.detokenizer(self.spec.prompt_token_ids), self.spec.sampling.stop
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.aborted

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is in the cache: all but the newest, which the next step writes."""
        return len(self.tokens) - 1

    def append(self, pick: Pick) -> None:
        """Adds a sampled token, decides whether the sequence is finished, and emits both."""
        token_id = pick.token
        self.tokens.append(token_id)
        self.generated += 1
        text = self._text.feed(token_id)
        self.finish_reason = self._finish_reason(token_id)
        if self.finish_reason is not None:
            text += self._text.finish()  # what it held back ("" after a stop string)
            # Before the last emission, so that a request sent as soon as this one ends finds
            # the room free and the prompt's blocks in the prefix cache. Safe: no step reads
            # these blocks any more (the engine thread, after its step; or the commit's thread,
            # for a sequence that ends at its first token, before it ever joins a step).
            self.table.release()
        logprobs = () if pick.logprobs is None else (pick.logprobs,)
        self.sink(
            Emission((token_id,), text, self.finish_reason, logprobs=logprobs, index=self.index)
        )

    def fail(self, message: str) -> None:
        self.aborted = True
        self.sink(Emission((), "", error=message, index=self.index))

    @property
    def completions(self) -> list["Sequence"]:
        """This request's sequences: this one and its forks."""
        return [self, *self.forks]

    def _finish_reason(self, token_id: int) -> FinishReason | None:
        if self._text.stopped or token_id in self.spec.sampling.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.tokenizer.eos_token_ids and not self.spec.sampling.ignore_eos:
            return FinishReason.EOS
        if self.generated >= self.spec.sampling.max_tokens:
            return FinishReason.LENGTH
        return None
