"""The OpenAI request bodies the HTTP front accepts, checked field by field before anything runs.

Only the fields pdserve honours are accepted; any other is refused by name rather than ignored,
since a client that sends `tools` expects something pdserve would not do. Fields it does not
implement (`best_of`, a chat's `echo`) are accepted at their neutral value, which is what
clients send when they mean "off"; null means unset for every field, as in OpenAI's API. The
rules on values that the gRPC path shares (max_tokens >= 1, temperature >= 0, prompt plus
max_tokens within the context, ...) are pdserve.core.request.validate's; this module checks the
types and the ranges the wire format can carry, and turns the body into a GenerateSpec.
"""

import logging
import math
import uuid
from dataclasses import dataclass, field

from pdserve.core.request import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    GenerateSpec,
    InvalidRequest,
    SamplingSpec,
)
from pdserve.models.tokenizer import MAX_CHAT_MESSAGES, ChatMessage, Tokenizer

log = logging.getLogger(__name__)

# A whole body, read before parsing; beyond it the reply is 413. 4 MiB holds a 128k-token prompt.
MAX_BODY_BYTES = 4 << 20
# max_tokens when the client gives none: the rest of the context, but at most this many. Decode
# reserves room for max_tokens before prefill starts, so "the whole context" by default would
# hold a context's worth of KV blocks for every request.
DEFAULT_MAX_TOKENS = 1024
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38  # sampling parameters travel as float32

SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "logit_bias",
}
# Fields pdserve does not implement yet, accepted at the value that means "off" (what clients such
# as vLLM's benchmark send by default), or null; any other value is refused by name.
NEUTRAL_VALUES: dict[str, object] = {"best_of": 1}
# vLLM's chat `echo` (repeat the last message) is not served; a completion's echo is.
CHAT_NEUTRAL_VALUES = NEUTRAL_VALUES | {"echo": False}
# Fields that only label a request: accepted, logged at debug, no effect.
LABEL_FIELDS = {"user", "metadata"}
COMMON_FIELDS = (
    SAMPLING_FIELDS
    | {"model", "stream", "stream_options", "n"}
    | set(NEUTRAL_VALUES)
    | LABEL_FIELDS
)
# A chat asks with `logprobs: true` and `top_logprobs: n`; a completion with `logprobs: n`.
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "echo",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "top_logprobs", "echo"}


