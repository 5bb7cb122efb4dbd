"""A generation request as the engines see it, and the checks every entry point applies."""

from dataclasses import dataclass, field, replace

from pdserve.core.config import ModelConfig

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 128
MAX_CACHE_SALT_BYTES = 64
# Bounds that keep one request's sampling state small (OpenAI's own limits where it has them).
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0  # OpenAI: "values from -100 to 100"
MAX_PENALTY = 2.0  # OpenAI: frequency and presence penalties "between -2.0 and 2.0"
MAX_TOP_LOGPROBS = 20  # OpenAI's chat API: top_logprobs "between 0 and 20"
MAX_CHOICES = 8  # completions per request (n): each one holds its own blocks on decode
_SEED_MASK = (1 << 64) - 1


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
    # What vLLM, SGLang and TGI offer beside these; pdserve.engine.sampling defines each. Every
    # default leaves the logits as the model gave them.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives'
    n: int = 1  # completions from the one prompt; GenerateSpec.completion(i) is completion i

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the model's logits before the token is picked."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    # The prefix caches find a block again only for requests with the same salt (the router's
    # --prefix-cache-scope client gives each client its own, so none can time another's).
    cache_salt: bytes = b""
    # Who sent it, as the service that runs it tells clients apart ("" for one client): decode
    # shares its batch between clients by it (engine/decode_scheduler.py).
    client: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def completion(self, index: int) -> "GenerateSpec":
        """Completion `index` of this request, as a request of one completion: seed + index,
        which gives the tokens a request with that seed would."""
        seed = (self.sampling.seed + index) & _SEED_MASK
        return replace(self, sampling=replace(self.sampling, n=1, seed=seed))

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
    _check_sampling_tokens(spec.sampling, config)
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
    _check_shaping(s)
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, 20], got {s.top_logprobs}")
    if s.top_logprobs and not s.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs")
    if not 1 <= s.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {s.n}")
    if s.n > 1 and s.first_step:
        raise InvalidRequest("a continuation (first_step > 0) has one completion: n must be 1")


def _check_shaping(s: SamplingSpec) -> None:
    """The parameters that change logits or the cut, in the ranges OpenAI and vLLM allow."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(f"{name} must be in [-2, 2] (0 is off), got {value}")
    if not 0 < s.repetition_penalty < float("inf"):
        raise InvalidRequest(
            f"repetition_penalty must be > 0 and finite (1 is off), got {s.repetition_penalty}"
        )
    if not 0 <= s.min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1] (0 is off), got {s.min_p}")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise InvalidRequest(
            f"min_tokens must be in [0, max_tokens = {s.max_tokens}], got {s.min_tokens}"
        )
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
    for token, bias in s.logit_bias:
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias for token {token} must be in [-100, 100], got {bias}")


def _check_sampling_tokens(s: SamplingSpec, config: ModelConfig) -> None:
    """Token ids in the sampling parameters name tokens of this model's vocabulary."""
    named = [*s.stop_token_ids, *(token for token, _ in s.logit_bias)]
    bad = [t for t in named if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]} in stop_token_ids or logit_bias is outside the vocabulary "
            f"[0, {config.vocab_size})"
        )
