"""Bounded waits of the embedded ClickHouse front: the engine's gate (writers first) and the inflated-body budget.

Statements run one at a time; a request waits at most ``queue_timeout_s`` for the engine (then 503, code 202).
A waiting writer goes before every waiting analyst, so ingestion waits at most for the statement running now
(:class:`Gate`). The inflated request bodies held at once across all requests are bounded too
(:class:`ByteBudget`): a body reserves the most it may reach before inflating, keeps its size until its
request ends, and waits at most ``queue_timeout_s`` for room, then 503.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class Gate:
    """The engine, one request at a time. A waiting writer goes before every waiting analyst.
    Each kind waits in arrival order. A wait is bounded: past its timeout the request gives up its place."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._queues: tuple[deque[object], deque[object]] = (deque(), deque())  # writers, analysts

    def _head(self) -> object | None:
        return next((q[0] for q in self._queues if q), None)

    def acquire(self, writer: bool, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the engine; True once it is this caller's."""
        ticket, queue = object(), self._queues[0 if writer else 1]
        deadline = time.monotonic() + timeout
        with self._cond:
            queue.append(ticket)
            try:
                while self._busy or self._head() is not ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                self._busy = True
                return True
            finally:
                queue.remove(ticket)
                self._cond.notify_all()  # a new head of the queue (or the one after a caller that gave up)

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class ByteBudget:
    """Bytes held at once, server-wide: a reservation waits (bounded) until it fits in ``total``.
    No holder waits for more budget, so holders always release (no deadlock)."""

    def __init__(self, total: int):
        self.total, self.held, self.peak = max(1, total), 0, 0
        self._cond = threading.Condition()

    def reserve(self, n: int, timeout: float) -> bool:
        """Hold ``n`` bytes (at most ``total``) once they fit, waiting at most ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.held + n <= self.total, timeout):
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()
