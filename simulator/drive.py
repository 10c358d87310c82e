"""Send generated emissions through the SDK, at a fixed rate or as fast as the SDK accepts them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from client.sdk import RtrlClient
from simulator.generate import Emission


@dataclass(frozen=True)
class DriveResult:
    """What one drive sent: ``accepted + dropped == len(emissions)``."""

    accepted: int
    dropped: int
    seconds: float


def drive(client: RtrlClient, emissions: list[Emission], rate: float = 0.0, progress: bool = False) -> DriveResult:
    """Record every emission's event in send order; ``rate`` > 0 paces to that many events/s."""
    start = time.monotonic()
    accepted = dropped = 0
    bar = Progress(
        TextColumn("simulating users"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), disable=not progress
    )
    with bar:
        task = bar.add_task("send", total=len(emissions))
        for i, em in enumerate(emissions):
            if rate > 0:
                ahead = start + i / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            # a replay lives in simulated time: the emission's send time is the producer's clock
            if client.record(em.event, now_ms=em.at_ms):
                accepted += 1
            else:
                dropped += 1
            if i % 500 == 0:
                bar.update(task, completed=i)
        bar.update(task, completed=len(emissions))
    return DriveResult(accepted, dropped, time.monotonic() - start)
