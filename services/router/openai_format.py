"""The OpenAI response bodies: whole completions, stream chunks, errors and the model list.

Each is a plain dict ready for JSON. A stream is a sequence of chunks: one per token the router
relays (its text may be empty while a multi-byte character is incomplete), then one that carries
the finish reason and usage, then, when the client asked for `stream_options.include_usage`,
OpenAI's usage chunk with no choices.
"""

import ast
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.core.shown import shown
from pdserve.v1 import pdserve_pb2 as pb

# OpenAI has two finish reasons for what pdserve tells apart: the model's end-of-sequence token
# and a stop string both end the text where the client asked it to end.
FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "stop",
}
# An error message may quote what the client sent (a 2 MB model name, a field name): each string
# it quotes is cut as gRPC's details cut them (pdserve.core.shown), then the whole message
# to MESSAGE_CHARS, so that no reply echoes a client's megabytes back.
MESSAGE_CHARS = 512
PARAM_CHARS = 64  # of `param`, which names the field: an unknown field's name is the client's
# A Python string literal, as the messages quote values with !r: '...' or "...", escapes inside.
_QUOTED = re.compile(r"""'[^'\\\n]*(?:\\.[^'\\\n]*)*'|"[^"\\\n]*(?:\\.[^"\\\n]*)*\"""")
# What vLLM reports for a log-probability of -infinity (a token that could not be drawn), which
# JSON cannot carry.
IMPOSSIBLE_LOGPROB = -9999.0
_GOING_ON = {"finish_reason": None}  # a stream chunk's choice before its completion's last
OBJECTS = {
    "chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
    "completion": ("text_completion", "text_completion", "cmpl-"),
}


def usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body, with whatever of the client's it quotes cut short."""
    if param is not None and len(param) > PARAM_CHARS:
        param = param[:PARAM_CHARS] + "..."
    return {"error": {"message": _public(message), "type": kind, "param": param, "code": code}}


def _public(message: str) -> str:
    """The message with each long string it quotes cut (shown), then at most MESSAGE_CHARS."""
    if len(message) <= MESSAGE_CHARS:  # short messages as written: nothing to cut
        return message
    message = _QUOTED.sub(_cut_quoted, message)
    if len(message) > MESSAGE_CHARS:  # a long value quoted otherwise: a list, a dict
        message = f"{message[:MESSAGE_CHARS]}... ({len(message)} characters)"
    return message


def _cut_quoted(match: re.Match) -> str:
    quoted = match.group()
    try:  # only a literal is evaluated; a quote that is not one (prose) stays as it is
        value = ast.literal_eval(quoted)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return quoted
    return shown(value) if isinstance(value, str) else quoted


def models(name: str, max_context: int, created: int, root: str) -> dict:
    """GET /v1/models: the one model served, with its context length, and the fields vLLM and
    SGLang return (`root`: where the model was loaded from; vLLM's benchmark loads its tokenizer
    from there)."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pdserve",
                "context_length": max_context,
                "max_model_len": max_context,
                "root": root,
                "parent": None,
                "permission": [],
            }
        ],
    }


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, repeated at the start of its reply (OpenAI's echo)."""

    text: str
    token_ids: tuple[int, ...]
    # Each prompt token's after the first, when the request asked for logprobs.
    scored: Sequence[pb.TokenLogprob] | None = None


@dataclass
class Completion:
    """One completion of a non-streamed reply: its text, its last response (finish reason,
    usage, index) and its tokens' logprobs."""

    text: str
    last: pb.GenerateResponse
    logprobs: Sequence[pb.TokenLogprob] = ()


