"""Which data planes a decode instance offers, asked over its gRPC control plane.

A Prefill call names a data endpoint for its lease, and whoever makes that call could name any
port. So prefill dials a data plane only when the decode instance it may send KV to (one its
--decode-allow, or loopback, admits) says over gRPC that it listens there.
"""

from collections.abc import Callable

import grpc

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


def data_endpoints_handler(
    offered: Callable[[], list[pb.DataEndpoint]], instance: str
) -> grpc.RpcMethodHandler:
    """Decode's side: answers with the endpoints offered with every lease, at call time."""

    async def get_data_endpoints(request, context) -> pb.GetDataEndpointsResponse:
        return pb.GetDataEndpointsResponse(instance=instance, data_endpoints=offered())

    return grpc.unary_unary_rpc_method_handler(
        get_data_endpoints,
        request_deserializer=pb.GetDataEndpointsRequest.FromString,
        response_serializer=pb.GetDataEndpointsResponse.SerializeToString,
    )


async def fetch(channel: grpc.aio.Channel, timeout: float) -> list[pb.DataEndpoint]:
    """Prefill's side: the data endpoints of the decode behind `channel`. Raises
    grpc.aio.AioRpcError (UNIMPLEMENTED from a decode that predates the method)."""
    stub = pb_grpc.DecodeServiceStub(channel)
    reply = await stub.GetDataEndpoints(pb.GetDataEndpointsRequest(), timeout=timeout)
    return list(reply.data_endpoints)
