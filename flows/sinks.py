"""Bytewax sinks of the reward flow: ClickHouse tables (+ the Parquet archive of events), Kafka topics.

All are at-least-once: each buffers rows and writes them when a buffer holds ``batch_rows`` rows,
when its oldest row is ``batch_seconds`` old, and always at the end of every Bytewax epoch
(``snapshot``), before the epoch's input offsets are committed to recovery. After a crash Bytewax
replays from the last snapshot and the sinks write some rows again; every destination is idempotent
for those (ReplacingMergeTree keys; reward revisions; archive readers deduplicate by event_id).

A failing write is retried with exponential backoff for as long as it takes: the sink blocks, the
flow stops consuming (backpressure), and nothing is dropped. ClickHouse and the archive share one
sink partition, so exactly one worker process writes them — an embedded chdb folder may only be
held by one process.
"""

from __future__ import annotations

import calendar
import hashlib
import logging
import os
import shutil
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bytewax.outputs import FixedPartitionedSink, StatefulSinkPartition
from confluent_kafka import Producer

from flows.reward_versions import RewardVersionImmutable, register
from rewards.versions import RewardVersion
from rtrl import clickhouse
from rtrl.clickhouse_cluster import Cluster
from rtrl.files import private_dir
from rtrl.kafka import produce, producer_config
from schemas.records import EventBase
from schemas.types import to_arrow

log = logging.getLogger("rtrl.sinks")


def retry_forever(
    what: str,
    fn: Callable[[], Any],
    on_error: Callable[[], None] | None = None,
    first_s: float = 0.1,
    max_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """Call ``fn`` until it succeeds, backing off exponentially; log each failure."""
    delay, attempt = first_s, 0
    while True:
        try:
            return fn()
        except RewardVersionImmutable:  # a setting to fix, not an outage: retrying cannot help
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the destination is retried
            attempt += 1
            log.warning("%s failed (attempt %d, retrying in %.1fs): %s", what, attempt, delay, e)
            if on_error is not None:
                try:
                    on_error()
                except Exception as e2:  # noqa: BLE001
                    log.warning("%s: reconnect failed: %s", what, e2)
            sleep(delay)
            delay = min(max_s, delay * 2)


class _Buffered(StatefulSinkPartition):
    """Row buffers flushed by size, by age and at every epoch end."""

    def __init__(self, batch_rows: int, batch_seconds: float):
        self.batch_rows = batch_rows
        self.batch_seconds = batch_seconds
        self.buffers: dict[str, list] = defaultdict(list)
        self.oldest: float | None = None

    def write_batch(self, items: list[tuple[str, list]]) -> None:
        for name, rows in items:
            self.buffers[name].extend(rows)
        if self.oldest is None and any(self.buffers.values()):
            self.oldest = time.monotonic()
        full = any(len(rows) >= self.batch_rows for rows in self.buffers.values())
        if full or (self.oldest is not None and time.monotonic() - self.oldest >= self.batch_seconds):
            self.flush()

    def flush(self) -> None:
        for name in list(self.buffers):
            rows = self.buffers.pop(name)
            if rows:
                self.write(name, rows)
        self.oldest = None

    def write(self, name: str, rows: list) -> None:
        raise NotImplementedError

    def snapshot(self) -> None:
        self.flush()
        return None

    def close(self) -> None:
        self.flush()


class _StoragePart(_Buffered):
    """Writes run in order on a writer thread, overlapping the worker's next batches; at most
    ``MAX_IN_FLIGHT`` batches wait there (a slow or failing ClickHouse blocks the worker: backpressure),
    and every write has finished before ``snapshot`` returns, so the epoch's offsets never run ahead
    of the data."""

    #: batches queued on the writer thread before ``write`` blocks (one flush is up to three: events,
    #: rewards, trajectories, so the worker keeps going while the previous flush is written)
    MAX_IN_FLIGHT = 4

    def __init__(
        self,
        dsn: str,
        database: str,
        archive: Path | None,
        batch_rows: int,
        batch_seconds: float,
        timeout_s: float,
        reward_versions: Sequence[RewardVersion] = (),
        cluster: Cluster | None = None,
    ):
        super().__init__(batch_rows, batch_seconds)
        self.dsn, self.database, self.archive, self.timeout_s = dsn, database, archive, timeout_s
        self.cluster = cluster
        self.reward_versions = reward_versions
        self.client = None  # set up (migrate + verify) on first write, again after any failure
        if reward_versions:  # registered before the first reward is written; a changed definition of a used
            # name stops the flow here, at its start, with the fix (not from the writer thread mid-run)
            retry_forever(
                f"register reward versions in {database} at {clickhouse.redact(dsn)}",
                self._connect,
                self._drop_client,
            )
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="rtrl-sink-writer")
        self.pending: deque[Future] = deque()

    def _connect(self) -> None:
        client = clickhouse.setup(self.dsn, self.database, self.timeout_s, self.cluster)
        register(client, self.database, self.reward_versions)
        self.client = client

    def _insert(self, table: str, data: pa.Table) -> None:
        if self.client is None:
            self._connect()
        clickhouse.insert_table(self.client, self.database, table, data)

    def _drop_client(self) -> None:
        self.client = None

    def _store(self, table: str, data: pa.Table, coords: list[tuple[int, ...]] | None) -> None:
        retry_forever(
            f"insert {data.num_rows} rows into {self.database}.{table} at {clickhouse.redact(self.dsn)}",
            lambda: self._insert(table, data),
            self._drop_client,
        )
        if table == "events" and self.archive is not None:
            write_archive(self.archive, with_coords(data, coords))

    def _wait(self, keep: int = 0) -> None:
        """Block until at most ``keep`` writes are still queued or running."""
        while len(self.pending) > keep:
            self.pending.popleft().result()

    def write(self, table: str, rows: list) -> None:
        coords = None
        if table == "events" and rows and isinstance(rows[0], tuple):  # (event, (partition, offset, ts)) pairs
            rows, coords = [r[0] for r in rows], [r[1] for r in rows]
        data = to_arrow(rows, clickhouse.TABLES[table])  # once, for ClickHouse and the archive
        self._wait(self.MAX_IN_FLIGHT - 1)
        self.pending.append(self.writer.submit(self._store, table, data, coords))

    def snapshot(self) -> None:
        self.flush()
        self._wait()
        return None

    def close(self) -> None:
        self.snapshot()
        self.writer.shutdown()


