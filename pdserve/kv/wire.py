"""The KV cache on the wire: how a prompt's KV is cut into chunks and checked when it arrives.

A chunk carries one layer's K and V for a token range, as raw little-endian bytes of shape
[2, tokens, kv_heads, head_dim] (K then V), with a CRC-32C. Nothing here unpickles anything: bytes
become a tensor only through torch.frombuffer with a dtype and shape that the receiver checks
against its own model config first.

The sender never copies: a chunk is two byte views, of K's and V's rows in the layer's own
tensors, and the transport writes them out as they are.
"""

import warnings
import zlib

import crc32c as _crc32c
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdserve.core.config import ModelConfig
from pdserve.kv import compression
from pdserve.engine.paged_cache import TORCH_DTYPES

# 1 MiB: gRPC streams moved these ~5x faster than 64 KiB pieces (2-vCPU VM, grpcio 1.85).
DEFAULT_CHUNK_BYTES = 1 << 20


ENCODINGS = ("raw", "int8")


class KvRejected(ValueError):
    """A chunk or commit that does not fit the lease, the model or the stream so far."""


@dataclass(frozen=True)
class ChunkHeader:
    index: int
    layer: int
    token_start: int
    token_end: int
    dtype: str
    shape: tuple[int, ...]
    crc32c: int
    model_fingerprint: str = ""
    lease_id: str = ""
    encoding: str = "raw"  # or "int8": pdserve.kv.compression


def tokens_per_chunk(config: ModelConfig, max_chunk_bytes: int) -> int:
    per_token = 2 * config.kv_heads * config.head_dim * config.bytes_per_element
    return max(1, max_chunk_bytes // per_token)


@dataclass(frozen=True)
class LayerPiece:
    """A token range of one layer's K and V: byte views of the layer's tensors, not copies."""

    token_start: int
    token_end: int
    parts: tuple[memoryview, memoryview]  # K's bytes, then V's
    crc32c: int

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def payload(self) -> bytes:
        """The chunk as one bytes object: a copy, for transports that need one buffer."""
        return b"".join(self.parts)


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (a uint8 view: numpy has no bfloat16)."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


def split_layer(k: torch.Tensor, v: torch.Tensor, tokens_per: int) -> Iterator[LayerPiece]:
    """Pieces of one layer's K and V [tokens, heads, dim], at most tokens_per tokens each.

    Lazily: each piece's CRC is computed as the transport asks for it, so the bytes of the
    previous piece are still on their way while it runs, and the receiver is not left idle
    while a whole layer is checksummed (measured: a third of the receiver's time, when it was)."""
    # Rows of a contiguous tensor are contiguous: .contiguous() copies only a strided layer once.
    k_bytes, v_bytes = byte_view(k), byte_view(v)
    row = k_bytes.nbytes // max(1, k.shape[0])
    for start in range(0, k.shape[0], tokens_per):
        end = min(start + tokens_per, k.shape[0])
        parts = (k_bytes[start * row : end * row], v_bytes[start * row : end * row])
        yield LayerPiece(start, end, parts, crc32c(*parts))


def split_layer_int8(k: torch.Tensor, v: torch.Tensor, tokens_per: int) -> Iterator[LayerPiece]:
    """As split_layer, with each piece compressed to int8 (pdserve.kv.compression)."""
    for start in range(0, k.shape[0], tokens_per):
        end = min(start + tokens_per, k.shape[0])
        scales, values = compression.quantize(torch.stack((k[start:end], v[start:end])))
        parts = (byte_view(scales), byte_view(values))
        yield LayerPiece(start, end, parts, crc32c(*parts))


def crc32c(*parts) -> int:
    """CRC-32C of the parts' concatenation, computed without joining them.

    CRC-32C rather than zlib's CRC-32, because CPUs compute it in hardware (SSE 4.2, ARMv8): on
    this project's 2-vCPU test machine 26 GB/s against zlib's 3.9 GB/s for 4 MiB, which made the
    checksum as costly as the socket on both ends of the data plane."""
    crc = 0
    for part in parts:
        crc = _crc32c.crc32c(part, crc)
    return crc


def digest(chunk_crcs: list[int]) -> int:
    """The commit's digest: CRC-32 over every chunk's CRC-32C, in stream order."""
    return zlib.crc32(b"".join(c.to_bytes(4, "little") for c in chunk_crcs))


def prompt_digest(token_ids) -> int:
    """Binds a commit to one prompt: CRC-32 of the token ids as int32 little-endian."""
    return zlib.crc32(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))


