"""Token sampling: greedy, temperature, top-k, top-p, seeded per request and per step.

The random number for step `i` of a request is a pure function of (seed, i), so a request gives the
same tokens wherever each of its steps runs: prefill samples step 0, decode the rest.
"""

import torch

from pdserve.core.request import SamplingSpec

_MASK64 = (1 << 64) - 1


def uniform(seed: int, step: int) -> float:
    """A number in [0, 1) from (seed, step), by the splitmix64 finaliser (Steele et al., 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, specs: list[SamplingSpec], steps: list[int]) -> list[int]:
    """One token per row of `logits` [batch, vocab]; row i follows specs[i] at step steps[i]."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[i] if spec.greedy else _sample_row(logits[i], spec, steps[i])
        for i, spec in enumerate(specs)
    ]


def _sample_row(logits: torch.Tensor, spec: SamplingSpec, step: int) -> int:
    scaled = (logits.double() - logits.max()) / spec.temperature  # max first: no inf at tiny T
    probs = torch.softmax(scaled, dim=-1)
    probs, order = torch.sort(probs, descending=True, stable=True)
    keep = len(probs) if spec.top_k == 0 else min(spec.top_k, len(probs))
    if spec.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        mass_before = torch.cumsum(probs, dim=0) - probs
        keep = min(keep, max(1, int((mass_before < spec.top_p).sum())))
    probs = probs[:keep]
    cdf = torch.cumsum(probs, dim=0)
    target = uniform(spec.seed, step) * float(cdf[-1])
    index = min(
        int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)), keep - 1
    )
    return int(order[index])
