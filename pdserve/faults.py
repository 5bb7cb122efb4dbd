"""Fault injection for tests: make a service fail at a chosen point of the KV handoff or decode.

Off unless the process starts with PDSERVE_FAULTS set (e.g. "corrupt_chunk=2" or
"stall_after_chunks=1,stall_seconds=5"). Nothing received over the network can turn it on. Each
fault names the point at which it fires:

  drop_after_chunks=N    prefill: break the KV stream instead of sending chunk N (0-based)
  corrupt_chunk=N        prefill: flip a byte of chunk N after its CRC was computed
  stall_after_chunks=N   prefill: pause stall_seconds before sending chunk N
  crash_after_chunks=N   prefill: exit abruptly before sending chunk N
  decode_crash_after_chunks=N  decode: exit abruptly on receiving its N-th chunk (1-based, all leases)
  decode_crash_after_steps=N   decode: exit abruptly after its N-th decode step
  decode_step_seconds=X  decode: sleep X seconds after every decode step (a slow model, so
                               that a test can act while a reply still streams)
  decode_refuse_chunks_from=N  decode: refuse every KV chunk from its N-th (1-based, all leases)
                               as if it failed a check, and stay up and healthy
  prefill_engine_crash_at_step=N  prefill: the engine loop fails outside the model call at its
                               N-th step (1-based), with jobs waiting
"""

import asyncio
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = 86


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Faults:
    drop_after_chunks: int | None = None
    corrupt_chunk: int | None = None
    stall_after_chunks: int | None = None
    stall_seconds: float = 0.0
    crash_after_chunks: int | None = None
    decode_crash_after_chunks: int | None = None
    decode_crash_after_steps: int | None = None
    decode_step_seconds: float = 0.0
    decode_refuse_chunks_from: int | None = None
    prefill_engine_crash_at_step: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        """Faults from "name=value,..."; an unknown name is an error, not silently ignored."""
        types = {f.name: (float if f.type is float else int) for f in fields(cls)}
        values: dict[str, Any] = {}  # int or float by field: what cls(**values) checks
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, raw = item.partition("=")
            if name not in types:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join(types)}")
            values[name] = types[name](raw)
        faults = cls(**values)
        if values:
            log.warning("FAULT INJECTION ENABLED: %s", faults)
        return faults

    async def before_chunk(self, index: int) -> None:
        """Prefill side, before chunk `index` goes out, whatever the transport."""
        if index == self.crash_after_chunks:
            log.error("fault: prefill exits before chunk %d", index)
            os._exit(CRASH_EXIT_CODE)
        if index == self.stall_after_chunks:
            log.warning("fault: stalling %.1f s before chunk %d", self.stall_seconds, index)
            await asyncio.sleep(self.stall_seconds)
        if index == self.drop_after_chunks:
            raise InjectedFault(f"fault: KV stream dropped before chunk {index}")

    def corrupts(self, index: int) -> bool:
        """Prefill side: whether chunk `index` goes out with a byte flipped after its CRC."""
        return index == self.corrupt_chunk

    def after_chunk_received(self, count: int) -> None:
        if count == self.decode_crash_after_chunks:
            log.error("fault: decode exits on chunk %d", count)
            os._exit(CRASH_EXIT_CODE)

    def refuses_chunk(self, count: int) -> bool:
        """Decode side: whether its `count`-th chunk (1-based) is refused."""
        return (
            self.decode_refuse_chunks_from is not None and count >= self.decode_refuse_chunks_from
        )

    def before_prefill_step(self, count: int) -> None:
        if count == self.prefill_engine_crash_at_step:
            raise InjectedFault(f"fault: prefill engine loop fails at step {count}")

    def after_decode_step(self, count: int) -> None:
        if count == self.decode_crash_after_steps:
            log.error("fault: decode exits after step %d", count)
            os._exit(CRASH_EXIT_CODE)
        if self.decode_step_seconds:
            time.sleep(self.decode_step_seconds)  # the engine thread: every stream slows