@dataclass
class Reply:
    """One request's reply, in OpenAI's shape for its endpoint ("chat" or "completion"), over
    its `completions` (the request's n)."""

    kind: str
    request_id: str
    model: str
    # The bytes each token stands for (the tokenizer's token_bytes), for logprobs.
    token_bytes: Callable[[int], bytes] = field(default=lambda token: b"", repr=False)
    created: int = 0
    completions: int = 1
    # Per completion: characters of its text whose logprobs were sent (text_offset).
    _offsets: dict[int, int] = field(default_factory=dict)
    _ended: list[pb.Usage] = field(default_factory=list)  # of the completions streamed to the end

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def whole(self, completions: Sequence[Completion]) -> dict:
        """The non-streaming body: each completion's text and finish reason, and the usage of
        all (the prompt once, every completion's tokens)."""
        choices = [self._choice(c) for c in sorted(completions, key=lambda c: c.last.index)]
        return self._envelope(
            OBJECTS[self.kind][0], choices, total_usage([c.last.usage for c in completions])
        )

    def _choice(self, completion: Completion) -> dict:
        last = completion.last
        choice: dict = {"index": last.index, "finish_reason": FINISH_REASONS[last.finish_reason]}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice["text"] = completion.text
        choice["logprobs"] = self._logprobs(completion.logprobs, last.index)
        return choice

    def echoed(self, echo: Echo, completions: Sequence[Completion]) -> dict:
        """A non-streaming reply whose completions each start with the prompt; their logprobs,
        when asked for, start with the prompt's, the first token's null (it follows nothing)."""
        body = self.whole([Completion(echo.text + c.text, c.last) for c in completions])
        if echo.scored is not None:
            by_index = {c.last.index: c.logprobs for c in completions}
            for choice in body["choices"]:
                index = choice["index"]
                choice["logprobs"] = self._echo_logprobs(echo, by_index[index], index)
        return body

    def _echo_logprobs(self, echo: Echo, logprobs: Sequence[pb.TokenLogprob], index: int) -> dict:
        head = self._text_of(echo.token_ids[0])
        self._offsets[index] = len(head)
        rest = self._logprobs([*(echo.scored or ()), *logprobs], index) or {
            key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
        return {
            "tokens": [head, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def echo_chunk(self, echo: Echo, index: int) -> dict:
        """A streamed echo's first chunk of completion `index`: the prompt, with its logprobs
        when asked for; the completion's own tokens follow, their offsets after the prompt's."""
        logprobs = self._echo_logprobs(echo, (), index) if echo.scored is not None else None
        return self._chunk({"index": index, "text": echo.text, "logprobs": logprobs} | _GOING_ON)

    def token_chunk(self, response: pb.GenerateResponse, first: bool) -> dict:
        """A stream chunk with one token's text, of completion `response.index`; a chat's first
        chunk of each completion also says who speaks."""
        index, text = response.index, response.text
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        logprobs_part = {"logprobs": self._logprobs(response.logprobs, index)}
        return self._chunk(choice | logprobs_part | _GOING_ON)

    def finish_chunk(self, last: pb.GenerateResponse) -> dict:
        """A completion's last choice chunk: its finish reason. The last completion's also
        carries the usage of all (OpenAI's own usage chunk follows when include_usage asks)."""
        self._ended.append(last.usage)
        reason = FINISH_REASONS[last.finish_reason]
        if self.kind == "chat":
            choice = {"index": last.index, "delta": {}, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": last.index, "text": "", "finish_reason": reason, "logprobs": None}
        done = len(self._ended) == self.completions
        return self._envelope(
            OBJECTS[self.kind][1], [choice], total_usage(self._ended) if done else None
        )

    def usage_chunk(self) -> dict:
        """OpenAI's stream_options.include_usage chunk: no choices, only the usage of all."""
        return self._envelope(OBJECTS[self.kind][1], [], total_usage(self._ended))

    def _logprobs(self, logprobs: Sequence[pb.TokenLogprob], index: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens of completion `index`: a chat's `content`
        list, or a completion's parallel lists."""
        if not logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        tokens = [self._text_of(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [self._top_by_text(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: pb.TokenLogprob) -> dict:
        top = [self._named(t.token_id, t.logprob) for t in lp.top]
        return self._named(lp.token_id, lp.logprob) | {"top_logprobs": top}

    def _named(self, token: int, logprob: float) -> dict:
        raw = self.token_bytes(token)
        return {
            "token": raw.decode(errors="replace"),
            "logprob": _finite(logprob),
            "bytes": list(raw),
        }

    def _top_by_text(self, lp: pb.TokenLogprob) -> dict[str, float]:
        """The most likely tokens by text, and the sampled one, which OpenAI always includes."""
        top = {self._text_of(t.token_id): _finite(t.logprob) for t in lp.top}
        top.setdefault(self._text_of(lp.token_id), _finite(lp.logprob))
        return top

    def _text_of(self, token: int) -> str:
        return self.token_bytes(token).decode(errors="replace")

    def _chunk(self, choice: dict) -> dict:
        return self._envelope(OBJECTS[self.kind][1], [choice], None)

    def _envelope(self, obj: str, choices: list[dict], u: pb.Usage | None) -> dict:
        return {
            "id": OBJECTS[self.kind][2] + self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(u) if u is not None else None,
        }


def total_usage(usages: Sequence[pb.Usage]) -> pb.Usage:
    """A request's usage over its completions: the prompt once, every completion's tokens."""
    return pb.Usage(
        prompt_tokens=usages[0].prompt_tokens if usages else 0,
        completion_tokens=sum(u.completion_tokens for u in usages),
    )


def _finite(logprob: float) -> float:
    return logprob if logprob > float("-inf") else IMPOSSIBLE_LOGPROB
