"""Protobuf messages <-> the core's dataclasses. Protobuf types stop here."""

import uuid

from pdserve.core.request import GenerateSpec, SamplingSpec, one_prompt
from pdserve.engine.sequence import FinishReason
from pdserve.models.loading import ServedModel
from pdserve.models.tokenizer import ChatMessage, Tokenizer
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
    )


def spec_from_generate(request: pb.GenerateRequest, tokenizer: Tokenizer) -> GenerateSpec:
    """The client's request as a spec (not yet validated); assigns a request id when empty.

    Raises InvalidRequest unless exactly one of prompt, prompt_token_ids and messages is given,
    or when the chat cannot be rendered.
    """
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


def spec_from_internal(
    request_id: str, token_ids, sampling: pb.SamplingParams, cache_salt: bytes = b""
) -> GenerateSpec:
    return GenerateSpec(request_id, tuple(token_ids), sampling_from_pb(sampling), cache_salt)


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
