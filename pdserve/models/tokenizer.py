"""Tokenizers: text to ids, ids back to text as they stream, and chat messages to a prompt.

Torch-free: the router tokenizes. Two kinds:
  ByteTokenizer  TinyGPT's: token i < 256 is the byte i, 256 is end-of-sequence; no chat template.
  HfTokenizer    a checkpoint's tokenizer.json (the `tokenizers` library) and its chat template
                 (rendered by jinja2 in a sandbox, since templates ship with downloaded models).
"""

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from pdserve.core.request import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant")
MAX_CHAT_MESSAGES = 256
# Prompt tokens a detokenizer starts from, so a token's leading space decodes as it does in context.
DETOKENIZER_CONTEXT = 4


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Detokenizer(Protocol):
    def feed(self, token_id: int) -> str:
        """Text that this token completes (never half a UTF-8 character); may be empty."""
        ...

    def flush(self) -> str:
        """Whatever is still held back, once the sequence has ended."""
        ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]: ...

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs report them (a special token's
        own name, such as <|im_end|>); it may be part of a UTF-8 character."""
        ...


def check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidRequest("the chat has no messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"at most {MAX_CHAT_MESSAGES} chat messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"message {i} has role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )


class ByteTokenizer:
    EOS = 256

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eos_token_ids = frozenset({self.EOS})
        self.has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        raise InvalidRequest("this model (tinygpt) has no chat template: send a plain prompt")

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b"<eos>"


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id >= 256:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HfTokenizer:
    def __init__(
        self,
        tokenizer_file: Path,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        special_tokens: dict[str, str],
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer
        from tokenizers.decoders import ByteLevel as ByteLevelDecoder

        try:
            self._tok = _Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library's errors name no file
            raise ValueError(
                f"{tokenizer_file}: not a tokenizer this version of `tokenizers` reads: {exc}"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self._template = _compile_template(chat_template) if chat_template else None
        self._special_tokens = special_tokens
        self._byte_level = isinstance(self._tok.decoder, ByteLevelDecoder)
        self._special_ids = {
            i for i, added in self._tok.get_added_tokens_decoder().items() if added.special
        }

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        check_messages(messages)
        if self._template is None:
            raise InvalidRequest("this model has no chat template: send a plain prompt")
        try:
            text = self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except Exception as exc:  # a template may raise on input it does not accept
            raise InvalidRequest(f"the chat template refused these messages: {exc}") from None
        # The template writes every special token itself, so the tokenizer must add none.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return _IncrementalDetokenizer(self, prompt_token_ids[-DETOKENIZER_CONTEXT:])

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:  # each character of the piece stands for one byte
            return bytes(_BYTE_OF_CHARACTER.get(c, 0x3F) for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes byte b as itself when it is a printable Latin-1 character,
    and as chr(256 + n) for the n-th other byte (Radford et al., 2019, the GPT-2 encoder)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHARACTER = _byte_level_alphabet()


class _IncrementalDetokenizer:
    """Decodes a short window of ids and sends only what the newest token added.

    Text is released once it no longer ends in U+FFFD, the replacement a decoder writes for an
    unfinished UTF-8 sequence, so a character spread over several byte tokens is never split.
    """

    def __init__(self, tokenizer: HfTokenizer, context: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(context)
        self._prefix = 0  # window start: decoded for context only
        self._read = len(self._ids)  # everything before this has been sent

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        sent = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(sent) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(sent) :]

    def flush(self) -> str:
        sent = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(sent) :]


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    # trim_blocks/lstrip_blocks: how Hugging Face renders chat templates, which are written for it.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    return env.from_string(source)
