"""The sampler against the definitions of its parameters (pdserve.engine.sampling's docstring).

Each shaped distribution is computed here again from the definition, independently of the
sampler's code, and the tokens drawn over thousands of seeds must follow it.
"""

import pytest
import torch

from pdserve.core.config import ModelConfig
from pdserve.core.request import GenerateSpec, InvalidRequest, SamplingSpec, validate
from pdserve.engine.sampling import Draw, sample, uniform

CONFIG = ModelConfig()
SEEDS = 4000
# Binomial spread at 4,000 draws is at most 0.008; 0.03 is about 4 of those.
FREQUENCY_TOLERANCE = 0.03


def tokens_of(logits, draws, ending=frozenset()) -> list[int]:
    return [pick.token for pick in sample(logits, draws, ending)]


def draw(spec: SamplingSpec, step: int = 0, tokens: tuple[int, ...] = ()) -> Draw:
    return Draw(spec, step, tokens)


def frequencies(logits: torch.Tensor, spec_of_seed, step=0, tokens=(), ending=frozenset()):
    counts = torch.zeros(logits.shape[-1])
    for seed in range(SEEDS):
        counts[tokens_of(logits, [draw(spec_of_seed(seed), step, tokens)], ending)[0]] += 1
    return counts / SEEDS


def test_sampling_is_a_function_of_seed_and_step():
    logits = torch.randn(3, CONFIG.vocab_size, generator=torch.Generator().manual_seed(0))
    s = SamplingSpec(temperature=1.0, top_p=0.9, top_k=40, seed=5)
    batched = tokens_of(logits, [draw(s, i) for i in range(3)])
    # Each row alone, in another order: the same tokens (nothing depends on the batch).
    alone = [tokens_of(logits[i : i + 1], [draw(s, i)])[0] for i in (2, 0, 1)]
    assert alone == [batched[2], batched[0], batched[1]]
    assert uniform(5, 0) != uniform(5, 1) and uniform(5, 0) != uniform(6, 0)
    greedy = tokens_of(logits, [draw(SamplingSpec())] * 3)
    assert greedy == logits.argmax(-1).tolist()
    top1 = tokens_of(
        logits, [draw(SamplingSpec(temperature=1.0, top_k=1, seed=9), i) for i in range(3)]
    )
    assert top1 == greedy


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, allowed",
    [
        (1.0, 0, 1.0, 0.0, 4),
        (0.5, 0, 1.0, 0.0, 4),
        (1.0, 2, 1.0, 0.0, 2),
        (1.0, 0, 0.8, 0.0, 2),
        (1.0, 0, 0.95, 0.0, 3),
        (2.0, 3, 0.99, 0.0, 3),
        # top-p applies to the tempered distribution: at T = 1 these would keep 2 tokens.
        (2.0, 0, 0.8, 0.0, 3),
        (0.5, 0, 0.8, 0.0, 1),
        # min-p: probabilities 0.64, 0.24, 0.09, 0.03 at T = 1; at T = 2, 0.46, 0.28, 0.17, 0.10.
        (1.0, 0, 1.0, 0.3, 2),
        (1.0, 0, 1.0, 0.1, 3),
        (2.0, 0, 1.0, 0.3, 3),
        (2.0, 0, 1.0, 0.5, 2),
        (1.0, 3, 1.0, 0.3, 2),  # the tightest cut decides
    ],
)
def test_sampled_frequencies_follow_the_definition(temperature, top_k, top_p, min_p, allowed):
    """Tokens follow softmax(logits / T) restricted to the top-k tokens, to the smallest set whose
    mass reaches top-p and to those at least min_p times as likely as the first, renormalised."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / temperature, -1)
    expected = probs[:allowed] / probs[:allowed].sum()
    seen = frequencies(
        logits,
        lambda seed: SamplingSpec(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
        ),
    )
    assert seen[allowed:].sum() == 0
    assert (seen[:allowed] - expected).abs().max() < FREQUENCY_TOLERANCE


# Logits of a 6-token vocabulary, and a sequence whose prompt is [0, 3] and whose output so far is
# [0, 0, 1]: token 0 is in both, 1 only in the output, 3 only in the prompt, 2, 4 and 5 nowhere.
LOGITS = [2.0, 1.0, 0.0, 1.5, 0.5, -0.5]
TOKENS, OUTPUT_TOKENS = (0, 3, 0, 0, 1), 3


def shaped_by_definition(spec: SamplingSpec) -> torch.Tensor:
    """The logits after bias and penalties, written out from OpenAI's and CTRL's definitions."""
    out = list(LOGITS)
    for token, bias in spec.logit_bias:
        out[token] += bias
    output = TOKENS[len(TOKENS) - OUTPUT_TOKENS :]
    for token in set(TOKENS):
        r = spec.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(output):
        out[token] -= spec.frequency_penalty * output.count(token) + spec.presence_penalty
    return torch.tensor(out)


@pytest.mark.parametrize(
    "shaping",
    [
        dict(repetition_penalty=2.0),
        dict(repetition_penalty=0.5),  # below 1 it favours what was seen
        dict(frequency_penalty=0.7),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=-0.5, presence_penalty=0.25),
        dict(logit_bias=((2, 1.5), (4, -100.0))),
        dict(
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            logit_bias=((3, 2.0),),
        ),
    ],
    ids=["repetition", "repetition-below-1", "frequency", "presence", "negative", "bias", "all"],
)
def test_penalties_and_bias_follow_the_definition(shaping):
    """Over 4,000 seeds at T = 0.8, tokens follow softmax(shaped / T), where `shaped` applies the
    bias, then repetition over prompt and output, then frequency and presence over the output."""
    base = SamplingSpec(temperature=0.8, **shaping)
    expected = torch.softmax(shaped_by_definition(base) / 0.8, -1)
    seen = frequencies(
        torch.tensor([LOGITS]),
        lambda seed: SamplingSpec(temperature=0.8, seed=seed, **shaping),
        OUTPUT_TOKENS,
        TOKENS,
    )
    assert (seen - expected.float()).abs().max() < FREQUENCY_TOLERANCE
    # Greedy takes the shaped argmax, not the model's.
    greedy = tokens_of(
        torch.tensor([LOGITS]), [draw(SamplingSpec(**shaping), OUTPUT_TOKENS, TOKENS)]
    )
    assert greedy == [int(shaped_by_definition(base).argmax())]


def test_the_step_marks_where_the_output_begins():
    """Frequency and presence count only the output, the last `step` tokens. A migrated
    continuation's prompt ends with its earlier output and its step counts that output, so it
    draws what the uninterrupted sequence would have."""
    tokens = (*range(10), 7, 7, 20)
    logits = torch.zeros(1, 64)
    logits[0, 7] = 1.0
    penalised = SamplingSpec(frequency_penalty=2.0)
    assert tokens_of(logits, [draw(penalised, 3, tokens)]) != [7]  # output twice: 1 - 2 * 2 < 0
    assert tokens_of(logits, [draw(penalised, 1, tokens)]) == [7]  # only 20 is output


def test_min_tokens_holds_back_the_tokens_that_end_a_sequence():
    """Before min_tokens outputs, EOS (unless ignore_eos) and stop_token_ids cannot be drawn; the
    rest of the distribution is renormalised; from min_tokens on, nothing is held back."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.5]])  # 2 is EOS, 3 a stop token id
    eos = frozenset({2})
    spec = SamplingSpec(min_tokens=2, stop_token_ids=(3,))
    assert tokens_of(logits, [draw(spec, 0)], eos) == [1]
    assert tokens_of(logits, [draw(spec, 1)], eos) == [1]
    assert tokens_of(logits, [draw(spec, 2)], eos) == [2]
    ignoring = SamplingSpec(min_tokens=2, ignore_eos=True)
    assert tokens_of(logits, [draw(ignoring, 0)], eos) == [2]  # EOS ends nothing: not held back
    seen = frequencies(
        logits, lambda seed: SamplingSpec(temperature=1.0, seed=seed, min_tokens=5), 4, (), eos
    )
    expected = torch.softmax(torch.tensor([0.0, 1.0, -torch.inf, 2.5]), -1)
    assert seen[2] == 0 and (seen - expected).abs().max() < FREQUENCY_TOLERANCE


def spec_with(**sampling) -> GenerateSpec:
    return GenerateSpec("r", (1, 2, 3), SamplingSpec(**({"max_tokens": 4} | sampling)))


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(frequency_penalty=2.5), "frequency_penalty must be in"),
        (dict(presence_penalty=-3.0), "presence_penalty must be in"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(min_tokens=5), "min_tokens must be in"),
        (dict(stop_token_ids=(CONFIG.vocab_size,)), "outside the vocabulary"),
        (dict(stop_token_ids=tuple(range(65))), "at most 64"),
        (dict(logit_bias=((5, 101.0),)), r"\[-100, 100\]"),
        (dict(logit_bias=((-1, 1.0),)), "outside the vocabulary"),
    ],
)
def test_shaping_parameters_out_of_range_are_refused_by_name(bad, words):
    with pytest.raises(InvalidRequest, match=words):
        validate(spec_with(**bad), CONFIG)
