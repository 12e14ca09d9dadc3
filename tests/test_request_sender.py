"""RequestSender: the frontend never blocks on a full pipe to the engine, and keeps order."""

from __future__ import annotations

import multiprocessing
import time

from treadle.core.messages import AbortRequest, AddRequest
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.request_sender import RequestSender


def add(i: int, prompt_len: int = 4000) -> AddRequest:
    return AddRequest(f"r{i}", list(range(prompt_len)), SamplingParams(), 0, "default", None,
                      None, None, False)


def test_send_returns_while_the_engine_reads_nothing_and_order_is_kept():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = RequestSender(writer)
    messages = [add(i) if i % 2 == 0 else AbortRequest(f"r{i - 1}") for i in range(40)]
    started = time.monotonic()
    for message in messages:  # ~20 prompts of 4,000 tokens: far more than a pipe holds
        sender.send(message)
    queued = time.monotonic() - started
    received = [reader.recv() for _ in messages]  # the engine reads at last
    assert received == messages
    assert queued < 1.0  # a blocking send would have waited here for the reads above: forever
    sender.close()
    sender.thread.join(5)
    assert not sender.thread.is_alive()


def test_messages_to_a_dead_engine_are_dropped():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = RequestSender(writer)
    reader.close()  # the engine process is gone
    for i in range(5):
        sender.send(add(i))  # no exception here, nor in the sending thread
    sender.close()
    sender.thread.join(5)
    assert not sender.thread.is_alive()
