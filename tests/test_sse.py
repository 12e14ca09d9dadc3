"""The SSE reader of Treadle's own clients, against a real HTTP server on loopback: a generated
token may hold U+2028 or U+0085, which servers send unescaped inside an event's JSON."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from treadle.sse import sse_data

TEXTS = ["a\u2028b", "c\u0085d\u2029", "e\x0cf", "plain"]


class Events(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        body = ": keep-alive\n\n" + "".join(
            f"data: {json.dumps({'text': t}, ensure_ascii=False)}\r\n\r\n" for t in TEXTS)
        raw = (body + "data: [DONE]\n\n").encode()
        for i in range(0, len(raw), 5):  # small writes: events split across reads
            self.wfile.write(raw[i:i + 5])
            self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


def test_events_split_only_at_cr_and_lf():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Events)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def read() -> list[str]:
        async with httpx.AsyncClient() as client, client.stream(
                "GET", f"http://127.0.0.1:{server.server_address[1]}/") as response:
            return [data async for data in sse_data(response)]

    try:
        events = asyncio.run(read())
    finally:
        server.shutdown()
        server.server_close()
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["text"] for e in events[:-1]] == TEXTS
