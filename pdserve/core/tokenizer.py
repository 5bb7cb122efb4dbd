"""Byte-level tokenizer: token i < 256 is the byte i; 256 is end-of-sequence."""

import codecs

EOS_TOKEN_ID = 256
BYTE_VOCAB = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class IncrementalDecoder:
    """Turns tokens into text one at a time; bytes of an unfinished UTF-8 character wait."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id >= BYTE_VOCAB:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
