"""KV transport bandwidth: each transport against raw TCP, on the same machine, in one run.

Moves --mib MiB of KV chunks (default 256) from a sender in this process to a receiver in a child
process, through:

  raw-tcp   sendall / recv_into of the same bytes, in the same chunk sizes: the baseline
  grpc      DecodeService.PushKv (GrpcKvSink -> push_kv_handler -> KvReceiver -> paged pool)
  tcp       the data plane (TcpKvSink -> DataPlaneServer -> KvReceiver -> paged pool)

The KV transports pay everything the services pay: framing, CRC-32C on both ends, every check, and
the write into decode's paged pool. Configurations run interleaved, --repeats times each, at each
chunk size and KV dtype; results report the median and the spread (min-max) of the rate, and the
median of the per-repeat ratio to raw TCP.

  .venv/bin/python bench/transport.py --json bench/results/transport.json
"""

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import platform
import socket
import statistics
import time

import grpc
import torch

from pdserve.loadtest.report import cpu_conditions
from pdserve.core.block_pool import BlockPool
from pdserve.core.config import ModelConfig
from pdserve.engine.paged_cache import TORCH_DTYPES, PagedCache
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.faults import Faults
from pdserve.kv.grpc_transport import GrpcKvSink, serve_push_kv_only
from pdserve.kv.leases import LeaseLimits, LeaseTable
from pdserve.kv.receiver import KvReceiver
from pdserve.kv.sink import KvTarget
from pdserve.kv.tcp_transport import DataPlaneLimits, DataPlaneServer, TcpKvSink

FINGERPRINT = "bench"
TOKENS = 4096  # per lease: one lease carries 4,096 tokens of every layer
BLOCK = 16


def model_config(dtype: str) -> ModelConfig:
    # Llama-3.1-8B's KV shape per layer (8 KV heads of 128): the rate a GPU prefill produces.
    return ModelConfig(
        n_layers=4,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=1000,
        max_context=TOKENS + 8,
        dtype=dtype,
    )


# ------------------------------------------------------------------------------ receivers


def _decode_side(config: ModelConfig):
    blocks = (TOKENS + 8) // BLOCK + 1
    pool = BlockPool(blocks, BLOCK)
    cache = PagedCache(config, blocks, BLOCK)
    leases = LeaseTable(pool, config)
    receiver = KvReceiver(
        leases, cache.write, config, FINGERPRINT, lambda lease, t: lease.table.release(), Faults()
    )
    return leases, receiver


def _receiver_main(kind: str, dtype: str, ports, leases_q, ready) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve(kind, dtype, ports, leases_q, ready))


async def _serve(kind, dtype, ports, leases_q, ready) -> None:
    leases, receiver = _decode_side(model_config(dtype))
    if kind == "grpc":
        _server, port = await serve_push_kv_only(receiver)
    else:
        plane = DataPlaneServer(receiver, DataPlaneLimits(stream_seconds=60))
        port = await plane.start("127.0.0.1", 0)
    ports.put(port)
    ready.set()
    loop = asyncio.get_running_loop()
    while True:  # grants a lease per request of the sender; None ends
        request = await loop.run_in_executor(None, leases_q[0].get)
        if request is None:
            return
        spec = GenerateSpec("b", tuple(range(TOKENS)), SamplingSpec(max_tokens=4))
        lease = leases.grant(spec, LeaseLimits(60, 60, 1.0), lambda e: None)
        leases_q[1].put(lease.lease_id)


