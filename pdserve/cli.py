"""The `pdserve` command: run a service, the whole stack, a client, or a tool.

  pdserve serve router|prefill|decode|colocated   one service (flags below, or PDSERVE_* variables)
  pdserve up                                      prefill, decode and router as local processes
  pdserve generate "text"                         stream one reply to the terminal
  pdserve health ADDRESS                          exit 0 when a service reports SERVING
  pdserve bench --preset chapter                  load test: latency percentiles, goodput, handoff
  pdserve handoff-table                           what one request's KV cache costs to move
"""

import argparse
import asyncio
import logging
import sys

from pdserve import settings as cfg
from pdserve.faults import Faults
from pdserve.settings import env

DEFAULT_PORTS = {"router": 50051, "prefill": 50052, "decode": 50053, "colocated": 50051}


FAULTS_EPILOG = ("For tests only, PDSERVE_FAULTS (e.g. corrupt_chunk=2) makes the service fail at a "
                 "chosen point; see pdserve/faults.py. It is off unless set.")


def _common_flags(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=env("HOST", "0.0.0.0"), help="address to listen on "
                   "(PDSERVE_HOST; default %(default)s)")
    g.add_argument("--port", type=int, default=env("PORT", DEFAULT_PORTS[role]),
                   help="gRPC port, 0 picks a free one (PDSERVE_PORT; default %(default)s)")
    g.add_argument("--metrics-port", type=int, default=env("METRICS_PORT", 0),
                   help="Prometheus /metrics HTTP port, 0 for none (PDSERVE_METRICS_PORT)")
    g.add_argument("--instance", default=env("INSTANCE", ""),
                   help="name in logs and responses (PDSERVE_INSTANCE; default role@host:port)")
    g.add_argument("--grace-seconds", type=float, default=env("GRACE_SECONDS", 10.0),
                   help="on SIGTERM, how long in-flight requests may take to finish "
                   "(PDSERVE_GRACE_SECONDS; default %(default)s)")
    g.add_argument("--torch-threads", type=int, default=env("TORCH_THREADS", 0),
                   help="threads for torch, 0 for torch's default (PDSERVE_TORCH_THREADS)")
    g.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (PDSERVE_LOG_LEVEL; default %(default)s)")


def _decode_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decode pool")
    g.add_argument("--num-blocks", type=int, default=env("NUM_BLOCKS", 2048),
                   help="KV blocks in the pool (PDSERVE_NUM_BLOCKS; default %(default)s)")
    g.add_argument("--block-size", type=int, default=env("BLOCK_SIZE", 16),
                   help="tokens per KV block (PDSERVE_BLOCK_SIZE; default %(default)s)")
    g.add_argument("--max-decode-batch", type=int, default=env("MAX_DECODE_BATCH", 64),
                   help="sequences decoded together per step (PDSERVE_MAX_DECODE_BATCH; "
                   "default %(default)s)")
    g.add_argument("--lease-ttl-seconds", type=float, default=env("LEASE_TTL_SECONDS", 30.0),
                   help="an uncommitted reservation expires after this long "
                   "(PDSERVE_LEASE_TTL_SECONDS; default %(default)s)")


def _prefill_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill batching")
    g.add_argument("--max-prefill-batch", type=int, default=env("MAX_PREFILL_BATCH", 8),
                   help="prompts per prefill batch (PDSERVE_MAX_PREFILL_BATCH; default %(default)s)")
    g.add_argument("--max-prefill-tokens", type=int, default=env("MAX_PREFILL_TOKENS", 4096),
                   help="prompt tokens per prefill batch (PDSERVE_MAX_PREFILL_TOKENS; "
                   "default %(default)s)")
    g.add_argument("--chunk-bytes", type=int, default=env("CHUNK_BYTES", 1 << 20),
                   help="largest KV chunk sent to decode (PDSERVE_CHUNK_BYTES; default %(default)s)")


