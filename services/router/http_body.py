"""The body of an HTTP API request: read within its deadline, decoded as strict UTF-8 JSON, and
every failure that comes of the client's input turned into a 400 that names it.

Python's json module accepts more than JSON (surrogates, UTF-16) and fails in ways that are not
ValueError (deep nesting), so the checks here stand between it and the rest of the router.
"""

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from typing import TypeVar

from aiohttp import web

from pdserve.core.request import InvalidRequest
from pdserve.core.shown import shown
from pdserve.services.router.openai_schema import BadRequest

Parsed = TypeVar("Parsed")

# What checking or using the body's values may raise besides BadRequest: a number too large for a
# float (OverflowError), a lone surrogate (UnicodeEncodeError), a value nested deeper than Python
# recurses. Each is the client's input, answered 400; anything else is a bug, answered 500.
VALUE_ERRORS = (ValueError, TypeError, ArithmeticError, RecursionError)


# Decoding and checking a body over this many bytes runs in a thread: one client's megabytes of
# JSON (a prompt of a million token ids) must not hold the event loop that serves every other.
OFF_LOOP_BYTES = 64 << 10


async def parsed_body(
    request: web.Request, deadline: float, parse: Callable[[object], Parsed]
) -> Parsed:
    """The body as JSON, checked by `parse` (openai_schema's): application/json, not empty, at
    most MAX_BODY_BYTES (413 beyond), whole within `deadline` seconds (408 beyond)."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Type must be application/json, got {shown(request.content_type)}"
        )
    raw = await _read(request, deadline)
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    work = functools.partial(_parsed, raw, parse)
    return await asyncio.to_thread(work) if len(raw) > OFF_LOOP_BYTES else work()


def _parsed(raw: bytes, parse: Callable[[object], Parsed]) -> Parsed:
    body = _decoded(raw)
    with client_values():
        return parse(body)


async def _read(request: web.Request, deadline: float) -> bytes:
    try:
        async with asyncio.timeout(deadline):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {deadline:g} s"
        ) from None
    except web.RequestPayloadError as exc:  # bad chunked encoding, a body cut short
        raise BadRequest(f"the request body could not be read: {exc}") from None


def _decoded(raw: bytes) -> object:
    """The body's JSON value, refused (400) with what is wrong: not UTF-8 (RFC 8259, 8.1), not
    JSON, nested deeper than the parser recurses, an integer of more digits than Python converts,
    or a string that is not Unicode (a lone surrogate escape such as \\ud800, which JSON parses
    but nothing downstream can encode)."""
    try:
        # Strict UTF-8 (a leading BOM allowed): json.loads would decode bytes with surrogatepass,
        # and guess UTF-16, so that surrogates could come of the bytes, not only of escapes.
        text = raw.decode("utf-8-sig")
        body = json.loads(text)
        if "\\u" in text:  # a surrogate now comes only of an escape; most bodies have none
            json.dumps(body, ensure_ascii=False).encode()
    except RecursionError:
        raise BadRequest(
            "the body is nested too deeply; a request needs only a few levels"
        ) from None
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the body is not valid JSON: it is not UTF-8 (byte {exc.start})"
        ) from None
    except UnicodeEncodeError as exc:
        char = exc.object[exc.start]
        raise BadRequest(
            f"the body holds a lone surrogate \\u{ord(char):04x}, which is not Unicode; "
            "send text as UTF-8, or a surrogate only as half of a pair"
        ) from None
    except ValueError as exc:  # also an integer of over 4300 digits
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    return body


@contextlib.contextmanager
def client_values() -> Iterator[None]:
    """Turns an exception raised while checking or using the body's values into BadRequest
    naming the problem: it comes from the client's input, not from a fault of the server."""
    try:
        yield
    except InvalidRequest:
        raise
    except VALUE_ERRORS as exc:
        raise BadRequest(f"the body holds a value pdserve cannot use: {_problem(exc)}") from None


def _problem(exc: BaseException) -> str:
    if isinstance(exc, UnicodeError):
        return "a string that is not valid Unicode (a lone surrogate?)"
    if isinstance(exc, ArithmeticError):
        return f"a number out of range ({exc})"
    if isinstance(exc, RecursionError):
        return "values nested too deeply"
    return f"a value of an unexpected type or form ({type(exc).__name__})"
