"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties and logit bias, seeded per
request and per step.

The random number for step `i` of a request is a pure function of (seed, i), so a request gives the
same tokens wherever each of its steps runs: prefill samples step 0, decode the rest. What shapes
the logits reads only the row's own tokens, so it too is the same wherever the step runs: a
migrated continuation carries its earlier output as the end of its prompt.

Per row, in this order (vLLM's, for the parts it shares):
1. `logit_bias` is added to the named tokens' logits;
2. before `min_tokens` outputs, the tokens that would end the sequence (EOS, unless ignore_eos, and
   `stop_token_ids`) are masked;
3. `repetition_penalty` r divides a positive logit by r and multiplies a negative one by r, for
   every token seen in the prompt or the output (Keskar et al., 2019, CTRL; as in HF and vLLM);
4. `frequency_penalty` f and `presence_penalty` p subtract f * count + p * (count > 0), over the
   output's tokens only (OpenAI's definition);
5. greedy takes the argmax; otherwise softmax(logits / T), cut to the longest prefix of the sorted
   tokens that every cut keeps (top-k; top-p, the smallest prefix whose mass reaches p; min-p,
   tokens whose probability is at least min_p times the largest), renormalised and sampled.

Log-probabilities, when asked for, are log_softmax(logits / T) after steps 1-4 and before the cuts
of step 5 (T = 1 for greedy): what vLLM calls "processed" log-probabilities.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.core.picked import Pick, TokenLogprobs
from pdserve.core.request import GenerateSpec, SamplingSpec

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Draw:
    """One row to sample: the request's parameters, the step (the counter of its random stream,
    which is also how many tokens it has output so far) and its tokens so far, whose last `step`
    are output (a migrated continuation's prompt ends with what it sent before)."""

    spec: SamplingSpec
    step: int
    tokens: Sequence[int]

    @property
    def output(self) -> Sequence[int]:
        return self.tokens[len(self.tokens) - self.step :] if self.step else ()


def first_draw(spec: GenerateSpec) -> Draw:
    """The draw of a prompt's first token (at its first step: 0, or a continuation's)."""
    return Draw(spec.sampling, spec.sampling.first_step, spec.prompt_token_ids)


def uniform(seed: int, step: int) -> float:
    """A number in [0, 1) from (seed, step), by the splitmix64 finaliser (Steele et al., 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample(
    logits: torch.Tensor, draws: Sequence[Draw], ending: frozenset[int] = frozenset()
) -> list[Pick]:
    """One token per row of `logits` [batch, vocab]; row i follows draws[i]. `ending` holds the
    model's end-of-sequence ids, which min_tokens holds back."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        Pick(greedy[i]) if _plain_greedy(d.spec) else _sample_row(logits[i], d, ending)
        for i, d in enumerate(draws)
    ]


def _plain_greedy(spec: SamplingSpec) -> bool:
    """The batch's argmax is this row's answer: nothing to shape, nothing to report."""
    return spec.greedy and not spec.shapes_logits and not spec.logprobs


def _sample_row(logits: torch.Tensor, draw: Draw, ending: frozenset[int]) -> Pick:
    shaped = shape_logits(logits.double(), draw, ending)
    spec = draw.spec
    token = int(shaped.argmax()) if spec.greedy else _draw_from(shaped, spec, draw.step)
    if not spec.logprobs:
        return Pick(token)
    return Pick(token, logprobs_of(shaped / (spec.temperature or 1.0), token, spec.top_logprobs))


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability under softmax(logits) [vocab], and the `top` most likely."""
    logprobs = torch.log_softmax(logits, dim=-1)
    best = torch.sort(logprobs, descending=True, stable=True)  # ties: the lower id first
    ranked = zip(best.indices[:top].tolist(), best.values[:top].tolist(), strict=True)
    return TokenLogprobs(float(logprobs[token]), tuple(ranked))


def shape_logits(logits: torch.Tensor, draw: Draw, ending: frozenset[int]) -> torch.Tensor:
    """Steps 1-4 of the module's order, on a copy of one row."""
    spec, logits = draw.spec, logits.clone()
    if spec.logit_bias:
        ids, biases = zip(*spec.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype)
    if draw.step < spec.min_tokens:
        held = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(ending))
        if held:
            logits[sorted(held)] = -torch.inf
    if spec.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(draw.tokens)), dtype=torch.long)
        values = logits[seen]
        r = spec.repetition_penalty
        logits[seen] = torch.where(values > 0, values / r, values * r)
    if spec.frequency_penalty or spec.presence_penalty:
        output = torch.tensor(list(draw.output), dtype=torch.long)
        counts = torch.bincount(output, minlength=logits.numel()).to(logits.dtype)
        logits -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0)
    return logits


def _draw_from(logits: torch.Tensor, spec: SamplingSpec, step: int) -> int:
    scaled = (logits - logits.max()) / spec.temperature  # max first: no inf at tiny T
    probs = torch.softmax(scaled, dim=-1)
    probs, order = torch.sort(probs, descending=True, stable=True)
    keep = _kept(probs, spec)
    probs = probs[:keep]
    cdf = torch.cumsum(probs, dim=0)
    target = uniform(spec.seed, step) * float(cdf[-1])
    index = min(
        int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)), keep - 1
    )
    return int(order[index])


def _kept(probs: torch.Tensor, spec: SamplingSpec) -> int:
    """How many of the sorted tokens every cut keeps (at least one)."""
    keep = len(probs) if spec.top_k == 0 else min(spec.top_k, len(probs))
    if spec.top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=0) - probs
        keep = min(keep, int((mass_before < spec.top_p).sum()))
    if spec.min_p > 0.0:
        keep = min(keep, int((probs >= spec.min_p * probs[0]).sum()))
    return max(1, keep)
