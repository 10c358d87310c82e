"""Beam backfill throughput (``flows.backfill.backfill``, ``rtrl backfill``) next to a plain pyarrow + rewards
loop over the same archive, same run.

    .venv/bin/python bench/backfill.py [--trajectories 20000] [--rounds 3] [--workers 1,2] [--profile]

About 75 s on 2 vCPUs at the defaults (quiet machine). Everything runs in this one process (and the FnApiRunner's
worker processes) on one temporary folder and one embedded chdb ClickHouse.

The archive is built once (not timed): ``--trajectories`` simulator trajectories (~10 events each, the
simulator's default duplicate, reorder and late-check rates), spread over 4 Kafka partitions by crc32 of the
trajectory id as the SDK's producer does, given per-partition offsets in the order they are produced, and
written with ``flows.sinks.write_archive(root, with_coords(...))`` in batches of 20,000 rows as the reward flow's
sink does (one file per batch and date). No broker is needed.

Then, for ``--rounds`` rounds, alternating (medians are reported):

- *baseline*: ``pyarrow.parquet.read_table`` per file, the rows as events (``schemas.types.from_arrow``, the
  same conversion the backfill uses), a Python group-by per trajectory id, and ``rewards.compute(events, "v2")``
  per trajectory. It does not dedupe by offset or by event id, close windows by event time, apply the
  deadline or the allowed lateness, revise rewards, write dead letters, write Parquet or load ClickHouse.
- *backfill code, no Beam*: ``ReadFile`` and ``WindowPartition`` (the pipeline's own DoFns) called directly in
  this process, one partition after the other, Parquet output included, no ClickHouse: what the pipeline
  computes without the runner.
- *backfill, N workers*: the whole ``backfill(settings, "v2", client=ch, workers=N)`` call on the local
  FnApiRunner (N=1: in this process; N>1: N worker processes), into a fresh ClickHouse database each time;
  also its pipeline part alone (``BackfillResult.seconds``: the Beam pipeline, from ``beam.Pipeline`` to its
  end) and the rest (archive listing, version registration, reading the Parquet output back and the
  idempotent ClickHouse load).

Every configuration also reports the CPU seconds of this process and its child processes, and those of every
other process on the machine meanwhile: on a shared small VM the wall-clock figures are only comparable when
the latter is near zero; events per bench CPU second move less. Last, the fixed cost: ``backfill()`` of a
100-trajectory archive once per worker count (starting the worker processes).

``--profile`` runs the 1-worker pipeline once more under cProfile (the FnApiRunner's in-memory worker runs in
this process) and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import calendar
import cProfile
import io
import os
import platform
import pstats
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import apache_beam
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from flows import backfill as bf
from flows.sinks import ARCHIVE_COORDS, with_coords, write_archive
from flows.windowing import WindowConfig
from rewards import compute
from rewards.versions import registry
from rtrl import clickhouse
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from schemas.records import EventBase, Reward
from schemas.types import from_arrow, to_arrow
from simulator.generate import generate

SALT = "bench-salt-123"
PARTITIONS = 4
BATCH_ROWS = 20_000  # the reward flow's sink batch (flow.batch_rows): one archive file per batch and date
VERSION = "v2"
START_MS = calendar.timegm((2026, 11, 1, 0, 0, 0)) * 1000


# ---------------------------------------------------------------- the archive


def build_archive(root: Path, trajectories: int) -> dict:
    """Simulator events, Kafka-partitioned and offset as the stream reads them, archived as the flow does."""
    codec = event_codec()
    sim = SimulatorSettings(trajectories=trajectories, seed=1, start_ms=START_MS)
    # through the codec, as the flow archives what it decoded from Kafka
    events = [codec.decode(codec.encode(e.event)) for e in generate(sim, SALT)]
    offsets: Counter[int] = Counter()
    coords = []
    for e in events:
        p = zlib.crc32(e.trajectory_id.encode()) % PARTITIONS
        coords.append((p, offsets[p]))
        offsets[p] += 1
    for i in range(0, len(events), BATCH_ROWS):
        write_archive(root, with_coords(to_arrow(events[i : i + BATCH_ROWS], EventBase), coords[i : i + BATCH_ROWS]))
    files = sorted(str(p) for p in root.glob("date=*/part-*.parquet"))
    return {
        "events": len(events),
        "files": files,
        "bytes": sum(os.path.getsize(f) for f in files),
        "partitions": dict(sorted(offsets.items())),
        "trajectories": len({e.trajectory_id for e in events}),
    }


# ---------------------------------------------------------------- CPU of this process and its children


class CpuSampler:
    """CPU seconds of this process, of its child processes (the FnApiRunner's workers, sampled every 0.2 s so
    that children which exit before the end still count) and of everything else on the machine (the cores'
    busy time minus these: on a shared 2-core VM this is what else competed for the cores)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.cpu0, self.busy0 = self._own(), self._busy()
        self.children: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-cpu-sampler")
        self.thread.start()

    def _own(self) -> float:
        c = self.me.cpu_times()
        return c.user + c.system

    @staticmethod
    def _busy() -> float:
        c = psutil.cpu_times()
        return sum(c) - c.idle - getattr(c, "iowait", 0.0)

    def _sample(self) -> None:
        for child in self.me.children(recursive=True):
            try:
                c = child.cpu_times()
                self.children[child.pid] = c.user + c.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self._sample()

    def report(self) -> dict[str, float]:
        """CPU seconds: ``own`` (this process), ``children`` (and how many: ``n_children``), ``others``."""
        self.stop.set()
        self.thread.join()
        self._sample()
        own, children = self._own() - self.cpu0, sum(self.children.values())
        others = max(0.0, self._busy() - self.busy0 - own - children)
        return {"own": own, "children": children, "n_children": len(self.children), "others": others}


