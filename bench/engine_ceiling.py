"""The engine's own ceiling: the colocated engine's loop in-process, with no server in front.

Builds the ColocatedEngine that `pdserve serve colocated` builds (the same model, --weights and
scheduler, chunked prefill of 256 tokens), submits --streams requests of --words random-token
prompts and --tokens output tokens (greedy, EOS ignored) straight to it, and steps it on this
thread until every one has finished. Its rate is the tokens that arrived after the last first
token over the time from then to the last token, when every sequence was decoding: the most that
serving could deliver through the same engine. bench/peers.py compares the served rate with it.
Prints one JSON object: {stream count: [tokens/s per --repeats]}.

  taskset -c 0-1 .venv/bin/python bench/engine_ceiling.py --streams 1 16 64
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import torch

from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.models.loading import load_served_model
from pdserve.services.colocated.engine import ColocatedEngine
from pdserve.settings import ColocatedSettings, CommonSettings, DecodeSettings, PrefillSettings

MODEL = "smollm2-135m-instruct"


class Streams:
    """Each request's token arrival times, and whether all of them have finished."""

    def __init__(self, count: int) -> None:
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.unfinished = count
        self.done = threading.Event()

    def sink(self, index: int):
        def record(emission) -> None:
            self.arrivals[index].append(time.perf_counter())
            if emission.finish_reason is not None or emission.error is not None:
                self.unfinished -= 1
                if not self.unfinished:
                    self.done.set()

        return record

    def decode_rate(self) -> float:
        start = max(a[0] for a in self.arrivals)
        end = max(a[-1] for a in self.arrivals)
        return sum(1 for a in self.arrivals for t in a if t > start) / (end - start)


def run(engine: ColocatedEngine, streams: int, words: int, tokens: int, rng) -> float:
    state = Streams(streams)
    for i in range(streams):
        prompt = tuple(rng.randrange(1000, 30000) for _ in range(words))
        sampling = SamplingSpec(max_tokens=tokens, ignore_eos=True)
        engine.submit(GenerateSpec(f"ceiling-{i}", prompt, sampling), state.sink(i))
    while not state.done.is_set():
        engine.step()
    return state.decode_rate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--weights", default="q4")
    p.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--words", type=int, default=60, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    common = CommonSettings()
    decode = DecodeSettings(common, max_batch=max(args.streams))
    settings = ColocatedSettings(common, decode, PrefillSettings(common), 256)
    engine = ColocatedEngine(load_served_model(MODEL, weight_format=args.weights), settings)
    rng = random.Random(7)
    run(engine, 2, args.words, 8, rng)  # warm-up
    rates = {
        s: [run(engine, s, args.words, args.tokens, rng) for _ in range(args.repeats)]
        for s in args.streams
    }
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
