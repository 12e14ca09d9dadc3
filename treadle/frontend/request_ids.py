"""The ids a request's records are keyed by (its streams, timelines, explain, the request log).

A client's X-Request-Id is sanitised (letters, digits and `-_.:@+=~`, at most 128 characters;
others become `_`), or a fresh uuid is made, with a suffix (`~2`, ...) while another request in
flight, or a recently finished request's records, hold it; held until released. Derived ids (a
prompt of a batch, one of n samples) add `/i`, which no client id contains, so no client can
reach or collide with another's request.
"""

from __future__ import annotations

import string
import threading
import uuid
from collections.abc import Callable

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:@+=~")


def sanitize_request_id(value: str) -> str:
    """A client's request id as Treadle keys it: at most MAX_REQUEST_ID_CHARS, each character
    outside REQUEST_ID_CHARS (URL-safe, no `/`, which derived ids use) replaced by `_`."""
    return "".join(c if c in REQUEST_ID_CHARS else "_" for c in value[:MAX_REQUEST_ID_CHARS])


class RequestIds:
    def __init__(self, lock: threading.Lock, in_flight: Callable[[str], bool]) -> None:
        """`in_flight(id)`: whether a request in flight (or a finished one's records) holds
        `id` (read under `lock`)."""
        self.lock = lock
        self.in_flight = in_flight
        self.held: set[str] = set()

    def reserve(self, wanted: str | None) -> str:
        """`wanted` (a client's) sanitised, or a fresh id, unique among the ids held and the
        requests in flight."""
        base = sanitize_request_id(wanted) if wanted else uuid.uuid4().hex
        request_id, suffix = base, 1
        with self.lock:
            while request_id in self.held or self.in_flight(request_id):
                suffix += 1
                request_id = f"{base[:MAX_REQUEST_ID_CHARS - 8]}~{suffix}"
            self.held.add(request_id)
        return request_id

    def release(self, request_id: str) -> None:
        with self.lock:
            self.held.discard(request_id)
