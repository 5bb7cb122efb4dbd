"""Chat over HTTP and in the terminal, on a model with a chat template: a tiny random Llama
checkpoint (TinyGPT, the session stack's model, has none)."""

import signal
import subprocess
import sys
import threading

import openai
import pytest

import tiny_checkpoints
from procs import generate, start_stack, wait_until
from pdserve.chat import converse
from pdserve.cli import build_parser
from pdserve.v1 import pdserve_pb2 as pb

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Grüße! What moves the KV cache?"},
]


@pytest.fixture(scope="module")
def chat_stack(tmp_path_factory):
    model = tiny_checkpoints.build("llama-tied", tmp_path_factory.mktemp("model"))
    flags = ("--model", str(model))
    stack = start_stack(
        str(tmp_path_factory.mktemp("chat")),
        decode_flags=flags,
        prefill_flags=flags,
        router_flags=flags,
        # 10 ms a step: a 400-token reply streams for about 5 s, so that the terminal test's
        # Ctrl-C lands while it streams even on a busy machine (unslowed, it took about 1 s).
        decode_faults="decode_step_seconds=0.01",
    )
    yield stack
    stack.stop()


@pytest.fixture
def chat(chat_stack):
    """The stack, checked after each test: every decode block free again."""
    yield chat_stack
    wait_until(chat_stack.pools_settled, 15, "the chat stack's decode pool to settle")


def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.router.http_url, api_key="unused", max_retries=0, timeout=60
    )


def grpc_chat(stack, max_tokens: int) -> tuple[list[int], str, pb.GenerateResponse]:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in MESSAGES],
        sampling=pb.SamplingParams(max_tokens=max_tokens),
    )
    return generate(stack.router_stub(), request)


def test_greedy_chat_equals_the_grpc_path(chat):
    reply = sdk(chat).chat.completions.create(
        model="llama-tied", messages=MESSAGES, max_completion_tokens=24, temperature=0
    )
    tokens, text, last = grpc_chat(chat, 24)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == len(tokens) == last.usage.completion_tokens
    assert reply.usage.prompt_tokens == last.usage.prompt_tokens
    finish = "length" if last.finish_reason == pb.FINISH_REASON_LENGTH else "stop"
    assert reply.choices[0].finish_reason == finish


def test_streamed_chat_is_the_same_text_one_chunk_per_token(chat):
    stream = sdk(chat).chat.completions.create(
        model="llama-tied",
        messages=MESSAGES,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta for c in chunks if c.choices and c.choices[0].finish_reason is None
    ]
    assert deltas[0].role == "assistant"
    assert "".join(d.content for d in deltas) == grpc_chat(chat, 24)[1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(deltas)


def test_chat_logprobs_have_openai_shape_and_spell_the_reply(chat):
    """Chat logprobs: one entry per token whose bytes, joined, are the reply's text, each with
    its top 2 alternatives, most likely first; the stream carries the same entries."""
    fields = dict(model="llama-tied", messages=MESSAGES, max_tokens=12, temperature=0)
    reply = sdk(chat).chat.completions.create(**fields, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    spelled = b"".join(bytes(entry.bytes) for entry in content)
    assert spelled.decode(errors="replace") == reply.choices[0].message.content
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
    stream = sdk(chat).chat.completions.create(**fields, logprobs=True, top_logprobs=2, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = sdk(chat).chat.completions.create(**fields)
    assert plain.choices[0].logprobs is None


def test_the_model_list_names_the_checkpoint_and_its_context(chat):
    (model,) = sdk(chat).models.list().data
    assert model.id == "llama-tied" and model.model_extra["context_length"] == 512


# --- pdserve chat ---


class Terminal:
    """`pdserve chat` on pipes: lines in, everything it prints collected by a thread."""

    def __init__(self, address: str, *flags: str) -> None:
        cmd = [sys.executable, "-m", "pdserve.cli", "chat", "--address", address, *flags]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.out = bytearray()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(4096):
            self.out += chunk

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def text(self) -> str:
        return self.out.decode(errors="replace")


def test_terminal_chat_streams_keeps_history_and_stops_on_ctrl_c(chat):
    # 400 tokens: room for the prompt in the model's 512, and a reply long enough that Ctrl-C,
    # sent once its first words show, comes while it still streams.
    term = Terminal(chat.router.address, "--max-tokens", "400", "--ignore-eos")
    try:
        term.say("Hello there")
        wait_until(lambda: len(term.text().partition("you> ")[2]) >= 4, 30, "a reply")
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C while the reply is streaming
        try:
            wait_until(lambda: "[stopped]" in term.text(), 30, "the reply to stop")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the terminal showed {term.text()!r}") from None
        wait_until(chat.pools_settled, 15, "the stopped reply's blocks to be freed")
        term.say("And again?")
        wait_until(lambda: term.text().count("you> ") == 3, 180, "the second reply to finish")
        term.proc.stdin.close()  # Ctrl-D
        assert term.proc.wait(30) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
    assert "error" not in term.text()


class ScriptedStub:
    """Stands in for RouterServiceStub: each call replies "r1", "r2", ... and is recorded."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, timeout):
        self.requests.append(pb.GenerateRequest.FromString(request.SerializeToString()))
        return iter([pb.GenerateResponse(text=f"r{len(self.requests)}")])


def test_every_turn_carries_the_whole_conversation(monkeypatch, capsys):
    lines = iter(["one", "", "two"])
    monkeypatch.setattr("builtins.input", lambda prompt: _next_or_eof(lines))
    stub = ScriptedStub()
    args = build_parser().parse_args(["chat", "--system", "Be brief."])
    history = converse(stub, args)
    said = [(m.role, m.content) for m in stub.requests[-1].messages]
    assert said == [("system", "Be brief."), ("user", "one"), ("assistant", "r1"), ("user", "two")]
    assert [(m.role, m.content) for m in history][-1] == ("assistant", "r2")
    assert len(stub.requests) == 2  # the empty line sent nothing
    assert "r1" in capsys.readouterr().out


def _next_or_eof(lines) -> str:
    line = next(lines, None)
    if line is None:
        raise EOFError
    return line
