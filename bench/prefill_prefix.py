"""Prefill's prefix cache at the engine: what it costs a batch with no hits, and what a hit saves.

One process, the real model, no services. Each run times one prefill batch of --batch prompts in
four ways, the ways interleaved run by run:

  plain        PrefillScheduler's path without a cache: `prefill_packed` over whole prompts;
  cache, miss  through PrefixCachedPrefill with prompts it has never seen (every run draws new
               ones), so everything is computed and written to its pool: the cost of keeping the
               cache when it does not help;
  cache, hit   through PrefixCachedPrefill, each prompt a --shared-token prefix already cached
               plus --own tokens of its own;
  plain, hit   the same prompts as `cache, hit`, prefilled whole without a cache.

Reports seconds per batch, median and range over --runs runs, and the ratios miss/plain and
hit/plain-hit.

  .venv/bin/python bench/prefill_prefix.py --json bench/results/prefill_prefix.json
"""

import argparse
import random
import sys
import time

import torch

from common import spread, write_results  # bench/ is the script's directory
from pdserve.engine.prefill_prefix import CachedPrompt, PrefixCachedPrefill
from pdserve.models.loading import load_served_model

BLOCK_TOKENS = 16
WAYS = ("plain", "cache, miss", "cache, hit", "plain, hit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024, help="of the plain and miss runs")
    p.add_argument("--shared", type=int, default=1024, help="cached prefix of the hit runs")
    p.add_argument("--own", type=int, default=64, help="own tokens of each hit prompt")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    served = load_served_model(args.model, "")
    model, config = served.built, served.config
    cache = PrefixCachedPrefill(model, config, 16384, BLOCK_TOKENS)
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(1, config.vocab_size) for _ in range(n)]

    shared = draw(args.shared)
    hit = args.shared // BLOCK_TOKENS * BLOCK_TOKENS
    run_cached(cache, [shared + draw(1)])  # the shared prefix is cached from here on

    def hit_prompts() -> list[list[int]]:
        return [shared + draw(args.own) for _ in range(args.batch)]

    def fresh() -> list[list[int]]:
        return [draw(args.prompt_tokens) for _ in range(args.batch)]

    ways = {
        "plain": lambda prompts: model.prefill_packed(prompts, lambda *kv: None),
        "cache, miss": lambda prompts: run_cached(cache, prompts),
        "cache, hit": lambda prompts: run_cached(cache, prompts, hit),
        "plain, hit": lambda prompts: model.prefill_packed(prompts, lambda *kv: None),
    }
    inputs = {"plain": fresh, "cache, miss": fresh, "cache, hit": hit_prompts}
    inputs["plain, hit"] = hit_prompts
    for way in WAYS:  # warm-up
        ways[way](inputs[way]())
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for run in range(args.runs):
        for way in WAYS if run % 2 == 0 else WAYS[::-1]:
            prompts = inputs[way]()
            start = time.perf_counter()
            ways[way](prompts)
            seconds[way].append(time.perf_counter() - start)
    summary = {way: spread(s) for way, s in seconds.items()}
    ratios = {
        "miss/plain": [m / p for m, p in zip(seconds["cache, miss"], seconds["plain"])],
        "hit/plain-hit": [h / p for h, p in zip(seconds["cache, hit"], seconds["plain, hit"])],
    }
    summary.update({k: spread(v) for k, v in ratios.items()})
    for name, figs in summary.items():
        print(f"{name}: {figs['median']:.4g} ({figs['min']:.4g}-{figs['max']:.4g})")
    if args.json:
        conditions = {
            "model": f"{args.model} ({config.dtype})",
            "torch": torch.__version__,
            "threads": args.threads,
            "workload": f"batches of {args.batch}: plain and miss {args.prompt_tokens}-token "
            f"prompts, new each run; hit {args.shared} cached + {args.own} own tokens each; "
            f"cache pool 16,384 tokens in {BLOCK_TOKENS}-token blocks; seed {args.seed}",
            "runs": f"{args.runs}, the four ways interleaved, order alternating; one warm-up each",
        }
        write_results(args.json, conditions, summary=summary, seconds=seconds)
    return 0


def run_cached(cache: PrefixCachedPrefill, prompts: list[list[int]], hit: int = 0) -> None:
    """One batch through the cache, as the prefill scheduler runs it; each prompt must find at
    least `hit` tokens cached."""
    batch = []
    for prompt in prompts:
        table = cache.reserve(tuple(prompt))
        assert table is not None, "the pool holds a whole batch"
        assert table.cached_tokens >= hit, f"{table.cached_tokens} cached, {hit} expected"
        batch.append(CachedPrompt(tuple(prompt), table, 0, lambda *kv: None))
    cache.run(batch)


if __name__ == "__main__":
    sys.exit(main())
