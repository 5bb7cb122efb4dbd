"""KV over a plain TCP connection: decode's data plane.

gRPC stays the control plane: a lease names the data plane's port (DataEndpoint), and prefill
connects there for that one lease's KV. The stream carries the same PushKvRequest messages as
DecodeService.PushKv, each preceded by its length (4 bytes, little-endian), and so the same
lease binding, chunk CRCs and commit digest. Decode answers with one DataPlaneReply frame (the
commit's answer, or the status and reason of a refusal) and closes the connection. A connection
that sends something unreadable, names an unknown lease or is too slow is closed; nothing it sent
stays in the pool.

Anyone who can reach the port can connect, so what one peer can hold is bounded
(DataPlaneLimits): connections in total and per peer address; each connection's whole life (a
lease's TTL) and each frame's, from its first byte to its last, rather than an idle timer that a
byte now and then would keep re-arming; and memory. A frame's buffer is allocated in full only
once its first HEADER_BYTES have named a live lease, so a 4-byte length alone allocates nothing
large.

Copies of a KV byte: the kernel copies it into decode's frame buffer (recv_into), and decode
writes it from there into the pool. The sender writes the layer's own memory (sendmsg over the
tensors' byte views), so it makes none.
"""

import asyncio
import logging
import socket
import ssl
import struct
from collections import Counter
from dataclasses import dataclass

import grpc

from pdserve.faults import Faults
from pdserve.kv import frames
from pdserve.core.shown import shown
from pdserve.kv.leases import LeaseRejected, LeaseState
from pdserve.kv.receiver import Committed, KvReceiver, KvStream, status_name
from pdserve.kv.sink import KvSink, KvTarget, KvTransferFailed
from pdserve.kv.wire import KvRejected
from pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
# A frame is one chunk (1 MiB by default) plus its header. Larger is refused before any buffer
# is allocated for it, so a hostile length cannot make decode allocate gigabytes.
MAX_FRAME_BYTES = 64 << 20
# A larger frame is read this far first: a chunk's header (the fields before its payload, a few
# hundred bytes) must name a live lease in it before the rest of the frame gets a buffer.
HEADER_BYTES = 4096
# Room for a few chunks in flight in each direction's kernel buffer, so neither side waits on the
# other while it checksums or writes a chunk.
SOCKET_BUFFER_BYTES = 8 << 20
# How long the sender waits for decode's reply once decode has closed the connection on it.
REPLY_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class DataPlaneLimits:
    """What one data-plane connection, and one peer, may hold (DecodeSettings)."""

    stream_seconds: float = 30.0  # a connection's whole life: --lease-ttl-seconds
    # A frame's bytes must all arrive within this long of its first: 4 MiB at 3.5 Mbit/s.
    frame_seconds: float = 10.0
    max_connections: int = 256  # --max-kv-connections
    max_per_peer: int = 64  # --max-kv-connections-per-peer


class _Peers:
    """Open connections, in total and by peer address. Touched on the event loop only."""

    def __init__(self, limits: DataPlaneLimits) -> None:
        self._limits, self._by_peer, self._total = limits, Counter[str](), 0

    def admit(self, peer: str) -> str:
        """Counts one more connection from `peer`; or, beyond a cap, says why not."""
        limits = self._limits
        if self._total >= limits.max_connections:
            return f"{self._total} data-plane connections open (--max-kv-connections)"
        if self._by_peer[peer] >= limits.max_per_peer:
            return (
                f"{self._by_peer[peer]} data-plane connections open from this peer "
                "(--max-kv-connections-per-peer)"
            )
        self._total += 1
        self._by_peer[peer] += 1
        return ""

    def release(self, peer: str) -> None:
        self._total -= 1
        self._by_peer[peer] -= 1
        if not self._by_peer[peer]:
            del self._by_peer[peer]


