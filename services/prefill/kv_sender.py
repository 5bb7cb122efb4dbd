"""Streams one request's KV cache to decode as its layers come out of the prefill engine.

The engine thread hands over each layer's K and V (views, no copy) as soon as it is computed; the
event loop cuts them into chunks and sends them while later layers are still running, then sends
the commit. Life cycle: open -> layers... -> commit | fail.
"""

import asyncio
import time

import torch

from pdserve.core.kv_wire import crc32, digest, encode_layer, prompt_digest, tokens_per_chunk
from pdserve.core.request import GenerateSpec
from pdserve.faults import Faults
from pdserve.models.loading import ServedModel
from pdserve.v1 import pdserve_pb2 as pb

DTYPE_TO_PB = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
}


class KvSender:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        lease_id: str,
        spec: GenerateSpec,
        served: ServedModel,
        chunk_bytes: int,
        faults: Faults,
    ) -> None:
        self._loop, self.lease_id, self._spec = loop, lease_id, spec
        self._config, self._fingerprint = served.config, served.fingerprint
        self._faults = faults
        self._tokens_per_chunk = tokens_per_chunk(self._config, chunk_bytes)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._crcs: list[int] = []
        self.bytes = 0
        self.first_sent_at: float | None = None

    def on_layer_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """From the engine thread: queue a layer for sending."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (layer, k, v))

    def commit(self, first_token: int) -> None:
        """From the event loop, after every layer: the stream ends with the commit."""
        self._queue.put_nowait(first_token)

    @property
    def num_chunks(self) -> int:
        return len(self._crcs)

    async def pushes(self):
        """The request stream of Decode.PushKv."""
        while True:
            item = await self._queue.get()
            if isinstance(item, int):
                yield pb.KvPush(
                    commit=pb.KvCommit(
                        lease_id=self.lease_id,
                        first_token_id=item,
                        num_chunks=len(self._crcs),
                        digest=digest(self._crcs),
                        request_id=self._spec.request_id,
                        prompt_digest=prompt_digest(self._spec.prompt_token_ids),
                    )
                )
                return
            for chunk in self._chunks(*item):
                if self.first_sent_at is None:
                    self.first_sent_at = time.perf_counter()
                await self._faults.before_chunk(chunk)
                yield pb.KvPush(chunk=chunk)

    def _chunks(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        for start, end, payload in encode_layer(k, v, self._tokens_per_chunk):
            crc = crc32(payload)
            chunk = pb.KvChunk(
                lease_id=self.lease_id,
                index=len(self._crcs),
                layer=layer,
                token_start=start,
                token_end=end,
                dtype=DTYPE_TO_PB[self._config.dtype],
                shape=[2, end - start, self._config.kv_heads, self._config.head_dim],
                data=payload,
                crc32=crc,
                model_fingerprint=self._fingerprint,
            )
            self._crcs.append(crc)
            self.bytes += len(payload)
            yield chunk
