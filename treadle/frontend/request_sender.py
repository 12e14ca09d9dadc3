"""RequestSender: the frontend's messages to one engine process, sent by a thread of their own.

A pipe holds about 64 KiB; prompts of a few thousand tokens fill it while the engine is in a
step (it reads messages between steps). Sent directly, a full pipe blocked the caller: the
event loop, under AsyncEngine's lock, so no stream moved and the reader thread (which takes the
lock) stopped reading the engine's outputs. Queued here, `send` never blocks, and messages keep
their order.
"""

from __future__ import annotations

import logging
import queue
import threading
from multiprocessing.connection import Connection

from treadle.core.messages import EngineRequest

logger = logging.getLogger(__name__)


class RequestSender:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.outbox: queue.SimpleQueue[EngineRequest | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="treadle-requests", daemon=True)
        self.thread.start()

    def send(self, message: EngineRequest) -> None:
        """Queue `message` for the engine; dropped if the engine is gone."""
        self.outbox.put(message)

    def close(self) -> None:
        """Send what is queued, then stop (the engine exited, or is told to)."""
        self.outbox.put(None)

    def _run(self) -> None:
        engine_gone = False
        while (message := self.outbox.get()) is not None:
            if engine_gone:
                continue
            try:
                self.connection.send(message)
            except OSError:  # the engine died: the reader sees its end and fails its requests
                engine_gone = True
        self.connection.close()