class DataPlaneServer:
    """Decode's listener. Each connection is one KV stream, handled on the event loop."""

    def __init__(self, receiver: KvReceiver, limits: DataPlaneLimits) -> None:
        self._receiver, self._limits = receiver, limits
        self._peers = _Peers(limits)
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listens; with an ssl context, only peers with a certificate of the prefill role may
        send (any other is refused PERMISSION_DENIED before a byte of KV is read)."""
        loop = asyncio.get_running_loop()
        tls = ssl_context is not None
        self._server = await loop.create_server(
            lambda: _Connection(self._receiver, self._limits, self._peers, tls),
            host,
            port,
            ssl=ssl_context,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _Connection(asyncio.BufferedProtocol):
    """Reads length-prefixed frames straight into a buffer it reuses (no copy of its own)."""

    def __init__(
        self, receiver: KvReceiver, limits: DataPlaneLimits, peers: _Peers, tls: bool
    ) -> None:
        self._receiver, self._limits, self._peers, self._tls = receiver, limits, peers, tls
        self._stream = KvStream("tcp")
        self._buffer = bytearray(LENGTH.size)
        self._need, self._filled, self._in_length = LENGTH.size, 0, True
        self._length = 0  # of the frame being read
        self._refusal: KvRejected | None = None  # of the frame being read, once it is in
        self._transport: asyncio.Transport | None = None
        self._finished = False
        self._peer: str | None = None  # counted in _peers while set
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = str((transport.get_extra_info("peername") or ("?",))[0])
        refusal = self._peers.admit(peer)
        if refusal:
            self._refuse("RESOURCE_EXHAUSTED", f"decode is full: {refusal}")
            return
        self._peer = peer
        seconds = self._limits.stream_seconds
        self._arm("stream", seconds, f"the KV stream took longer than {seconds:g} s")
        if self._tls:
            role = role_of_peercert(transport.get_extra_info("peercert"))
            if role != "prefill":
                self._refuse(
                    "PERMISSION_DENIED",
                    f"only the prefill role may send KV; this peer's certificate says {role!r}",
                )

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._refusal is not None:  # the rest of a refused frame, read over and over again
            return memoryview(self._buffer)[: min(len(self._buffer), self._need - self._filled)]
        return memoryview(self._buffer)[self._filled : self._need]

    def buffer_updated(self, nbytes: int) -> None:
        if self._in_length and self._filled == 0 and not self._finished:
            seconds = self._limits.frame_seconds
            self._arm("frame", seconds, f"a frame took longer than {seconds:g} s to arrive")
        self._filled += nbytes
        if self._filled < self._need or self._finished:
            return
        try:
            self._frame_complete()
        except KvRejected as exc:
            self._refuse(status_name(exc), str(exc))

    def _frame_complete(self) -> None:
        if self._in_length:
            (length,) = LENGTH.unpack_from(self._buffer)
            if not 0 < length <= MAX_FRAME_BYTES:
                raise KvRejected(f"frame of {length} bytes; the limit is {MAX_FRAME_BYTES}")
            self._length, self._in_length = length, False
            self._need, self._filled = min(length, HEADER_BYTES), 0
            if len(self._buffer) < self._need:
                self._buffer = bytearray(self._need)
            return
        if self._refusal is not None:
            raise self._refusal
        if self._need < self._length:  # the header is in: the whole frame, if its lease lives
            try:
                self._check_named_lease()
            except KvRejected as exc:
                # Answered once the frame is in, without keeping it: a peer still sending when
                # the connection closes would get a reset, not the answer.
                self._refusal, self._need = exc, self._length
                return
            grown = bytearray(self._length)  # replaced, not resized: views of the old may live
            grown[: self._filled] = memoryview(self._buffer)[: self._filled]
            self._buffer, self._need = grown, self._length
            return
        self._disarm("frame")
        frame = frames.read_frame(memoryview(self._buffer)[: self._need])
        committed = frames.deliver(self._receiver, self._stream, frame)
        self._need, self._filled, self._in_length = LENGTH.size, 0, True
        if committed is not None:
            self._reply(pb.DataPlaneReply(committed=_to_pb(committed)))

    def _check_named_lease(self) -> None:
        """Raises KvRejected unless the frame's start names a lease this stream may fill."""
        lease_id = frames.named_lease(memoryview(self._buffer)[: self._filled])
        if lease_id is None:
            raise KvRejected(
                f"a frame of {self._length} bytes names no lease in its first {HEADER_BYTES}"
            )
        lease = self._receiver.leases.for_push(lease_id)  # LeaseRejected: unknown, expired...
        if lease is not self._stream.lease and lease.state is not LeaseState.GRANTED:
            raise LeaseRejected(f"lease {shown(lease_id)} is already receiving on another stream")

    def _refuse(self, code: str, reason: str) -> None:
        log.warning("data plane: refused a KV stream: %s", reason)
        self._receiver.refuse(self._stream, f"KV transfer rejected: {reason}")
        self._reply(pb.DataPlaneReply(error_code=_code_number(code), error_message=reason))

    def _reply(self, reply: pb.DataPlaneReply) -> None:
        self._finished = True
        self._disarm("stream", "frame")
        payload = reply.SerializeToString()
        assert self._transport is not None
        self._transport.write(LENGTH.pack(len(payload)) + payload)
        self._transport.close()

    def _arm(self, name: str, seconds: float, why: str) -> None:
        self._disarm(name)
        loop = asyncio.get_running_loop()
        self._timers[name] = loop.call_later(seconds, self._too_slow, why)

    def _disarm(self, *names: str) -> None:
        for name in names:
            timer = self._timers.pop(name, None)
            if timer is not None:
                timer.cancel()

    def _too_slow(self, why: str) -> None:
        if not self._finished:
            self._refuse("DEADLINE_EXCEEDED", why)

    def eof_received(self) -> bool:
        return False  # close: a stream that ends early is broken

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm("stream", "frame")
        if self._peer is not None:
            self._peers.release(self._peer)
            self._peer = None
        if not self._finished:
            self._finished = True
            self._receiver.refuse(self._stream, "KV stream broke before its commit")


