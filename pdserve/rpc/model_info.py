"""ModelInfoService: every pdserve process says which model it serves, the same way."""

import grpc

from pdserve.rpc import convert
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


class ModelInfoServicer(pb_grpc.ModelInfoServiceServicer):
    def __init__(self, info: pb.ModelInfo) -> None:
        self._reply = pb.GetModelInfoResponse(model=info)

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return self._reply


def add_to_server(served, server: grpc.aio.Server) -> None:
    """Serves `served` (a ServedModel)'s identity on the server's ModelInfoService."""
    pb_grpc.add_ModelInfoServiceServicer_to_server(
        ModelInfoServicer(convert.model_info_to_pb(served)), server
    )


async def fetch(channel: grpc.aio.Channel, timeout: float, **call_options) -> pb.ModelInfo:
    """The model the instance behind `channel` serves; raises grpc.aio.AioRpcError."""
    reply = await pb_grpc.ModelInfoServiceStub(channel).GetModelInfo(
        pb.GetModelInfoRequest(), timeout=timeout, **call_options
    )
    return reply.model


def fetch_blocking(channel: grpc.Channel, timeout: float) -> pb.ModelInfo:
    """fetch() for a synchronous channel (the CLI and the tests)."""
    stub = pb_grpc.ModelInfoServiceStub(channel)
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout).model
