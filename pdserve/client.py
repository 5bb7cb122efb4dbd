"""Client commands: `pdserve generate` streams a reply; `pdserve health` checks a service."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.tls import client_channel
from pdserve.services.router.phases import phase_items
from pdserve.settings import env
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

FINISH_NAMES = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
}


def add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="send one prompt to a router and stream the reply",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompt", help="prompt text, tokenized by the server with its model's tokenizer")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user's chat message, rendered with the model's chat "
        "template (the reply is the assistant's turn)",
    )
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument(
        "--address",
        default=env("ADDRESS", "127.0.0.1:50051"),
        help="router (or colocated) address (PDSERVE_ADDRESS)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 is no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    p.set_defaults(func=run_generate)


def request_from_args(args) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if not args.chat:
        return pb.GenerateRequest(prompt=args.prompt, sampling=sampling)
    messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    messages.append(pb.ChatMessage(role="user", content=args.prompt))
    return pb.GenerateRequest(messages=messages, sampling=sampling)


def run_generate(args) -> int:
    with client_channel(args.address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        try:
            for response in stub.Generate(request_from_args(args), timeout=args.timeout):
                sys.stdout.write(printable(response.text))
                sys.stdout.flush()
                if response.finish_reason:
                    _print_summary(response)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def printable(text: str) -> str:
    """The text with control characters shown as escapes, so a random model's bytes cannot
    drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def _print_summary(last: pb.GenerateResponse) -> None:
    m = last.metrics
    print(
        f"\n[{FINISH_NAMES.get(last.finish_reason, '?')}] "
        f"{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} generated tokens; "
        f"TTFT {m.time_to_first_token_seconds * 1e3:.1f} ms, "
        f"total {m.end_to_end_seconds * 1e3:.1f} ms; handoff {m.handoff.bytes / 1024:.0f} KiB "
        f"in {m.handoff.seconds * 1e3:.2f} ms over {m.handoff.transport}; prefill {m.prefill_instance}, "
        f"decode {m.decode_instance}",
        file=sys.stderr,
    )
    if m.HasField("phases"):
        print(f"time to first token: {phase_split(m.phases)}", file=sys.stderr)


def phase_split(phases: pb.RequestPhases) -> str:
    """'routing 0.4 ms, decode_room 1.1 ms, ...': the phases in the order they happen."""
    return ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in phase_items(phases))


def add_health(sub) -> None:
    p = sub.add_parser("health", help="exit 0 if the service at ADDRESS reports SERVING")
    p.add_argument("address", nargs="?", default="127.0.0.1:50051", help="host:port")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument(
        "--server-name",
        help="over TLS, verify the server's certificate as this name (its role: prefill, "
        "decode) instead of the address dialled",
    )
    p.set_defaults(func=run_health)


def check_health(address: str, timeout: float, channel_factory=None) -> bool:
    """SERVING or not; the channel from `channel_factory(address)`, else client_channel."""
    with (channel_factory or client_channel)(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run_health(args) -> int:
    healthy = check_health(
        args.address, args.timeout, lambda address: client_channel(address, args.server_name)
    )
    print("SERVING" if healthy else "NOT SERVING")
    return 0 if healthy else 1
