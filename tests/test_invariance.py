"""Invariant numerics (--numerics invariant): a row's logits do not depend on its batch or path.

Each case compares float32 logits bit for bit, which is stronger than comparing tokens: the same
logits give the same greedy and seeded tokens. The paths are the ones a request can take:
- prefilled alone, or packed with other prompts (a prefill instance's batch);
- prefilled in chunks beside running decodes (colocated, and decode's local prefill), or after a
  cached prefix (only the rest of the prompt is computed);
- decoded alone, or among 31 others of mixed lengths (other length buckets), on 1 or 2 threads;
- its generated tokens re-prefilled as prompt (a migration continues that way).
The fast numerics are checked too, so that the test shows what the setting changes.
"""

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from procs import generate, start_router, start_service, start_stack, wait_until

from pdserve.core.block_pool import BlockPool
from pdserve.engine.model_runner import Decoding, ModelRunner, PromptPiece
from pdserve.engine.paged_cache import PagedCache
from pdserve.models.loading import load_served_model
from pdserve.settings import CommonSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

BLOCK = 16
rng = random.Random(7)


class Engine:
    """One model with a paged pool, and the ways to compute a prompt and a step."""

    def __init__(self, model: str, weights: str, numerics: str, vocab: int) -> None:
        served = load_served_model(model, weight_format=weights, numerics=numerics)
        self.model = served.built
        self.pool = BlockPool(1000, BLOCK)
        self.cache = PagedCache(served.config, 1000, BLOCK)
        self.runner = ModelRunner(self.model, self.cache, frozenset())
        self.vocab = vocab

    def prompt(self, n: int) -> list[int]:
        return [rng.randrange(1, self.vocab) for _ in range(n)]

    def packed(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list]:
        """prefill_packed, as a prefill instance runs it: last-position logits, block tables."""
        tables = [self.pool.reserve(len(p) + BLOCK) for p in prompts]  # room for a few steps
        for table, p in zip(tables, prompts):
            table.ensure(len(p))

        def keep(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            start = 0
            for table, p in zip(tables, prompts):
                rows = slice(start, start + len(p))
                self.cache.write(layer, table.slots(0, len(p)), k[rows], v[rows])
                start += len(p)

        return self.model.prefill_packed(prompts, keep), tables

    def chunked(self, prompt: list[int], chunk: int, beside: list[Decoding], start: int = 0):
        """The prompt from `start` in pieces of `chunk` tokens, each beside decodes `beside`
        (the chunked prefill of a colocated engine); the last piece's logits and the table."""
        table = self.pool.reserve(len(prompt) + 1)
        table.ensure(len(prompt) + 1)  # and room for the first decode step
        if start:  # a cached prefix: its KV is copied in, as the prefix cache supplies it
            source_logits, (source,) = self.packed([prompt[:start]])
            for layer in range(self.cache.kv.shape[0]):
                self.cache.kv[layer][:, :, table.slots(0, start)] = self.cache.kv[layer][
                    :, :, source.slots(0, start)
                ]
        logits = None
        for first in range(start, len(prompt), chunk):
            piece = PromptPiece(table, prompt, first, min(first + chunk, len(prompt)))
            out = self.runner.run(beside, [piece])
            logits = out[len(beside)] if piece.completes else None  # a row only at the end
        return logits, table

    def step(self, decodes: list[Decoding], threads: int = 1) -> torch.Tensor:
        torch.set_num_threads(threads)
        try:
            return self.runner.run(decodes)
        finally:
            torch.set_num_threads(1)


def same_logits_on_every_path(engine: Engine, length: int) -> dict[str, bool]:
    """Each path's logits for one prompt (and its decode steps) against prefilling it alone."""
    engine.cache.kv.normal_()  # other sequences' KV: finite values that a row must not feel
    prompt = engine.prompt(length)
    alone, (table,) = engine.packed([prompt])
    results = {}
    packed, _ = engine.packed([engine.prompt(30), prompt, engine.prompt(200)])
    results["packed with other prompts"] = torch.equal(packed[1], alone[0])
    others = [_decoding(engine, rng.randrange(5, 500)) for _ in range(31)]
    chunked, chunked_table = engine.chunked(prompt, 64, others[:3])
    results["prefilled in chunks beside decodes"] = torch.equal(chunked, alone[0])
    cached, _ = engine.chunked(prompt, 128, others[3:5], start=length // 2 // BLOCK * BLOCK)
    results["after a cached prefix"] = torch.equal(cached, alone[0])

    generated, steps = [int(alone[0].argmax())], []
    for position in range(length, length + 8):
        table.ensure(position + 1)
        steps.append(engine.step([Decoding(table, generated[-1], position)])[0])
        generated.append(int(steps[-1].argmax()))
    me = Decoding(table, generated[-2], length + 7)
    crowd = others + [me]
    rng.shuffle(crowd)
    in_crowd = engine.step(crowd)[crowd.index(me)]
    results["decoded among 31 others of mixed lengths"] = torch.equal(in_crowd, steps[-1])
    results["decoded on 2 threads"] = torch.equal(engine.step([me], threads=2)[0], steps[-1])
    on_chunked = engine.step([Decoding(chunked_table, generated[0], length)])[0]
    results["decoded over KV prefilled in chunks"] = torch.equal(on_chunked, steps[0])
    migrated, _ = engine.packed([prompt + generated[:-1]])
    results["generated tokens prefilled again (migration)"] = torch.equal(migrated[0], steps[-1])
    return results


def _decoding(engine: Engine, cached: int) -> Decoding:
    table = engine.pool.reserve(cached + 1)
    table.ensure(cached + 1)
    return Decoding(table, rng.randrange(1, engine.vocab), cached)


@pytest.mark.parametrize(
    "model, weights, length",
    [
        ("smollm2-135m-instruct", "q4", 160),  # the default: bfloat16, the GGUF's own 4-bit blocks
        ("smollm2-135m-instruct", "int8", 100),
        ("smollm2-135m-instruct", "dense", 48),  # bfloat16 GEMMs are slow on AVX2: a shorter one
        ("tinygpt", "dense", 1000),  # float32
    ],
)
def test_invariant_numerics_give_a_row_the_same_logits_on_every_path(model, weights, length):
    engine = Engine(model, weights, "invariant", 49152 if model != "tinygpt" else 257)
    results = same_logits_on_every_path(engine, length)
    assert all(results.values()), {case: ok for case, ok in results.items() if not ok}


def test_fast_numerics_change_a_row_with_its_path():
    """What --numerics invariant is for: with the fast kernels the same row's logits differ by
    path, so the check above can fail."""
    engine = Engine("tinygpt", "dense", "fast", 257)
    results = same_logits_on_every_path(engine, 1000)
    assert not all(results.values()), results


def test_numerics_are_part_of_the_model_identity_and_checked_at_start():
    """Services with other numerics compute other KV, so each refuses the other's like another
    model's (the fingerprint); a misspelt value stops the service at start."""
    fast = load_served_model("tinygpt", weights=False, numerics="fast")
    invariant = load_served_model("tinygpt", weights=False, numerics="invariant")
    assert fast.fingerprint != invariant.fingerprint
    with pytest.raises(ValueError, match="numerics"):
        CommonSettings(model="tinygpt", numerics="exact")


def test_a_request_gets_the_same_tokens_on_every_path_of_the_stack(tmp_path):
    """End to end, the real model's default format with --numerics invariant: greedy and seeded
    probes of 5, 30 and 150 tokens give the same tokens
    - prefilled on the prefill instance and handed off, alone;
    - the same, among 31 concurrent requests of mixed lengths;
    - prefilled on the decode instance itself, in chunks beside its decodes (a second router
      on the same instances, with every prompt under its --local-prefill-tokens);
    - on a colocated engine."""
    flags = ("--model", "smollm2-135m-instruct", "--numerics", "invariant")
    started: list = []  # everything started, stopped at the end whatever happens
    try:
        with ThreadPoolExecutor(1) as starter:  # the colocated engine loads while the stack does
            colocated_start = starter.submit(
                start_service, "colocated", *flags, "--torch-threads", "1", tmp_dir=str(tmp_path)
            )
            try:
                stack = start_stack(
                    str(tmp_path), decode_flags=flags, prefill_flags=flags, router_flags=flags
                )
                started.append(stack)
            finally:
                started.append(colocated := colocated_start.result(timeout=300))
        local_router = start_router(
            stack.prefills,
            stack.decodes,
            *flags,
            "--local-prefill-tokens",
            "100000",
            tmp_dir=str(tmp_path),
        )
        started.append(local_router)
        same_tokens_on_every_path(stack, local_router, colocated)
    finally:
        for service in reversed(started):
            service.stop()


def same_tokens_on_every_path(stack, local_router, colocated) -> None:
    probe_rng = random.Random(3)
    greedy = pb.SamplingParams(max_tokens=8, ignore_eos=True)
    seeded = pb.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)
    prompts = [[probe_rng.randrange(1, 49152) for _ in range(n)] for n in (5, 30, 150)]
    probes = [(ids, sampling) for ids in prompts for sampling in (greedy, seeded)]
    crowd = [
        ([probe_rng.randrange(1, 49152) for _ in range(probe_rng.randrange(5, 40))], greedy)
        for _ in range(31)
    ]

    def tokens(stub, ids, sampling) -> tuple[list[int], str]:
        request = pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
        out, _, last = generate(stub, request, timeout=240)
        return out, last.metrics.prefill_path

    def alone(stub) -> list[tuple[list[int], str]]:
        return [tokens(stub, ids, s) for ids, s in probes]

    def in_crowd(stub) -> list[tuple[list[int], str]]:
        with ThreadPoolExecutor(len(crowd) + len(probes)) as pool:  # all sent at once
            others = [pool.submit(tokens, stub, ids, s) for ids, s in crowd[:16]]
            among = [pool.submit(tokens, stub, ids, s) for ids, s in probes]
            others += [pool.submit(tokens, stub, ids, s) for ids, s in crowd[16:]]
            assert all(len(o.result()[0]) == 8 for o in others)
            return [a.result() for a in among]

    handed_off = alone(stack.router_stub())
    assert {path for _, path in handed_off} == {"prefill"}
    assert all(len(t) == 8 for t, _ in handed_off)
    assert [t for t, _ in in_crowd(stack.router_stub())] == [t for t, _ in handed_off]
    with grpc.insecure_channel(local_router.address) as channel:
        local = alone(pb_grpc.RouterServiceStub(channel))
    assert {path for _, path in local} == {"decode"}
    assert [t for t, _ in local] == [t for t, _ in handed_off]
    with grpc.insecure_channel(colocated.address) as channel:
        on_colocated = alone(pb_grpc.RouterServiceStub(channel))
    assert [t for t, _ in on_colocated] == [t for t, _ in handed_off]
    wait_until(stack.pools_settled, 30, "every block back on the decode instance")
