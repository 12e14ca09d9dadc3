"""EngineClient: one engine as the frontend talks to it, whatever hosts it.

Every host speaks the typed messages of treadle/core/messages.py: AddRequest, AbortRequest and
Shutdown in; EngineReady or EngineFailed, then StepOutputs, RequestRejected and RequestFailed
out. Three hosts implement it:
- `ProcessEngineClient` (process_client.py): a child process over two pipes, the default;
- `ThreadEngineClient` (thread_client.py): a thread of this process (each Ray replica runs one);
- `ReplicaGroup` (data_parallel.py): data-parallel replicas on Ray, routed and merged.
AsyncEngine reads one client's outputs on a thread of its own; its supervisor starts a new
client when one ends.
"""

from __future__ import annotations

from typing import Protocol

from treadle.core.messages import EngineFailed, EngineOutput, EngineReady, EngineRequest


class EngineClient(Protocol):
    def start(self) -> EngineReady | EngineFailed:
        """Start the engine and wait until its model is loaded (blocking: call it in a
        thread)."""

    def send(self, message: EngineRequest) -> None:
        """Queue a message for the engine, in order; never blocks; dropped once it is gone."""

    def recv(self) -> EngineOutput:
        """The engine's next output (blocking); EOFError once it has ended."""

    def stop(self, timeout: float) -> None:
        """Ask the engine to stop after its current step; kill it past `timeout` seconds."""

    def kill(self) -> None:
        """End the engine now; safe to call twice, and while `start` waits."""

    def close(self) -> None:
        """The reader has seen the engine's end (or failed): release what the client holds."""

    def exit_status(self) -> str:
        """How the engine ended, for the log: "exit code 1", "killed by signal 9"."""
