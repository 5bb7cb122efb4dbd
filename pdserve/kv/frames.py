"""A KV chunk or commit as a PushKvRequest message, built and read without copying the payload.

Protobuf's Python API copies a bytes field when it is set, again when the message is serialized,
again when it is parsed and again on every read of the field. KV payloads are most of the bytes a
deployment moves, so they go around it:

- Sending, the header (the chunk or commit fields) is serialized by protobuf, and the payload is
  appended as field 3 (`data`) by hand. A serialized message followed by more fields is a valid
  serialization of the message, so any protobuf library reads the result.
- Receiving, the top-level fields are walked by hand: `data` becomes a view into the received
  buffer, and only the small rest goes through protobuf.

Both gRPC (DecodeService.PushKv) and the TCP data plane carry exactly these messages.
"""

from dataclasses import dataclass

from pdserve.kv.receiver import CommitRecord, Committed, KvReceiver, KvStream
from pdserve.kv.sink import OutChunk
from pdserve.kv.wire import ChunkHeader, KvRejected
from pdserve.rpc.convert import logprobs_from_pb, logprobs_to_pb
from pdserve.v1 import pdserve_pb2 as pb

DTYPE_TO_PB = {
    "float32": pb.D_TYPE_FLOAT32,
    "float16": pb.D_TYPE_FLOAT16,
    "bfloat16": pb.D_TYPE_BFLOAT16,
}
DTYPE_FROM_PB = {value: name for name, value in DTYPE_TO_PB.items()}
ENCODING_TO_PB = {"raw": pb.KV_ENCODING_UNSPECIFIED, "int8": pb.KV_ENCODING_INT8}
ENCODING_FROM_PB = {value: name for name, value in ENCODING_TO_PB.items()}

DATA_FIELD = 3  # PushKvRequest.data
_DATA_TAG = bytes([DATA_FIELD << 3 | 2])  # field 3, wire type 2 (length-delimited)


class MalformedFrame(ValueError):
    """Bytes that are not a PushKvRequest."""


@dataclass(frozen=True)
class Frame:
    """A received PushKvRequest: a chunk's header with its payload, or a commit."""

    chunk: ChunkHeader | None = None
    payload: memoryview | None = None
    commit: CommitRecord | None = None
    problem: str = ""  # set instead of the above when the bytes could not be read


# ------------------------------------------------------------------------------- sending


def chunk_parts(chunk: OutChunk) -> list:
    """The serialized PushKvRequest of a chunk as buffers to write one after the other: the
    header's bytes, the data field's tag and length, then the payload's own views."""
    h = chunk.header
    header = pb.PushKvRequest(
        chunk=pb.KvChunk(
            lease_id=h.lease_id,
            index=h.index,
            layer=h.layer,
            token_start=h.token_start,
            token_end=h.token_end,
            dtype=DTYPE_TO_PB[h.dtype],
            shape=list(h.shape),
            crc32c=h.crc32c,
            model_fingerprint=h.model_fingerprint,
            encoding=ENCODING_TO_PB[h.encoding],
        )
    ).SerializeToString()
    return [header + _DATA_TAG + _varint(chunk.nbytes), *chunk.parts]


def commit_bytes(record: CommitRecord) -> bytes:
    return pb.PushKvRequest(
        commit=pb.KvCommit(
            lease_id=record.lease_id,
            first_token_id=record.first_token_id,
            num_chunks=record.num_chunks,
            digest=record.digest,
            request_id=record.request_id,
            prompt_digest=record.prompt_digest,
            first_token_logprob=(
                None
                if record.first_logprobs is None
                else logprobs_to_pb(record.first_token_id, record.first_logprobs)
            ),
        )
    ).SerializeToString()


def message_parts(item: OutChunk | CommitRecord) -> list:
    return chunk_parts(item) if isinstance(item, OutChunk) else [commit_bytes(item)]


def join_message(item: OutChunk | CommitRecord) -> bytes:
    """One bytes object, for gRPC's serializer: the single copy of the payload on that path."""
    return b"".join(message_parts(item))


# ------------------------------------------------------------------------------- receiving


