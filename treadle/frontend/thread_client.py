"""ThreadEngineClient: the engine on a thread of this process, over in-process pipes.

It runs the engine process's own loop (`serve_engine`) on a thread, so it speaks the same
typed messages as an engine process. Ray replicas host their engine this way
(ray_replica.py). Starting it builds the engine core here: this process imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from treadle.config import EngineConfig
from treadle.core.engine_process import ready_message, serve_engine
from treadle.core.messages import EngineFailed, EngineOutput, EngineReady, EngineRequest, Shutdown

logger = logging.getLogger(__name__)


class ThreadEngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: Connection | None = None
        self.outputs: Connection | None = None
        self.thread: threading.Thread | None = None
        self.failure: str | None = None  # why the loop ended, if it raised

    def start(self) -> EngineReady | EngineFailed:
        requests_in, self.requests = Pipe(duplex=False)
        self.outputs, outputs_out = Pipe(duplex=False)
        try:
            from treadle.core.engine_core import EngineCore

            core = EngineCore(self.config)
        except Exception as e:
            return EngineFailed(f"{type(e).__name__}: {e}")
        self.thread = threading.Thread(target=self._serve, args=(core, requests_in, outputs_out),
                                       name="treadle-engine-loop", daemon=True)
        self.thread.start()
        return ready_message(core)

    def _serve(self, core, requests_in: Connection, outputs_out: Connection) -> None:
        try:
            serve_engine(core, requests_in, outputs_out, None)
        except BaseException as e:
            logger.exception("the engine loop failed")
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            outputs_out.close()  # the reader sees the end
            requests_in.close()

    def send(self, message: EngineRequest) -> None:
        with contextlib.suppress(OSError):  # the loop has ended
            self.requests.send(message)

    def recv(self) -> EngineOutput:
        try:
            return self.outputs.recv()
        except OSError:
            raise EOFError from None

    def poll(self, timeout: float) -> bool:
        """Whether an output (or the end) can be received within `timeout` seconds."""
        return self.outputs.poll(timeout)

    def stop(self, timeout: float) -> None:
        self.send(Shutdown())
        if self.thread is not None:
            self.thread.join(timeout)

    def kill(self) -> None:
        # A thread cannot be killed: told to stop, it ends after its step.
        self.send(Shutdown())

    def close(self) -> None:
        self.outputs.close()

    def exit_status(self) -> str:
        return f"loop failed: {self.failure}" if self.failure else "stopped"
