"""Server-sent events read from an httpx response, for Treadle's own clients (`treadle chat`,
`bench serve`, `bench soak`).

SSE ends a line only at CR, LF or CRLF. httpx's `aiter_lines` splits as `str.splitlines` does,
also at U+2028, U+0085 and others, which servers (Treadle's, vLLM's) send unescaped inside the
JSON of a generated token, so that one event came back as two halves of broken JSON."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx

LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Each line of the stream, without its line ending, decoded as UTF-8 (bytes that are not
    replaced, as httpx does)."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        # A CR that ends a chunk may be the first half of a CRLF: it waits for the next one.
        held = b"\r" if pending.endswith(b"\r") else b""
        *lines, pending = LINE_END.split(pending[:len(pending) - len(held)])
        pending += held
        for line in lines:
            yield line.decode(errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode(errors="replace")


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The payload of each `data:` line (comments, event names and blank lines skipped)."""
    async for line in sse_lines(response):
        if line.startswith("data:"):
            yield line[5:].strip()