def deliver(receiver: KvReceiver, stream: KvStream, frame: Frame) -> Committed | None:
    """Hands one received message to the receiver; returns the commit's answer once it is the
    commit. Raises KvRejected for a message the receiver refuses or cannot read."""
    if frame.problem:
        raise KvRejected(frame.problem)
    if frame.chunk is not None:
        receiver.accept(stream, frame.chunk, frame.payload)
        return None
    assert frame.commit is not None  # read_frame gives a chunk, a commit or a problem
    return receiver.commit(stream, frame.commit)


def read_frame(buffer) -> Frame:
    """Reads a PushKvRequest; never raises: a malformed message becomes Frame(problem=...)."""
    try:
        return _read(memoryview(buffer))
    except MalformedFrame as exc:
        return Frame(problem=f"malformed PushKvRequest: {exc}")


def _read(view: memoryview) -> Frame:
    rest, payload = _split_data(view)
    try:
        message = pb.PushKvRequest.FromString(rest)
    except Exception as exc:  # protobuf's DecodeError, whose module path differs by backend
        raise MalformedFrame(str(exc) or type(exc).__name__) from None
    if message.HasField("chunk"):
        return Frame(chunk=_header(message.chunk), payload=payload or memoryview(b""))
    if message.HasField("commit"):
        c = message.commit
        logprobs = c.first_token_logprob
        record = CommitRecord(
            c.lease_id,
            c.first_token_id,
            c.num_chunks,
            c.digest,
            c.request_id,
            c.prompt_digest,
            logprobs_from_pb(logprobs) if c.HasField("first_token_logprob") else None,
        )
        return Frame(commit=record)
    raise MalformedFrame("neither chunk nor commit")


def named_lease(start: memoryview) -> str | None:
    """The lease a chunk names, read from the `start` of its PushKvRequest alone: the fields
    before its data field. None when no data field begins within `start`, or what precedes it
    is no chunk header."""
    pos = 0
    try:
        while pos < len(start):
            field_start = pos
            key, pos = _read_varint(start, pos)
            if key == DATA_FIELD << 3 | 2:
                message = pb.PushKvRequest.FromString(bytes(start[:field_start]))
                return message.chunk.lease_id if message.HasField("chunk") else None
            pos = _skip(start, pos, key)
    except Exception:  # MalformedFrame, or protobuf's DecodeError (its module varies by backend)
        return None
    return None


def _skip(view: memoryview, pos: int, key: int) -> int:
    """The position after the value of a field with `key` whose value starts at `pos`."""
    wire_type = key & 7
    if wire_type == 0:
        return _read_varint(view, pos)[1]
    if wire_type == 2:
        length, pos = _read_varint(view, pos)
        return pos + length
    if wire_type in (1, 5):
        return pos + (8 if wire_type == 1 else 4)
    raise MalformedFrame(f"wire type {wire_type}")


def _header(c: pb.KvChunk) -> ChunkHeader:
    return ChunkHeader(
        index=c.index,
        layer=c.layer,
        token_start=c.token_start,
        token_end=c.token_end,
        dtype=DTYPE_FROM_PB.get(c.dtype, "unspecified"),
        shape=tuple(c.shape),
        crc32c=c.crc32c,
        model_fingerprint=c.model_fingerprint,
        lease_id=c.lease_id,
        encoding=ENCODING_FROM_PB.get(c.encoding, f"unknown ({c.encoding})"),
    )


def _split_data(view: memoryview) -> tuple[bytes, memoryview | None]:
    """(every top-level field but data, as bytes; data as a view). The last data field wins, as
    protobuf's own parsers decide for a repeated scalar field."""
    others, payload, pos = [], None, 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            if field == DATA_FIELD:
                if pos + length > len(view):
                    raise MalformedFrame("data runs past the end of the message")
                payload = view[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise MalformedFrame(f"wire type {wire_type} of field {field}")
        if pos > len(view):
            raise MalformedFrame(f"field {field} runs past the end of the message")
        others.append(view[start:pos])
    return b"".join(others), payload


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(view):
            raise MalformedFrame("truncated varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise MalformedFrame("varint longer than 10 bytes")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
