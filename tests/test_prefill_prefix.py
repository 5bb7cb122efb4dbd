"""Prefill's own prefix cache: a prompt is computed from the end of its longest cached prefix, the
KV handed out covers exactly what decode lacks, and the result equals a whole-prompt prefill."""

from dataclasses import dataclass, field

import pytest
import torch

from pdserve.core.config import ModelConfig
from pdserve.engine.prefill_prefix import PrefixCachedPrefill
from pdserve.engine.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.models.tinygpt import TinyGPT

CONFIG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_ff=128)
BS = 16
SYSTEM = [(i * 7) % 250 + 1 for i in range(100)]  # six full blocks and four tokens


class CountingModel:
    """The model, noting how many tokens each pass computes."""

    def __init__(self) -> None:
        self.model = TinyGPT(CONFIG)
        self.config = CONFIG
        self.computed: list[int] = []

    def prefill_packed(self, prompts, on_layer):
        self.computed.append(sum(map(len, prompts)))
        return self.model.prefill_packed(prompts, on_layer)

    def decode_paged(self, tokens, positions, cache, logits_rows=None):
        self.computed.append(len(tokens))
        return self.model.decode_paged(tokens, positions, cache, logits_rows)


@dataclass
class Outcome:
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    first: int | None = None
    timing: PrefillTiming | None = None
    error: str | None = None


def job(prompt: list[int], send_from: int = 0, seed: int = 0) -> tuple[PrefillJob, Outcome]:
    out = Outcome()
    sampling = SamplingSpec(temperature=0.9 if seed else 0.0, seed=seed)

    def done(token: int, timing: PrefillTiming) -> None:
        out.first, out.timing = token, timing

    def error(message: str) -> None:
        out.error = message

    spec = GenerateSpec("r", tuple(prompt), sampling)
    kv = lambda layer, k, v: out.kv.__setitem__(layer, (k.clone(), v.clone()))  # noqa: E731
    return PrefillJob(spec, kv, done, error, send_from=send_from), out


def run(scheduler: PrefillScheduler, *jobs: PrefillJob) -> None:
    for j in jobs:
        scheduler.add(j)
    while scheduler.has_work:
        scheduler.step()


def cached_scheduler(tokens: int = 1024, batch_tokens: int = 4096):
    model = CountingModel()
    prefix = PrefixCachedPrefill(model, CONFIG, tokens, BS)
    return PrefillScheduler(model, 8, batch_tokens, frozenset(), prefix), model, prefix


def reference(prompt: list[int], send_from: int = 0, seed: int = 0) -> Outcome:
    """The same prompt prefilled whole, without any cache."""
    j, out = job(prompt, send_from, seed)
    run(PrefillScheduler(CountingModel(), 8, 4096, frozenset()), j)
    return out


def assert_same(got: Outcome, want: Outcome) -> None:
    assert got.error is None and got.first == want.first
    assert sorted(got.kv) == sorted(want.kv)
    for layer, (k, v) in want.kv.items():
        # Close, not equal: a prefix read back is attended by a masked kernel, a whole prompt by
        # the fused causal one, and the two sum in different orders.
        torch.testing.assert_close(got.kv[layer][0], k, rtol=0, atol=1e-4)
        torch.testing.assert_close(got.kv[layer][1], v, rtol=0, atol=1e-4)


@pytest.mark.parametrize("send_from", [0, 48, 96, 99], ids=["all", "less", "same", "more"])
@pytest.mark.parametrize("seed", [0, 3], ids=["greedy", "seeded"])
def test_a_cached_prefix_is_not_computed_again_and_the_kv_handed_out_is_what_decode_lacks(
    send_from, seed
):
    """Decode may hold none of the prefix, less of it than this cache, as much, or more: the
    KV handed out always starts at send_from, read back from the pool where it must be."""
    scheduler, model, prefix = cached_scheduler()
    first, _ = job(SYSTEM + [5, 6, 7])
    run(scheduler, first)
    prompt = SYSTEM + [9] * 30
    second, out = job(prompt, send_from, seed)
    run(scheduler, second)
    assert out.timing is not None and out.timing.cached_tokens == 96  # six full blocks
    assert model.computed == [103, len(prompt) - 96]
    assert_same(out, reference(prompt, send_from, seed))
    assert out.kv[0][0].shape[0] == len(prompt) - send_from
    assert prefix.pool.available_blocks == prefix.pool.num_blocks  # nothing held after


