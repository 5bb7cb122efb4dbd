"""How many times the KV path copies each byte, and what each copy costs, in one process.

Follows one request's KV (default 1024 tokens, 12 MiB) through every stage between prefill's
layer output and decode's paged cache, except the socket itself, and times each stage against a
plain memcpy of the same bytes (the baseline, measured in the same run).

  .venv/bin/python bench/kv_copies.py --tokens 1024 --json bench/results/kv_copies.json
"""

import argparse
import datetime
import json
import platform
import time

import numpy as np
import torch

from pdserve.core import kv_wire
from pdserve.core.block_pool import BlockPool
from pdserve.core.config import ModelConfig
from pdserve.core.paged_cache import PagedCache
from pdserve.v1 import pdserve_pb2 as pb

# stage name -> whether it makes a full copy of the payload
STAGES = {
    "stack K and V into one tensor": True,
    "tensor -> bytes": True,
    "bytes -> protobuf field": True,
    "serialize (grpc send)": True,
    "parse (grpc receive)": True,
    "read the data field": True,
    "checks + CRC + frombuffer view": False,
    "write into the paged cache": True,
}


def run(tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)  # as the services run under `pdserve up` and in the tests
    config = ModelConfig()
    per = kv_wire.tokens_per_chunk(config, kv_wire.DEFAULT_CHUNK_BYTES)
    qkv = torch.randn(tokens, 3 * config.d_model)  # a layer's projection output, as in prefill
    k = qkv[:, config.d_model : 2 * config.d_model].reshape(tokens, config.n_heads, config.head_dim)
    v = qkv[:, 2 * config.d_model :].reshape(tokens, config.n_heads, config.head_dim)
    pool = BlockPool(tokens // 16 + 1, 16)
    table = pool.reserve(tokens)
    table.ensure(tokens)
    cache = PagedCache(config, tokens // 16 + 1, 16)
    timings = {name: [] for name in STAGES}
    nbytes = 2 * k.numel() * 4
    src, dst = np.random.rand(nbytes // 8), np.empty(nbytes // 8)
    memcpy = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t)
        for start in range(0, tokens, per):
            end = min(start + per, tokens)
            _one_chunk(k, v, start, end, config, table, cache, timings)
    stage_s = {name: min(_sums(times, repeats)) for name, times in timings.items()}
    return {
        "bytes": nbytes,
        "chunk_tokens": per,
        "memcpy_s": min(memcpy),
        "stages": {
            name: {
                "seconds": s,
                "copies": STAGES[name],
                "gb_per_s": nbytes / s / 1e9 if s else None,
            }
            for name, s in stage_s.items()
        },
        "full_copies": sum(STAGES.values()),
        "end_to_end_gb_per_s": nbytes / sum(stage_s.values()) / 1e9,
        "conditions": {
            "tokens": tokens,
            "kv_bytes_per_token": config.kv_bytes_per_token,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "repeats": repeats,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    }


def _one_chunk(k, v, start, end, config, table, cache, timings) -> None:
    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        timings[name].append(time.perf_counter() - t)
        return out

    both = timed("stack K and V into one tensor", lambda: torch.stack((k[start:end], v[start:end])))
    payload = timed("tensor -> bytes", lambda: both.numpy().tobytes())
    chunk = timed("bytes -> protobuf field", lambda: pb.KvPush(chunk=pb.KvChunk(data=payload)))
    wire = timed("serialize (grpc send)", chunk.SerializeToString)
    parsed = timed("parse (grpc receive)", lambda: pb.KvPush.FromString(wire))
    data = timed("read the data field", lambda: parsed.chunk.data)
    header = kv_wire.ChunkHeader(
        0,
        0,
        start,
        end,
        "float32",
        (2, end - start, config.n_heads, config.head_dim),
        kv_wire.crc32(data),
    )
    k2, v2 = timed(
        "checks + CRC + frombuffer view", lambda: kv_wire.decode_chunk(header, data, config, end)
    )
    timed("write into the paged cache", lambda: cache.write(0, table.slots(start, end), k2, v2))


def _sums(times: list[float], repeats: int) -> list[float]:
    per_repeat = len(times) // repeats
    return [sum(times[i * per_repeat : (i + 1) * per_repeat]) for i in range(repeats)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    result = run(args.tokens, args.repeats)
    print(
        f"{result['bytes'] / 2**20:.1f} MiB (one layer of {args.tokens} tokens); memcpy baseline "
        f"{result['bytes'] / result['memcpy_s'] / 1e9:.1f} GB/s"
    )
    for name, s in result["stages"].items():
        rate = f"{s['gb_per_s']:6.2f} GB/s" if s["gb_per_s"] else ""
        print(
            f"  {'copy' if s['copies'] else '    '}  {name:32} {s['seconds'] * 1e3:7.2f} ms {rate}"
        )
    print(
        f"{result['full_copies']} full copies; end to end {result['end_to_end_gb_per_s']:.2f} GB/s "
        f"({result['end_to_end_gb_per_s'] * 1e9 * result['memcpy_s'] / result['bytes']:.2f}x memcpy)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
