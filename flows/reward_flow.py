"""The reward flow: Kafka ``rtrl.events`` -> per-trajectory rewards in ClickHouse and Kafka.

    python -m bytewax.run flows.reward_flow:flow -r <recovery dir> -s 2   (needs kafka.bootstrap; or: rtrl flow rewards)

Steps (stable step ids key the recovery state):

``events_in``   KafkaSource over rtrl.events (built after a bounded broker check), each message
                keyed by its Kafka partition: one partition = one event-time clock
``rewards``     parse/validate, deduplicate, window, compute rewards (flows.processor); beyond
                ``flow.state_memory_mb`` per partition, windows spill to SQLite in ``flow.state_dir``
                (flows.spill), rolled back with the recovery snapshot on a resume
``clickhouse``  events, rewards, trajectories, dead_letters tables, and the Parquet archive of
                raw events by date (for backfill)
``kafka``       rtrl.rewards and rtrl.dead_letters topics

Settings come from :func:`rtrl.settings.load_settings` (file + RTRL_* environment), section [flow].

The input and the outputs are injectable: :func:`build_flow` takes ``sources`` (by input name, see
:data:`INPUTS`) and ``sinks`` (by output name, see :data:`OUTPUTS`), so the flow runs in-process on
Bytewax's ``TestingSource``/``TestingSink`` without a broker or ClickHouse. Left out, they are
:func:`kafka_inputs` and :func:`service_outputs`.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import Source
from bytewax.operators import StatefulBatchLogic
from bytewax.outputs import Sink

from flows.counts import FlowCounts, by_kind, dead_letters
from flows.kafka_io import kafka_source, paused
from flows.processor import FlowOutput, RewardProcessor
from flows.sinks import ClickHouseSink, KafkaSink
from flows.spill import SqliteStore, partition_file
from flows.windowing import PartitionWindows, WindowConfig
from flows.wiring import injected, require_bootstrap
from rewards.versions import registry
from rtrl import clickhouse, metrics
from rtrl.clickhouse_cluster import cluster_of
from rtrl.errors import ConfigError
from rtrl.settings import Settings, load_settings
from schemas.codec import JsonCodec
from schemas.erasure import DenySource
from schemas.records import DeadLetter, Reward

#: the flow's input: ``events`` yields ``(str(partition), Message)`` pairs, one key per Kafka partition
INPUTS = ("events",)
#: the flow's outputs: ``clickhouse`` takes ``("clickhouse", (table, rows))`` items, ``kafka`` takes
#: ``("kafka", [(topic, key, value), ...])`` items
OUTPUTS = ("clickhouse", "kafka")


def verdict_kinds(settings: Settings) -> tuple[str, ...]:
    """The task kinds that end with the user's verdict (``flow.task_kinds.NAME.awaits_verdict``): their rewards
    are provisional until it arrives."""
    return WindowConfig(settings.flow).verdict_kinds


def count(counts: FlowCounts | None, messages: int, out: FlowOutput) -> FlowOutput:
    """Add what one batch read and produced to ``counts`` (when given): ``events`` (messages read),
    ``trajectories`` (closed windows, revisions included), ``rewards:<version>`` and ``dead:<kind>``."""
    if counts is not None:
        tally: Counter[str] = Counter(f"rewards:{r.reward_version}" for r in out.rewards)
        tally.update(f"dead:{d.kind}" for d in out.dead_letters)
        tally["events"], tally["trajectories"] = messages, len(out.summaries)
        if out.erased:
            tally["erased"] = out.erased
        counts.add(tally)
    if out.erased:
        metrics.ERASED_SKIPPED.labels(consumer="reward_flow").inc(out.erased)
    metrics.count_flow("rewards", messages, (d.kind for d in out.dead_letters))
    metrics.observe_rewards(out.rewards, time.time_ns() // 1_000_000)
    metrics.observe_trajectories(out.summaries)
    return out


def observe_windows(windows: PartitionWindows) -> None:
    """The partition's open windows and their estimated bytes in memory, as the metrics' gauges."""
    partition = str(windows.partition)
    metrics.OPEN_WINDOWS.labels(partition=partition).set(windows.open_count)
    metrics.WINDOW_STATE_BYTES.labels(partition=partition).set(windows.estimated_bytes)


def summary(counts: FlowCounts, versions: list[str], seconds: float | None = None) -> str:
    """The line the reward flow prints when it ends, e.g. ``reward flow: 12,345 events, 1,001 trajectories closed,
    1,001 rewards (v2), 17 dead letters (duplicate 12, too_late 5) in 4.2s`` (a trajectory a late event reopened
    closes, and is counted, again)."""
    c = counts.snapshot()
    per_version = {v: c[f"rewards:{v}"] for v in versions} | by_kind(c, "rewards:")
    rewards = sum(per_version.values())
    detail = (
        ", ".join(per_version) if len(per_version) == 1 else ", ".join(f"{v} {n:,}" for v, n in per_version.items())
    )
    return (
        f"reward flow: {c['events']:,} events, {c['trajectories']:,} trajectories closed, {rewards:,} rewards ({detail}), "
        f"{dead_letters(c)}" + ("" if seconds is None else f" in {seconds:.1f}s")
    )


class _PartitionLogic(StatefulBatchLogic):
    """Bytewax wrapper: the processor's windows are the snapshotted state of one partition key."""

    def __init__(
        self,
        processor: RewardProcessor,
        stop: threading.Event | None = None,
        counts: FlowCounts | None = None,
        state_root: Path | None = None,
    ):
        self.processor, self.stop, self.counts, self.state_root = processor, stop, counts, state_root

    def on_batch(self, values: list) -> tuple[list[FlowOutput], bool]:
        windows = self.processor.windows
        if self.state_root is not None and windows.store is None and values:
            # the first batch names the partition (the builder is not told its key): a fresh file for it
            windows.store = SqliteStore.fresh(
                partition_file(self.state_root, values[0].partition, uuid.uuid4().hex[:12])
            )
        out = count(self.counts, len(values), self.processor.process(values))
        observe_windows(windows)
        return [out], StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[FlowOutput], bool]:
        if paused(self.stop):  # stopped, not the end of the input: open windows stay open in the snapshot
            return [], StatefulBatchLogic.RETAIN
        return [count(self.counts, 0, self.processor.finish())], StatefulBatchLogic.RETAIN

    def snapshot(self) -> PartitionWindows:
        windows = self.processor.windows
        if isinstance(windows.store, SqliteStore):  # each epoch's writes committed, recovery or not
            windows.store.checkpoint()
        return windows


