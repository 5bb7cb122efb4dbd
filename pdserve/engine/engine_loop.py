"""The thread that runs an engine's steps while there is work and sleeps while there is none."""

import logging
import threading
from typing import Callable

from pdserve.engine import torch_threads

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        has_work: Callable[[], bool],
        on_crash: Callable[[str], None],
    ) -> None:
        self._step, self._has_work, self._on_crash = step, has_work, on_crash
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Call after adding work or aborting, so a sleeping loop looks again."""
        with self._wakeup:
            self._wakeup.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        torch_threads.enter_engine_thread()
        while True:
            with self._wakeup:
                # The timeout is a safety net; wake() is the normal way in.
                self._wakeup.wait_for(lambda: self._stopping or self._has_work(), timeout=0.5)
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as exc:
                log.exception("engine step failed")
                try:
                    self._on_crash(f"engine step failed: {exc}")
                except Exception:  # the loop must outlive its crash handler
                    log.exception("engine crash handler failed")