# ---------------------------------------------------------------- the three sides


def baseline(files: list[str]) -> dict:
    """pyarrow read per file -> events -> group by trajectory -> rewards.compute per trajectory."""
    t = time.perf_counter()
    split = dict.fromkeys(("read", "to_events", "group", "compute"), 0.0)
    by_traj: dict[str, list[EventBase]] = defaultdict(list)
    n = 0
    coords = [f.name for f in ARCHIVE_COORDS]
    for path in files:
        t0 = time.perf_counter()
        table = pq.read_table(path)
        t1 = time.perf_counter()
        events = from_arrow(table.drop_columns(coords), EventBase)
        t2 = time.perf_counter()
        for e in events:
            by_traj[e.trajectory_id].append(e)
        n += len(events)
        split["read"] += t1 - t0
        split["to_events"] += t2 - t1
        split["group"] += time.perf_counter() - t2
    t0 = time.perf_counter()
    scored = sum(1 for events in by_traj.values() if compute(events, VERSION) is not None)
    split["compute"] = time.perf_counter() - t0
    return {"events": n, "s": time.perf_counter() - t, "rewards": scored, "split": split}


def no_beam(settings, files: list[str], out: str) -> dict:
    """The pipeline's DoFns called directly, in this process: read, group by partition, window, write Parquet."""
    chosen = registry(settings).select([VERSION], "--reward-version")[0]
    spec = bf.Spec(chosen.config, WindowConfig(settings.flow), out, None, None, settings.sdk.max_event_bytes, 0)
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    read, window = bf.ReadFile(spec), bf.WindowPartition(spec)
    by_part: dict[int, list] = defaultdict(list)
    n, dead = 0, 0
    for path in files:
        for item in read.process(path):
            if isinstance(item, apache_beam.pvalue.TaggedOutput):
                dead += 1
                continue
            by_part[item[0]].append(item[1])
            n += 1
    t_read = time.perf_counter() - t
    for kv in sorted(by_part.items()):
        list(window.process(kv))
    s = time.perf_counter() - t
    rewards = len(bf._read_out(out, "rewards", Reward))
    return {"events": n, "s": s, "read_s": t_read, "window_s": s - t_read, "rewards": rewards, "dead_files": dead}


def run_backfill(settings, ch, workers: int) -> dict:
    t = time.perf_counter()
    result = bf.backfill(settings, VERSION, client=ch, workers=workers)
    total = time.perf_counter() - t
    c = result.counts
    return {
        "events": c["events"],
        "s": total,
        "pipeline_s": result.seconds,
        "rest_s": total - result.seconds,
        "rewards": c["rewards"],
        "written": result.written.get("rewards", 0),
        "dead": {k.removeprefix("dead:"): v for k, v in c.items() if k.startswith("dead:") and v},
        "summary": result.summary(),
    }


