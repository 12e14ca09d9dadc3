"""EngineReplica: one data-parallel replica, the body of a Ray actor (data_parallel.py makes it
one; this module imports neither Ray nor, until built, torch).

It hosts its engine on a thread (ThreadEngineClient): the frontend's `submit` sends
AddRequest/AbortRequest, its `pull` drains the outputs, one batch of StepOutputs (a step's
outputs each) per call. A threaded actor (two calls at once): a `pull` waiting for the next step
never delays a `submit`. Should the loop fail, the actor's process exits, and Ray restarts it,
as the frontend restarts a dead engine process.
"""

from __future__ import annotations

import logging
import os

from treadle.config import EngineConfig
from treadle.core.messages import EngineFailed, EngineOutput, EngineReady, EngineRequest
from treadle.frontend.thread_client import ThreadEngineClient

# Outputs one `pull` returns at most: a frontend far behind catches up over a few calls.
MAX_PULLED = 256


class EngineReplica:
    def __init__(self, config: EngineConfig) -> None:
        """Build the engine core and start its loop; a failure is kept for `ready()` to say
        (raised here, Ray would call it the actor's death and give no reason)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s "
                                                       "treadle-replica %(name)s: %(message)s")
        self.engine = ThreadEngineClient(config)
        self.first = self.engine.start()

    def ready(self) -> EngineReady | EngineFailed:
        return self.first

    def submit(self, messages: list[EngineRequest]) -> None:
        """Requests for the engine, in order (one caller at a time: the frontend's sender)."""
        for message in messages:
            self.engine.send(message)

    def pull(self, timeout: float) -> list[EngineOutput]:
        """The engine's outputs since the last call; waits up to `timeout` seconds for one (the
        loop sends its load at least once a second, even idle)."""
        pulled: list[EngineOutput] = []
        if self.engine.poll(timeout):
            while len(pulled) < MAX_PULLED and self.engine.poll(0):
                try:
                    pulled.append(self.engine.recv())
                except EOFError:
                    # Nothing stops the loop but a failure: exit for Ray to restart the actor.
                    logging.getLogger(__name__).error("the replica's engine loop ended (%s); "
                                                      "exiting", self.engine.exit_status())
                    os._exit(1)
        return pulled
