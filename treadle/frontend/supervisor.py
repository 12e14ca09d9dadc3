"""EngineSupervisor: keeps one engine serving, and says how it is doing.

Status: starting → ok ⇄ stalled; when the engine dies: restarting → ok, or dead; on shutdown:
stopping. When the engine dies (its outputs end), AsyncEngine ends every request in flight and
tells the supervisor, which starts a fresh engine (all KV blocks free) after a backoff; past
`max_engine_restarts` in a row the status is "dead" for good. An engine alive but with no step
finished for `engine_stall_timeout` while it has work (or with no heartbeat at all) is
"stalled": not ready, but not restarted, since it may recover and its requests are not lost; the
orchestrator's liveness probe decides how long to wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

from treadle.config import SupervisionConfig

logger = logging.getLogger(__name__)

WATCH_SECONDS = 0.1  # how often a stall is looked for
# Restarts back off 0.5, 1, 2, ... s up to MAX_RESTART_BACKOFF; an engine that ran this long
# since its start counts as healthy again, so its next death starts the count afresh.
RESTART_BACKOFF = 0.5
MAX_RESTART_BACKOFF = 30.0
STABLE_SECONDS = 60.0
# What the frontends say while the engine cannot take requests, by status.
UNAVAILABLE = {"starting": "the engine is starting",
               "restarting": "the engine failed and is restarting; retry later",
               "dead": "the engine failed and will not be restarted",
               "stopping": "the server is shutting down"}


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: it died (restarting, or not), or the server is shutting down.
    `kind` says which to clients: "engine_error" or "server_shutdown"."""

    def __init__(self, message: str, kind: str = "engine_error") -> None:
        super().__init__(message)
        self.kind = kind


class EngineSupervisor:
    def __init__(self, config: SupervisionConfig, spawn: Callable[[], Awaitable[None]],
                 stalled: Callable[[], bool]) -> None:
        """`spawn` starts an engine and returns once it serves (raising if it cannot);
        `stalled` says whether the running one has stopped making progress."""
        self.config = config
        self.spawn = spawn
        self.stalled = stalled
        self.status = "starting"
        self.listeners: list[Callable[[str], None]] = []  # called on the loop at each change
        self.restarts = 0  # in a row, since the engine last ran STABLE_SECONDS
        self.started_at = 0.0
        self.tasks: set[asyncio.Task] = set()  # the stall watcher, a restart in progress

    async def start(self) -> None:
        """Start the engine; then watch it."""
        await self._spawn()
        self._set_status("ok")
        self._run(self._watch())

    async def _spawn(self) -> None:
        await self.spawn()
        self.started_at = time.monotonic()

    def add_listener(self, listener: Callable[[str], None]) -> None:
        self.listeners.append(listener)

    def check_available(self) -> None:
        """EngineUnavailable unless the engine takes requests (a stalled one does: it may
        recover)."""
        if self.status not in ("ok", "stalled"):
            raise EngineUnavailable(UNAVAILABLE[self.status], "server_shutdown"
                                    if self.status == "stopping" else "engine_error")

    def drain(self) -> None:
        """The server is stopping: no engine is started again."""
        self._set_status("stopping")

    async def shutdown(self) -> None:
        """Stop watching, and any restart in progress."""
        self.drain()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def engine_died(self) -> None:
        """On the loop, once the dead engine's requests have ended: restart it, or declare it
        dead."""
        if self.status == "stopping":
            return
        if time.monotonic() - self.started_at > STABLE_SECONDS:
            self.restarts = 0
        if self.restarts < self.config.max_engine_restarts:
            self._set_status("restarting")
            self._run(self._restart())
        else:
            self._set_status("dead")

    def _set_status(self, status: str) -> None:
        if status == self.status:
            return
        logger.log(logging.INFO if status in ("ok", "stopping") else logging.ERROR,
                   "engine status: %s (was %s)", status, self.status)
        self.status = status
        for listener in self.listeners:
            listener(status)

    def _run(self, coroutine: Coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _watch(self) -> None:
        """Turn the status to stalled and back as the engine stops and resumes progress."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            if self.status in ("ok", "stalled"):
                self._set_status("stalled" if self.stalled() else "ok")

    async def _restart(self) -> None:
        """Start a new engine after a backoff, doubling it after each failed start, until one
        starts or `max_engine_restarts` in a row have been tried."""
        max_restarts = self.config.max_engine_restarts
        while self.restarts < max_restarts:
            delay = min(RESTART_BACKOFF * 2 ** self.restarts, MAX_RESTART_BACKOFF)
            self.restarts += 1
            logger.error("restarting the engine in %.1f s (restart %d of at most %d in a row)",
                         delay, self.restarts, max_restarts)
            await asyncio.sleep(delay)
            try:
                await self._spawn()
            except Exception as e:  # whatever the cause, the next try backs off further
                logger.error("the engine failed to restart: %s", e)
                continue
            self._set_status("ok")
            return
        self._set_status("dead")
