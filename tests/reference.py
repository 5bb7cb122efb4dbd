"""The plain reference: one sequence, no batching, no paging, a contiguous KV cache.

`check_against_reference` accepts a served token that is not the reference's argmax only where the
reference's logit for it is within TOLERANCE of the top logit (a near-tie that batched arithmetic
may legitimately break the other way), and counts how often that happens.
"""

from dataclasses import dataclass


from pdserve.models.loading import load_served_model
from pdserve.models.tinygpt import TinyGPT

# Batched, paged and contiguous paths differ by ~2e-5 in the logits (measured on this model);
# logits have a spread of about 1, so 1e-3 is 50x the noise and still a very close tie.
TOLERANCE = 1e-3

_model = None
# Over the whole session: tokens checked, and how many were accepted only as near-ties.
TOTALS = {"tokens": 0, "near_ties": 0}


def model() -> TinyGPT:
    global _model
    if _model is None:
        _model = load_served_model("tinygpt").model
    return _model


def greedy_generate(prompt: list[int], max_tokens: int) -> list[int]:
    """Token by token with a contiguous cache."""
    cache: list = []
    logits = model().forward_contiguous(prompt, cache)[-1]
    out = []
    for _ in range(max_tokens):
        out.append(int(logits.argmax()))
        logits = model().forward_contiguous([out[-1]], cache)[-1]
    return out


@dataclass
class Comparison:
    tokens: int = 0
    exact: int = 0
    near_ties: int = 0


def check_against_reference(prompt: list[int], served: list[int]) -> Comparison:
    """Teacher-forces the served tokens through the reference and checks each one."""
    cache: list = []
    logits = model().forward_contiguous(prompt, cache)[-1]
    result = Comparison()
    for i, token in enumerate(served):
        top = float(logits.max())
        chosen = float(logits[token])
        assert chosen >= top - TOLERANCE, (
            f"token {i}: served {token} (logit {chosen:.6f}) but the reference's best is "
            f"{int(logits.argmax())} (logit {top:.6f}); not a near-tie"
        )
        result.tokens += 1
        TOTALS["tokens"] += 1
        if token == int(logits.argmax()):
            result.exact += 1
        else:
            result.near_ties += 1
            TOTALS["near_ties"] += 1
        logits = model().forward_contiguous([token], cache)[-1]
    return result