def kafka_inputs(
    settings: Settings,
    bootstrap: str | None = None,
    stop: threading.Event | None = None,
    keys: Mapping[int, str] | None = None,
) -> dict[str, Source]:
    """The flow's default input (after a bounded broker check): rtrl.events, keyed by Kafka partition (``keys``:
    each partition's key; default ``str(partition)``)."""
    bootstrap, fs = require_bootstrap(settings, bootstrap), settings.flow
    return {
        "events": kafka_source(
            bootstrap,
            [settings.topic("events")],
            settings.kafka.timeout_s,
            tail=fs.tail,
            idle_s=settings.kafka.idle_backoff_s,
            keyed=True,
            stop=stop,
            keys=keys,
        )
    }


def service_outputs(settings: Settings, bootstrap: str | None = None) -> dict[str, Sink]:
    """The flow's default outputs: the ClickHouse tables (+ the Parquet archive) and the Kafka topics."""
    fs = settings.flow
    archive_root = settings.archive_root
    return {
        "clickhouse": ClickHouseSink(
            settings.clickhouse_dsn,
            settings.clickhouse.database,
            fs.batch_rows,
            fs.batch_seconds,
            settings.clickhouse.timeout_s,
            archive=archive_root,
            # registered before the first write (refused: other weights under a name that has scored)
            reward_versions=registry(settings).select(settings.rewards.versions),
            cluster=cluster_of(settings.clickhouse),
        ),
        "kafka": KafkaSink(
            require_bootstrap(settings, bootstrap), settings.sdk.delivery_timeout_s, settings.kafka.compression
        ),
    }


def reconfigure(windows: PartitionWindows, cfg: WindowConfig) -> None:
    """Resume ``windows`` under the current settings' rules ``cfg``: the windows in memory are rescheduled by
    them. Windows spilled to the state file keep the due times they were written with, so a change with some
    spilled is refused (:class:`rtrl.errors.ConfigError`) rather than half applied."""
    if windows.store is not None and len(windows.store):
        raise ConfigError(
            "the reward flow's recovery state was made under other window rules (flow.deadline_s, flow.grace_s, "
            "flow.allowed_lateness_s, flow.max_future_s, flow.max_clock_skew_s or flow.task_kinds) and holds windows spilled to "
            "flow.state_dir, which would keep the old rules; fix: restore the settings the state was made with, "
            "or start the flow afresh (delete flow.recovery_dir and flow.state_dir, and replay the topic)"
        )
    windows.config = cfg
    windows.reschedule()


