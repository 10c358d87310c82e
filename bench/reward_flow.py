"""Reward flow figures: throughput per worker next to a raw loader, end-to-end latency, window memory.

    .venv/bin/python bench/reward_flow.py [--events 200000] [--rate 100] [--measure-s 20] [--open 100000]

Everything runs in this one process on a local noida-db broker and one embedded chdb folder
(separate databases per run). What each figure means:

1. **Throughput, events/s per worker, Kafka -> ClickHouse.** ~200k simulator events are produced
   once (not timed) to a 4-partition topic. *Baseline*: a raw confluent-kafka Consumer (all
   partitions assigned from the beginning, ``consume(1000)`` until the high watermarks) + msgspec
   decode + ``to_arrow`` + ``insert_table`` into the events table every 20k rows, timed end to end.
   *Flow*: ``flows.rewards.build_flow`` run in-process on one Bytewax worker (``run_main``,
   ``flow.tail=false`` so it stops at the end of the topic, 2 s epochs as ``-s 2`` in production)
   over the same topic into another database, timed end to end. The flow does strictly more than
   the baseline: it also windows every trajectory, computes rewards and trajectory summaries,
   writes the rewards/trajectories tables, produces every reward to the rewards topic and writes
   the Parquet archive. Target from the issue: >= 50k events/s per worker and >= 0.5 of the
   baseline. If it is missed, the flow is run again under cProfile and the top functions printed.
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
import tracemalloc
from datetime import timedelta

from bytewax.testing import run_main
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from client.sdk import RtrlClient
from flows.rewards import build_flow
from flows.windowing import PartitionWindows, WindowConfig
from rtrl import clickhouse
from rtrl.broker import LocalBroker
from rtrl.config import SimulatorSettings, load_settings
from rtrl.kafka import base_config, ensure_topics, producer_config
from schemas.codec import Invalid, event_codec
from schemas.records import EditProposed, EventBase, ToolCall, TrajectoryStarted
from schemas.types import to_arrow
from simulator.generate import generate

SALT = "bench-salt-123"
TARGET_EPS = 50_000
TARGET_RATIO = 0.5
EPOCH = timedelta(seconds=2)  # what `bytewax.run -s 2` (flow.snapshot_s) gives in production


def flow_settings(bootstrap: str, prefix: str, dsn: str, db: str, data_dir: str, **flow: str):
    env = {"RTRL_KAFKA__BOOTSTRAP": bootstrap, "RTRL_KAFKA__TOPIC_PREFIX": prefix, "RTRL_CLICKHOUSE__DSN": dsn,
           "RTRL_CLICKHOUSE__DATABASE": db, "RTRL_DATA_DIR": data_dir, "RTRL_SDK__SALT": SALT}
    env |= {f"RTRL_FLOW__{k.upper()}": v for k, v in flow.items()}
    return load_settings(env=env)


def count(ch, db: str, table: str) -> int:
    return int(ch.command(f"SELECT count() FROM {db}.{table}"))


# ---------------------------------------------------------------- 1. throughput


def produce(bootstrap: str, topic: str, payloads: list[tuple[bytes, bytes]]) -> None:
    p = Producer(producer_config(bootstrap))
    for key, value in payloads:
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    assert p.flush(120) == 0


def raw_load(bootstrap: str, topic: str, ch, db: str, batch_rows: int = 20_000) -> tuple[int, float, dict]:
    """Baseline: consume everything, decode, insert in batches of ``batch_rows``; (events, seconds, split)."""
    t = time.perf_counter()
    split = dict.fromkeys(("consume", "decode", "to_arrow", "insert"), 0.0)
    c = Consumer(base_config(bootstrap) | {"group.id": "bench-raw", "enable.auto.commit": False,
                                           "auto.offset.reset": "earliest"})
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
    print(f"\n[1] throughput: {n:,} simulator events ({sum(len(v) for _, v in payloads) / 1e6:.1f} MB JSON) "
          f"in {prefix}events, 4 partitions")

    for db in ("bench_raw", "bench_flow", "bench_prof"):
        clickhouse.migrate(ch, db)  # both sides start from migrated, empty tables

    seen, raw_s, split = raw_load(bootstrap, prefix + "events", ch, "bench_raw")
    raw_rows = count(ch, "bench_raw", "events")
    # ReplacingMergeTree drops the simulator's duplicate deliveries already on insert (optimize_on_insert)
    assert seen == n, (seen, n)
    raw_eps = n / raw_s
    print(f"  baseline raw consumer+decode+to_arrow+insert : {raw_eps:>9,.0f} events/s ({raw_s:.2f} s, {raw_rows:,} distinct rows)")
    print("    baseline split: " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()))

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

    flow_s = run_flow("bench_flow")
    flow_rows, rewards, trajs = (count(ch, "bench_flow", t) for t in ("events", "rewards", "trajectories"))
    assert flow_rows == raw_rows, (flow_rows, raw_rows)
    flow_eps = n / flow_s
    ratio = flow_eps / raw_eps
    met = flow_eps >= TARGET_EPS and ratio >= TARGET_RATIO
    print(f"  reward flow, 1 worker (run_main, tail=false) : {flow_eps:>9,.0f} events/s ({flow_s:.2f} s, "
          f"{flow_rows:,} event rows, {rewards:,} rewards, {trajs:,} trajectory rows, + rewards topic + Parquet archive)")
    print(f"  ratio flow/baseline: {ratio:.2f}")
    print(f"  target >= {TARGET_EPS:,} events/s per worker and >= {TARGET_RATIO} of raw: "
          f"{'MET' if met else 'NOT MET'} ({flow_eps:,.0f} events/s, ratio {ratio:.2f})")

    out = {"events": n, "raw_split": split, "raw_eps": raw_eps, "raw_s": raw_s, "flow_eps": flow_eps, "flow_s": flow_s, "ratio": ratio,
           "met": met, "rewards": rewards}
    if not met or args.profile:
        prof = cProfile.Profile()
        prof_s = run_flow("bench_prof", prof)
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).strip_dirs()
        st.sort_stats("cumulative").print_stats(15)
        st.sort_stats("tottime").print_stats(15)
        print(f"  cProfile of a second flow run ({prof_s:.2f} s under the profiler; chdb inserts run on the "
              f"rtrl-chdb thread and show here as the wait in EngineThread._call):")
        print("\n".join("    " + line for line in buf.getvalue().splitlines() if line.strip()))
    return out


# ---------------------------------------------------------------- 2. latency


def latency(args, bootstrap: str, dsn: str, ch, tmp: str) -> dict:
    prefix, db = "lat.", "bench_lat"
    ensure_topics(bootstrap, prefix, 4)
    clickhouse.migrate(ch, db)
    s = flow_settings(bootstrap, prefix, dsn, db, os.path.join(tmp, db), tail="true", grace_s="1",
                      batch_seconds="0.2")
    flow = build_flow(s)
    runner = threading.Thread(target=run_main, args=(flow,), kwargs={"epoch_interval": EPOCH}, daemon=True,
                              name="bench-flow")
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
            t = client.start_trajectory(org_id="org-bench", user_id=f"user-{i % 500}", task_kind="bugfix",
                                        policy_version=1)
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
    out = {"rate": args.rate, "measured": len(measured), "missing": missing, "p50": q[49], "p99": q[98],
           "min": lat[0], "max": lat[-1], "warmup_s": warmup_s, "runner_alive": runner.is_alive()}
    print(f"\n[2] end-to-end latency at {args.rate} trajectories/s ({args.rate * 7} events/s, 4 partitions), "
          f"{len(measured):,} trajectories measured over {args.measure_s:g} s (warm-up {warmup_s:.1f} s, "
          f"tail {args.tail_s:g} s; SDK delivered {cstats.delivered:,}, dropped {cstats.dropped})")
    print(f"  last event recorded (SDK) -> reward row visible in ClickHouse: p50 {out['p50']:,.0f} ms, "
          f"p99 {out['p99']:,.0f} ms (min {out['min']:,.0f}, max {out['max']:,.0f}; {missing} never appeared)")
    print("  components: grace 1,000 ms (event time after trajectory_ended before the window may close; the close "
          "happens on the first later event of the same partition, here a few ms later) + SDK queue/linger 5 ms + "
          "Kafka + Bytewax source poll + ClickHouse sink buffer (flushed when its oldest row is 0.2 s old, checked "
          "as new rows arrive, and at every 2 s epoch end) + chdb insert + the 50 ms poll of this bench")
    return out


# ---------------------------------------------------------------- 3. memory


def memory(args) -> dict:
    codec = event_codec()
    rnd = random.Random(7)
    base = 1_780_000_000_000
    hexid = lambda: f"{rnd.getrandbits(128):032x}"  # noqa: E731
    w = PartitionWindows(WindowConfig(deadline_ms=10 * 3600 * 1000), partition=0)
    payload_bytes = 0
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    off = 0
    for i in range(args.open):
        common = {"trajectory_id": hexid(), "org_id": f"org-{i % 6}", "user_hash": f"{rnd.getrandbits(128):032x}",
                  "policy_version": 3, "arm": "control"}
        ts = base + i * 10
        for ev in (TrajectoryStarted(event_id=hexid(), ts=ts, task_kind="bugfix", **common),
                   ToolCall(event_id=hexid(), ts=ts + 2, tool="read_file", valid=True, **common),
                   EditProposed(event_id=hexid(), ts=ts + 5, edit_id=hexid(), lines=12, **common)):
            p = codec.encode(ev)
            payload_bytes += len(p)
            assert w.ingest(ev, p, off) == []
            off += 1
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert w.open_count == args.open
    held = after - before
    snap = len(pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL))
    scale = 100_000 / args.open
    out = {"open": args.open, "heap_mb": held * scale / 1e6, "pickle_mb": snap * scale / 1e6,
           "payload_mb": payload_bytes * scale / 1e6, "per_traj_b": held / args.open}
    print(f"\n[3] memory: {args.open:,} open trajectories x 3 events in one PartitionWindows (nothing closed)")
    print(f"  Python heap held (tracemalloc): {out['heap_mb']:.1f} MB per 100k open trajectories "
          f"({out['per_traj_b']:,.0f} B each; of which raw JSON payloads {out['payload_mb']:.1f} MB)")
    print(f"  pickled snapshot (what Bytewax recovery stores each epoch): {out['pickle_mb']:.1f} MB per 100k")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="simulator events for the throughput figure (~)")
    ap.add_argument("--rate", type=int, default=100, help="trajectories/s for the latency figure (7 events each)")
    ap.add_argument("--measure-s", type=float, default=20.0, help="seconds of measured trajectories")
    ap.add_argument("--tail-s", type=float, default=3.0, help="seconds of unmeasured trajectories after the measured")
    ap.add_argument("--open", type=int, default=100_000, help="open trajectories for the memory figure")
    ap.add_argument("--profile", action="store_true", help="profile the flow even when the target is met")
    args = ap.parse_args()

    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
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
        print(f"  throughput: flow {tp['flow_eps']:,.0f} events/s/worker vs raw {tp['raw_eps']:,.0f} "
              f"(ratio {tp['ratio']:.2f}); target >= {TARGET_EPS:,} and >= {TARGET_RATIO}: "
              f"{'MET' if tp['met'] else 'NOT MET'}")
        print(f"  latency at {lat['rate']} traj/s: p50 {lat['p50']:,.0f} ms, p99 {lat['p99']:,.0f} ms "
              f"(grace 1 s included)")
        print(f"  memory: {mem['heap_mb']:.1f} MB heap / {mem['pickle_mb']:.1f} MB pickled per 100k open trajectories")
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
    os._exit(0)


if __name__ == "__main__":
    main()
