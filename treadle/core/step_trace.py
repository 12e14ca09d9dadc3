"""A step trace in the Chrome trace-event format (chrome://tracing, ui.perfetto.dev): one
complete event per engine step with the batch's composition, KV usage, preemptions and time.

Events are written as they happen and flushed, so a crashed server still leaves a trace that the
viewers open (they accept a missing closing bracket); `close()` completes the JSON array.
"""

from __future__ import annotations

import json
from pathlib import Path


class StepTraceWriter:
    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the server's life
        self.file.write("[\n")
        self.first = True

    def write(self, event: dict) -> None:
        self.file.write(("" if self.first else ",\n") + json.dumps(event))
        self.file.flush()
        self.first = False

    def close(self) -> None:
        self.file.write("\n]\n")
        self.file.close()
