"""The HTTP front against hostile clients: bodies that broke the parser, megabyte strings that
came back in error messages, a malformed Authorization header that was logged with its key, the
auth scheme's case, and connections that trickle their bytes (slow loris).

Bodies go to the session stack's real router; the rest runs the front alone over a scripted
router (test_http_front.py), where the deadlines can be short and the log can be captured.
"""

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from test_http_api import JSON, raw
from test_http_front import SERVED, ScriptedRouter, tokens
from pdserve.services.router.clients import ApiKeys
from pdserve.services.router.http_api import Deadlines, HttpApi
from pdserve.services.router.openai_format import MESSAGE_CHARS

KEY = "sk-hostile-5d2e8b"
SLACK = 3.0  # seconds beyond a deadline that a busy 2-core machine may take to act on it


def _deep(levels: int) -> bytes:
    return b'{"prompt": ' + b"[" * levels + b"]" * levels + b', "max_tokens": 2}'


HOSTILE_BODIES = {
    # case: (body, words in the message)
    "100,000 levels of nesting": (_deep(100_000), "nested too deeply"),
    "a 400-digit temperature": (
        b'{"prompt": "hi", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}",
        "number out of range",
    ),
    "a 400-digit top_p": (
        b'{"prompt": "hi", "max_tokens": 2, "top_p": -1' + b"0" * 400 + b"}",
        "number out of range",
    ),
    "a lone surrogate in the prompt": (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "\\ud800"),
    "a lone low surrogate in a stop string": (
        b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\udc00"]}',
        "\\udc00",
    ),
    "a surrogate encoded as UTF-8 bytes": (
        b'{"prompt": "a\xed\xa0\x80", "max_tokens": 2}',
        "not UTF-8",
    ),
    "UTF-16 with a lone surrogate": (
        '{"prompt": "a\ud800", "max_tokens": 2}'.encode("utf-16-le", "surrogatepass"),
        "not UTF-8",
    ),
    "a lone surrogate in a chat message": (
        b'{"messages": [{"role": "user", "content": "\\udbff"}]}',
        "\\udbff",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_BODIES))
def test_bodies_that_broke_the_parser_are_400_naming_the_problem(stack, case):
    data, words = HOSTILE_BODIES[case]
    path = "/v1/chat/completions" if b'"messages"' in data else "/v1/completions"
    status, reply = raw(stack, "POST", path, data, JSON)
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert words in reply["error"]["message"], reply


def test_a_surrogate_pair_is_still_text(stack):
    status, reply = raw(
        stack, "POST", "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', JSON
    )
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == len("\U0001f600".encode())


MEGABYTE_ECHOES = {
    # case: (body, status)
    "a 2 MB model name": ({"model": "m" * 2_000_000, "prompt": "hi"}, 404),
    "a 1 MB unknown field name": ({"f" * 1_000_000: 1, "prompt": "hi"}, 400),
    "a 1 MB string as temperature": ({"prompt": "hi", "temperature": "t" * 1_000_000}, 400),
    "a 1 MB list as max_tokens": ({"prompt": "hi", "max_tokens": [1] * 300_000}, 400),
}


@pytest.mark.parametrize("case", list(MEGABYTE_ECHOES))
def test_errors_do_not_echo_megabytes_back(stack, case):
    fields, status = MEGABYTE_ECHOES[case]
    path = "/v1/chat/completions" if "messages" in fields else "/v1/completions"
    got, reply = raw(stack, "POST", path, json.dumps(fields).encode(), JSON)
    assert got == status, str(reply)[:300]
    error = reply["error"]
    assert len(error["message"]) <= MESSAGE_CHARS + 40, error["message"][:300]
    assert error["param"] is None or len(error["param"]) <= 70
    assert "characters" in error["message"]  # says how long the value it cut was


def test_short_messages_are_not_cut(stack):
    fields = {"prompt": "hi", "tools": []}
    status, reply = raw(stack, "POST", "/v1/completions", json.dumps(fields).encode(), JSON)
    assert status == 400 and reply["error"]["param"] == "tools"
    assert reply["error"]["message"].startswith("unsupported field 'tools'; this server accepts")
    assert "characters" not in reply["error"]["message"]


# --- the front alone ---


async def _serving(api: HttpApi, call):
    """Serves `api` with its own runner (its deadlines, its logger) on a free loopback port and
    returns `await call(port)`."""
    runner = api.runner()
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        return await call(port)
    finally:
        await runner.cleanup()


