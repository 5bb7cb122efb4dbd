"""`pdserve chat`: a conversation in the terminal with a running router (or colocated engine).

Each turn sends the whole conversation over gRPC as chat messages, which the server renders with
the model's chat template, and prints the reply as its tokens arrive. Ctrl-C stops the reply
being written (what was shown stays in the conversation, and the call is cancelled, so the server
frees its blocks); Ctrl-C at the prompt clears the line; Ctrl-D (end of input) exits.
"""

import signal
import sys

import grpc

from pdserve.rpc.tls import client_channel
from pdserve.client import printable
from pdserve.settings import env
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

PROMPT = "you> "


def add_chat(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="talk with the model in the terminal (Ctrl-C stops a reply, Ctrl-D exits)",
        description=__doc__,
    )
    p.add_argument(
        "--address",
        default=env("ADDRESS", "127.0.0.1:50051"),
        help="router (or colocated) gRPC address (PDSERVE_ADDRESS; default %(default)s)",
    )
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="per reply (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always write --max-tokens tokens")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of one reply, seconds")
    p.set_defaults(func=run_chat)


def run_chat(args) -> int:
    # Ctrl-C stops a reply (KeyboardInterrupt), even when started with SIGINT ignored, as a
    # shell's background job (`cmd &` in a script) starts it: Python then raises none.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with client_channel(args.address) as channel:
        converse(pb_grpc.RouterServiceStub(channel), args)
    return 0


def converse(stub: pb_grpc.RouterServiceStub, args) -> list[pb.ChatMessage]:
    """Turns until end of input; returns the conversation."""
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    while (line := _read_turn()) is not None:
        if not line.strip():
            continue
        history.append(pb.ChatMessage(role="user", content=line))
        reply = _stream_reply(stub, _request(history, args), args.timeout)
        if reply is None:  # failed: the question was not answered, so it leaves the history
            history.pop()
        else:
            history.append(pb.ChatMessage(role="assistant", content=reply))
    return history


def _read_turn() -> str | None:
    """The user's next line; None at end of input (Ctrl-D)."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-D exits)")


def _request(history: list[pb.ChatMessage], args) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    return pb.GenerateRequest(messages=history, sampling=sampling)


def _stream_reply(stub, request: pb.GenerateRequest, timeout: float) -> str | None:
    """Prints the reply as it streams; returns its text (as far as it got when stopped), or
    None when the request failed."""
    parts: list[str] = []
    call = None
    try:  # from the call on: a Ctrl-C just after Enter stops the reply, it does not crash
        call = stub.Generate(request, timeout=timeout)
        for response in call:
            parts.append(response.text)
            sys.stdout.write(printable(response.text))
            sys.stdout.flush()
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()  # the server cancels the request and frees its blocks
        print(" [stopped]")
        return "".join(parts)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return None
    print()
    return "".join(parts)
