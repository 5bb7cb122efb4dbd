"""The Llama family against transformers, the reference implementation, on tiny random checkpoints.

Logits (fp32) within 1e-4 of transformers' forward pass, for packed prefill of mixed lengths and
for paged decode step by step; greedy generations identical through router -> prefill -> decode
and through the colocated engine; checkpoints that are broken fail at start with the file named.
"""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

import tiny_checkpoints as tc
from procs import generate, greedy_request, start_service, start_stack
from pdserve.core.block_pool import BlockPool
from pdserve.engine.paged_cache import PagedCache
from pdserve.models.checkpoint import CheckpointError
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

TOLERANCE = 1e-4
# Long enough that Llama 3's scaled low frequencies turn by a visible angle.
PROMPT_LENGTHS = [1, 5, 17, 64, 200]
CASES = [(name, False) for name in tc.SHAPES] + [("llama3-rope", True), ("qwen2-bias", True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {(name, old): tc.build(name, root, old_style=old) for name, old in CASES}


def prompts(vocab: int = tc.VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize(
    "name, old", CASES, ids=[f"{n}{'-old-config' if o else ''}" for n, o in CASES]
)
def test_prefill_and_paged_decode_logits_match_transformers(checkpoints, name, old):
    directory = checkpoints[(name, old)]
    served, ref = load_served_model(str(directory)), tc.reference(directory)
    batch = prompts()
    packed = served.model.prefill_packed(batch, lambda *kv: None)
    for prompt, logits in zip(batch, packed):
        assert (logits - reference_logits(ref, prompt)[-1]).abs().max() < TOLERANCE
    worst = paged_decode_against_reference(
        served, lambda s: reference_logits(ref, s)[-1], batch, steps=6
    )
    assert worst < TOLERANCE, f"paged decode differs from transformers by {worst}"


def test_a_long_sequence_decodes_correctly_beside_short_ones():
    """A 3,000-token sequence in one decode batch with short ones (they fall in different length
    buckets): every step's logits equal the plain contiguous reference's."""
    served = load_served_model("tinygpt")
    gen = torch.Generator().manual_seed(5)
    batch = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3000, 7, 130, 64)]

    def contiguous(tokens):
        return served.model.forward_contiguous(tokens, [])[-1]

    assert paged_decode_against_reference(served, contiguous, batch, steps=3) < TOLERANCE


def paged_decode_against_reference(served, reference_last_logits, batch, steps: int) -> float:
    """Prefills the batch into a paged cache, then feeds the reference's argmax for `steps`
    batched steps, comparing every step's logits with transformers' on the whole sequence."""
    blocks, block = 512, 8
    pool, cache = BlockPool(blocks, block), PagedCache(served.config, blocks, block)
    tables = [pool.reserve(len(p) + steps + 1) for p in batch]
    for t, p in zip(tables, batch):
        t.ensure(len(p))

    def store(layer, k, v):
        start = 0
        for t, p in zip(tables, batch):
            cache.write(
                layer, t.slots(0, len(p)), k[start : start + len(p)], v[start : start + len(p)]
            )
            start += len(p)

    logits = served.model.prefill_packed(batch, store)
    seqs, worst = [list(p) for p in batch], 0.0
    for _ in range(steps):
        for s, t, row in zip(seqs, tables, logits):
            s.append(int(row.argmax()))
            t.ensure(len(s))
        lengths = [len(s) - 1 for s in seqs]
        view = cache.step_view(tables, lengths)
        logits = served.model.decode_paged([s[-1] for s in seqs], lengths, view)
        for s, row in zip(seqs, logits):
            worst = max(worst, float((row - reference_last_logits(s)).abs().max()))
    for t in tables:
        t.release()
    assert pool.available_blocks == blocks
    return worst


def reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


GREEDY_TOKENS = 12


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias"])
def test_greedy_generation_equals_transformers_disaggregated_and_colocated(
    checkpoints, tmp_path, name
):
    directory = checkpoints[(name, False)]
    ref = tc.reference(directory)
    expected = [reference_greedy(ref, p, GREEDY_TOKENS) for p in prompts()]
    model = ("--model", str(directory))
    stack = start_stack(str(tmp_path), decode_flags=model, prefill_flags=model, router_flags=model)
    colocated = start_service("colocated", *model, "--torch-threads", "1", tmp_dir=str(tmp_path))
    try:
        with grpc.insecure_channel(colocated.address) as channel:
            for stub in (stack.router_stub(), pb_grpc.RouterServiceStub(channel)):
                alone = [_greedy(stub, p) for p in prompts()[:2]]
                with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:  # one mixed-length batch
                    batched = list(pool.map(lambda p: _greedy(stub, p), prompts()))
                assert alone == expected[:2]
                assert batched == expected
        assert stack.pool_stats().free_blocks == stack.pool_stats().total_blocks
    finally:
        colocated.stop()
        stack.stop()


def _greedy(stub, prompt: list[int]) -> list[int]:
    tokens, _, last = generate(stub, greedy_request(prompt, GREEDY_TOKENS))
    assert last.usage.completion_tokens == GREEDY_TOKENS
    return tokens


def test_chat_template_renders_as_transformers_does(checkpoints):
    from transformers import AutoTokenizer
    from pdserve.models.tokenizer import ChatMessage

    directory = checkpoints[("llama-tied", False)]
    served = load_served_model(str(directory), weights=False)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Grüße 🙂 quick fox?")]
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=True,
    )
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert served.tokenizer.render_chat(messages) == list(theirs)
    assert served.tokenizer.eos_token_ids == {1, 2}  # generation_config.json's list


