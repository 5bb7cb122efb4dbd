"""KV handed over inside one process, with no socket: for unit tests of the handoff itself.

The sink calls the receiver directly, on the same event loop, with the same chunks, commit and
checks as the network transports.
"""

from pdserve.faults import Faults
from pdserve.kv.receiver import Committed, KvReceiver, KvStream, status_name
from pdserve.kv.sink import KvSink, KvTarget, KvTransferFailed, OutChunk
from pdserve.kv.wire import KvRejected


class InProcessKvSink(KvSink):
    transport = "inproc"

    def __init__(self, target: KvTarget, faults: Faults, receiver: KvReceiver) -> None:
        super().__init__(target, faults)
        self._receiver = receiver

    async def send(self, timeout: float | None) -> Committed:
        stream = KvStream(self.transport)
        try:
            async for item in self.items():
                if isinstance(item, OutChunk):
                    self._receiver.accept(stream, item.header, b"".join(item.parts))
                else:
                    return self._receiver.commit(stream, item)
        except KvRejected as exc:
            self._receiver.refuse(stream, f"KV transfer rejected: {exc}")
            raise KvTransferFailed(status_name(exc), str(exc)) from None
        except BaseException:
            self._receiver.refuse(stream, "KV stream broke before its commit")
            raise
        self._receiver.refuse(stream, "KV stream ended without a commit")
        raise KvTransferFailed("CANCELLED", "the sink was aborted before its commit")
