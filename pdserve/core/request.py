"""A generation request as the engines see it, and the checks every entry point applies."""

from dataclasses import dataclass, field

from pdserve.core.config import ModelConfig

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 128
MAX_CACHE_SALT_BYTES = 64


class InvalidRequest(ValueError):
    """The request cannot be served as asked; the message says why (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    first_step: int = 0  # step number of the first token: nonzero for a migrated continuation

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    # The prefix caches find a block again only for requests with the same salt (the router's
    # --prefix-cache-scope client gives each client its own, so none can time another's).
    cache_salt: bytes = b""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens the sequence may hold at most: the room decode must reserve."""
        return self.prompt_len + self.sampling.max_tokens


def one_prompt(prompt: str, prompt_token_ids: list[int], messages: list) -> None:
    """Exactly one of text, token ids or chat messages."""
    given = sum(1 for p in (prompt, prompt_token_ids, messages) if p)
    if given > 1:
        raise InvalidRequest("give one of prompt, prompt_token_ids or messages, not several")
    if not given:
        raise InvalidRequest(
            "the prompt is empty: give prompt (text), prompt_token_ids or messages (a chat)"
        )


def validate(spec: GenerateSpec, config: ModelConfig) -> GenerateSpec:
    """Raises InvalidRequest naming the first thing wrong; returns the spec unchanged."""
    _check_request_id(spec.request_id)
    _check_tokens(spec.prompt_token_ids, config)
    _check_sampling(spec.sampling)
    if len(spec.cache_salt) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes")
    if spec.max_total_tokens > config.max_context:
        raise InvalidRequest(
            f"prompt ({spec.prompt_len} tokens) plus max_tokens ({spec.sampling.max_tokens}) is "
            f"{spec.max_total_tokens}, over the context length of {config.max_context}"
        )
    return spec


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
    # It goes into log lines and status details: a newline in it would forge a log line.
    if not all(" " <= c <= "~" for c in request_id):
        raise InvalidRequest("request_id must be printable ASCII (no control characters)")


def _check_tokens(token_ids: tuple[int, ...], config: ModelConfig) -> None:
    if not token_ids:
        raise InvalidRequest("the prompt has no tokens")
    bad = [t for t in token_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size}) "
            f"({len(bad)} such id(s))"
        )


def _check_sampling(s: SamplingSpec) -> None:
    if s.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be at least 1, got {s.max_tokens}")
    if not 0 <= s.temperature < float("inf"):  # also catches NaN
        raise InvalidRequest(f"temperature must be >= 0 and finite, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 means no limit), got {s.top_k}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")
