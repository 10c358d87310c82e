"""What one run of a flow moved, counted where the records pass: the one line a flow prints when it ends.

A :class:`FlowCounts` is handed to a flow builder (``build_flow(..., counts=FlowCounts())``). The flow's
Bytewax wrappers add to it once per batch from their worker threads (a lock guards it), and whoever ran
the flow prints the flow's ``summary(counts)`` after ``run_main``/``cli_main`` returned, when the sinks
have flushed everything counted. The counts are this process's run only: a run resumed from a snapshot
counts what it reads again, nothing of an earlier run. The pure logic (:mod:`flows.processor`,
:mod:`flows.batching`) knows nothing of it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping


class FlowCounts:
    """Named counters, safe to add to from every worker thread of a flow."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            self._counts.update(counts)

    def snapshot(self) -> Counter[str]:
        """A copy of the counts so far."""
        with self._lock:
            return Counter(self._counts)


def by_kind(counts: Mapping[str, int], prefix: str) -> dict[str, int]:
    """The non-zero counters named ``prefix<kind>``, by kind, largest first (then by name)."""
    found = {k.removeprefix(prefix): v for k, v in counts.items() if k.startswith(prefix) and v}
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def dead_letters(counts: Mapping[str, int]) -> str:
    """``17 dead letters (duplicate 12, too_late 5)``, or ``0 dead letters``, from the ``dead:<kind>`` counters."""
    kinds = by_kind(counts, "dead:")
    total = sum(kinds.values())
    detail = ", ".join(f"{kind} {n:,}" for kind, n in kinds.items())
    return f"{total:,} dead letter{'' if total == 1 else 's'}" + (f" ({detail})" if detail else "")