#: the archive's columns after the event's own: where the event was read from and its record's timestamp
#: (-1 when not from Kafka or unknown); the backfill bounds event time by that timestamp as the stream did
ARCHIVE_COORDS = (
    pa.field("kafka_partition", pa.int32()),
    pa.field("kafka_offset", pa.int64()),
    pa.field("kafka_timestamp", pa.int64()),
)


def archive_schema() -> pa.Schema:
    """The Parquet archive's schema: the events table's columns, then :data:`ARCHIVE_COORDS`."""
    schema = to_arrow([], EventBase).schema
    for f in ARCHIVE_COORDS:
        schema = schema.append(f)
    return schema


def with_coords(events: pa.Table, coords: Sequence[tuple[int, ...]] | None) -> pa.Table:
    """``events`` with their Kafka partition, offset and record timestamp appended. Each of ``coords`` is
    ``(partition, offset)`` or ``(partition, offset, timestamp)``; what is unknown is ``-1``."""
    if coords is None:
        coords = [(-1, -1)] * events.num_rows
    full = [(c[0], c[1], c[2] if len(c) > 2 else -1) for c in coords]
    columns = list(zip(*full)) if full else [(), (), ()]
    for f, values in zip(ARCHIVE_COORDS, columns):
        events = events.append_column(f, pa.array(values, f.type))
    return events


def write_archive(root: Path, events: pa.Table) -> None:
    """Events to ``root/date=YYYY-MM-DD/part-<hash of event ids>.parquet`` (atomic rename; same batch, same file)."""
    days = np.asarray(events.column("ts").cast(pa.int64())) // 86_400_000
    for day in np.unique(days):
        part = events.take(np.nonzero(days == day)[0])
        folder = root / f"date={time.strftime('%Y-%m-%d', time.gmtime(int(day) * 86_400))}"
        digest = hashlib.sha1("\n".join(sorted(part.column("event_id").to_pylist())).encode()).hexdigest()[:20]
        path = folder / f"part-{digest}.parquet"

        def put(folder: Path = folder, path: Path = path, part: pa.Table = part) -> None:
            private_dir(folder)
            tmp = path.with_suffix(".tmp")
            pq.write_table(part, tmp, compression="zstd")
            os.replace(tmp, path)

        retry_forever(f"write {path}", put)


