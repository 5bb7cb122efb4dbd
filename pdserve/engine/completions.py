"""What a request's emissions have told so far, over its n completions (SamplingSpec.n): the
tokens each one has output and how many have ended. A request's stream ends once all have."""

from pdserve.engine.sequence import Emission


class CompletionTally:
    def __init__(self, n: int) -> None:
        self.generated = [0] * n  # tokens output, by completion index
        self.ended = 0

    def add(self, emission: Emission) -> None:
        self.generated[emission.index] += len(emission.token_ids)
        if emission.finish_reason is not None:
            self.ended += 1

    @property
    def done(self) -> bool:
        return self.ended == len(self.generated)

    @property
    def total(self) -> int:
        """Tokens output by every completion together."""
        return sum(self.generated)
