"""A prompt's own log-probabilities (OpenAI's `echo`), asked of a prefill instance.

Scoring needs no decode room and no KV handoff: the router sends the prompt to one healthy
prefill and relays the answer. A prefill that is unreachable or refuses as overloaded is followed
by the next; a refusal of the prompt itself ends it, as it would on every instance.
"""

import grpc

from pdserve.core.request import GenerateSpec
from pdserve.services.router.backends import BackendSet
from pdserve.services.router.errors import RouterError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

# What one instance answering says nothing about the next: try another.
_TRY_ANOTHER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


async def score_prompt(
    prefills: BackendSet[pb_grpc.PrefillServiceStub],
    fingerprint: str,
    spec: GenerateSpec,
    top: int,
    timeout: float,
) -> list[pb.TokenLogprob]:
    """One entry per prompt token after the first. Raises RouterError."""
    request = pb.ScorePromptRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        top_logprobs=top,
        model_fingerprint=fingerprint,
    )
    last: grpc.aio.AioRpcError | None = None
    for prefill in prefills.ordered():
        try:
            reply = await prefill.stub.ScorePrompt(request, timeout=timeout)
            return list(reply.logprobs)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _TRY_ANOTHER:
                raise RouterError(exc.code(), f"scoring the prompt: {exc.details()}") from None
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                prefills.mark_down(prefill)
            last = exc
    if last is None:
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "no prefill instance is known")
    raise RouterError(last.code(), f"no prefill instance could score the prompt: {last.details()}")
