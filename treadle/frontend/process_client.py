"""ProcessEngineClient: the engine in a child process, over two pipes (the default host).

The child is spawned, not forked: it imports torch and builds the model itself, while this
process never imports torch. Requests go through a RequestSender thread, so a full pipe never
blocks the event loop; outputs come back on the other pipe, read by AsyncEngine's reader
thread. A daemonic child dies with this process.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

from treadle.config import EngineConfig
from treadle.core.engine_process import engine_process
from treadle.core.messages import EngineFailed, EngineOutput, EngineReady, EngineRequest, Shutdown
from treadle.frontend.request_sender import RequestSender


class ProcessEngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.process: multiprocessing.process.BaseProcess | None = None
        self.outputs: Connection | None = None
        self.sender: RequestSender | None = None
        self.killed = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> EngineReady | EngineFailed:
        context = multiprocessing.get_context("spawn")
        requests_in, requests_out = context.Pipe(duplex=False)
        self.outputs, outputs_out = context.Pipe(duplex=False)
        self.process = context.Process(target=engine_process, name="treadle-engine",
                                       args=(self.config, requests_in, outputs_out), daemon=True)
        self.process.start()
        requests_in.close()
        outputs_out.close()
        if self.killed:  # killed while it was being spawned
            self.process.kill()
        try:
            first = self.outputs.recv()
        except (EOFError, OSError):
            self.process.join(1)
            first = EngineFailed(f"the engine process exited while loading "
                                 f"({self.exit_status()})")
        if isinstance(first, EngineReady):
            self.sender = RequestSender(requests_out)
        else:
            requests_out.close()
            self.kill()
        return first

    def send(self, message: EngineRequest) -> None:
        if self.sender is not None:
            self.sender.send(message)

    def recv(self) -> EngineOutput:
        try:
            return self.outputs.recv()
        except OSError:  # the pipe was closed under the reader
            raise EOFError from None

    def stop(self, timeout: float) -> None:
        self.send(Shutdown())
        if self.process is not None:
            self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        self.killed = True
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def close(self) -> None:
        self.outputs.close()
        if self.sender is not None:
            self.sender.close()
        self.process.join(1)  # for its exit code: a dead process's end comes at once

    def exit_status(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        return (f"killed by signal {-code}" if code is not None and code < 0
                else f"exit code {code}")