def serve(call, api_key: str = "", deadlines: Deadlines = Deadlines()):
    api = HttpApi(ScriptedRouter(tokens("a")), SERVED, api_key, deadlines)
    return asyncio.run(asyncio.wait_for(_serving(api, call), 60))


async def _exchange(port: int, request: bytes) -> bytes:
    """Everything the server sends back to `request` until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


MALFORMED_AUTHORIZATION = [
    b"Bearer " + KEY.encode() + b"\x01",  # a control character: aiohttp's parser refuses it
    b"Bearer " + KEY.encode() + b"\x7f",
    b"Bearer " + KEY.encode() + b"\x00",
    b"Bearer " + KEY.encode() + b"\r",  # CR without LF
    b"Bearer\x0b" + KEY.encode(),
    b"Bearer " + KEY.encode() + b"\xff\xfe",  # not UTF-8: reached the key check as surrogates
]


@pytest.mark.parametrize("value", MALFORMED_AUTHORIZATION, ids=repr)
def test_a_malformed_authorization_header_is_refused_and_its_key_never_logged_or_echoed(
    caplog, value
):
    caplog.set_level(logging.DEBUG)
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: " + value + b"\r\n\r\n"
    )
    reply = serve(lambda port: _exchange(port, request), api_key=KEY)
    status = int(reply.split(b" ", 2)[1])
    assert status in (400, 401), reply[:200]
    assert KEY.encode() not in reply, reply  # aiohttp's own 400 quoted the line back
    logged = "\n".join(caplog.text.splitlines() + [r.getMessage() for r in caplog.records])
    assert KEY not in logged, logged


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR", "Bearer  "])
def test_the_bearer_scheme_is_matched_without_regard_to_case(scheme):
    keys = ApiKeys(f"other,{KEY}")
    assert keys.client_of(f"{scheme} {KEY}") == "key #2"  # gRPC metadata and HTTP alike
    assert keys.client_of(f"{scheme} {KEY.upper()}") is None  # the key itself is exact

    async def call(port: int):
        url = f"http://127.0.0.1:{port}/v1/models"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers={"Authorization": f"{scheme} {KEY}"}) as reply:
                return reply.status

    assert serve(call, api_key=KEY) == 200


@pytest.mark.parametrize("value", ["Basic " + KEY, KEY, "Bearer", "Bearer ", "Bearerx " + KEY])
def test_other_schemes_and_bare_keys_are_refused(value):
    assert ApiKeys(KEY).client_of(value) is None


SHORT = Deadlines(headers=0.5, body=0.5, linger=0.5)


async def _closed_within(port: int, sent: bytes, connections: int) -> tuple[float, list[bytes]]:
    """Opens `connections` connections that each send `sent` and then nothing; returns how long
    the server took to close the last one, and what each received."""
    started = time.monotonic()
    replies = await asyncio.wait_for(
        asyncio.gather(*(_exchange(port, sent) for _ in range(connections))),
        SHORT.headers + SHORT.body + SHORT.linger + SLACK * 3,
    )
    return time.monotonic() - started, replies


def test_connections_that_send_half_a_header_are_closed_at_the_deadline():
    half = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    took, replies = serve(lambda port: _closed_within(port, half, 50), deadlines=SHORT)
    assert took < SHORT.headers + SLACK, took
    assert all(reply == b"" for reply in replies)  # nothing to answer: no request came


def test_a_body_that_trickles_is_408_and_the_connection_closed():
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    partial = head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
    took, replies = serve(lambda port: _closed_within(port, partial, 20), deadlines=SHORT)
    assert took < SHORT.body + SHORT.linger + SLACK, took
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"] == (
            "the request body did not arrive within 0.5 s"
        )


def test_an_idle_keepalive_connection_is_closed_at_the_deadline():
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # keep-alive: HTTP/1.1's default
    took, replies = serve(lambda port: _closed_within(port, request, 5), deadlines=SHORT)
    assert took < SHORT.headers + SLACK, took
    assert all(reply.startswith(b"HTTP/1.1 200 ") for reply in replies)


def test_the_served_deadlines_are_bounded():
    # What the router and the colocated engine serve with (http_api.start): aiohttp's own
    # defaults were an hour for headers and no bound on a body.
    assert HttpApi(ScriptedRouter(), SERVED, "").deadlines == Deadlines()
    assert 5 <= Deadlines().headers <= 60 and 10 <= Deadlines().body <= 120
    assert Deadlines().linger <= 10
