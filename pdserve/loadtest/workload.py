"""Seeded request sequences for the load test: when each request arrives, and what it asks for.

A workload is a pure function of its spec: the same spec (seed included) gives the same arrival
times, prompt lengths, prompts and output lengths, on any machine (the draws come from Python's
`random.Random`, whose algorithms are fixed across platforms and versions).

Arrivals are drawn at unit rate and then divided by the rate, and the lengths and prompts come
from a second stream, so a sweep over rates sends the same requests at every rate, only closer
together or further apart.

Arrival processes:
  poisson   exponential gaps of mean 1/rate (coefficient of variation 1);
  gamma     gamma gaps of shape `burstiness` and the same mean 1/rate; the coefficient of
            variation is 1/sqrt(burstiness): below 1 the traffic comes in bursts, above 1 it is
            more regular than Poisson, and exactly 1 is Poisson.
A rate of infinity sends every request at time 0.
"""

import itertools
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

ARRIVALS = ("poisson", "gamma")
PROMPT_KINDS = ("tokens", "text")
# Printable ASCII: byte-level token ids that are also one character of text each.
PROMPT_TOKEN_LOW, PROMPT_TOKEN_HIGH = 32, 126
PROMPT_TOKENS = range(PROMPT_TOKEN_LOW, PROMPT_TOKEN_HIGH + 1)
MAX_DATASET_LINES = 1_000_000


@dataclass(frozen=True)
class LengthRange:
    """A uniform integer range [low, high]; low == high is a fixed value."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range {self.low}-{self.high}: need 1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        """'64-256' or '64:256' is a range, '128' a fixed value."""
        text = text.strip()
        for sep in ("-", ":", ","):
            if sep in text:
                low, high = text.split(sep, 1)
                return cls(int(low), int(high))
        return cls(int(text), int(text))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class DatasetEntry:
    prompt: str
    max_tokens: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: str = "poisson"
    rate: float = 16.0  # requests per second; math.inf sends everything at once
    burstiness: float = 1.0  # gamma shape; ignored for poisson
    prompt_len: LengthRange = field(default_factory=lambda: LengthRange(64, 256))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(16, 48))
    prompt_kind: str = "tokens"
    dataset: str | None = None  # JSONL path: {"prompt": ..., "max_tokens": ...} per line
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival {self.arrival!r} is not one of {ARRIVALS}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"prompt kind {self.prompt_kind!r} is not one of {PROMPT_KINDS}")

    def with_rate(self, rate: float) -> "WorkloadSpec":
        return WorkloadSpec(
            self.arrival,
            rate,
            self.burstiness,
            self.prompt_len,
            self.output_len,
            self.prompt_kind,
            self.dataset,
            self.seed,
        )

    def describe(self) -> str:
        arrival = (
            "gamma (burstiness %g)" % self.burstiness if self.arrival == "gamma" else self.arrival
        )
        prompts = (
            f"dataset {Path(self.dataset).name}" if self.dataset else f"prompt {self.prompt_len}"
        )
        return (
            f"{arrival}, {prompts}, output {self.output_len}, seed {self.seed}, "
            f"rate {format_rate(self.rate)}"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_len"] = str(self.prompt_len)
        d["output_len"] = str(self.output_len)
        d["rate"] = None if math.isinf(self.rate) else self.rate
        if self.arrival == "poisson":
            d["burstiness"] = 1.0
        return d


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival: float  # seconds after the start of the run
    max_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str = ""  # text prompts (byte-level tokenized by the server)

    @property
    def prompt_len(self) -> int:
        return (
            len(self.prompt_token_ids)
            if self.prompt_token_ids
            else len(self.prompt.encode("utf-8"))
        )


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g} req/s"


def unit_gaps(arrival: str, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Interarrival gaps of mean 1, to be divided by the rate."""
    while True:
        if arrival == "poisson":
            yield rng.expovariate(1.0)
        else:
            yield rng.gammavariate(burstiness, 1.0 / burstiness)


def load_dataset(path: str | Path) -> list[DatasetEntry]:
    """Reads a JSONL file of {"prompt": str, "max_tokens": int (optional)} objects."""
    entries: list[DatasetEntry] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(entries) >= MAX_DATASET_LINES:
                raise ValueError(f"{path}: more than {MAX_DATASET_LINES} prompts")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("prompt"), str)
                or not obj["prompt"]
            ):
                raise ValueError(f'{path}:{lineno}: need an object with a non-empty "prompt"')
            max_tokens = obj.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{lineno}: max_tokens must be an integer >= 1")
            entries.append(DatasetEntry(obj["prompt"], max_tokens))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def iter_requests(spec: WorkloadSpec) -> Iterator[BenchRequest]:
    """The workload's requests in arrival order, without end (take what you need).

    The first request arrives at time 0; each gap after it is one draw from the arrival process.
    """
    arrival_rng = random.Random(f"pdserve-bench-arrivals-{spec.seed}")
    content_rng = random.Random(f"pdserve-bench-content-{spec.seed}")
    dataset = load_dataset(spec.dataset) if spec.dataset else None
    order: list[int] = []
    gaps = unit_gaps(spec.arrival, spec.burstiness, arrival_rng)
    t = 0.0
    for index in itertools.count():
        if index:
            gap = next(gaps)
            t += 0.0 if math.isinf(spec.rate) else gap / spec.rate
        if dataset is not None:
            if not order:  # a fresh shuffled pass over the dataset
                order = list(range(len(dataset)))
                content_rng.shuffle(order)
            entry = dataset[order.pop()]
            max_tokens = entry.max_tokens or spec.output_len.draw(content_rng)
            yield BenchRequest(index, t, max_tokens, prompt=entry.prompt)
            continue
        n = spec.prompt_len.draw(content_rng)
        max_tokens = spec.output_len.draw(content_rng)
        ids = tuple(content_rng.choices(PROMPT_TOKENS, k=n))
        if spec.prompt_kind == "text":
            yield BenchRequest(index, t, max_tokens, prompt=bytes(ids).decode("ascii"))
        else:
            yield BenchRequest(index, t, max_tokens, prompt_token_ids=ids)


def generate(
    spec: WorkloadSpec, num_requests: int | None = None, duration: float | None = None
) -> list[BenchRequest]:
    """The first `num_requests` requests, or those arriving before `duration` seconds, or both."""
    if num_requests is None and (duration is None or math.isinf(spec.rate)):
        raise ValueError("give a number of requests, or a duration with a finite rate")
    out: list[BenchRequest] = []
    for request in iter_requests(spec):
        if num_requests is not None and len(out) >= num_requests:
            break
        if duration is not None and request.arrival >= duration:
            break
        out.append(request)
    return out
