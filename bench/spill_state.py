"""Spilled window state: peak RSS and events/s with N open trajectories, all in memory vs spilled to SQLite.

    .venv/bin/python bench/spill_state.py [--trajectories 1000000] [--budget-mb 64] [--snapshot-every 100000]
    .venv/bin/python bench/spill_state.py --calibrate      (the size constants of flows.windowing)

Each mode runs in its own subprocess (a fresh interpreter, so peak RSS is its own): ``--trajectories``
synthetic trajectories, each trajectory_started + tool_call + edit_proposed with a 10-day deadline, are
ingested into one ``PartitionWindows`` and never end, so every window stays open. *memory*: no store, as
with ``flow.state_memory_mb = 0``. *spill*: a ``flows.spill.SqliteStore`` in a temporary folder and a budget
of ``--budget-mb``; the store is checkpointed (what a Bytewax snapshot does) every ``--snapshot-every``
events. Events are built on the fly (not held), so the generator adds no memory; the timed loop includes
building them. Reported: peak RSS (``ru_maxrss``) of each, their ratio, events/s of each, and for the spill
run the windows left in memory, the rows on disk and the file's size.

``--calibrate`` measures (tracemalloc, in this process) the bytes one window, one event and one tombstone
hold in memory with their schedule entries and bookkeeping while spilling: the constants
``WINDOW_BYTES``, ``EVENT_BYTES`` and ``TOMBSTONE_BYTES`` the budget is estimated with.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flows.spill import SqliteStore  # noqa: E402
from flows.windowing import MemoryStore, PartitionWindows, WindowConfig  # noqa: E402
from rtrl.sections.flows import FlowSettings  # noqa: E402
from schemas.records import EditProposed, EventBase, ToolCall, TrajectoryStarted  # noqa: E402

BASE = 1_780_000_000_000
CFG = WindowConfig(FlowSettings(deadline_s=10 * 86_400, task_kinds={}))


def trajectory(rnd: random.Random, i: int, n_events: int = 3, started: bool = True) -> list[EventBase]:
    hexid = lambda: f"{rnd.getrandbits(128):032x}"  # noqa: E731
    common: dict[str, Any] = {
        "trajectory_id": hexid(),
        "org_id": f"org-{i % 6}",
        "user_hash": f"{rnd.getrandbits(128):032x}",
        "policy_version": 3,
        "arm": "control",
    }
    ts = BASE + i * 10
    out: list[EventBase] = [
        TrajectoryStarted(event_id=hexid(), ts=ts, task_kind="bugfix", **common)
        if started
        else ToolCall(event_id=hexid(), ts=ts, tool="read_file", valid=True, **common),
        ToolCall(event_id=hexid(), ts=ts + 2, tool="read_file", valid=True, **common),
        EditProposed(event_id=hexid(), ts=ts + 5, edit_id=hexid(), lines=12, **common),
    ]
    return out[:n_events]


def run(mode: str, n: int, budget_mb: float, snapshot_every: int) -> dict:
    rnd = random.Random(7)
    tmp = tempfile.mkdtemp(prefix="spill-bench-")
    store = SqliteStore.fresh(Path(tmp) / "partition-0.sqlite") if mode == "spill" else None
    w = PartitionWindows(
        CFG, partition=0, store=store, budget_bytes=int(budget_mb * 1_000_000) if store is not None else 0
    )
    off = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = ru0.ru_utime + ru0.ru_stime
    t0 = time.perf_counter()
    for i in range(n):
        for e in trajectory(rnd, i):
            assert not w.ingest(e, off)
            off += 1
            if store is not None and off % snapshot_every == 0:
                store.checkpoint()
    seconds = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru.ru_utime + ru.ru_stime - cpu0
    out = {
        "mode": mode,
        "trajectories": n,
        "events": off,
        "seconds": seconds,
        "events_per_s": off / seconds,
        "cpu_s": cpu,
        "events_per_cpu_s": off / cpu,
        "peak_rss_mb": ru.ru_maxrss / 1024,
        "in_memory": w.hot_count,
    }
    if store is not None:
        store.checkpoint()
        path = Path(tmp) / "partition-0.sqlite"
        out |= {"on_disk": len(store), "file_mb": sum(f.stat().st_size for f in path.parent.iterdir()) / 1e6}
        assert w.hot_count + len(store) == n
    else:
        assert w.open_count == n
    shutil.rmtree(tmp)
    return out


def calibrate(n: int = 20_000) -> dict:
    """Bytes held per window, per event and per tombstone (while spilling: the LRU entry included)."""
    rnd = random.Random(11)

    def held(n_events: int, started: bool = True, close: bool = False) -> float:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        batches = [trajectory(rnd, i, n_events, started) for i in range(n)]
        cfg = (
            WindowConfig(FlowSettings(deadline_s=1, allowed_lateness_s=10**9, max_future_s=10**9, task_kinds={}))
            if close
            else CFG
        )
        w = PartitionWindows(cfg, store=MemoryStore(), budget_bytes=10**15)
        for i, evs in enumerate(batches):
            for e in evs:
                w.ingest(e, i)
        if close:  # a far event closes every window by deadline: never started, so each becomes a tombstone
            w.ingest(trajectory(rnd, n + 10**8, 1)[0], n)
            assert len(w.tombstones) == n and len(w.open) == 1
        del batches, evs  # the events are the windows' now (or garbage, for tombstones)
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return (after - before) / n

    one, three = held(1), held(3)
    event = (three - one) / 2
    return {"window": one - event, "event": event, "tombstone": held(1, started=False, close=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=1_000_000, help="open trajectories (3 events each)")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="flow.state_memory_mb of the spill run")
    ap.add_argument("--snapshot-every", type=int, default=100_000, help="events between store checkpoints")
    ap.add_argument("--calibrate", action="store_true", help="measure the size constants instead")
    ap.add_argument("--mode", choices=["memory", "spill"], help=argparse.SUPPRESS)  # one subprocess's run
    args = ap.parse_args()
    if args.calibrate:
        c = calibrate()
        print(
            f"bytes in memory: window {c['window']:,.0f}, event {c['event']:,.0f}, tombstone {c['tombstone']:,.0f} "
            "(flows.windowing: WINDOW_BYTES, EVENT_BYTES, TOMBSTONE_BYTES)"
        )
        return
    if args.mode:
        print(json.dumps(run(args.mode, args.trajectories, args.budget_mb, args.snapshot_every)))
        return
    res = {}
    for mode in ("memory", "spill"):
        cmd = [sys.executable, __file__, "--mode", mode, "--trajectories", str(args.trajectories)]
        cmd += ["--budget-mb", str(args.budget_mb), "--snapshot-every", str(args.snapshot_every)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(res[mode]))
    m, s = res["memory"], res["spill"]
    print(
        f"\n{args.trajectories:,} open trajectories x 3 events, one partition:\n"
        f"  all in memory: peak RSS {m['peak_rss_mb']:,.0f} MB, {m['events_per_s']:,.0f} events/s "
        f"({m['events_per_cpu_s']:,.0f} per CPU second)\n"
        f"  spilled (budget {args.budget_mb:g} MB): peak RSS {s['peak_rss_mb']:,.0f} MB, "
        f"{s['events_per_s']:,.0f} events/s ({s['events_per_cpu_s']:,.0f} per CPU second); {s['in_memory']:,} "
        f"windows in memory, {s['on_disk']:,} on disk ({s['file_mb']:,.0f} MB of files)\n"
        f"  ratio spilled/in-memory: RSS {s['peak_rss_mb'] / m['peak_rss_mb']:.3f}, "
        f"events/s {s['events_per_s'] / m['events_per_s']:.2f}, "
        f"per CPU second {s['events_per_cpu_s'] / m['events_per_cpu_s']:.2f}"
    )


if __name__ == "__main__":
    main()
