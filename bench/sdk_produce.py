"""SDK produce throughput next to a raw confluent-kafka producer sending the same bytes, same run.

Both sides use the same idempotent producer settings, the same keys and the same encoded events
(the simulator's), against a local noida-db broker, and count until every event is acknowledged.
The SDK additionally validates each event and hands it across its bounded queue to its producer
thread; "caller" is how long ``record()`` calls held the product backend's thread.

    .venv/bin/python bench/sdk_produce.py [--events 100000] [--rounds 3] [--compression zstd|lz4|none]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

from confluent_kafka import Producer

from client.sdk import RtrlClient
from devservices.broker import LocalBroker
from rtrl.kafka import ensure_topics, produce, producer_config
from rtrl.sections.simulator import SimulatorSettings
from schemas.codec import event_codec
from simulator.generate import generate

SALT = "bench-salt-1234"


def raw_round(bootstrap: str, topic: str, payloads: list[tuple[bytes, bytes]], compression: str) -> float:
    p = Producer(producer_config(bootstrap, compression))
    t = time.perf_counter()
    for key, value in payloads:
        produce(p, topic, value, key, poll_s=0.01)
        p.poll(0)
    assert p.flush(120) == 0
    return time.perf_counter() - t


def sdk_round(bootstrap: str, topic: str, events: list, compression: str) -> tuple[float, float]:
    c = RtrlClient(bootstrap, salt=SALT, topic=topic, queue_size=len(events) + 1, compression=compression)
    t = time.perf_counter()
    for e in events:
        c.record(e)
    caller = time.perf_counter() - t
    s = c.close(timeout_s=120)
    total = time.perf_counter() - t
    assert s.delivered == len(events) and s.dropped == 0, s
    return total, caller


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--compression", default="zstd", help="producer batch compression on both sides (kafka.compression)"
    )
    args = ap.parse_args()

    trajectories = max(1, args.events // 10)
    # stamped a day back: inside the SDK's window around its clock (sdk.max_past_s, sdk.max_future_s)
    start_ms = time.time_ns() // 1_000_000 - 86_400_000
    sim = SimulatorSettings(trajectories=trajectories, seed=1, start_ms=start_ms)
    events = [e.event for e in generate(sim, SALT)][: args.events]
    codec = event_codec()
    payloads = [(e.trajectory_id.encode(), codec.encode(e)) for e in events]
    n = len(events)
    mb = sum(len(v) for _, v in payloads) / 1e6

    with tempfile.TemporaryDirectory() as d, LocalBroker(d) as broker:
        raw_s, sdk_s, caller_s = [], [], []
        for r in range(args.rounds):  # alternate so both see the same broker state
            prefix = f"bench{r}."
            ensure_topics(broker.bootstrap, prefix, 4)
            raw_s.append(raw_round(broker.bootstrap, prefix + "rollouts", payloads, args.compression))
            total, caller = sdk_round(broker.bootstrap, prefix + "events", events, args.compression)
            sdk_s.append(total)
            caller_s.append(caller)

    raw, sdk, caller = statistics.median(raw_s), statistics.median(sdk_s), statistics.median(caller_s)
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    print(
        f"{n:,} events ({mb:.1f} MB encoded), {args.compression} batches, median of {args.rounds} rounds, "
        "acknowledged by the broker"
    )
    print(f"raw confluent-kafka producer : {n / raw:>10,.0f} events/s  ({raw:.2f} s)")
    print(f"rtrl SDK (validate+queue+produce): {n / sdk:>10,.0f} events/s  ({sdk:.2f} s)")
    print(f"rtrl SDK caller-side record()    : {n / caller:>10,.0f} events/s  ({caller:.2f} s)")
    print(f"ratio SDK / raw: {raw / sdk:.2f}")


if __name__ == "__main__":
    main()
