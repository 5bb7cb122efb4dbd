"""The router's OpenAI-compatible HTTP API, driven by the official `openai` SDK (and curl).

The session stack serves TinyGPT, which has no chat template: completions are checked here, chat
in test_http_chat.py on a tiny Llama checkpoint. Raw HTTP (urllib) appears only where the SDK
cannot send what a test needs: malformed bodies and wrong content types.
"""

import json
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from procs import Stack, free_port, generate, start_router, start_service, wait_until
import reference
from pdserve.models.loading import load_served_model
from pdserve.models.tokenizer import ByteTokenizer
from pdserve.v1 import pdserve_pb2 as pb

TIMEOUT = 60.0
PROMPT = "Disaggregated serving moves the KV cache"
MAX_CONTEXT = load_served_model("tinygpt", weights=False).config.max_context


def client(stack_or_url: Stack | str, api_key: str = "unused") -> openai.OpenAI:
    """The SDK without retries, so that every error reaches the test."""
    url = stack_or_url if isinstance(stack_or_url, str) else stack_or_url.router.http_url
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=TIMEOUT)


def grpc_text(stack: Stack, prompt: str, max_tokens: int) -> tuple[str, pb.GenerateResponse]:
    request = pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    _, text, last = generate(stack.router_stub(), request)
    return text, last


def complete(stack: Stack, extra: dict | None = None, **fields) -> openai.types.Completion:
    """A completion of PROMPT that ignores EOS (so its length is max_tokens), plus `extra`
    (pdserve's extension fields, sent as the SDK sends any field it does not know)."""
    fields = {"model": "tinygpt", "prompt": PROMPT, "max_tokens": 12} | fields
    extra_body = {"ignore_eos": True} | (extra or {})
    return client(stack).completions.create(**fields, extra_body=extra_body)


# --- completions ---


def test_completion_equals_the_grpc_path_and_counts_usage(stack):
    reply = complete(stack, max_tokens=12)
    text, last = grpc_text(stack, PROMPT, 12)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(PROMPT.encode()) == last.usage.prompt_tokens
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.model == "tinygpt" and reply.object == "text_completion"


def test_streamed_completion_has_one_chunk_per_token_and_usage(stack):
    stream = complete(stack, max_tokens=16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    usage_only = [c for c in chunks if not c.choices]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert len(usage_only) == 1 and chunks[-1] is usage_only[0]
    assert len(tokens) == usage_only[0].usage.completion_tokens == 16
    assert finish[0].usage.completion_tokens == 16  # every pdserve reply carries usage
    assert "".join(c.choices[0].text for c in tokens) == grpc_text(stack, PROMPT, 16)[0]


def test_stream_without_include_usage_sends_no_usage_chunk(stack):
    chunks = list(complete(stack, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_and_temperature_reach_the_sampler(stack):
    def sampled(seed: int) -> str:
        fields = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=seed)
        return complete(stack, {"top_k": 50}, **fields).choices[0].text

    assert sampled(1) == sampled(1) != sampled(2)


def test_logit_bias_and_min_tokens_reach_the_sampler(stack):
    """A +100 bias makes one token the greedy choice every step; on EOS, min_tokens holds it back
    for exactly that many tokens, and then EOS ends the completion."""
    letter = ord("q")
    reply = complete(stack, {"logit_bias": {str(letter): 100}}, max_tokens=8)
    assert reply.choices[0].text == "q" * 8
    eos = str(ByteTokenizer.EOS)
    reply = client(stack).completions.create(
        model="tinygpt",
        prompt=PROMPT,
        max_tokens=20,
        extra_body={"logit_bias": {eos: 100}, "min_tokens": 5},
    )
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "stop"


def grpc_tokens(stack: Stack, max_tokens: int, **sampling) -> list[int]:
    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )
    return generate(stack.router_stub(), request)[0]


def test_stop_token_ids_end_the_completion_on_that_token(stack):
    tokens = grpc_tokens(stack, 12)
    stop_at = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])  # its first occurrence
    reply = complete(stack, {"stop_token_ids": [tokens[stop_at]]}, max_tokens=12)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == stop_at + 1  # the stop token is returned


