"""KV over gRPC: DecodeService.PushKv, a client stream of PushKvRequest messages.

Both ends use the hand-framed messages of pdserve.kv.frames instead of protobuf's own
(de)serialization of the payload: the sender builds one bytes object per chunk straight from the
layer's tensors (the serializer must return bytes), and the receiver writes the pool from a view
of the bytes gRPC hands it.

PushKv shares decode's gRPC server, and so its --max-concurrent-rpcs, with the router's calls. So
that KV streams can never take every slot, decode admits at most IngestLimits.max_streams of them
at once, and ends one that is silent before its first message or outlives its lease's TTL.
"""

import asyncio
import time
from dataclasses import dataclass

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
        # The call opens only once its first chunk is ready: decode ends a PushKv that stays
        # silent past its first-frame deadline, and a prompt may wait longer for its batch.
        # Waiting for it without taking it: the stream then holds no chunk of its own.
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                await self.started.wait()
        except TimeoutError:
            raise KvTransferFailed("DEADLINE_EXCEEDED", "KV transfer timed out") from None
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            reply = await self._push(self.items(), timeout=left)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferFailed(exc.code().name, exc.details() or "") from None
        return Committed(reply.lease_id, reply.bytes, reply.newly_committed)


@dataclass(frozen=True)
class IngestLimits:
    """Decode's bounds on PushKv streams (DecodeSettings: --max-kv-streams,
    --kv-first-frame-seconds, and --lease-ttl-seconds for a whole stream)."""

    max_streams: int = 256
    first_frame_seconds: float = 10.0
    stream_seconds: float = 30.0


class _StreamCount:
    """PushKv streams in progress. Touched on the event loop only, so a plain counter."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def refusal(self) -> str:
        """Why one more stream may not start, or ""."""
        if self.active < self.limit:
            return ""
        return (
            f"decode is receiving {self.active} KV streams already (--max-kv-streams "
            f"{self.limit}); try again or use another decode"
        )


def push_kv_handler(
    receiver: KvReceiver, limits: IngestLimits = IngestLimits()
) -> grpc.RpcMethodHandler:
    """DecodeService.PushKv, reading each message with frames.read_frame, within `limits`."""
    count = _StreamCount(limits.max_streams)

    async def push_kv(frames_in, context) -> pb.PushKvResponse:
        refusal = count.refusal()
        if refusal:  # refused at once: the call gives its slot of --max-concurrent-rpcs back
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            raise AssertionError("unreachable: abort raises")
        count.active += 1
        stream = KvStream("grpc")
        try:
            committed = await _received(receiver, stream, frames_in, limits)
        except (KvRejected, _TooSlow) as exc:
            receiver.refuse(stream, f"KV transfer rejected: {exc}")
            code = "DEADLINE_EXCEEDED" if isinstance(exc, _TooSlow) else status_name(exc)
            await context.abort(grpc.StatusCode[code], str(exc))
            raise AssertionError("unreachable: abort raises") from None
        except BaseException:  # the stream broke or was cancelled before its commit
            receiver.refuse(stream, "KV stream broke before its commit")
            raise
        finally:
            count.active -= 1
        return pb.PushKvResponse(
            lease_id=committed.lease_id,
            bytes=committed.bytes,
            newly_committed=committed.newly_committed,
        )

    return grpc.stream_unary_rpc_method_handler(
        push_kv,
        request_deserializer=frames.read_frame,
        response_serializer=pb.PushKvResponse.SerializeToString,
    )


class _TooSlow(Exception):
    """The stream missed its first-frame or whole-stream deadline."""


async def _received(
    receiver: KvReceiver, stream: KvStream, frames_in, limits: IngestLimits
) -> Committed:
    """Delivers the stream's messages until its commit; raises KvRejected, or _TooSlow when the
    first message takes longer than first_frame_seconds or the stream than stream_seconds."""
    stream_ends = asyncio.get_running_loop().time() + limits.stream_seconds
    why = f"no KV message within {limits.first_frame_seconds:g} s of the call"
    try:
        async with asyncio.timeout(min(limits.first_frame_seconds, limits.stream_seconds)) as due:
            async for frame in frames_in:
                due.reschedule(stream_ends)  # from the first message on, the whole stream's
                why = f"the KV stream took longer than {limits.stream_seconds:g} s"
                committed = frames.deliver(receiver, stream, frame)
                if committed is not None:
                    return committed
    except TimeoutError:
        raise _TooSlow(why) from None
    raise KvRejected("KV stream ended without a commit")


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
