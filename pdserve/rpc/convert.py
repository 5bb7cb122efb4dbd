"""Protobuf messages <-> the core's dataclasses. Protobuf types stop here."""

import uuid

from pdserve.core.picked import TokenLogprobs
from pdserve.core.request import GenerateSpec, InvalidRequest, SamplingSpec, one_prompt
from pdserve.engine.sequence import Emission, FinishReason
from pdserve.models.loading import ServedModel
from pdserve.models.tokenizer import MAX_CHAT_MESSAGES, ChatMessage, Tokenizer
from pdserve.v1 import pdserve_pb2 as pb

FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}


def sampling_from_pb(s: pb.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        first_step=s.first_step,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        min_p=s.min_p,
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        n=s.n or 1,
    )


def sampling_to_pb(s: SamplingSpec) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
        first_step=s.first_step,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        logit_bias=dict(s.logit_bias),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        n=s.n,
    )


def logprobs_to_pb(token: int, logprobs: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token,
        logprob=logprobs.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def prompt_logprobs_to_pb(
    prompt: tuple[int, ...], scored: list[TokenLogprobs]
) -> list[pb.TokenLogprob]:
    """A scored prompt's logprobs: entry i is prompt[i + 1]'s (the first token has none)."""
    return [logprobs_to_pb(t, lp) for t, lp in zip(prompt[1:], scored, strict=True)]


def logprobs_from_pb(message: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(message.logprob, tuple((t.token_id, t.logprob) for t in message.top))


def token_event(emission: Emission) -> pb.TokenEvent:
    """An emission's tokens, text and (when asked for) log-probabilities."""
    return pb.TokenEvent(
        token_ids=emission.token_ids,
        text=emission.text,
        logprobs=[logprobs_to_pb(t, lp) for t, lp in zip(emission.token_ids, emission.logprobs)],
        index=emission.index,
    )


def spec_from_generate(
    request: pb.GenerateRequest, tokenizer: Tokenizer, max_context: int
) -> GenerateSpec:
    """The client's request as a spec (not yet validated); assigns a request id when empty.

    Raises InvalidRequest unless exactly one of prompt, prompt_token_ids and messages is given,
    when the chat cannot be rendered, or when the prompt is plainly longer than the context
    (checked first, before any work on it) or the client set first_step.
    """
    _check_client_request(request, max_context)
    one_prompt(request.prompt, list(request.prompt_token_ids), list(request.messages))
    if request.messages:
        tokens = tokenizer.render_chat([ChatMessage(m.role, m.content) for m in request.messages])
    elif request.prompt:
        tokens = tokenizer.encode(request.prompt)
    else:
        tokens = list(request.prompt_token_ids)
    return GenerateSpec(
        request.request_id or uuid.uuid4().hex, tuple(tokens), sampling_from_pb(request.sampling)
    )


# A token of any vocabulary here spells at most this many characters; a text over max_context
# times as many cannot fit the context, and is refused before it is tokenized.
MAX_CHARACTERS_PER_TOKEN = 64


def _check_client_request(request: pb.GenerateRequest, max_context: int) -> None:
    """What can be refused at once, in time that does not grow with the prompt."""
    if request.sampling.first_step:
        raise InvalidRequest(
            "sampling.first_step is the router's, set when it moves a request to another "
            "decode instance; a client must leave it 0"
        )
    if len(request.prompt_token_ids) > max_context:
        raise InvalidRequest(
            f"the prompt has {len(request.prompt_token_ids)} token ids, over the context length "
            f"of {max_context}"
        )
    if len(request.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(
            f"at most {MAX_CHAT_MESSAGES} chat messages, got {len(request.messages)}"
        )
    characters = len(request.prompt) + sum(len(m.content) for m in request.messages)
    if characters > max_context * MAX_CHARACTERS_PER_TOKEN:
        raise InvalidRequest(
            f"the prompt has {characters} characters, far over what a context of {max_context} "
            "tokens holds"
        )


def spec_from_internal(
    request_id: str,
    token_ids,
    sampling: pb.SamplingParams,
    cache_salt: bytes = b"",
    client: str = "",
) -> GenerateSpec:
    return GenerateSpec(
        request_id, tuple(token_ids), sampling_from_pb(sampling), cache_salt, client
    )


def model_info_to_pb(served: ServedModel) -> pb.ModelInfo:
    c = served.config
    return pb.ModelInfo(
        name=served.name,
        architecture=c.architecture,
        dtype=c.dtype,
        fingerprint=served.fingerprint,
        vocab_size=c.vocab_size,
        max_context=c.max_context,
        num_layers=c.n_layers,
        num_kv_heads=c.kv_heads,
        head_dim=c.head_dim,
        kv_bytes_per_token=c.kv_bytes_per_token,
    )
