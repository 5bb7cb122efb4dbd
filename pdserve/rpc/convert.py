"""Protobuf messages <-> the core's dataclasses. Protobuf types stop here."""

import uuid

from pdserve.core.request import GenerateSpec, SamplingSpec, prompt_tokens
from pdserve.core.sequence import FinishReason
from pdserve.v1 import pdserve_pb2 as pb

FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}


def sampling_from_pb(s: pb.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
        top_k=s.top_k, seed=s.seed, stop=tuple(s.stop), ignore_eos=s.ignore_eos)


def sampling_to_pb(s: SamplingSpec) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed, stop=list(s.stop), ignore_eos=s.ignore_eos)


def spec_from_generate(request: pb.GenerateRequest) -> GenerateSpec:
    """The client's request as a spec (not yet validated); assigns a request id when empty.

    Raises InvalidRequest when prompt and prompt_token_ids are both or neither given.
    """
    tokens = prompt_tokens(request.prompt, list(request.prompt_token_ids))
    return GenerateSpec(request.request_id or uuid.uuid4().hex, tokens,
                        sampling_from_pb(request.sampling))


def spec_from_internal(request_id: str, token_ids, sampling: pb.SamplingParams) -> GenerateSpec:
    return GenerateSpec(request_id, tuple(token_ids), sampling_from_pb(sampling))