def with_cpu(fn, *args) -> dict:
    """``fn(*args)``'s result with the CPU seconds used meanwhile (:class:`CpuSampler`) as ``cpu``."""
    sampler = CpuSampler()
    out = fn(*args)
    out["cpu"] = sampler.report()
    return out


def cpu_text(cpu: dict[str, float]) -> str:
    kids = f", {cpu['n_children']} child processes {cpu['children']:.1f}" if cpu["n_children"] else ""
    return f"CPU s: this process {cpu['own']:.1f}{kids}, other processes on the machine {cpu['others']:.1f}"


def profile_pipeline(settings, files: list[str], top: int = 20) -> None:
    """The 1-worker pipeline under cProfile (its in-memory SDK worker runs in this process)."""
    chosen = registry(settings).select([VERSION], "--reward-version")[0]
    out = str(settings.data_path / "profile-out")
    spec = bf.Spec(chosen.config, WindowConfig(settings.flow), out, None, None, settings.sdk.max_event_bytes, 0)
    options = bf.pipeline_options(settings, 1)
    prof = cProfile.Profile()
    prof.enable()
    bf.run_pipeline(spec, files, options)
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        text = s.getvalue()
        print(f"\n  cProfile, 1-worker pipeline, top {top} by {key}:")
        print("\n".join("    " + line for line in text.splitlines()[text.count("\n", 0, text.find("ncalls")) :]))


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=20_000, help="simulator trajectories (~10 events each)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (all configurations alternate); medians")
    ap.add_argument("--workers", default="1,2", help="FnApiRunner worker counts to measure, comma-separated")
    ap.add_argument("--profile", action="store_true", help="also profile the 1-worker pipeline (cProfile)")
    args = ap.parse_args()
    worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]

    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, apache-beam {apache_beam.__version__}, pyarrow {pa.__version__}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="rtrl-bench-backfill-"))
    try:
        t = time.perf_counter()
        arc = build_archive(tmp / "archive", args.trajectories)
        tiny = build_archive(tmp / "tiny", 100)
        files, n = arc["files"], arc["events"]
        print(
            f"archive: {n:,} events ({arc['trajectories']:,} trajectories), {len(files)} files, "
            f"{arc['bytes'] / 1e6:.1f} MB Parquet, partitions {arc['partitions']} (built in "
            f"{time.perf_counter() - t:.1f} s, not timed)"
        )
        dsn = f"chdb://{tmp}/ch"
        ch = clickhouse.setup(dsn, "bench", 30)

        def settings_for(name: str, archive: str = "archive"):
            return load_settings(
                env={
                    "RTRL_SDK__SALT": SALT,
                    "RTRL_DATA_DIR": str(tmp / name),
                    "RTRL_FLOW__ARCHIVE_DIR": str(tmp / archive),
                    "RTRL_CLICKHOUSE__DSN": dsn,
                    "RTRL_CLICKHOUSE__DATABASE": name,
                }
            )

        base_runs: list[dict] = []
        plain_runs: list[dict] = []
        bf_runs: dict[int, list[dict]] = {w: [] for w in worker_counts}
        for r in range(args.rounds):
            b = with_cpu(baseline, files)
            assert b["events"] == n, (b["events"], n)
            base_runs.append(b)
            print(
                f"  round {r + 1} baseline (pyarrow + group-by + rewards.compute): {n / b['s']:>9,.0f} events/s "
                f"({b['s']:.2f} s, {b['rewards']:,} trajectories scored; "
                + ", ".join(f"{k} {v:.2f} s" for k, v in b["split"].items())
                + f"; {cpu_text(b['cpu'])})"
            )
            p = with_cpu(no_beam, settings_for(f"plain{r}"), files, str(tmp / f"plain{r}" / "out"))
            plain_runs.append(p)
            print(
                f"  round {r + 1} backfill DoFns, no Beam: {p['events'] / p['s']:>9,.0f} events/s ({p['s']:.2f} s: read "
                f"{p['read_s']:.2f} s, window+Parquet {p['window_s']:.2f} s; {p['rewards']:,} rewards; "
                f"{cpu_text(p['cpu'])})"
            )
            for w in worker_counts:
                db = f"bench_w{w}_r{r}"
                clickhouse.migrate(ch, db)  # a fresh database: every run inserts all its rewards
                x = with_cpu(run_backfill, settings_for(db), ch, w)
                assert x["events"] == n, (x["events"], n)
                bf_runs[w].append(x)
                print(
                    f"  round {r + 1} backfill(), {w} worker{'s' if w > 1 else ''}: {n / x['s']:>9,.0f} events/s "
                    f"({x['s']:.2f} s: pipeline {x['pipeline_s']:.2f} s = {n / x['pipeline_s']:,.0f} events/s, rest "
                    f"{x['rest_s']:.2f} s; {x['rewards']:,} rewards, {x['written']:,} inserted; dead letters "
                    f"{x['dead'] or 'none'}; {cpu_text(x['cpu'])})"
                )

        def med(runs: list[dict], key: str) -> float:
            return statistics.median(x[key] for x in runs)

        def med_cpu(runs: list[dict]) -> tuple[float, float]:
            mine = statistics.median(x["cpu"]["own"] + x["cpu"]["children"] for x in runs)
            return mine, statistics.median(x["cpu"]["others"] for x in runs)

        base_s = med(base_runs, "s")
        base_eps = n / base_s
        rows: list[tuple[str, float, tuple[float, float] | None]] = [
            ("baseline: pyarrow read + group-by + rewards.compute v2", base_s, med_cpu(base_runs)),
            (
                "backfill DoFns called directly, no Beam (Parquet out, no ClickHouse)",
                med(plain_runs, "s"),
                med_cpu(plain_runs),
            ),
        ]
        for w in worker_counts:
            label = f"{w} worker{'s' if w > 1 else ''}"
            cpu = med_cpu(bf_runs[w])
            rows.append((f"backfill(), {label}: whole call (incl. ClickHouse load)", med(bf_runs[w], "s"), cpu))
            rows.append((f"backfill(), {label}: pipeline part alone", med(bf_runs[w], "pipeline_s"), None))
        base_per_cpu = n / med_cpu(base_runs)[0]
        print(f"\nmedians of {args.rounds} round(s), {n:,} events, {len(files)} files:")
        print(
            f"  {'configuration':70}{'events':>9}{'seconds':>9}{'events/s':>10}{'ratio':>7}"
            f"{'CPU s, bench':>14}{'CPU s, others':>15}{'events/CPU s':>14}{'ratio':>7}"
        )
        for label, s, used in rows:
            cpu_cols = (
                f"{used[0]:>14.1f}{used[1]:>15.1f}{n / used[0]:>14,.0f}{(n / used[0]) / base_per_cpu:>7.2f}"
                if used
                else ""
            )
            print(f"  {label:70}{n:>9,}{s:>9.2f}{n / s:>10,.0f}{(n / s) / base_eps:>7.2f}{cpu_cols}")
        for w in worker_counts:
            print(
                f"  {w} worker(s): outside the pipeline (listing, version registration, Parquet read-back, ClickHouse "
                f"load) {med(bf_runs[w], 'rest_s'):.2f} s"
            )
        print(
            "  CPU s, bench: this process and its child processes (the FnApiRunner's workers); CPU s, others: what\n"
            "  the rest of the machine used meanwhile (when it is high, the wall-clock figures are contended: the\n"
            "  events per bench CPU second move less). Read the ratios honestly: the baseline scores every\n"
            "  trajectory once from all its events; it does not dedupe by offset or event id, close windows by event\n"
            "  time (deadline, grace, allowed lateness, revisions), write dead letters, write Parquet or load\n"
            "  ClickHouse, and it runs without a runner (no per-element encoding between stages, no worker processes)."
        )
        print(f"  last run: {bf_runs[worker_counts[-1]][-1]['summary']}")

        print(
            f"\nfixed cost: backfill() of {tiny['events']:,} events ({len(tiny['files'])} file), once per worker count"
        )
        for w in worker_counts:
            db = f"bench_tiny_w{w}"
            clickhouse.migrate(ch, db)
            x = with_cpu(run_backfill, settings_for(db, "tiny"), ch, w)
            print(
                f"  {w} worker{'s' if w > 1 else ''}: {x['s']:.2f} s whole call, pipeline {x['pipeline_s']:.2f} s; "
                f"{cpu_text(x['cpu'])}"
            )
        if args.profile:
            profile_pipeline(settings_for("profile"), files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
