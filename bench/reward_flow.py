"""Reward flow figures: throughput per worker next to a raw loader, end-to-end latency, window memory.

    .venv/bin/python bench/reward_flow.py [--events 200000] [--rounds 5] [--rate 100] [--measure-s 20]
                                          [--open 100000] [--profile]

About 4 minutes on 2 vCPUs. Everything runs in this one process on a local noida-db broker and one
embedded chdb folder (separate databases per run). What each figure means:

1. **Throughput, events/s per worker, Kafka -> ClickHouse.** ~200k simulator events are produced
   once (not timed) to a 4-partition topic. *Baseline*: a raw confluent-kafka Consumer (all
   partitions assigned from the beginning, ``consume(1000)`` until the high watermarks) + msgspec
   decode + ``to_arrow`` + ``insert_table`` into the events table every 20k rows, timed end to end.
   *Flow*: ``flows.reward_flow.build_flow`` run in-process on one Bytewax worker (``run_main``,
   ``flow.tail=false`` so it stops at the end of the topic, 2 s epochs as ``-s 2`` in production)
   over the same topic into another database, timed end to end. The flow does strictly more than
   the baseline: it also windows every trajectory, computes rewards and trajectory summaries,
   writes the rewards/trajectories tables, produces every reward to the rewards topic and writes
   the Parquet archive. Target from the issue: >= 50k events/s per worker and >= 0.5 of the
   baseline. Baseline and flow alternate for ``--rounds`` rounds (3 s pause before each, while
   noida-db saves its state); medians are reported. Each run also prints where the CPU went (per
   thread group of this process, read from /proc, plus the noida-db process) and the CPU time of
   Python's cyclic GC. If the target is missed (or with ``--profile``), the flow is run once more
   under cProfile and the top 15 functions by cumulative and by own time are printed; GC pauses
   appear there charged to whatever call allocated (``__new__``, msgspec ``decode``).
2. **End-to-end latency p50/p99 at a fixed load.** A flow thread (``tail=true``, grace 1 s, sink
   ``batch_seconds`` 0.2, 2 s epochs) on its own topics and database. Synthetic trajectories
   (started, 2 tool calls, edit_proposed, edit_rejected, latency, trajectory_ended; no accepted
   edit, so nothing waits for a persistence check) are recorded through the client SDK with event
   time = wall time, at ``--rate`` trajectories/s. Latency = the wall time a trajectory's reward row
   is first seen by a ``SELECT`` polled every 50 ms from the main thread, minus the wall time its
   last event was recorded. Measured trajectories are those started during the ``--measure-s``
   window after a warm-up (until the first reward appears); production continues for a tail
   afterwards, because a window only closes when a *later* event on the same partition moves that
   partition's watermark past ``ended + grace``.
3. **Memory per 100k open trajectories.** ``--open`` trajectories' first three events (started,
   tool_call, edit_proposed) are ingested into one ``PartitionWindows`` with a 10 h deadline (so
   nothing closes); reported are the tracemalloc growth (Python heap held by the windows) and the
   pickled size of the windows, which is what Bytewax recovery stores per snapshot.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pickle
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from datetime import timedelta
from pathlib import Path
from typing import Any

from bytewax.testing import run_main
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from client.sdk import RtrlClient
from devservices.broker import LocalBroker
from flows.reward_flow import build_flow
from flows.windowing import PartitionWindows, WindowConfig
from rtrl import clickhouse
from rtrl.kafka import base_config, ensure_topics, producer_config
from rtrl.kafka import produce as produce_one  # bench's own produce() sends a whole list
from rtrl.sections.flows import FlowSettings
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import Invalid, event_codec
from schemas.records import EventBase
from schemas.types import to_arrow
from simulator.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for bench.spill_state
from bench.spill_state import trajectory as open_trajectory  # noqa: E402  # the same open trajectory as the spill bench

SALT = "bench-salt-123"
TARGET_EPS = 50_000
TARGET_RATIO = 0.5
EPOCH = timedelta(seconds=2)  # what `bytewax.run -s 2` (flow.snapshot_s) gives in production


def flow_settings(bootstrap: str, prefix: str, dsn: str, db: str, data_dir: str, **flow: str):
    env = {
        "RTRL_KAFKA__BOOTSTRAP": bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": prefix,
        "RTRL_CLICKHOUSE__DSN": dsn,
        "RTRL_CLICKHOUSE__DATABASE": db,
        "RTRL_DATA_DIR": data_dir,
        "RTRL_SDK__SALT": SALT,
    }
    env |= {f"RTRL_FLOW__{k.upper()}": v for k, v in flow.items()}
    return load_settings(env=env)


def count(ch, db: str, table: str) -> int:
    return int(ch.command(f"SELECT count() FROM {db}.{table}"))


def distinct_events(ch, db: str) -> int:
    # ReplacingMergeTree already drops duplicates inside one insert block (optimize_on_insert), so a
    # plain count depends on batch boundaries: compare distinct event ids instead
    return int(ch.command(f"SELECT uniqExact(event_id) FROM {db}.events"))


class CpuSampler:
    """CPU seconds per thread group of this process, and of the noida-db broker process, over a run.

    Reads /proc every 0.2 s so threads that exit before the end (Bytewax's Kafka consumers) count.
    """

    def __init__(self, broker_dir: str) -> None:
        self.broker_dir = broker_dir  # counts only the noida-db processes serving this bench's broker
        self.worker = threading.get_native_id()  # the baseline loop and run_main (the Bytewax worker) run here
        self.me: int | None = None
        self.first, self.last = self._threads(), {}  # type: dict, dict
        self.noida0 = self._noida()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-cpu-sampler")
        self.thread.start()

    @staticmethod
    def _stat(path: str) -> tuple[str, float]:
        with open(path + "/comm") as f:
            comm = f.read().strip()
        with open(path + "/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        return comm, (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")

    def _threads(self) -> dict[int, tuple[str, float]]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                out[int(tid)] = self._stat(f"/proc/self/task/{tid}")
            except OSError:
                pass
        return out

    def _noida(self) -> float:
        total = 0.0
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    comm, cpu = self._stat(f"/proc/{pid}")
                    if comm.startswith("noida"):
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            total += cpu if self.broker_dir.encode() in f.read() else 0.0
                except OSError:
                    continue
        return total

    def _loop(self) -> None:
        self.me = threading.get_native_id()
        while not self.stop.wait(0.2):
            self.last.update(self._threads())

    def report(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        self.last.update(self._threads())
        groups: dict[str, float] = {}
        for tid, (comm, cpu) in self.last.items():
            if tid == self.me:
                continue
            used = cpu - self.first.get(tid, (comm, 0.0))[1]
            if tid == self.worker:
                g = "main thread (all Python steps)"
            elif comm.startswith("rdk:"):
                g = "librdkafka threads"
            elif comm.startswith("python"):
                g = "other Python threads (chdb calls, SDK)"
            else:
                g = "chdb engine threads"
            groups[g] = groups.get(g, 0.0) + used
        groups["noida-db broker (other process)"] = self._noida() - self.noida0
        return groups


class GcTimer:
    """CPU time spent in Python's cyclic garbage collector (cProfile charges it to whichever call
    allocated when a collection started, e.g. ``__new__`` or msgspec ``decode``)."""

    def __init__(self) -> None:
        self.total, self.collections, self._t = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.thread_time()
        else:
            self.total += time.thread_time() - self._t
            self.collections += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def print_cpu(groups: dict[str, float], wall: float) -> None:
    cores = os.cpu_count() or 1
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    print(f"    CPU seconds over {wall:.1f} s wall x {cores} cores: {parts}")


# ---------------------------------------------------------------- 1. throughput


def produce(bootstrap: str, topic: str, payloads: list[tuple[bytes, bytes]]) -> None:
    p = Producer(producer_config(bootstrap))
    for key, value in payloads:
        produce_one(p, topic, value, key, poll_s=0.01)
        p.poll(0)
    assert p.flush(120) == 0


def raw_load(bootstrap: str, topic: str, ch, db: str, batch_rows: int = 20_000) -> tuple[int, float, dict]:
    """Baseline: consume everything, decode, insert in batches of ``batch_rows``; (events, seconds, split)."""
    t = time.perf_counter()
    split = dict.fromkeys(("consume", "decode", "to_arrow", "insert"), 0.0)
    c = Consumer(
        base_config(bootstrap) | {"group.id": "bench-raw", "enable.auto.commit": False, "auto.offset.reset": "earliest"}
    )
    parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
    total = 0
    for p in parts:
        low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        total += high - low
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    codec = event_codec()
    seen, rows, bad = 0, [], 0

    def insert(rows: list) -> None:
        t0 = time.perf_counter()
        data = to_arrow(rows, EventBase)
        t1 = time.perf_counter()
        clickhouse.insert_table(ch, db, "events", data)
        split["to_arrow"] += t1 - t0
        split["insert"] += time.perf_counter() - t1

    while seen < total:
        t0 = time.perf_counter()
        msgs = c.consume(1000, timeout=1.0)
        t1 = time.perf_counter()
        for m in msgs:
            if m.error():
                continue
            seen += 1
            try:
                rows.append(codec.decode(m.value()))
            except Invalid:
                bad += 1
        split["consume"] += t1 - t0
        split["decode"] += time.perf_counter() - t1
        if len(rows) >= batch_rows:
            insert(rows)
            rows = []
    if rows:
        insert(rows)
    c.close()
    return seen, time.perf_counter() - t, split


def throughput(args, bootstrap: str, dsn: str, ch, tmp: str) -> dict:
    prefix = "tp."
    ensure_topics(bootstrap, prefix, 4)
    events = [e.event for e in generate(SimulatorSettings(trajectories=max(1, args.events // 10), seed=1), SALT)]
    codec = event_codec()
    payloads = [(e.trajectory_id.encode(), codec.encode(e)) for e in events]
    produce(bootstrap, prefix + "events", payloads)
    n = len(payloads)
    print(
        f"\n[1] throughput: {n:,} simulator events ({sum(len(v) for _, v in payloads) / 1e6:.1f} MB JSON) "
        f"in {prefix}events, 4 partitions"
    )

    def run_flow(db: str, profile: cProfile.Profile | None = None) -> float:
        s = flow_settings(bootstrap, prefix, dsn, db, os.path.join(tmp, db), tail="false")
        t = time.perf_counter()
        flow = build_flow(s)
        if profile is not None:
            profile.enable()
        run_main(flow, epoch_interval=EPOCH)
        if profile is not None:
            profile.disable()
        return time.perf_counter() - t

    raws: list[dict[str, Any]] = []
    flows: list[dict[str, Any]] = []
    for r in range(args.rounds):  # alternate, so both sides see the same broker and engine state
        raw_db, flow_db = f"bench_raw{r}", f"bench_flow{r}"
        for db in (raw_db, flow_db):
            clickhouse.migrate(ch, db)  # both sides start from migrated, empty tables
        time.sleep(args.settle_s)  # noida-db saves its state a second or two after writes: let it finish
        sampler = CpuSampler(os.path.join(tmp, "broker"))
        seen, raw_s, split = raw_load(bootstrap, prefix + "events", ch, raw_db)
        raw_cpu = sampler.report()
        raw_rows = distinct_events(ch, raw_db)
        assert seen == n, (seen, n)
        raws.append({"eps": n / raw_s, "s": raw_s, "split": split, "cpu": raw_cpu})
        print(
            f"  round {r + 1} baseline raw consumer+decode+to_arrow+insert: {n / raw_s:>9,.0f} events/s "
            f"({raw_s:.2f} s, {raw_rows:,} distinct events)"
        )
        print("    baseline split: " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()))
        print_cpu(raw_cpu, raw_s)

        time.sleep(args.settle_s)
        sampler = CpuSampler(os.path.join(tmp, "broker"))
        with GcTimer() as gct:
            flow_s = run_flow(flow_db)
        flow_cpu = sampler.report()
        flow_rows = distinct_events(ch, flow_db)
        rewards, trajs = (count(ch, flow_db, t) for t in ("rewards", "trajectories"))
        assert flow_rows == raw_rows, (flow_rows, raw_rows)
        flows.append(
            {
                "eps": n / flow_s,
                "s": flow_s,
                "cpu": flow_cpu,
                "gc_s": gct.total,
                "gc_n": gct.collections,
                "rewards": rewards,
            }
        )
        print(
            f"  round {r + 1} reward flow, 1 worker (run_main, tail=false): {n / flow_s:>9,.0f} events/s ({flow_s:.2f} s, "
            f"{flow_rows:,} distinct events, {rewards:,} reward rows, {trajs:,} trajectory rows, + rewards topic "
            f"+ Parquet archive)"
        )
        print_cpu(flow_cpu, flow_s)
        print(
            f"    Python cyclic GC: {gct.total:.1f} CPU s in {gct.collections:,} collections (part of the Python threads' time)"
        )

    raw_eps = statistics.median(x["eps"] for x in raws)
    flow_eps = statistics.median(x["eps"] for x in flows)
    mid = sorted(flows, key=lambda x: x["eps"])[len(flows) // 2]
    worker_cpu = mid["cpu"].get("main thread (all Python steps)", 0.0)
    ratio = flow_eps / raw_eps
    met = flow_eps >= TARGET_EPS and ratio >= TARGET_RATIO
    print(
        f"  median of {args.rounds}: baseline {raw_eps:,.0f} events/s, flow {flow_eps:,.0f} events/s per worker, "
        f"ratio flow/baseline {ratio:.2f}"
    )
    print(
        f"  target >= {TARGET_EPS:,} events/s per worker and >= {TARGET_RATIO} of raw: "
        f"{'MET' if met else 'NOT MET'} ({flow_eps:,.0f} events/s, ratio {ratio:.2f})"
    )
    print(
        f"  the median flow run's main thread (every Python step) used {worker_cpu:.1f} CPU s = "
        f"{n / worker_cpu:,.0f} events per CPU second of the worker thread; GC took {mid['gc_s']:.1f} CPU s"
    )
    out = {
        "events": n,
        "raws": raws,
        "flows": flows,
        "raw_eps": raw_eps,
        "flow_eps": flow_eps,
        "ratio": ratio,
        "met": met,
        "worker_cpu": worker_cpu,
        "mid": mid,
    }
    if not met or args.profile:
        prof = cProfile.Profile()
        clickhouse.migrate(ch, "bench_prof")
        time.sleep(args.settle_s)
        prof_s = run_flow("bench_prof", prof)
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).strip_dirs()
        st.sort_stats("cumulative").print_stats(15)
        st.sort_stats("tottime").print_stats(15)
        print(
            f"  cProfile of a second flow run ({prof_s:.2f} s under the profiler; chdb inserts run on the "
            f"rtrl-chdb thread and show here as the wait in EngineThread._call):"
        )
        print("\n".join("    " + line for line in buf.getvalue().splitlines() if line.strip()))
    return out


# ---------------------------------------------------------------- 2. latency


def latency(args, bootstrap: str, dsn: str, ch, tmp: str) -> dict:
    prefix, db = "lat.", "bench_lat"
    ensure_topics(bootstrap, prefix, 4)
    clickhouse.migrate(ch, db)
    s = flow_settings(bootstrap, prefix, dsn, db, os.path.join(tmp, db), tail="true", grace_s="1", batch_seconds="0.2")
    flow = build_flow(s)
    runner = threading.Thread(
        target=run_main, args=(flow,), kwargs={"epoch_interval": EPOCH}, daemon=True, name="bench-flow"
    )
    runner.start()

    client = RtrlClient(bootstrap, salt=SALT, topic=prefix + "events")
    last_event: dict[str, float] = {}
    measured: set[str] = set()
    phase = {"name": "warmup"}  # warmup -> measure -> tail -> stop
    stop = threading.Event()

    def producer() -> None:
        period, i = 1.0 / args.rate, 0
        nxt = time.perf_counter()
        while not stop.is_set():
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            nxt += period
            t = client.start_trajectory(
                org_id="org-bench", user_id=f"user-{i % 500}", task_kind="bugfix", policy_version=1
            )
            t.tool_call("read_file", True)
            t.tool_call("run_tests", True)
            edit = t.edit_proposed(12)
            t.edit_rejected(edit)
            t.latency(ttft_ms=350.0, total_ms=2400.0)
            t.end("completed")
            last_event[t.trajectory_id] = time.time()
            if phase["name"] == "measure":
                measured.add(t.trajectory_id)
            i += 1

    appeared: dict[str, float] = {}

    def poll() -> None:
        t0 = time.time()  # a row in the result was committed before this query started
        for (tid,) in ch.query(f"SELECT trajectory_id FROM {db}.rewards").result_rows:
            appeared.setdefault(tid, t0)

    prod = threading.Thread(target=producer, daemon=True, name="bench-producer")
    prod.start()
    started = time.monotonic()
    while not appeared and time.monotonic() - started < 60:
        poll()
        time.sleep(0.05)
    warmup_s = time.monotonic() - started
    if not appeared:
        raise RuntimeError("no reward appeared within 60 s of warm-up: is the flow running?")
    time.sleep(1.0)
    phase["name"] = "measure"
    end_measure = time.monotonic() + args.measure_s
    while time.monotonic() < end_measure:
        poll()
        time.sleep(0.05)
    phase["name"] = "tail"
    end_tail = time.monotonic() + args.tail_s
    while time.monotonic() < end_tail:
        poll()
        time.sleep(0.05)
    stop.set()
    prod.join()
    give_up = time.monotonic() + 15
    while not measured <= appeared.keys() and time.monotonic() < give_up:
        poll()
        time.sleep(0.05)
    cstats = client.close()

    lat = sorted((appeared[t] - last_event[t]) * 1000 for t in measured if t in appeared)
    missing = len(measured) - len(lat)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    out = {
        "rate": args.rate,
        "measured": len(measured),
        "missing": missing,
        "p50": q[49],
        "p99": q[98],
        "min": lat[0],
        "max": lat[-1],
        "warmup_s": warmup_s,
        "runner_alive": runner.is_alive(),
    }
    print(
        f"\n[2] end-to-end latency at {args.rate} trajectories/s ({args.rate * 7} events/s, 4 partitions), "
        f"{len(measured):,} trajectories measured over {args.measure_s:g} s (warm-up {warmup_s:.1f} s, "
        f"tail {args.tail_s:g} s; SDK delivered {cstats.delivered:,}, dropped {cstats.dropped})"
    )
    print(
        f"  last event recorded (SDK) -> reward row visible in ClickHouse: p50 {out['p50']:,.0f} ms, "
        f"p99 {out['p99']:,.0f} ms (min {out['min']:,.0f}, max {out['max']:,.0f}; {missing} never appeared)"
    )
    print(f"  p50 minus the 1 s grace: {out['p50'] - 1000:,.0f} ms")
    print(
        "  components: grace 1,000 ms (event time after trajectory_ended before the window may close; the close "
        "happens on the first later event of the same partition, here a few ms later) + SDK queue/linger 5 ms + "
        "Kafka + Bytewax source poll + ClickHouse sink buffer (flushed when its oldest row is 0.2 s old, checked "
        "as new rows arrive, and at every 2 s epoch end) + chdb insert + the 50 ms poll of this bench"
    )
    return out


# ---------------------------------------------------------------- 3. memory


def memory(args) -> dict:
    codec = event_codec()
    rnd = random.Random(7)
    w = PartitionWindows(WindowConfig(FlowSettings(deadline_s=10 * 3600, task_kinds={})), partition=0)
    payload_bytes = 0
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    off = 0
    for i in range(args.open):
        for ev in open_trajectory(rnd, i):
            p = codec.encode(ev)
            payload_bytes += len(p)
            assert w.ingest(ev, off) == []
            off += 1
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert w.open_count == args.open
    held = after - before
    snap = len(pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL))
    scale = 100_000 / args.open
    out = {
        "open": args.open,
        "heap_mb": held * scale / 1e6,
        "pickle_mb": snap * scale / 1e6,
        "payload_mb": payload_bytes * scale / 1e6,
        "per_traj_b": held / args.open,
    }
    print(f"\n[3] memory: {args.open:,} open trajectories x 3 events in one PartitionWindows (nothing closed)")
    print(
        f"  Python heap held (tracemalloc): {out['heap_mb']:.1f} MB per 100k open trajectories "
        f"({out['per_traj_b']:,.0f} B each, decoded events included; the same events as JSON: {out['payload_mb']:.1f} MB)"
    )
    print(f"  pickled snapshot (what Bytewax recovery stores each epoch): {out['pickle_mb']:.1f} MB per 100k")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="simulator events for the throughput figure (~)")
    ap.add_argument("--rounds", type=int, default=5, help="throughput rounds (baseline and flow alternate); medians")
    ap.add_argument("--settle-s", type=float, default=3.0, help="pause before each timed throughput run")
    ap.add_argument("--rate", type=int, default=100, help="trajectories/s for the latency figure (7 events each)")
    ap.add_argument("--measure-s", type=float, default=20.0, help="seconds of measured trajectories")
    ap.add_argument("--tail-s", type=float, default=3.0, help="seconds of unmeasured trajectories after the measured")
    ap.add_argument("--open", type=int, default=100_000, help="open trajectories for the memory figure")
    ap.add_argument("--profile", action="store_true", help="profile the flow even when the target is met")
    args = ap.parse_args()

    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}"
    )
    tmp = tempfile.mkdtemp(prefix="rtrl-bench-flow-")
    dsn = f"chdb://{tmp}/ch"
    broker = LocalBroker(os.path.join(tmp, "broker"))
    broker.up()
    try:
        ch = clickhouse.connect(dsn)
        tp = throughput(args, broker.bootstrap, dsn, ch, tmp)
        mem = memory(args)
        lat = latency(args, broker.bootstrap, dsn, ch, tmp)
        print("\nsummary")
        print(
            f"  throughput (median of {args.rounds}): flow {tp['flow_eps']:,.0f} events/s/worker vs raw {tp['raw_eps']:,.0f} "
            f"(ratio {tp['ratio']:.2f}); target >= {TARGET_EPS:,} and >= {TARGET_RATIO}: "
            f"{'MET' if tp['met'] else 'NOT MET'}"
        )
        print(
            f"  latency at {lat['rate']} traj/s: p50 {lat['p50']:,.0f} ms, p99 {lat['p99']:,.0f} ms "
            f"(grace 1 s included)"
        )
        print(f"  memory: {mem['heap_mb']:.1f} MB heap / {mem['pickle_mb']:.1f} MB pickled per 100k open trajectories")
        failed = False
    except BaseException:
        traceback.print_exc()  # before stderr is silenced below
        failed = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # the tail=true flow's consumers log every lost connection once the broker stops: silence them
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        try:
            broker.down()
        except Exception as e:  # noqa: BLE001 - report it where it can still be seen
            print(f"broker down failed: {e}")
        shutil.rmtree(tmp, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
    # The latency flow thread (tail=true) never ends and Bytewax has no stop call: leave without
    # running interpreter shutdown under it.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