def test_penalties_follow_their_definition_against_the_reference_path(stack):
    """Greedy with repetition, frequency and presence penalties: each served token is the argmax
    of the reference model's logits shaped by the definitions (prompt and output for repetition,
    output only for the others), teacher-forced, within the batching tolerance."""
    shaping = {"repetition_penalty": 1.3, "frequency_penalty": 0.8, "presence_penalty": 0.4}
    served = grpc_tokens(stack, 24, **shaping)  # over gRPC, which carries the fields too
    assert served != grpc_tokens(stack, 24)  # the penalties changed something
    prompt = list(PROMPT.encode())
    cache: list = []
    logits = reference.model().forward_contiguous(prompt, cache)[-1]
    for i, token in enumerate(served):
        shaped = penalised(logits, prompt, list(served[:i]), **shaping)
        assert shaped[token] >= shaped.max() - reference.TOLERANCE, f"token {i}"
        logits = reference.model().forward_contiguous([token], cache)[-1]


# Batched and contiguous logits differ by ~2e-5 here (see reference.TOLERANCE); so do their
# log-softmaxes.
LOGPROB_TOLERANCE = 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "seeded"])
def test_logprobs_are_the_reference_log_softmax_after_temperature(stack, temperature):
    """Each token's logprob, and its top 3, equal log_softmax(logits / T) of the reference path
    (T = 1 for greedy), teacher-forced on the served tokens; the first token's came from
    prefill, through the KV commit. gRPC carries the same values, with token ids."""
    sampling = dict(temperature=temperature, seed=5)
    reply = complete(stack, max_tokens=10, logprobs=3, **sampling)
    logprobs = reply.choices[0].logprobs
    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.SamplingParams(
            max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=3, **sampling
        ),
    )
    served, by_id = [], []
    for response in stack.router_stub().Generate(request, timeout=TIMEOUT):
        served += response.token_ids
        by_id += response.logprobs
    assert [lp.token_id for lp in by_id] == served and len(served) == 10
    assert logprobs.token_logprobs == [lp.logprob for lp in by_id]
    assert logprobs.tokens == [bytes([t]).decode(errors="replace") for t in served]
    assert logprobs.text_offset == list(range(10))  # one character per byte token
    cache: list = []
    logits = reference.model().forward_contiguous(list(PROMPT.encode()), cache)[-1]
    for i, (token, lp) in enumerate(zip(served, by_id)):
        expected = torch.log_softmax(logits.double() / (temperature or 1.0), -1)
        assert abs(lp.logprob - float(expected[token])) < LOGPROB_TOLERANCE, i
        assert len(lp.top) == 3
        for alternative in lp.top:
            assert (
                abs(alternative.logprob - float(expected[alternative.token_id])) < LOGPROB_TOLERANCE
            )
        third = float(expected.sort(descending=True).values[2])
        assert lp.top[2].logprob >= third - LOGPROB_TOLERANCE  # they are the 3 most likely
        logits = reference.model().forward_contiguous([token], cache)[-1]


