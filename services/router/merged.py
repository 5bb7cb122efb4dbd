"""Several async streams read as one, each item as soon as its stream yields it.

The first stream to fail ends the whole with its error; the whole ending any way (done, failed,
closed by its reader) closes every stream, so that each one's backend calls are cancelled.
"""

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

Item = TypeVar("Item")
_DONE = object()


async def merged(
    streams: dict[int, AsyncGenerator[Item, None]],
) -> AsyncIterator[tuple[int, Item]]:
    """(key, item) for every item of every stream in `streams`, as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(key: int, stream: AsyncGenerator[Item, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((key, item))
            await queue.put((key, _DONE))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((key, exc))

    tasks = [asyncio.create_task(pump(key, stream)) for key, stream in streams.items()]
    try:
        open_streams = len(tasks)
        while open_streams:
            key, item = await queue.get()
            if item is _DONE:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield key, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
