"""Text of a sequence's output as it streams: UTF-8 assembly and stop strings.

Text that could be the start of a stop string is held back until it is clear that it is not,
so a stop string never reaches the client, even one spread over many tokens.
"""

from pdserve.models.tokenizer import Detokenizer


class OutputText:
    def __init__(self, decoder: Detokenizer, stop: tuple[str, ...] = ()) -> None:
        self._stop = stop
        self._decoder = decoder
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Adds one token; returns the text that can be sent now. Sets `stopped` on a stop string."""
        self._text += self._decoder.feed(token_id)
        cut = self._stop_index()
        if cut is not None:
            self.stopped = True
            return self._take(cut)
        return self._take(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text once the sequence has ended for another reason."""
        if self.stopped:
            return ""
        self._text += self._decoder.flush()
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        piece = self._text[self._sent : end]
        self._sent = end
        return piece

    def _stop_index(self) -> int | None:
        # A stop string can only have completed within the last len(stop) characters.
        hits = [self._text.find(s, max(self._sent - len(s), 0)) for s in self._stop]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
