"""A sampled token as it travels from the sampler to the client, with its log-probabilities
when the request asked for them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """The picked token's log-probability under the distribution it was drawn from, and the
    `top_logprobs` most likely tokens' (token id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Pick:
    token: int
    logprobs: TokenLogprobs | None = None  # None unless the request asked for logprobs
