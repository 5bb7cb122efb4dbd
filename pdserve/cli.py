"""The `pdserve` command: run a service, the whole stack, a client, or a tool.

pdserve serve router|prefill|decode|colocated   one service (flags below, or PDSERVE_* variables)
pdserve up                                      prefill, decode and router as local processes
pdserve generate "text"                         stream one reply to the terminal
pdserve chat                                    a conversation in the terminal
pdserve health ADDRESS                          exit 0 when a service reports SERVING
pdserve bench --preset chapter                  load test: latency percentiles, goodput, handoff
pdserve handoff-table                           what one request's KV cache costs to move
pdserve certs DIR                               a development CA and a certificate per role
"""

import argparse
import asyncio
import importlib
import logging
import os
import sys

from pdserve import settings as cfg
from pdserve import tracing

FAULTS_EPILOG = (
    "For tests only, PDSERVE_FAULTS (e.g. corrupt_chunk=2) makes the service fail at a "
    "chosen point; see pdserve/faults.py. It is off unless set."
)

ROLE_HELP = {
    "router": "the public entry: validates, reserves decode room, relays tokens",
    "prefill": "batched prefill that pushes each request's KV cache to decode",
    "decode": "the paged KV pool and the continuous-batching decode loop",
    "colocated": "prefill and decode in one process and one loop (the baseline)",
}


def _serve(args) -> int:
    settings = cfg.settings_from_args(args.role, args)  # invalid settings fail before any loading
    common = settings.common
    logging.basicConfig(
        level=common.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _pin(cfg.parse_cpu_list(common.cpus))
    if args.role != "router":  # the router never imports torch
        from pdserve.engine import torch_threads

        # Threads follow the CPUs the service may use: more would only contend for them. They
        # go to the engine's thread alone (pdserve/engine/torch_threads.py says why).
        threads = common.torch_threads or len(os.sched_getaffinity(0))
        torch_threads.reserve_for_engine(threads)
        logging.getLogger("pdserve").info(
            "torch threads: %d for the engine, on CPUs %s; loading and the event loop use one",
            threads,
            sorted(os.sched_getaffinity(0)),
        )
    from pdserve.models.loading import load_served_model

    # The router only tokenizes and checks model identity, so it needs no weights.
    holds_weights = args.role != "router"
    model = load_served_model(
        common.model,
        common.dtype,
        weights=holds_weights,
        weight_format=common.weights,
        numerics=common.numerics,
        q4_kernel=common.q4_kernel,
        step_ops=common.step_ops,
    )
    # Every role that holds the weights warms up. Decode too: where a pass of 8 rows or more
    # goes wide (bf16 dot products), its first such step would otherwise build every layer's
    # bf16 copy while its streams wait (about 2 s on an AVX-512 EPYC), and any load of 8 streams
    # builds them anyway.
    if holds_weights:
        from pdserve.engine.model_runner import WARM_UP_TOKENS, warm_up

        seconds = warm_up(model.built)
        logging.getLogger("pdserve").info(
            "warmed up: a %d-token prompt in %.2f s, before the first request",
            WARM_UP_TOKENS,
            seconds,
        )
    service = importlib.import_module(f"pdserve.services.{args.role}.server")
    tracing.configure(common.otlp_endpoint, args.role)
    try:
        asyncio.run(service.serve(model, settings))
    finally:
        tracing.shutdown()
    return 0


def _pin(cpus: set[int]) -> None:
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ValueError(
            f"--cpus {sorted(cpus)}: cannot run there ({exc.strerror}); this "
            f"process may use CPUs {sorted(os.sched_getaffinity(0))}"
        ) from None


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role, text in ROLE_HELP.items():
        # Each flag's help already names its variable and the default in force.
        p = roles.add_parser(role, help=text, description=text, epilog=FAULTS_EPILOG)
        cfg.add_role_flags(p, role)
        p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    from pdserve.loadtest.cli import add_bench
    from pdserve.chat import add_chat
    from pdserve.client import add_generate, add_health
    from pdserve.launcher import add_up
    from pdserve.tools import handoff_table

    add_up(sub)
    add_generate(sub)
    add_chat(sub)
    add_health(sub)
    add_bench(sub)
    table = sub.add_parser("handoff-table", help="what one request's KV cache costs to move")
    handoff_table.add_arguments(table)
    table.set_defaults(func=handoff_table.run)
    certs = sub.add_parser(
        "certs",
        help="write a development CA and one certificate per role (router, prefill, decode, "
        "client) for mutual TLS; docs/security.md",
    )
    certs.add_argument("directory", help="where to write ca.pem, <role>.pem and <role>-key.pem")
    certs.add_argument(
        "--readable-keys",
        action="store_true",
        help="keys readable by every user (0644) and DIRECTORY owner-only (0700): for containers "
        "that run as another user and mount only their role's files",
    )
    certs.add_argument(
        "--ca-key",
        metavar="FILE",
        help="keep the development CA's key in FILE (owner-only; not inside DIRECTORY), to sign "
        "more certificates later; by default it is discarded once the certificates are signed",
    )
    certs.set_defaults(func=_run_certs)
    return parser


def _run_certs(args) -> int:
    from pdserve.certs import make_dev_certs

    try:
        out = make_dev_certs(args.directory, readable_keys=args.readable_keys, ca_key=args.ca_key)
    except ValueError as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a development CA and certificates for router, prefill, decode, client to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:  # a setting out of range, a model that cannot be read
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