def _raw_receiver(port_q, total: int, chunk: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    buffer = memoryview(bytearray(chunk))
    while True:
        got = 0
        while got < total:
            n = conn.recv_into(buffer[: min(chunk, total - got)])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


# ------------------------------------------------------------------------------ senders


def _raw_send(port: int, total: int, chunk: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(chunk))
    start = time.perf_counter()
    sent = 0
    while sent < total:
        sock.sendall(payload[: min(chunk, total - sent)])
        sent += chunk
    sock.recv(1)
    elapsed = time.perf_counter() - start
    sock.close()
    return elapsed


async def _kv_send(kind, port, leases_q, config, total, chunk) -> float:
    layer_shape = (TOKENS, config.kv_heads, config.head_dim)
    dtype = TORCH_DTYPES[config.dtype]
    kv = [
        (layer, torch.randn(layer_shape).to(dtype), torch.randn(layer_shape).to(dtype))
        for layer in range(config.n_layers)
    ]
    per_lease = config.kv_bytes_per_token * TOKENS
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]
    )
    elapsed = 0.0
    for _ in range(max(1, total // per_lease)):
        leases_q[0].put("lease")
        lease_id = leases_q[1].get()
        target = KvTarget(lease_id, "b", tuple(range(TOKENS)), config, FINGERPRINT, chunk)
        start = time.perf_counter()
        if kind == "grpc":
            sink = GrpcKvSink(target, Faults(), channel)
        else:
            sink = TcpKvSink(target, Faults(), "127.0.0.1", port)
            await sink.connect(5)
        for layer, k, v in kv:
            sink.on_layer_kv(layer, k, v)
        await asyncio.sleep(0)  # the layers reach the queue (call_soon_threadsafe) first
        sink.commit(1)
        await sink.send(60)
        elapsed += time.perf_counter() - start
    await channel.close()
    return elapsed


def measure(kind: str, dtype: str, total: int, chunk: int) -> float:
    """GB/s of one configuration (one repeat), receiver in a fresh child process."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    if kind == "raw-tcp":
        child = ctx.Process(target=_raw_receiver, args=(ports, total, chunk))
        child.start()
        seconds = _raw_send(ports.get(timeout=30), total, chunk)
        moved = total
    else:
        leases_q, ready = (ctx.Queue(), ctx.Queue()), ctx.Event()
        child = ctx.Process(target=_receiver_main, args=(kind, dtype, ports, leases_q, ready))
        child.start()
        ready.wait(60)
        config = model_config(dtype)
        seconds = asyncio.run(_kv_send(kind, ports.get(timeout=30), leases_q, config, total, chunk))
        moved = max(1, total // (config.kv_bytes_per_token * TOKENS)) * (
            config.kv_bytes_per_token * TOKENS
        )
        leases_q[0].put(None)
    child.join(30)
    if child.is_alive():
        child.kill()
    return moved / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per configuration")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks-mib", default="1,4", help="chunk sizes, MiB")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    total = args.mib << 20
    kinds = ("raw-tcp", "grpc", "tcp")
    rows = []
    for chunk_mib in (int(c) for c in args.chunks_mib.split(",")):
        for dtype in args.dtypes.split(","):
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.repeats):  # interleaved: every kind once per round
                for kind in kinds:
                    rates[kind].append(measure(kind, dtype, total, chunk_mib << 20))
            for kind in kinds[1:]:
                ratios = [r / b for r, b in zip(rates[kind], rates["raw-tcp"])]
                rows.append(_row(kind, dtype, chunk_mib, rates[kind], rates["raw-tcp"], ratios))
                print(_line(rows[-1]), flush=True)
    result = {"conditions": _conditions(args), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _row(kind, dtype, chunk_mib, rates, base, ratios) -> dict:
    return {
        "transport": kind,
        "dtype": dtype,
        "chunk_mib": chunk_mib,
        "gb_per_s": [round(r, 3) for r in rates],
        "raw_tcp_gb_per_s": [round(r, 3) for r in base],
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


def _line(row) -> str:
    return (
        f"{row['transport']:5s} {row['dtype']:9s} {row['chunk_mib']} MiB chunks: "
        f"{statistics.median(row['gb_per_s']):.2f} GB/s vs raw TCP "
        f"{statistics.median(row['raw_tcp_gb_per_s']):.2f} GB/s -> "
        f"{row['ratio_median']:.2f}x (spread {row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
    )


def _conditions(args) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_conditions(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "mib_per_configuration": args.mib,
        "repeats": args.repeats,
        "kv_shape": "4 layers x 8 KV heads x 128 per token (Llama-3.1-8B's layer shape)",
        "receiver": "a child process; the KV transports write into a paged pool",
    }


if __name__ == "__main__":
    main()