def build_flow(
    settings: Settings,
    bootstrap: str | None = None,
    stop: threading.Event | None = None,
    *,
    sources: Mapping[str, Source] | None = None,
    sinks: Mapping[str, Sink] | None = None,
    counts: FlowCounts | None = None,
    keys: Mapping[int, str] | None = None,
    deny: DenySource | None = None,
) -> Dataflow:
    """The reward flow for ``settings``; ``keys`` maps each Kafka partition to the key its windows live under
    (default: ``str(partition)``; a cluster's from :func:`flows.routing.balanced_keys`, which spreads them over the
    workers).

    ``sources`` maps each name of :data:`INPUTS` to a Bytewax source and ``sinks`` each name of
    :data:`OUTPUTS` to a sink; left out, they are :func:`kafka_inputs` / :func:`service_outputs`
    (``bootstrap`` overrides ``kafka.bootstrap``; setting ``stop`` ends an in-process run cleanly,
    closing every open window as at the end of the input; a :class:`flows.kafka_io.Pause` keeps them
    open for a restart from the recovery state). With both given the flow touches neither Kafka nor ClickHouse.
    ``counts`` (a :class:`flows.counts.FlowCounts`) counts what the run reads and produces: :func:`summary`.
    ``deny`` lists the erased subjects whose events are skipped; with the service outputs it defaults to the one
    ClickHouse holds (:func:`rtrl.clickhouse.deny_watch`)."""
    source_topic = settings.topic("events")
    cfg = WindowConfig(settings.flow)
    # every listed version is scored (shadow scoring); unknown or ill-defined ones fail here, before any I/O
    versions = registry(settings).configs(settings.rewards.versions)
    sources = kafka_inputs(settings, bootstrap, stop, keys) if sources is None else injected(sources, INPUTS, "sources")
    if deny is None and sinks is None:
        deny = clickhouse.deny_watch(settings)
    sinks = service_outputs(settings, bootstrap) if sinks is None else injected(sinks, OUTPUTS, "sinks")

    # windows beyond the memory budget live in one SQLite file per partition (flows.spill)
    budget = int(settings.flow.state_memory_mb * 1_000_000)
    state_root = Path(settings.state_root)

    def build(resume: PartitionWindows | None) -> _PartitionLogic:
        if resume is not None:
            if isinstance(resume.store, SqliteStore):  # roll the file back to this snapshot's generation
                resume.store.resume(state_root / resume.store.path.name)
            if resume.config != cfg:  # the settings' window rules changed since the snapshot
                reconfigure(resume, cfg)
            resume.budget_bytes = budget
        processor = RewardProcessor(
            source_topic, cfg, versions, settings.sdk.max_event_bytes, resume, verdict_kinds(settings), deny
        )
        processor.windows.budget_bytes = budget
        return _PartitionLogic(processor, stop, counts, state_root if budget > 0 else None)

    # The source makes a tracked Python object per Kafka message; with the default generation-0
    # threshold (700) the cyclic GC ran ~2,000 times per 200k events and took ~30% of the worker's
    # CPU. Nothing here builds cycles, so collect far less often (process-wide, set once).
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)
    flow = Dataflow("rtrl_rewards")
    # keyed by Kafka partition at the source: one partition = one event-time clock
    keyed = op.input("events_in", flow, sources["events"])
    out = op.stateful_batch("rewards", keyed, build)

    def to_clickhouse(kv: tuple[str, FlowOutput]) -> list[tuple[str, tuple[str, list]]]:
        o = kv[1]
        parts: list[tuple[str, list]] = [
            # the archive keeps each event's Kafka partition, offset and record timestamp
            ("events", list(zip(o.events, o.coords))),
            ("rewards", o.rewards),
            ("trajectories", o.summaries),
            ("dead_letters", o.dead_letters),
        ]
        return [("clickhouse", (t, rows)) for t, rows in parts if rows]

    reward_codec: JsonCodec[Reward] = JsonCodec(Reward)
    dl_codec: JsonCodec[DeadLetter] = JsonCodec(DeadLetter)
    rewards_topic, dl_topic = settings.topic("rewards"), settings.topic("dead_letters")

    def to_kafka(kv: tuple[str, FlowOutput]) -> list[tuple[str, list[tuple[str, bytes, bytes]]]]:
        o = kv[1]
        batch = [(rewards_topic, r.trajectory_id.encode(), reward_codec.encode(r)) for r in o.rewards]
        batch += [(dl_topic, d.source.encode(), dl_codec.encode(d)) for d in o.dead_letters]
        return [("kafka", batch)] if batch else []

    op.output("clickhouse", op.flat_map("to_clickhouse", out, to_clickhouse), sinks["clickhouse"])
    op.output("kafka", op.flat_map("to_kafka", out, to_kafka), sinks["kafka"])
    return flow


def __getattr__(name: str) -> Dataflow:
    """``flows.reward_flow:flow`` is built on first access from the environment's settings, so importing
    this module does no I/O but ``python -m bytewax.run flows.reward_flow:flow`` works."""
    if name == "flow":
        return build_flow(load_settings())
    raise AttributeError(name)
