"""EngineReplica: one data-parallel replica, the body of a Ray actor (treadle/frontend/
data_parallel.py makes it one; this module imports neither Ray nor, until built, torch).

It runs the engine process's own loop (`serve_engine`) on a thread over two in-process pipes,
so a replica speaks the same typed messages as an engine process: the frontend's `submit`
writes AddRequest/AbortRequest into one, its `pull` drains the other, one batch of StepOutputs
(a step's outputs each) per call. A threaded actor (two calls at once): a `pull` waiting for the
next step never delays a `submit`. Should the loop raise, the actor's process exits, and Ray
restarts it, as the frontend restarts a dead engine process.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing import Pipe

from treadle.config import EngineConfig
from treadle.core.engine_process import ready_message, serve_engine
from treadle.core.messages import EngineFailed, EngineOutput, EngineReady, EngineRequest

logger = logging.getLogger(__name__)

# Outputs one `pull` returns at most: a frontend far behind catches up over a few calls.
MAX_PULLED = 256


class EngineReplica:
    def __init__(self, config: EngineConfig) -> None:
        """Build the engine core and start its loop; a failure is kept for `ready()` to say
        (raised here, Ray would call it the actor's death and give no reason)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s "
                                                       "treadle-replica %(name)s: %(message)s")
        requests_in, self.requests = Pipe(duplex=False)
        self.outputs, outputs_out = Pipe(duplex=False)
        try:
            from treadle.core.engine_core import EngineCore

            core = EngineCore(config)
        except Exception as e:
            self.first: EngineReady | EngineFailed = EngineFailed(f"{type(e).__name__}: {e}")
            return
        self.first = ready_message(core)
        threading.Thread(target=self._serve, args=(core, requests_in, outputs_out),
                         name="treadle-replica-loop", daemon=True).start()

    @staticmethod
    def _serve(core, requests_in, outputs_out) -> None:
        try:
            serve_engine(core, requests_in, outputs_out, None)
        except BaseException:
            logger.exception("the replica's engine loop failed; exiting for Ray to restart it")
        os._exit(1)  # nothing stops the loop but a failure: the frontend kills the actor

    def ready(self) -> EngineReady | EngineFailed:
        return self.first

    def submit(self, messages: list[EngineRequest]) -> None:
        """Requests for the engine, in order (one caller at a time: the frontend's sender)."""
        for message in messages:
            self.requests.send(message)

    def pull(self, timeout: float) -> list[EngineOutput]:
        """The engine's outputs since the last call; waits up to `timeout` seconds for one (the
        loop sends its load at least once a second, even idle)."""
        pulled: list[EngineOutput] = []
        if self.outputs.poll(timeout):
            while len(pulled) < MAX_PULLED and self.outputs.poll(0):
                pulled.append(self.outputs.recv())
        return pulled