class BadRequest(InvalidRequest):
    """Invalid input, with the field it concerns (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(BadRequest):
    """`model` names a model this server does not serve (404, as OpenAI answers)."""


@dataclass(frozen=True)
class OpenAIRequest:
    """A chat or completion request as pdserve will serve it."""

    kind: str  # "chat" or "completion"
    messages: tuple[ChatMessage, ...] = ()  # a chat's
    prompt: str | tuple[int, ...] = ""  # a completion's: text or token ids
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, within the context
    sampling: dict = field(default_factory=dict)  # SamplingSpec fields the client gave
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # a completion's: the reply starts with the prompt
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def generates(self) -> bool:
        """False for an echo of max_tokens 0: the prompt (and its logprobs) is all it asks."""
        return self.max_tokens != 0 or not self.echo

    def spec(self, tokenizer: Tokenizer, max_context: int) -> GenerateSpec:
        """Tokenized (chat messages through the model's chat template); not yet validated. An
        echo of max_tokens 0 is checked as if it asked for one token: its prompt must fit."""
        tokens = self._tokens(tokenizer)
        max_tokens = self.max_tokens if self.generates else 1
        if max_tokens is None:  # at least 1, so that a full context is refused as too long
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_context - len(tokens)))
        sampling = SamplingSpec(max_tokens=max_tokens, **self.sampling)
        return GenerateSpec(self.request_id, tuple(tokens), sampling)

    def _tokens(self, tokenizer: Tokenizer) -> list[int]:
        if self.kind == "chat":
            return tokenizer.render_chat(self.messages)
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt)
        return list(self.prompt)


def parse_chat(body: object, model_name: str) -> OpenAIRequest:
    """POST /v1/chat/completions. Raises BadRequest naming the first field that is wrong."""
    fields = _object(body, CHAT_FIELDS, model_name, CHAT_NEUTRAL_VALUES)
    common = _common(fields)
    common["sampling"] |= _chat_logprobs(fields)
    return OpenAIRequest(
        "chat",
        messages=_messages(fields.get("messages")),
        max_tokens=_max_tokens(fields, "max_completion_tokens", "max_tokens"),
        **common,
    )


def parse_completion(body: object, model_name: str) -> OpenAIRequest:
    """POST /v1/completions. Raises BadRequest naming the first field that is wrong."""
    fields = _object(body, COMPLETION_FIELDS, model_name, NEUTRAL_VALUES)
    common = _common(fields)
    common["echo"] = _boolean(fields, "echo") or False
    if "top_logprobs" in fields and not (
        _is_int(fields["top_logprobs"]) and fields["top_logprobs"] == 0
    ):
        raise BadRequest(
            "top_logprobs is a chat field (0 or null here): a completion asks for the n most "
            "likely tokens with logprobs: n",
            "top_logprobs",
        )
    top = _integer(fields, "logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None:
        common["sampling"] |= {"logprobs": True, "top_logprobs": top}
    return OpenAIRequest(
        "completion",
        prompt=_prompt(fields.get("prompt")),
        max_tokens=_max_tokens(fields, "max_tokens"),
        **common,
    )


def _chat_logprobs(fields: dict) -> dict:
    """SamplingSpec fields of a chat's `logprobs` (a flag) and `top_logprobs` (how many)."""
    wanted = _boolean(fields, "logprobs") or False
    top = _integer(fields, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return {"logprobs": True, "top_logprobs": top or 0} if wanted else {}


def _object(body: object, allowed: set[str], model_name: str, neutral: dict[str, object]) -> dict:
    """The body's fields, none unknown; null counts as absent, as in OpenAI's API."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise BadRequest(
                f"unsupported field {name!r}; this server accepts {', '.join(sorted(allowed))}",
                name,
            )
    fields = {k: v for k, v in body.items() if v is not None}
    for name in fields.keys() & neutral.keys():
        _neutral(name, fields[name], neutral[name])
    labels = {name: fields[name] for name in fields.keys() & LABEL_FIELDS}
    if labels:
        log.debug("request labels: %s", labels)
    model = fields.get("model", model_name)
    if model != model_name:
        raise UnknownModel(f"the model {model!r} does not exist; this server serves {model_name!r}")
    return fields


def _neutral(name: str, value: object, neutral: object) -> None:
    """Refuses a value of a field pdserve does not implement, unless it means "off"."""
    # bool is an int in Python, and True == 1: a flag and a number must not stand for each other.
    same_kind = isinstance(value, bool) == isinstance(neutral, bool)
    if not (same_kind and value == neutral):
        raise BadRequest(
            f"{name}={value!r} is not supported: pdserve accepts only {neutral!r} (or null), "
            "which leaves it off",
            name,
        )


def _common(fields: dict) -> dict:
    """OpenAIRequest's keyword arguments shared by both endpoints."""
    stream = _boolean(fields, "stream") or False
    return {
        "sampling": _sampling(fields),
        "stream": stream,
        "include_usage": _include_usage(fields.get("stream_options"), stream),
    }


def _sampling(fields: dict) -> dict:
    given = {
        "temperature": _number(fields, "temperature"),
        "top_p": _number(fields, "top_p"),
        "top_k": _integer(fields, "top_k", -INT32_MAX, INT32_MAX),
        "seed": _integer(fields, "seed", 0, UINT64_MAX),
        "stop": _stop(fields.get("stop")),
        "ignore_eos": _boolean(fields, "ignore_eos"),
        "frequency_penalty": _number(fields, "frequency_penalty"),
        "presence_penalty": _number(fields, "presence_penalty"),
        "repetition_penalty": _number(fields, "repetition_penalty"),
        "min_p": _number(fields, "min_p"),
        "min_tokens": _integer(fields, "min_tokens", 0, INT32_MAX),
        "stop_token_ids": _token_ids(fields.get("stop_token_ids"), "stop_token_ids"),
        "logit_bias": _logit_bias(fields.get("logit_bias")),
        "n": _integer(fields, "n", 1, MAX_CHOICES),
    }
    return {name: value for name, value in given.items() if value is not None}


def _token_ids(raw: object, name: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in raw):
        raise BadRequest(f"{name} must be a list of token ids", name)
    if len(raw) > MAX_STOP_TOKEN_IDS:  # before building anything of a long list
        raise BadRequest(f"at most {MAX_STOP_TOKEN_IDS} {name}, got {len(raw)}", name)
    return tuple(raw)


def _logit_bias(raw: object) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's shape: {"<token id>": bias}, the ids written as decimal strings (JSON keys)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest('logit_bias must be an object of {"<token id>": bias}', "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(
            f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias"
        )
    pairs = []
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX):
            raise BadRequest(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias")
        bias = _number({"logit_bias": value}, "logit_bias")
        if bias is None:
            raise BadRequest(f"logit_bias for token {key} must be a number, not null", "logit_bias")
        pairs.append((int(key), bias))
    return tuple(sorted(pairs))


def _max_tokens(fields: dict, *names: str) -> int | None:
    """The first of `names` given (max_completion_tokens replaced max_tokens in OpenAI's API)."""
    values = {name: _integer(fields, name, -INT32_MAX, INT32_MAX) for name in names}
    given = {name: value for name, value in values.items() if value is not None}
    if len(set(given.values())) > 1:
        raise BadRequest(f"{' and '.join(given)} differ; give one", names[0])
    return next(iter(given.values()), None)


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(
            'stream_options must be an object with one field, "include_usage"', "stream_options"
        )
    return _boolean(options, "include_usage", "stream_options.include_usage") or False


def _messages(raw: object) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    if len(raw) > MAX_CHAT_MESSAGES:  # checked before reading them: a body may hold thousands
        raise BadRequest(f"at most {MAX_CHAT_MESSAGES} messages, got {len(raw)}", "messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(raw))


def _message(raw: object, where: str) -> ChatMessage:
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object with role and content", where)
    for name in raw:
        if name not in ("role", "content"):
            raise BadRequest(f"{where}: unsupported field {name!r}", f"{where}.{name}")
    role = raw.get("role")
    if not isinstance(role, str):
        raise BadRequest(f"{where}.role must be a string", f"{where}.role")
    return ChatMessage(role, _content(raw.get("content"), f"{where}.content"))


def _content(raw: object, where: str) -> str:
    """A string, or a list of text parts (the SDK's other form), joined."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(_is_text_part(p) for p in raw):
        return "".join(p["text"] for p in raw)
    raise BadRequest(f'{where} must be a string or a list of {{"type": "text", "text"}}', where)


def _is_text_part(part: object) -> bool:
    return (
        isinstance(part, dict)
        and set(part) == {"type", "text"}
        and part["type"] == "text"
        and isinstance(part["text"], str)
    )


def _prompt(raw: object) -> str | tuple[int, ...]:
    """Text, token ids, or a list holding one text (one prompt per request)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(_is_int(t) and 0 <= t <= INT32_MAX for t in raw):
        return tuple(raw)
    raise BadRequest("prompt must be a string or a list of token ids (one prompt)", "prompt")


def _stop(raw: object) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise BadRequest("stop must be a string or a list of strings", "stop")


def _integer(fields: dict, name: str, lo: int, hi: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def _number(fields: dict, name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    # bool is an int in Python; NaN and Infinity are what json.loads makes of those literals.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise BadRequest(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _boolean(fields: dict, name: str, param: str | None = None) -> bool | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{param or name} must be true or false, got {value!r}", param or name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
