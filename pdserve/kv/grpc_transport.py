"""KV over gRPC: DecodeService.PushKv, a client stream of PushKvRequest messages.

Both ends use the hand-framed messages of pdserve.kv.frames instead of protobuf's own
(de)serialization of the payload: the sender builds one bytes object per chunk straight from the
layer's tensors (the serializer must return bytes), and the receiver writes the pool from a view
of the bytes gRPC hands it.
"""

import grpc

from pdserve.kv import frames
from pdserve.kv.receiver import Committed, KvReceiver, KvStream, status_name
from pdserve.kv.sink import KvSink, KvTarget, KvTransferFailed
from pdserve.kv.wire import KvRejected
from pdserve.faults import Faults
from pdserve.v1 import pdserve_pb2 as pb

PUSH_KV_METHOD = "/pdserve.v1.DecodeService/PushKv"


class GrpcKvSink(KvSink):
    transport = "grpc"

    def __init__(self, target: KvTarget, faults: Faults, channel: grpc.aio.Channel) -> None:
        super().__init__(target, faults)
        self._push = channel.stream_unary(
            PUSH_KV_METHOD,
            request_serializer=frames.join_message,
            response_deserializer=pb.PushKvResponse.FromString,
        )

    async def send(self, timeout: float | None) -> Committed:
        try:
            reply = await self._push(self.items(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferFailed(exc.code().name, exc.details() or "") from None
        return Committed(reply.lease_id, reply.bytes, reply.newly_committed)


def push_kv_handler(receiver: KvReceiver) -> grpc.RpcMethodHandler:
    """DecodeService.PushKv, reading each message with frames.read_frame."""

    async def push_kv(frames_in, context) -> pb.PushKvResponse:
        stream = KvStream("grpc")
        try:
            async for frame in frames_in:
                committed = frames.deliver(receiver, stream, frame)
                if committed is not None:
                    return pb.PushKvResponse(
                        lease_id=committed.lease_id,
                        bytes=committed.bytes,
                        newly_committed=committed.newly_committed,
                    )
            raise KvRejected("KV stream ended without a commit")
        except KvRejected as exc:
            receiver.refuse(stream, f"KV transfer rejected: {exc}")
            await context.abort(grpc.StatusCode[status_name(exc)], str(exc))
            raise AssertionError("unreachable: abort raises") from None
        except BaseException:  # the stream broke or was cancelled before its commit
            receiver.refuse(stream, "KV stream broke before its commit")
            raise

    return grpc.stream_unary_rpc_method_handler(
        push_kv,
        request_deserializer=frames.read_frame,
        response_serializer=pb.PushKvResponse.SerializeToString,
    )


async def serve_push_kv_only(
    receiver: KvReceiver, host: str = "127.0.0.1", max_message_bytes: int = 64 << 20
) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server with nothing but DecodeService.PushKv, and its port: the transport
    alone, for the tests and benchmarks that measure it."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
    handlers = {"PushKv": push_kv_handler(receiver)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.DecodeService", handlers),)
    )
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, port