def decode_chunk(
    header: ChunkHeader,
    payload,
    config: ModelConfig,
    prompt_len: int,
    model_fingerprint: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks a chunk against the model (and its fingerprint, when given) and the prompt; returns
    K, V views of the payload (any buffer: bytes, bytearray, memoryview), not copies."""
    if model_fingerprint and header.model_fingerprint != model_fingerprint:
        raise KvRejected(
            f"chunk computed by model {header.model_fingerprint or '(unnamed)'}, but "
            f"this decode serves model {model_fingerprint}"
        )
    if header.dtype != config.dtype:
        raise KvRejected(f"chunk dtype {header.dtype} but the model's KV is {config.dtype}")
    if not 0 <= header.layer < config.n_layers:
        raise KvRejected(f"layer {header.layer} outside [0, {config.n_layers})")
    if not 0 <= header.token_start < header.token_end <= prompt_len:
        raise KvRejected(
            f"token range [{header.token_start}, {header.token_end}) outside the "
            f"prompt's {prompt_len} tokens"
        )
    n = header.token_end - header.token_start
    expected = (2, n, config.kv_heads, config.head_dim)
    if tuple(header.shape) != expected:
        raise KvRejected(f"chunk shape {list(header.shape)}, expected {list(expected)}")
    if header.encoding not in ENCODINGS:
        raise KvRejected(f"chunk encoding {header.encoding!r} unknown")
    raw_size = n * 2 * config.kv_heads * config.head_dim * config.bytes_per_element
    int8_size = compression.int8_payload_bytes(n, config.kv_heads, config.head_dim)
    size = raw_size if header.encoding == "raw" else int8_size
    if memoryview(payload).nbytes != size:
        raise KvRejected(
            f"chunk has {memoryview(payload).nbytes} bytes; {header.encoding} KV of its shape "
            f"takes {size}"
        )
    if crc32c(payload) != header.crc32c:
        raise KvRejected(f"chunk {header.index} fails its CRC-32C check")
    with warnings.catch_warnings():  # a read-only payload is fine: it is only ever read
        warnings.simplefilter("ignore", UserWarning)
        if header.encoding == "int8":
            both = compression.decode_int8(payload, expected, TORCH_DTYPES[config.dtype])
        else:
            both = torch.frombuffer(payload, dtype=TORCH_DTYPES[config.dtype]).view(expected)
    # NaN or inf would poison every later token of the sequence.
    if not all_finite(both):
        raise KvRejected(f"chunk {header.index} holds non-finite values (NaN or infinity)")
    return both[0], both[1]


def all_finite(t: torch.Tensor) -> bool:
    """Whether no element is NaN or infinite, in one pass that allocates nothing.

    The smallest and largest elements are both finite exactly when every element is, because
    torch's min and max propagate NaN. isfinite(t).all() gives the same answer, but it builds a
    mask first: 1.4 GB/s against 31 GB/s for float32 on one core (0.7 against 14 for bfloat16),
    and it was a third of the data plane receiver's time."""
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


class KvAssembly:
    """Tracks one lease's incoming stream: chunks in order, each layer's tokens contiguous."""

    def __init__(self, config: ModelConfig, prompt_len: int, cached_tokens: int = 0) -> None:
        """`cached_tokens`: the prompt's first tokens are in the decode's prefix cache, so every
        layer's KV starts after them."""
        self.config, self.prompt_len = config, prompt_len
        self._next_token = [cached_tokens] * config.n_layers
        self._crcs: list[int] = []
        self.bytes = 0

    def check(self, header: ChunkHeader) -> None:
        if header.index != len(self._crcs):
            raise KvRejected(f"chunk {header.index} arrived, expected chunk {len(self._crcs)}")
        if 0 <= header.layer < self.config.n_layers:
            expected = self._next_token[header.layer]
            if header.token_start != expected:
                raise KvRejected(
                    f"layer {header.layer} chunk starts at token {header.token_start},"
                    f" expected {expected}"
                )

    def accepted(self, header: ChunkHeader, payload_len: int) -> None:
        self._next_token[header.layer] = header.token_end
        self._crcs.append(header.crc32c)
        self.bytes += payload_len

    def check_commit(self, num_chunks: int, commit_digest: int) -> None:
        if num_chunks != len(self._crcs):
            raise KvRejected(f"commit says {num_chunks} chunks, {len(self._crcs)} arrived")
        missing = [i for i, n in enumerate(self._next_token) if n != self.prompt_len]
        if missing:
            raise KvRejected(f"commit before layer {missing[0]} has all {self.prompt_len} tokens")
        if commit_digest != digest(self._crcs):
            raise KvRejected("commit digest does not match the chunks received")