def _router_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--prefill", nargs="+", default=env("PREFILL", ["127.0.0.1:50052"]),
                   help="prefill instances, host:port; a host with several addresses counts as "
                   "several instances (PDSERVE_PREFILL, comma-separated; default %(default)s)")
    g.add_argument("--decode", nargs="+", default=env("DECODE", ["127.0.0.1:50053"]),
                   help="decode instances, host:port (PDSERVE_DECODE; default %(default)s)")
    g.add_argument("--max-queue", type=int, default=env("MAX_QUEUE", 256),
                   help="requests that may wait for decode room; more get RESOURCE_EXHAUSTED "
                   "(PDSERVE_MAX_QUEUE; default %(default)s)")
    g.add_argument("--queue-timeout-seconds", type=float, default=env("QUEUE_TIMEOUT_SECONDS", 30.0),
                   help="longest wait for decode room (PDSERVE_QUEUE_TIMEOUT_SECONDS; "
                   "default %(default)s)")
    g.add_argument("--max-attempts", type=int, default=env("MAX_ATTEMPTS", 3),
                   help="handoff attempts per request; a request is retried on another instance "
                   "only while no token has reached the client (PDSERVE_MAX_ATTEMPTS)")
    g.add_argument("--request-timeout-seconds", type=float,
                   default=env("REQUEST_TIMEOUT_SECONDS", 600.0),
                   help="deadline of a request whose client set none; a client's own deadline "
                   "is kept when shorter (PDSERVE_REQUEST_TIMEOUT_SECONDS; default %(default)s)")


def _common(a) -> cfg.CommonSettings:
    return cfg.CommonSettings(a.host, a.port, a.metrics_port, a.instance, a.grace_seconds,
                              a.torch_threads, Faults.parse(env("FAULTS", "")))


def _decode(a) -> cfg.DecodeSettings:
    return cfg.DecodeSettings(_common(a), a.num_blocks, a.block_size, a.max_decode_batch,
                              a.lease_ttl_seconds)


def _prefill(a) -> cfg.PrefillSettings:
    return cfg.PrefillSettings(_common(a), a.max_prefill_batch, a.max_prefill_tokens,
                               a.chunk_bytes)


def _serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.core.config import ModelConfig
    config = ModelConfig()
    if args.role == "router":  # never imports torch
        from services.router.server import serve
        asyncio.run(serve(config, cfg.RouterSettings(_common(args), args.prefill, args.decode,
                                                     args.max_queue, args.queue_timeout_seconds,
                                                     args.max_attempts,
                                                     args.request_timeout_seconds)))
        return 0
    import torch
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.role == "prefill":
        from services.prefill.server import serve
        asyncio.run(serve(config, _prefill(args)))
    elif args.role == "decode":
        from services.decode.server import serve
        asyncio.run(serve(config, _decode(args)))
    else:
        from services.colocated.server import serve
        asyncio.run(serve(config, cfg.ColocatedSettings(_common(args), _decode(args),
                                                        _prefill(args))))
    return 0


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    helps = {"router": "the public entry: validates, reserves decode room, relays tokens",
             "prefill": "batched prefill that pushes each request's KV cache to decode",
             "decode": "the paged KV pool and the continuous-batching decode loop",
             "colocated": "prefill and decode in one process and one loop (the baseline)"}
    for role, text in helps.items():
        p = roles.add_parser(role, help=text, description=text, epilog=FAULTS_EPILOG,
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        _common_flags(p, role)
        if role in ("decode", "colocated"):
            _decode_flags(p)
        if role in ("prefill", "colocated"):
            _prefill_flags(p)
        if role == "router":
            _router_flags(p)
        p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    from pdserve.bench.cli import add_bench
    from pdserve.client import add_generate, add_health
    from pdserve.launcher import add_up
    from pdserve.tools import handoff_table
    add_up(sub)
    add_generate(sub)
    add_health(sub)
    add_bench(sub)
    table = sub.add_parser("handoff-table", help="what one request's KV cache costs to move")
    handoff_table.add_arguments(table)
    table.set_defaults(func=handoff_table.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # a setting out of range
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