class TcpKvSink(KvSink):
    """Prefill's side: one connection per lease, opened with connect() before the transfer.

    Plaintext, it writes the tensors' own memory with sendmsg. Over TLS (an ssl context from
    --tls-*), it writes through an asyncio stream, which encrypts: a copy the cipher makes anyway.
    """

    transport = "tcp"

    def __init__(
        self,
        target: KvTarget,
        faults: Faults,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(target, faults)
        self.address = f"{host}:{port}"
        self._host, self._port, self._ssl = host, port, ssl_context
        self._sock: socket.socket | None = None
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def connect(self, timeout: float) -> None:
        """Raises OSError (or TimeoutError) when the data plane cannot be reached, or its
        certificate is not decode's."""
        async with asyncio.timeout(timeout):
            if self._ssl is not None:
                self._stream = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl, server_hostname="decode"
                )
                return
            self._sock = await _connect_plain(self._host, self._port)

    async def send(self, timeout: float | None) -> Committed:
        assert self._sock is not None or self._stream is not None, "connect() first"
        try:
            async with asyncio.timeout(timeout):
                if self._stream is not None:
                    reader, writer = self._stream
                    return await self._transfer(
                        _read_reply_from(reader), self._send_all_tls(writer)
                    )
                assert self._sock is not None
                return await self._transfer(_read_reply(self._sock), self._send_all(self._sock))
        except TimeoutError:
            raise KvTransferFailed("DEADLINE_EXCEEDED", "KV transfer timed out") from None
        finally:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._stream is not None:
            self._stream[1].close()

    async def _transfer(self, read_reply, send_all) -> Committed:
        """Sends everything while watching for decode's reply, which may come early (a refusal)."""
        reply = asyncio.ensure_future(read_reply)
        sending = asyncio.ensure_future(send_all)
        try:
            await asyncio.wait({reply, sending}, return_when=asyncio.FIRST_COMPLETED)
            if not reply.done():
                try:
                    sending.result()
                except OSError:  # decode closed first: its reply, if any, says why
                    await asyncio.wait_for(asyncio.shield(reply), REPLY_GRACE_SECONDS)
                # Sent means handed to the kernel: on a slow link megabytes may still be on
                # their way, so the reply is waited for as long as the caller's deadline allows.
                await reply
            return _committed(reply.result(), self.address)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            raise KvTransferFailed(
                "UNAVAILABLE", f"data plane {self.address} broke: {str(exc) or type(exc).__name__}"
            ) from None
        finally:
            reply.cancel()
            sending.cancel()

    async def _send_all(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        async for item in self.items():
            parts = _framed(item)
            await _send_parts(loop, sock, parts)

    async def _send_all_tls(self, writer: asyncio.StreamWriter) -> None:
        async for item in self.items():
            writer.writelines(_framed(item))
            await writer.drain()


def _framed(item) -> list:
    parts = frames.message_parts(item)
    return [LENGTH.pack(sum(memoryview(part).nbytes for part in parts)), *parts]


def role_of_peercert(peercert: dict | None) -> str | None:
    """The common name, which names the role, of a certificate as Python's ssl module gives it."""
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


async def _connect_plain(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    family, _, _, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    try:
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


async def _read_reply_from(reader: asyncio.StreamReader) -> pb.DataPlaneReply:
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > 1 << 16:
        raise OSError(f"reply of {length} bytes")
    return pb.DataPlaneReply.FromString(await reader.readexactly(length))


async def _send_parts(loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list) -> None:
    """Writes the buffers in order with sendmsg (a gather write: nothing joined, nothing
    copied); whatever the socket does not take at once is waited on with sock_sendall."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            sent = 0
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views:
            await loop.sock_sendall(sock, views.pop(0)[sent:])


async def _read_reply(sock: socket.socket) -> pb.DataPlaneReply:
    loop = asyncio.get_running_loop()
    (length,) = LENGTH.unpack(await _recv_exactly(loop, sock, LENGTH.size))
    if length > 1 << 16:
        raise OSError(f"reply of {length} bytes")
    return pb.DataPlaneReply.FromString(await _recv_exactly(loop, sock, length))


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        count = await loop.sock_recv_into(sock, view[got:])
        if count == 0:
            raise OSError("connection closed")
        got += count
    return bytes(buffer)


def _committed(reply: pb.DataPlaneReply, address: str) -> Committed:
    if reply.HasField("committed"):
        c = reply.committed
        return Committed(c.lease_id, c.bytes, c.newly_committed)
    raise KvTransferFailed(_code_name(reply.error_code), reply.error_message or "refused")


def _to_pb(committed: Committed) -> pb.PushKvResponse:
    return pb.PushKvResponse(
        lease_id=committed.lease_id,
        bytes=committed.bytes,
        newly_committed=committed.newly_committed,
    )


def _code_number(name: str) -> int:
    return grpc.StatusCode[name].value[0]  # google.rpc.Code numbers, as gRPC itself sends them


def _code_name(number: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == number), "UNKNOWN")