class ClickHouseSink(FixedPartitionedSink):
    """Items ``("clickhouse", (table, records))`` -> batched Arrow inserts into ``database.table``.

    With ``archive`` set, the ``events`` rows are also written to the Parquet archive (from the same
    Arrow table, with each event's Kafka partition and offset when the rows are ``(event, (partition,
    offset))`` pairs: what the backfill (flows.backfill) replays in the stream's order). A file's name is the hash of its event ids, so rewriting the same batch replaces the
    file; a replay with other batch boundaries may store an event in two files, which
    :func:`read_archive` deduplicates by ``event_id``. One partition: one process writes chdb, and
    chdb never runs beside pyarrow work in another thread of this sink.
    """

    def __init__(
        self,
        dsn: str,
        database: str,
        batch_rows: int = 20_000,
        batch_seconds: float = 1.0,
        timeout_s: float = 10.0,
        archive: str | Path | None = None,
        reward_versions: Sequence[RewardVersion] = (),
        cluster: Cluster | None = None,
    ):
        self.args = (
            dsn, database, None if archive is None else Path(archive), batch_rows, batch_seconds, timeout_s,
            tuple(reward_versions), cluster,
        )  # fmt: skip

    def list_parts(self) -> list[str]:
        return ["clickhouse"]

    def part_fn(self, item_key: str) -> int:
        return 0

    def build_part(self, step_id: str, for_part: str, resume_state: None) -> _StoragePart:
        return _StoragePart(*self.args)


def prune_archive(root: str | Path, days: float, now_ms: int, dry_run: bool = False) -> list[str]:
    """Delete the archive's day folders (``date=YYYY-MM-DD``) whose whole day is older than ``days`` before
    ``now_ms``; return the dates deleted (or, ``dry_run``, that would be). ``days`` 0 keeps everything."""
    if days <= 0:
        return []
    cutoff = now_ms - round(days * 86_400_000)
    gone = []
    for folder in sorted(Path(root).glob("date=*")):
        date = folder.name.removeprefix("date=")
        try:
            day_end = (int(calendar.timegm(time.strptime(date, "%Y-%m-%d"))) + 86_400) * 1000
        except ValueError:  # not a folder the archive wrote: never ours to delete
            continue
        if day_end <= cutoff:
            if not dry_run:
                shutil.rmtree(folder)
            gone.append(date)
    return gone


def _conform(table: pa.Table) -> pa.Table:
    """An archive file in today's schema: a column added since it was written (``data_use``) reads as null."""
    schema = archive_schema()
    cols = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def read_archive(root: str | Path, dates: list[str] | None = None) -> pa.Table:
    """The archived events (optionally only some ``YYYY-MM-DD`` dates), one row per event_id, with their
    Kafka partition and offset (a replay may have stored an event in two files)."""
    files = sorted(Path(root).glob("date=*/part-*.parquet"))
    if dates is not None:
        files = [f for f in files if f.parent.name.removeprefix("date=") in dates]
    if not files:
        return archive_schema().empty_table()
    table = pa.concat_tables(_conform(pq.read_table(f)) for f in files)
    seen: set[str] = set()
    keep = []
    for i, eid in enumerate(table.column("event_id").to_pylist()):
        if eid not in seen:
            seen.add(eid)
            keep.append(i)
    return table.take(keep)


class _KafkaPart(StatefulSinkPartition):
    """Produces as items arrive; waits for every acknowledgement only at the epoch's end (``snapshot``),
    before Bytewax commits the epoch's input offsets: the worker never stalls on the broker mid-epoch."""

    def __init__(self, bootstrap: str, delivery_timeout_s: float, compression: str):
        self.producer = Producer(
            producer_config(bootstrap, compression, **{"message.timeout.ms": int(delivery_timeout_s * 1000)})
        )
        self.errors: list[str] = []

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))

    def write_batch(self, items: list[list[tuple[str, bytes, bytes]]]) -> None:
        for batch in items:
            for topic, key, value in batch:  # a full producer queue waits for deliveries (backpressure)
                produce(self.producer, topic, value, key, self._on_delivery, poll_s=0.1)
        self.producer.poll(0)  # serve delivery callbacks

    def _flush(self) -> None:
        left = self.producer.flush(30)
        if left or self.errors:
            errors, self.errors = self.errors, []
            raise RuntimeError(f"{left} messages unacknowledged, delivery errors: {errors[:3]}")

    def snapshot(self) -> None:
        retry_forever("flush Kafka producer", self._flush)
        return None

    def close(self) -> None:
        self.snapshot()


class KafkaSink(FixedPartitionedSink):
    """Items ``("kafka", [(topic, key, value), ...])`` -> one idempotent producer, acknowledged at every
    epoch end. A delivery that fails is retried until the broker takes it; the epoch does not end
    before (at-least-once; readers deduplicate rewards by trajectory, version and revision)."""

    def __init__(self, bootstrap: str, delivery_timeout_s: float = 120.0, compression: str = "zstd"):
        self.bootstrap, self.delivery_timeout_s, self.compression = bootstrap, delivery_timeout_s, compression

    def list_parts(self) -> list[str]:
        return ["kafka"]

    def part_fn(self, item_key: str) -> int:
        return 0

    def build_part(self, step_id: str, for_part: str, resume_state: None) -> _KafkaPart:
        return _KafkaPart(self.bootstrap, self.delivery_timeout_s, self.compression)