def test_streamed_logprobs_equal_the_whole_reply(stack):
    whole = complete(stack, max_tokens=8, logprobs=2).choices[0].logprobs
    chunks = [c for c in complete(stack, max_tokens=8, logprobs=2, stream=True) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [lp.tokens[0] for lp in streamed] == whole.tokens
    assert [lp.token_logprobs[0] for lp in streamed] == whole.token_logprobs
    assert [lp.text_offset[0] for lp in streamed] == whole.text_offset
    assert [lp.top_logprobs[0] for lp in streamed] == whole.top_logprobs


def prompt_log_softmax(prompt: str):
    """The reference path's log-softmax at every prompt position, float64 [tokens, vocab]."""
    logits = reference.model().forward_contiguous(list(prompt.encode()), [])
    return torch.log_softmax(logits.double(), -1)


def check_scored_prompt(logprobs, prompt: str, top: int) -> None:
    """Entry 0 is null; entry i is prompt token i's log-probability after the ones before it,
    with `top` alternatives (and the token itself), as the reference computes them."""
    expected, ids = prompt_log_softmax(prompt), list(prompt.encode())
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[i] - float(expected[i - 1, ids[i]])) < LOGPROB_TOLERANCE
        assert top <= len(logprobs.top_logprobs[i]) <= top + 1
    assert logprobs.tokens[: len(ids)] == list(prompt)  # ASCII: one character per token


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(stack):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0."""
    reply = complete(stack, max_tokens=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(PROMPT)
    assert len(choice.logprobs.tokens) == len(PROMPT)
    check_scored_prompt(choice.logprobs, PROMPT, 2)
    assert choice.logprobs.text_offset == list(range(len(PROMPT)))


def test_echo_with_tokens_is_the_prompt_then_the_completion(stack):
    plain = complete(stack, max_tokens=4, logprobs=1).choices[0]
    echoed = complete(stack, max_tokens=4, logprobs=1, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    check_scored_prompt(echoed.logprobs, PROMPT, 1)
    assert echoed.logprobs.token_logprobs[len(PROMPT) :] == plain.logprobs.token_logprobs
    assert echoed.logprobs.text_offset[len(PROMPT)] == len(PROMPT)
    assert complete(stack, max_tokens=3, echo=True).choices[0].text.startswith(PROMPT)


def test_no_logprobs_unless_asked(stack):
    assert complete(stack, max_tokens=3).choices[0].logprobs is None


def penalised(logits, prompt, output, repetition_penalty, frequency_penalty, presence_penalty):
    shaped = logits.double().clone()
    for token in set(prompt + output):
        value = float(shaped[token])
        shaped[token] = value / repetition_penalty if value > 0 else value * repetition_penalty
    for token in set(output):
        shaped[token] -= frequency_penalty * output.count(token) + presence_penalty
    return shaped


def test_stop_string_finishes_with_stop(stack):
    text = complete(stack, max_tokens=24).choices[0].text
    stop = next(c for c in text[len(text) // 2 :] if c.isascii() and c.isprintable())
    reply = complete(stack, max_tokens=24, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert stop not in reply.choices[0].text


def test_token_id_prompt(stack):
    reply = complete(stack, prompt=list(PROMPT.encode()), max_tokens=6)
    assert reply.choices[0].text == grpc_text(stack, PROMPT, 6)[0]


def test_models_lists_the_served_model_with_its_context(stack):
    models = client(stack).models.list().data
    assert [m.id for m in models] == ["tinygpt"]
    assert models[0].model_extra["context_length"] == MAX_CONTEXT


def test_models_has_the_fields_vllm_returns(stack):
    _, reply = raw(stack, "GET", "/v1/models")
    (entry,) = reply["data"]
    assert entry["root"] == "tinygpt" and entry["parent"] is None and entry["permission"] == []
    assert entry["max_model_len"] == MAX_CONTEXT


def test_fields_at_their_neutral_value_and_labels_are_accepted_and_change_nothing(stack):
    """What vLLM's benchmark client sends (repetition_penalty 1.0, logprobs null), the other
    fields at the value that means off, and the labels user and metadata."""
    neutral = dict(
        repetition_penalty=1.0,
        logprobs=None,
        frequency_penalty=0,
        presence_penalty=0.0,
        min_p=0,
        min_tokens=0,
        best_of=1,
        echo=False,
        logit_bias={},
        stop_token_ids=[],
        top_logprobs=None,
        user="bench",
        metadata={"run": "1"},
    )
    status, plain = raw(stack, "POST", "/v1/completions", body(max_tokens=6), JSON)
    assert status == 200, plain
    status, with_fields = raw(stack, "POST", "/v1/completions", body(max_tokens=6, **neutral), JSON)
    assert status == 200, with_fields
    assert with_fields["choices"][0]["text"] == plain["choices"][0]["text"]


def test_health(stack):
    status, body = raw(stack, "GET", "/health")
    assert (status, body) == (200, {"status": "serving"})


def test_cancelled_stream_frees_its_blocks(stack):
    stream = complete(stack, max_tokens=MAX_CONTEXT - 64, stream=True)
    for _, _ in zip(range(3), stream):  # a few tokens: the sequence is running on decode
        pass
    assert stack.pool_stats().running == 1
    stream.close()  # the client leaves mid-stream
    wait_until(stack.pools_settled, 15, "decode to free the cancelled stream's blocks")
    assert complete(stack, max_tokens=2).usage.completion_tokens == 2  # still serving


# --- bad input ---


def raw(stack: Stack, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, JSON body) of one HTTP request, errors included."""
    url = stack.router.http_url.removesuffix("/v1") + path
    request = urllib.request.Request(url, body, headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


JSON = {"Content-Type": "application/json"}


def body(**fields) -> bytes:
    return json.dumps({"model": "tinygpt", "prompt": "hi", "max_tokens": 2} | fields).encode()


BAD_INPUT = {
    # case: (body, headers, status, words in the message, param)
    "invalid JSON": (b'{"prompt": "hi",', JSON, 400, "not valid JSON", None),
    "wrong content type": (body(), {"Content-Type": "text/plain"}, 415, "application/json", None),
    "empty body": (b"", JSON, 400, "empty", None),
    "not an object": (b"[1, 2]", JSON, 400, "JSON object", None),
    "unknown field": (body(tools=[]), JSON, 400, "'tools'", "tools"),
    "logprobs over 20": (body(logprobs=21), JSON, 400, "[0, 20]", "logprobs"),
    "repetition penalty 0": (body(repetition_penalty=0), JSON, 400, "must be > 0", None),
    "frequency penalty out of range": (body(frequency_penalty=3), JSON, 400, "[-2, 2]", None),
    "min_tokens over max_tokens": (body(min_tokens=3), JSON, 400, "min_tokens", None),
    "logit_bias key not a token id": (
        body(logit_bias={"q": 1}),
        JSON,
        400,
        "keys must be token ids",
        "logit_bias",
    ),
    "logit_bias outside the vocabulary": (
        body(logit_bias={"300": 1}),
        JSON,
        400,
        "outside the vocabulary",
        None,
    ),
    "stop_token_ids not a list": (
        body(stop_token_ids=5),
        JSON,
        400,
        "list of token ids",
        "stop_token_ids",
    ),
    "echo as a number": (body(echo=0), JSON, 400, "echo must be true or false", "echo"),
    "max_tokens 0 without echo": (body(max_tokens=0), JSON, 400, "max_tokens", None),
    # 2.6 MB of JSON, checked in a thread rather than on the router's event loop.
    "a million token ids": (body(prompt=[1] * 1_000_000), JSON, 400, "context length", None),
    "max_tokens negative": (body(max_tokens=-5), JSON, 400, "max_tokens", None),
    "max_tokens over the context": (body(max_tokens=MAX_CONTEXT), JSON, 400, "context", None),
    "max_tokens not an integer": (body(max_tokens=2.5), JSON, 400, "integer", "max_tokens"),
    "temperature NaN string": (body(temperature="NaN"), JSON, 400, "finite", "temperature"),
    "temperature NaN literal": (
        b'{"prompt": "hi", "temperature": NaN}',
        JSON,
        400,
        "finite",
        "temperature",
    ),
    "temperature negative": (body(temperature=-0.5), JSON, 400, "temperature", None),
    "top_p above one": (body(top_p=1.5), JSON, 400, "top_p", None),
    "seed negative": (body(seed=-1), JSON, 400, "seed", "seed"),
    "n above eight": (body(n=9), JSON, 400, "n must be an integer in [1, 8]", "n"),
    "n zero": (body(n=0), JSON, 400, "n must be an integer in [1, 8]", "n"),
    "stream_options without stream": (
        body(stream_options={"include_usage": True}),
        JSON,
        400,
        "stream: true",
        "stream_options",
    ),
    "another model": (body(model="gpt-4o"), JSON, 404, "gpt-4o", None),
    "chat without a template": (
        json.dumps({"model": "tinygpt", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        JSON,
        400,
        "chat template",
        None,
    ),
    "10,000 messages": (
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 10_000}).encode(),
        JSON,
        400,
        "at most 256 messages",
        "messages",
    ),
    "10 MB body": (body(prompt="x" * 10_000_000), JSON, 413, "bytes", None),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_its_status_and_the_server_keeps_serving(stack, case):
    data, headers, status, words, param = BAD_INPUT[case]
    path = "/v1/chat/completions" if b'"messages"' in data else "/v1/completions"
    got, reply = raw(stack, "POST", path, data, headers)
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert words in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    if param:
        assert reply["error"]["param"] == param
    assert complete(stack, max_tokens=2).usage.completion_tokens == 2


def test_sdk_raises_the_matching_errors(stack):
    with pytest.raises(openai.BadRequestError) as err:
        complete(stack, max_tokens=0)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client(stack).completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(stack).get("/no/such/path", cast_to=object)


def test_unknown_paths_and_methods_get_openai_errors(stack):
    status, reply = raw(stack, "GET", "/v1/completions")
    assert status == 405 and "error" in reply
    status, reply = raw(stack, "GET", "/v2/anything")
    assert status == 404 and "error" in reply


# --- SSE framing, with curl ---


def test_curl_sees_valid_sse_events_with_multibyte_text(stack):
    # TinyGPT's output is random bytes: many tokens decode to U+FFFD or to other characters of
    # two to four UTF-8 bytes, each within one event.
    fields = {"prompt": "日本語 🙂 Grüße", "max_tokens": 48, "stream": True, "ignore_eos": True}
    out = subprocess.run(
        ["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", json.dumps(fields)]
        + [stack.router.http_url + "/completions"],
        capture_output=True,
        timeout=TIMEOUT,
        check=True,
    ).stdout
    events = out.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ").decode("utf-8")) for e in events[:-2]]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-2])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert any(len(ch.encode()) > 1 for ch in text), "no multi-byte character to check"
    assert text == grpc_text(stack, fields["prompt"], 48)[0]
    assert len(chunks) - 1 == chunks[-1]["usage"]["completion_tokens"] == 48


# --- routers of their own: an API key, no backends, a deadline ---


KEY = "sk-test-a7f3c9"


@pytest.fixture(scope="module")
def keyed(_session_stack, tmp_path_factory):
    metrics_port = free_port()
    router = start_router(
        _session_stack.prefills,
        _session_stack.decodes,
        "--api-key",
        KEY,
        "--metrics-port",
        str(metrics_port),
        tmp_dir=str(tmp_path_factory.mktemp("keyed")),
    )
    yield router, metrics_port
    router.stop()


def test_api_key_is_required_on_v1(stack, keyed):
    router, _ = keyed
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            client(router.http_url, wrong).models.list()
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key"
    # No key at all (the SDK always sends one): plain HTTP.
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(router.http_url + "/models")
    assert missing.value.code == 401 and missing.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(missing.value.read())["error"]["code"] == "invalid_api_key"
    reply = client(router.http_url, KEY).completions.create(
        model="tinygpt", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 3
    with urllib.request.urlopen(router.http_url.removesuffix("/v1") + "/health") as health:
        assert health.status == 200  # no key needed
    assert KEY not in router.log()


def test_http_requests_are_counted_by_endpoint_and_status(stack, keyed):
    router, metrics_port = keyed
    with pytest.raises(openai.AuthenticationError):
        client(router.http_url, "wrong").completions.create(model="tinygpt", prompt="a")
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    counted = [line for line in text.splitlines() if line.startswith("pdserve_http_requests_total")]
    assert any('endpoint="/v1/completions"' in ln and 'status="401"' in ln for ln in counted)


@pytest.fixture(scope="module")
def prefill_down(_session_stack, tmp_path_factory):
    """A router whose only prefill address has nothing behind it (its decode is real)."""
    router = start_service(
        "router",
        "--prefill",
        f"127.0.0.1:{free_port()}",
        "--decode",
        _session_stack.decodes[0].address,
        tmp_dir=str(tmp_path_factory.mktemp("prefill-down")),
        ready=False,
    )
    wait_until(lambda: _http_up(router.http_port), 30, "the router's HTTP port")
    yield router
    router.stop()


def _http_up(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_no_backend_is_503(stack, prefill_down):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(prefill_down.http_url.removesuffix("/v1") + "/health")
    assert err.value.code == 503
    with pytest.raises(openai.InternalServerError) as sdk:
        client(prefill_down.http_url).completions.create(model="tinygpt", prompt="a", max_tokens=2)
    assert sdk.value.status_code == 503
    assert sdk.value.body["type"] == "service_unavailable"
    assert "prefill" in sdk.value.message


@pytest.fixture(scope="module")
def decode_down(_session_stack, tmp_path_factory):
    """A router whose only decode address has nothing behind it (its prefill is real)."""
    router = start_service(
        "router",
        "--prefill",
        _session_stack.prefills[0].address,
        "--decode",
        f"127.0.0.1:{free_port()}",
        tmp_dir=str(tmp_path_factory.mktemp("decode-down")),
        ready=False,
    )
    wait_until(lambda: _http_up(router.http_port), 30, "the router's HTTP port")
    yield router
    router.stop()


def test_no_decode_up_is_503_at_once_not_a_wait_in_line(stack, decode_down):
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as sdk:
        client(decode_down.http_url).completions.create(model="tinygpt", prompt="a", max_tokens=2)
    assert sdk.value.status_code == 503 and "no decode instance is up" in sdk.value.message
    assert time.monotonic() - started < 10  # not the 30 s queue timeout


def test_deadline_is_504(stack, tmp_path):
    router = start_router(
        stack.prefills, stack.decodes, "--request-timeout-seconds", "0.0001", tmp_dir=str(tmp_path)
    )
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client(router.http_url).completions.create(model="tinygpt", prompt="a", max_tokens=2)
        assert err.value.status_code == 504
        assert err.value.body["code"] == "DEADLINE_EXCEEDED"
    finally:
        router.stop()
