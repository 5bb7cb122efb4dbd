"""The OpenAI response bodies: whole completions, stream chunks, errors and the model list.

Each is a plain dict ready for JSON. A stream is a sequence of chunks: one per token the router
relays (its text may be empty while a multi-byte character is incomplete), then one that carries
the finish reason and usage, then, when the client asked for `stream_options.include_usage`,
OpenAI's usage chunk with no choices.
"""

import time
from dataclasses import dataclass

from pdserve.v1 import pdserve_pb2 as pb

# OpenAI has two finish reasons for what pdserve tells apart: the model's end-of-sequence token
# and a stop string both end the text where the client asked it to end.
FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "stop",
}
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
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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


@dataclass
class Reply:
    """One request's reply, in OpenAI's shape for its endpoint ("chat" or "completion")."""

    kind: str
    request_id: str
    model: str
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def whole(self, text: str, last: pb.GenerateResponse) -> dict:
        """The non-streaming body: all the text, the finish reason and usage."""
        choice = {"index": 0, "finish_reason": FINISH_REASONS[last.finish_reason]}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._envelope(OBJECTS[self.kind][0], [choice | {"logprobs": None}], last.usage)

    def token_chunk(self, text: str, first: bool) -> dict:
        """A stream chunk with one token's text; a chat's first also says who speaks."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return self._chunk({"index": 0, "delta": delta, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def finish_chunk(self, last: pb.GenerateResponse) -> dict:
        """The stream's last choice chunk: the finish reason, and usage (which every pdserve
        response carries; OpenAI's own usage chunk follows when include_usage asks for it)."""
        reason = FINISH_REASONS[last.finish_reason]
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        return self._envelope(OBJECTS[self.kind][1], [choice], last.usage)

    def usage_chunk(self, last: pb.GenerateResponse) -> dict:
        """OpenAI's stream_options.include_usage chunk: no choices, only usage."""
        return self._envelope(OBJECTS[self.kind][1], [], last.usage)

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
