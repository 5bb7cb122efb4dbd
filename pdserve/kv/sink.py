"""Prefill's side of a KV handoff: a KvSink, opened for one lease, that the engine writes into.

The engine thread hands over each layer's K and V (views, no copy) as soon as it is computed;
the sink cuts them into chunks on the event loop and its transport sends them while later layers
still run. Then prefill commits with the first token, or aborts. Life cycle:
open -> layers... -> commit | abort. `send()` drives the transfer and returns decode's answer to
the commit; it raises KvTransferFailed, in transport-neutral terms, when the transfer fails.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from pdserve.core.config import ModelConfig
from pdserve.core.picked import Pick
from pdserve.faults import Faults
from pdserve.kv.receiver import CommitRecord, Committed
from pdserve.kv.wire import ChunkHeader, LayerPiece, digest, split_layer, split_layer_int8
from pdserve.kv.wire import tokens_per_chunk
from pdserve.kv.wire import prompt_digest


class KvTransferFailed(Exception):
    """The transfer failed. code is a gRPC status name (e.g. INVALID_ARGUMENT, UNAVAILABLE,
    DEADLINE_EXCEEDED), whichever transport carried it, so callers map it once."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class OutChunk:
    """One chunk ready to go: its header and its bytes (views of the layer's tensors)."""

    header: ChunkHeader
    parts: tuple[memoryview | bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)


@dataclass(frozen=True)
class KvTarget:
    """Where one lease's KV goes, and what it must carry."""

    lease_id: str
    request_id: str
    prompt_token_ids: tuple[int, ...]
    config: ModelConfig
    model_fingerprint: str
    chunk_bytes: int
    compression: str = "none"  # or "int8": lossy, pdserve.kv.compression
    skip_tokens: int = 0  # the prompt's first tokens, whose KV decode holds already: not sent


class KvSink:
    """Base of every transport's sink: the chunking, the commit record, the fault hooks."""

    transport = "none"

    def __init__(self, target: KvTarget, faults: Faults) -> None:
        self.target, self._faults = target, faults
        self._loop = asyncio.get_running_loop()
        self._tokens_per_chunk = tokens_per_chunk(target.config, target.chunk_bytes)
        self._queue: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()  # set once anything is queued: a layer, commit or abort
        self._crcs: list[int] = []
        self._split = split_layer_int8 if target.compression == "int8" else split_layer
        self.bytes = 0  # of KV, as the model holds it
        self.wire_bytes = 0  # of payload sent: fewer than bytes when compressed
        self.first_sent_at: float | None = None

    # -- the writer's side
    def on_layer_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """From the engine thread: queue a layer's K and V [tokens, heads, dim] for sending, of
        positions from skip_tokens to the prompt's end."""
        self._loop.call_soon_threadsafe(self._put, (layer, k, v))

    def commit(self, first: Pick) -> None:
        """From the event loop, after every layer: the stream ends with the commit."""
        self._put(first)

    def abort(self) -> None:
        """Ends the stream without a commit: decode voids the lease."""
        self._put(None)

    def _put(self, item: object) -> None:
        self._queue.put_nowait(item)
        self.started.set()

    async def send(self, timeout: float | None) -> Committed:
        """Runs the transfer until decode answers the commit. Implemented by each transport."""
        raise NotImplementedError

    @property
    def num_chunks(self) -> int:
        return len(self._crcs)

    # -- the transport's side
    async def items(self) -> AsyncIterator[OutChunk | CommitRecord]:
        """The chunks in order, then the commit record. Ends early, with neither, on abort."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, Pick):
                yield self._commit_record(item)
                return
            skip = self.target.skip_tokens  # the layer's KV starts at this position
            for piece in self._split(item[1], item[2], self._tokens_per_chunk):
                chunk = self._chunk(item[0], piece, skip)
                if self.first_sent_at is None:
                    self.first_sent_at = time.perf_counter()
                await self._faults.before_chunk(chunk.header.index)
                if self._faults.corrupts(chunk.header.index):
                    chunk = OutChunk(
                        chunk.header, (_flip_first_byte(piece.parts[0]), piece.parts[1])
                    )
                yield chunk

    def _chunk(self, layer: int, piece: LayerPiece, offset: int) -> OutChunk:
        cfg = self.target.config
        header = ChunkHeader(
            index=len(self._crcs),
            layer=layer,
            token_start=offset + piece.token_start,
            token_end=offset + piece.token_end,
            dtype=cfg.dtype,
            shape=(2, piece.token_end - piece.token_start, cfg.kv_heads, cfg.head_dim),
            crc32c=piece.crc32c,
            model_fingerprint=self.target.model_fingerprint,
            lease_id=self.target.lease_id,
            encoding="int8" if self.target.compression == "int8" else "raw",
        )
        self._crcs.append(piece.crc32c)
        self.bytes += header.shape[1] * 2 * cfg.kv_heads * cfg.head_dim * cfg.bytes_per_element
        self.wire_bytes += piece.nbytes
        return OutChunk(header, piece.parts)

    def _commit_record(self, first: Pick) -> CommitRecord:
        return CommitRecord(
            lease_id=self.target.lease_id,
            first_token_id=first.token,
            num_chunks=len(self._crcs),
            digest=digest(self._crcs),
            request_id=self.target.request_id,
            prompt_digest=prompt_digest(self.target.prompt_token_ids),
            first_logprobs=first.logprobs,
        )


def _flip_first_byte(part: memoryview) -> bytes:
    """A damaged copy for the corruption fault; the layer's own tensor is never touched."""
    data = bytearray(part)
    data[0] ^= 0xFF
    return bytes(data)