def test_streamed_text_never_splits_a_character(checkpoints):
    """Every piece is valid text, and the pieces add up to the whole decode."""
    served = load_served_model(str(checkpoints[("llama-tied", False)]), weights=False)
    tok = served.tokenizer
    text = "naïve café 日本語 🙂🙂 Grüße"
    ids = tok.encode(text)
    detok = tok.detokenizer([])
    pieces = [detok.feed(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split())  # multi-byte characters did span several tokens


# ------------------------------------------------------------------------------ broken checkpoints


def _copy(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / "broken")


def _rewrite_tensors(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    "breakage, words",
    [
        ("missing tensor", "model.layers.1.mlp.up_proj.weight' is missing"),
        ("wrong shape", "has shape [128, 32]"),
        ("no tokenizer", "tokenizer.json: file not found"),
        ("bad field", "field 'num_hidden_layers' is 'two'"),
        ("unknown architecture", "GPTNeoXForCausalLM"),
    ],
)
def test_a_broken_checkpoint_is_refused_with_the_file_and_field_named(
    checkpoints, tmp_path, breakage, words
):
    directory = _copy(checkpoints[("llama-gqa-untied", False)], tmp_path)
    weights = directory / "model.safetensors"
    config = json.loads((directory / "config.json").read_text())
    if breakage == "missing tensor":
        _rewrite_tensors(weights, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    elif breakage == "wrong shape":
        _rewrite_tensors(
            weights, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 32)})
        )
    elif breakage == "no tokenizer":
        (directory / "tokenizer.json").unlink()
    else:
        config.update(
            {"num_hidden_layers": "two"}
            if breakage == "bad field"
            else {"architectures": ["GPTNeoXForCausalLM"]}
        )
        (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=None) as err:
        load_served_model(str(directory))
    assert words in str(err.value)


def test_a_service_given_a_broken_checkpoint_exits_with_a_message(checkpoints, tmp_path):
    directory = _copy(checkpoints[("llama-gqa-untied", False)], tmp_path)
    (directory / "tokenizer.json").unlink()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "decode",
            "--model",
            str(directory),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "tokenizer.json: file not found" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------- bad input, one model


def test_bad_input_to_a_real_tokenizer_stack(checkpoints, tmp_path):
    directory = checkpoints[("qwen2-bias", False)]
    model = ("--model", str(directory))
    stack = start_stack(str(tmp_path), decode_flags=model, prefill_flags=model, router_flags=model)
    stub = stack.router_stub()
    cases = [
        (
            pb.GenerateRequest(
                prompt_token_ids=[5, tc.VOCAB + 3], sampling=pb.SamplingParams(max_tokens=2)
            ),
            "outside the vocabulary",
        ),
        (
            pb.GenerateRequest(
                prompt_token_ids=[5] * 600, sampling=pb.SamplingParams(max_tokens=2)
            ),
            "over the context length of 512",
        ),
        (
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="wizard", content="hi")],
                sampling=pb.SamplingParams(max_tokens=2),
            ),
            "role 'wizard'",
        ),
    ]
    try:
        for request, words in cases:
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, request, timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.value.details()
        # And it keeps serving: a chat and a text prompt, tokenized by the checkpoint's tokenizer.
        chat = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="quick fox")],
            sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
        )
        text = pb.GenerateRequest(
            prompt="The quick brown", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
        )
        served = load_served_model(str(directory), weights=False)
        for request, prompt_len in (
            (chat, len(served.tokenizer.render_chat([_user("quick fox")]))),
            (text, len(served.tokenizer.encode("The quick brown"))),
        ):
            _, _, last = generate(stub, request, timeout=20)
            assert last.usage.prompt_tokens == prompt_len and last.usage.completion_tokens == 3
    finally:
        stack.stop()


def _user(content: str):
    from pdserve.models.tokenizer import ChatMessage

    return ChatMessage("user", content)


def test_a_sharded_checkpoint_loads_the_same_weights(tmp_path):
    directory = tc.build("llama-gqa-untied", tmp_path, shards=3)
    assert (directory / "model.safetensors.index.json").exists()
    served, ref = load_served_model(str(directory)), tc.reference(directory)
    prompt = prompts()[3]
    logits = served.model.prefill_packed([prompt], lambda *kv: None)[0]
    assert (logits - reference_logits(ref, prompt)[-1]).abs().max() < TOLERANCE