def test_prompts_of_one_batch_each_start_from_their_own_prefix():
    scheduler, model, _ = cached_scheduler()
    run(scheduler, job(SYSTEM)[0])
    prompts = [SYSTEM[:40] + [3] * 20, SYSTEM + [4] * 10, [200] * 50]
    pairs = [job(p) for p in prompts]
    run(scheduler, *(j for j, _ in pairs))
    assert [o.timing.cached_tokens for _, o in pairs if o.timing] == [32, 96, 0]
    assert model.computed[-1] == (60 - 32) + (110 - 96) + 50  # one pass for the batch
    for prompt, (_, out) in zip(prompts, pairs, strict=True):
        assert_same(out, reference(prompt))


def test_the_token_budget_counts_only_what_is_computed():
    """Four prompts sharing a 96-token prefix fit one 200-token batch: each computes 34."""
    scheduler, model, _ = cached_scheduler(batch_tokens=200)
    run(scheduler, job(SYSTEM + [1] * 30)[0])
    pairs = [job(SYSTEM + [2 + i] * 30) for i in range(4)]
    run(scheduler, *(j for j, _ in pairs))
    assert model.computed[1:] == [4 * 34]
    assert all(out.timing and out.timing.batch_size == 4 for _, out in pairs)


def test_a_prompt_larger_than_the_pool_runs_alone_and_uncached():
    scheduler, model, prefix = cached_scheduler(tokens=64)
    small, long = [7] * 20, SYSTEM
    pairs = [job(small), job(long), job(small)]
    run(scheduler, *(j for j, _ in pairs))
    assert model.computed == [20, 100, 20 - 16]  # the last found the first's full block
    for prompt, (_, out) in zip([small, long, small], pairs, strict=True):
        assert_same(out, reference(prompt))
    assert prefix.pool.available_blocks == 4


def test_a_failed_pass_caches_nothing_and_gives_every_block_back():
    scheduler, model, prefix = cached_scheduler()

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    model.decode_paged = broken  # type: ignore[method-assign]
    failed, out = job(SYSTEM)
    run(scheduler, failed)
    assert out.error is not None and "out of memory" in out.error
    assert prefix.pool.cached_blocks == 0
    assert prefix.pool.available_blocks == prefix.pool.num_blocks


def test_a_job_cancelled_during_the_pass_hands_out_nothing_more():
    """The first prompt's KV callback cancels the second (as a client leaving mid-pass would):
    the second gets no layer after that, and its blocks still come back."""
    scheduler, _, prefix = cached_scheduler()
    leaving, out = job(SYSTEM + [2])
    staying, staying_out = job(SYSTEM + [1])

    def cancel_the_other(layer, k, v):
        leaving.cancelled = True
        staying_out.kv[layer] = (k, v)

    staying.on_layer_kv = cancel_the_other
    run(scheduler, staying, leaving)
    assert out.kv == {} and sorted(staying_out.kv) == list(range(CONFIG.n_layers))
    assert prefix.pool.available_blocks == prefix.pool.num_blocks


def test_a_failure_while_scheduling_puts_the_jobs_back_and_holds_no_blocks():
    scheduler, _, prefix = cached_scheduler()
    pairs = [job(SYSTEM + [i]) for i in range(3)]
    for j, _ in pairs:
        scheduler.add(j)
    reserve, calls = prefix.reserve, []

    def fails_on_the_third(prompt, salt=b""):
        calls.append(prompt)
        if len(calls) == 3:
            raise RuntimeError("bug in the pool")
        return reserve(prompt, salt)

    prefix.reserve = fails_on_the_third  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        scheduler.step()
    assert scheduler.queue_depth == 3 and all(j.table is None for j, _ in pairs)
    assert prefix.pool.available_blocks == prefix.pool.num_blocks
    prefix.reserve = reserve  # type: ignore[method-assign]
    run(scheduler)
    assert all(out.first is not None for _, out in pairs)
