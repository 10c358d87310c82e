"""Backfill: one reward version over the Parquet archive, with Apache Beam (``rtrl backfill``).

    rtrl backfill --reward-version V [--from T1] [--to T2] [--workers N]   (another runner: backfill.pipeline_options)

The reward flow archives every valid event it reads with its Kafka partition and offset
(``<archive>/date=YYYY-MM-DD/part-*.parquet``, flows.sinks). The backfill replays that archive through the
stream's own code, so a version scores the past exactly as the live flow would have:

``read``      one Parquet file per element: a file that cannot be read, a missing or retyped column
              (schema drift) or a row that is not a valid event becomes a dead letter naming the file
              and the row; the rest of the file is used, and the run goes on
``partition`` events keyed by their Kafka partition (the stream's event-time clock), ordered by offset
              and deduplicated by offset (a replayed flow may have archived an event twice)
``window``    :class:`flows.processor.RewardProcessor`, the reward flow's own windowing
              (:mod:`flows.windowing`), dead-letter rules and pure reward code, under version V only;
              the end of the archive closes open windows as the end of the input does in the stream
``write``     each partition's final rewards (a trajectory's last revision) for trajectories whose first
              event lies in [T1, T2), and its dead
              letters, to ``<out>/rewards|dead_letters/partition=P.parquet`` (fixed names: a rerun replaces them)

The driver then loads those files into ClickHouse ``rewards`` and ``dead_letters``, inserting only the
rows that are not there already with the same content: a second run changes nothing, and backfilling
the live version over what the live flow scored inserts nothing at all (stream = batch).

Which files are read: every date from ``T1 - (flow.deadline_s + flow.allowed_lateness_s)`` to the end
of the archive, because events before T1 move the partitions' watermarks and late events after T2 can
still revise a trajectory that started in the range.

Runners: locally the FnApiRunner with ``backfill.workers`` worker processes (Beam's default runner would
try to download Prism). A pipeline-options file (``backfill.pipeline_options``) that names another
runner (Flink, Spark, Dataflow: ``deploy/beam/``) runs the same pipeline there; the archive and the
output folder must then be paths every worker can reach (``gs://``, ``s3://``, ``hdfs://``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from flows.processor import RewardProcessor
from flows.reward_flow import verdict_kinds
from flows.reward_versions import register
from flows.sinks import ARCHIVE_COORDS, archive_schema
from flows.windowing import WindowConfig
from rewards import RewardConfig
from rewards.versions import RewardVersion, registry
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.settings import Settings
from schemas.codec import dead_letter
from schemas.erasure import DenyList
from schemas.records import DeadLetter, EventBase, Reward
from schemas.types import from_arrow, to_arrow

DAY_MS = 86_400_000
NAMESPACE = "rtrl.backfill"
#: the column archives written before rtrl kept record timestamps lack: read as unknown (-1), not as drift
RECORD_TS = "kafka_timestamp"
#: the columns a file must have: the event envelope and where the event was read from
REQUIRED = ("event_id", "trajectory_id", "ts", "org_id", "user_hash", "policy_version", "arm", "type") + tuple(
    f.name for f in ARCHIVE_COORDS if f.name != RECORD_TS
)

log = logging.getLogger("rtrl.backfill")


@dataclass(frozen=True)
class Spec:
    """Everything a worker needs (pickled to each one)."""

    version: RewardConfig
    window: WindowConfig
    out: str
    since_ms: int | None = None
    until_ms: int | None = None
    max_event_bytes: int = 64 * 1024
    now_ms: int = 0
    verdict_kinds: tuple[str, ...] = ()  # task kinds whose rewards stay provisional until the user's verdict
    deny: DenyList = DenyList()  # erased subjects (`rtrl erase`): their events are skipped

    @property
    def source(self) -> str:
        return f"backfill:{self.version.version}"

    def in_range(self, first_ts: int) -> bool:
        return (self.since_ms is None or first_ts >= self.since_ms) and (
            self.until_ms is None or first_ts < self.until_ms
        )


def archive_files(root: str, since_ms: int | None, retention_ms: int) -> list[str]:
    """The archive's files from the date of ``since_ms - retention_ms`` on (all of them without ``since_ms``)."""
    pattern = root.rstrip("/") + "/date=*/part-*.parquet"
    paths = sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list)
    if since_ms is None:
        return paths
    first = time.strftime("%Y-%m-%d", time.gmtime(max(0, since_ms - retention_ms) // 1000))
    return [p for p in paths if p.rsplit("date=", 1)[-1][:10] >= first]


def _dead(spec: Spec, kind: Any, field_: str, reason: str, path: str, row: int, payload: str | None) -> DeadLetter:
    # the file is in the source (the dead_letters table's key: one row per file, row and kind), its tail where the
    # whole path would not fit a label, and whole in the key; the row is the offset
    source = f"{spec.source} {path}"
    if len(source) > 128:
        source = f"{spec.source} …{path[-(128 - len(spec.source) - 2) :]}"
    return dead_letter(kind, field_, reason, source, -1, row, path, payload, spec.now_ms)


class ReadFile(beam.DoFn):
    """A Parquet file of the archive -> ``(partition, (offset, event, record timestamp))`` and dead letters
    (tag ``dead``)."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.files = Metrics.counter(NAMESPACE, "files")
        self.events = Metrics.counter(NAMESPACE, "events")

    def process(self, path: str) -> Iterator[Any]:
        self.files.inc()
        try:
            with FileSystems.open(path) as f:
                table = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a dead letter, never the end of the run
            yield beam.pvalue.TaggedOutput(
                "dead", _dead(self.spec, "malformed", "$", f"cannot read Parquet file: {e}", path, -1, None)
            )
            return
        table, problems = conform(table)
        for column, why in problems:
            yield beam.pvalue.TaggedOutput(
                "dead", _dead(self.spec, "invalid", f"$.{column}", f"schema drift: {why}", path, -1, None)
            )
        if table is None:
            return
        events, bad = to_events(table)
        for row, field_, why, payload in bad:
            yield beam.pvalue.TaggedOutput("dead", _dead(self.spec, "invalid", field_, why, path, row, payload))
        parts = table.column("kafka_partition").to_pylist()
        offsets = table.column("kafka_offset").to_pylist()
        stamps = table.column(RECORD_TS).to_pylist()
        located = []
        for row, event in events:
            p, o = parts[row], offsets[row]
            if p is not None and o is not None and p >= 0 and o >= 0:
                located.append((row, event))
                continue
            why = (
                f"row {row} has no Kafka partition and offset ({p}, {o}): the backfill replays each partition in "
                "offset order, as the stream read it (archives written before rtrl kept them cannot be replayed)"
            )
            yield beam.pvalue.TaggedOutput("dead", _dead(self.spec, "invalid", "$.kafka_offset", why, path, row, None))
        self.events.inc(len(located))
        for row, event in located:
            yield parts[row], (offsets[row], event, -1 if stamps[row] is None else stamps[row])


def conform(table: pa.Table) -> tuple[pa.Table | None, list[tuple[str, str]]]:
    """``table`` in the archive's schema, and the schema drift found: a missing required column drops the file
    (None); a missing optional column is filled with nulls; a column of another type is cast (or, when it
    cannot be, dropped as missing); unknown columns are ignored."""
    schema, problems = archive_schema(), []
    arrays = []
    for f in schema:
        if f.name not in table.column_names:
            if f.name not in (RECORD_TS, "data_use"):  # an older archive's layout, not drift
                problems.append((f.name, f"column {f.name} is missing"))
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                problems.append((f.name, f"column {f.name} is {col.type}, expected {f.type} ({e})"))
                col = pa.nulls(table.num_rows, f.type)
        arrays.append(col)
    missing = [c for c, _ in problems if c in REQUIRED]
    if missing:
        return None, problems
    return pa.Table.from_arrays(arrays, schema=schema), problems


def to_events(table: pa.Table) -> tuple[list[tuple[int, EventBase]], list[tuple[int, str, str, str]]]:
    """The rows as validated events ``(row, event)``, and the rows that are not ``(row, field, reason, payload)``."""
    events = table.drop_columns([f.name for f in ARCHIVE_COORDS])
    try:
        return list(enumerate(from_arrow(events, EventBase))), []
    except (msgspec.ValidationError, TypeError, ValueError):
        pass  # find the bad rows one by one
    good, bad = [], []
    for row in range(events.num_rows):
        one = events.slice(row, 1)
        try:
            good.append((row, from_arrow(one, EventBase)[0]))
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            text = str(e)
            field_ = "$" + text.rsplit("`$[0]", 1)[-1].split("`", 1)[0] if "`$[0]" in text else "$"
            payload = str({k: v[0] for k, v in one.to_pydict().items()})
            bad.append((row, field_, f"row {row} is not a valid event: {text}", payload))
    return good, bad


class WindowPartition(beam.DoFn):
    """One Kafka partition's events in offset order through the stream's processor; writes its Parquet files."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.counters = {
            n: Metrics.counter(NAMESPACE, n)
            for n in ("replayed", "trajectories", "rewards", "discarded", "out_of_range", "erased")
        }

    def process(self, kv: tuple[int, Iterable[tuple[int, EventBase, int]]]) -> Iterator[Any]:
        partition, items = kv
        spec = self.spec
        by_offset: dict[int, EventBase] = {}
        stamps: dict[int, int] = {}
        clashes: list[DeadLetter] = []
        for offset, event, record_ts in items:
            kept = by_offset.setdefault(offset, event)  # an event archived twice (a replayed flow) counts once
            stamps.setdefault(offset, record_ts)
            if kept.event_id != event.event_id:  # two Kafka histories in one archive (a topic made anew)
                why = (
                    f"partition {partition} offset {offset} holds event {kept.event_id} and event {event.event_id}: "
                    "the archive mixes two histories of the topic; fix: move the older archive aside (a fresh rtrl "
                    "run on the embedded defaults deletes it with the broker)"
                )
                clashes.append(
                    dead_letter(
                        "invalid", "$.kafka_offset", why, spec.source, partition, offset, None, None, spec.now_ms
                    )
                )
        self.counters["replayed"].inc(len(by_offset))
        proc = RewardProcessor(
            spec.source,
            spec.window,
            [spec.version],
            spec.max_event_bytes,
            verdict_kinds=spec.verdict_kinds,
            deny=spec.deny if spec.deny else None,
        )
        located = ((by_offset[o], partition, o, stamps[o]) for o in sorted(by_offset))
        out = proc.process_events(located, now_ms=spec.now_ms)
        out.dead_letters.extend(clashes)
        out.extend(proc.finish(now_ms=spec.now_ms))
        final: dict[str, Reward] = {}  # a trajectory's last revision is its reward (rewards keeps the highest)
        for r in out.rewards:
            final[r.trajectory_id] = r
        rewards = [r for r in final.values() if spec.in_range(r.first_event_ts)]
        self.counters["trajectories"].inc(len({s.trajectory_id for s in out.summaries}))
        self.counters["rewards"].inc(len(rewards))
        self.counters["discarded"].inc(out.discarded)
        self.counters["erased"].inc(out.erased)
        self.counters["out_of_range"].inc(len(final) - len(rewards))
        for d in out.dead_letters:
            Metrics.counter(NAMESPACE, f"dead:{d.kind}").inc()
        write_parquet(f"{spec.out}/rewards/partition={partition}.parquet", to_arrow(rewards, Reward))
        write_parquet(f"{spec.out}/dead_letters/partition={partition}.parquet", to_arrow(out.dead_letters, DeadLetter))
        yield partition


def write_parquet(path: str, table: pa.Table) -> None:
    """``table`` to ``path`` on any Beam filesystem (local, gs://, s3://, hdfs://), replacing it."""
    with FileSystems.create(path) as f:
        pq.write_table(table, f, compression="zstd")


def write_dead_files(spec: Spec, dead: list[DeadLetter]) -> None:
    """The read stage's dead letters (bad files and rows) as one Parquet file."""
    write_parquet(f"{spec.out}/dead_letters/files.parquet", to_arrow(dead, DeadLetter))


def pipeline_options(settings: Settings, workers: int | None = None, extra: Sequence[str] = ()) -> PipelineOptions:
    """The options file (``backfill.pipeline_options``) and ``extra`` arguments; without a ``--runner`` among
    them, the local FnApiRunner with ``workers`` (``backfill.workers``) worker processes."""
    args: list[str] = []
    if settings.backfill.pipeline_options:
        path = Path(settings.backfill.pipeline_options)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(
                f"setting backfill.pipeline_options = {str(path)!r} cannot be read ({e}); fix: point it at a file of "
                "Beam options such as deploy/beam/flink.options"
            ) from None
        for line in text.splitlines():
            args += shlex.split(line, comments=True)
    args += list(extra)
    options = PipelineOptions(args)
    FileSystems.set_options(options)  # this process lists and reads remote paths (hdfs://, s3://) with them too
    if not options.view_as(StandardOptions).runner:
        n = workers or settings.backfill.workers
        direct = options.view_as(DirectOptions)
        direct.direct_num_workers = n
        direct.direct_running_mode = "multi_processing" if n > 1 else "in_memory"
    return options


def _runner(options: PipelineOptions) -> Any:
    if options.view_as(StandardOptions).runner:
        return None  # the options name it
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner()


@dataclass
class BackfillResult:
    """What a backfill read, computed and wrote."""

    version: RewardVersion
    out: str
    files: int
    counts: Counter[str] = field(default_factory=Counter)
    written: dict[str, int] = field(default_factory=dict)  # ClickHouse rows inserted now, by table
    unchanged: dict[str, int] = field(default_factory=dict)  # rows already there with the same content
    seconds: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.counts["events"] / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        c = self.counts
        dead = {k.removeprefix("dead:"): n for k, n in c.items() if k.startswith("dead:") and n}
        dead_text = ", ".join(f"{k} {n:,}" for k, n in sorted(dead.items())) or "none"
        return (
            f"backfill {self.version.name} ({self.version.checksum[:12]}): {self.files:,} files, {c['events']:,} events, "
            f"{c['trajectories']:,} trajectories closed, {c['rewards']:,} rewards in range ({c['discarded']:,} "
            f"discarded by the version)"
            + (f", {c['erased']:,} events of erased subjects skipped" if c["erased"] else "")
            + f", dead letters: {dead_text}; ClickHouse: "
            f"{self.written.get('rewards', 0):,} rewards written, {self.unchanged.get('rewards', 0):,} unchanged; "
            f"Parquet: {self.out}; {self.seconds:.1f}s ({self.events_per_s:,.0f} events/s)"
        )


def run_pipeline(spec: Spec, files: list[str], options: PipelineOptions) -> Counter[str]:
    """The Beam pipeline over ``files``; returns its counters (events, rewards, dead:<kind>, ...)."""
    with beam.Pipeline(runner=_runner(options), options=options) as p:
        read = (
            p | "files" >> beam.Create(files) | "read" >> beam.ParDo(ReadFile(spec)).with_outputs("dead", main="events")
        )
        _ = read.events | "partition" >> beam.GroupByKey() | "window" >> beam.ParDo(WindowPartition(spec))
        _ = (
            read.dead
            | "dead_files" >> beam.combiners.ToList()
            | "write_dead_files" >> beam.Map(lambda dead: write_dead_files(spec, dead))
        )
    result = p.result
    counts: Counter[str] = Counter()
    for m in result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]:
        counts[m.key.metric.name] += m.committed if m.committed is not None else m.attempted
    return counts


def _read_out(out: str, name: str, cls: type) -> list:
    paths = sorted(m.path for r in FileSystems.match([f"{out}/{name}/*.parquet"]) for m in r.metadata_list)
    tables = []
    for path in paths:
        with FileSystems.open(path) as f:
            tables.append(pq.read_table(f))
    return from_arrow(pa.concat_tables(tables), cls) if tables else []


def _reward_key(r: Reward) -> tuple:
    return (
        r.trajectory_id,
        r.revision,
        r.policy_version,
        r.reward,
        tuple(sorted(r.components.items())),
        tuple(r.flags),
        r.close_reason,
    )


def load(client: Any, database: str, version: str, rewards: list[Reward], dead: list[DeadLetter]) -> tuple[dict, dict]:
    """Insert what is not in ClickHouse already with the same content; (written, unchanged) row counts by table."""
    written, unchanged = {}, {}
    have: set[tuple] = set()
    if rewards:
        lo, hi = min(r.first_event_ts for r in rewards), max(r.first_event_ts for r in rewards)
        where = (
            f"WHERE reward_version = '{version}' AND first_event_ts >= fromUnixTimestamp64Milli({lo}) "
            f"AND first_event_ts <= fromUnixTimestamp64Milli({hi})"
        )
        have = {_reward_key(r) for r in clickhouse.select(client, database, "rewards", where)}
    new = [r for r in rewards if _reward_key(r) not in have]
    written["rewards"], unchanged["rewards"] = (
        clickhouse.insert(client, database, "rewards", new),
        len(rewards) - len(new),
    )
    dead_have = {
        (d.source, d.partition, d.offset, d.kind)
        for d in clickhouse.select(client, database, "dead_letters", f"WHERE startsWith(source, 'backfill:{version}')")
    }
    dead_new = [d for d in dead if (d.source, d.partition, d.offset, d.kind) not in dead_have]
    written["dead_letters"] = clickhouse.insert(client, database, "dead_letters", dead_new)
    unchanged["dead_letters"] = len(dead) - len(dead_new)
    return written, unchanged


def out_dir(settings: Settings, version: str, since_ms: int | None, until_ms: int | None) -> str:
    root = settings.backfill.out_dir or str(settings.data_path / "backfill")
    span = f"{since_ms if since_ms is not None else 'start'}-{until_ms if until_ms is not None else 'end'}"
    return f"{root.rstrip('/')}/{version}/{span}"


def _span(ms: int | None, open_end: str) -> str:
    return open_end if ms is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def describe_plan(
    settings: Settings, version: str, since_ms: int | None, until_ms: int | None, workers: int | None = None
) -> str:
    """One line: what :func:`backfill` is about to read, where it runs and where it writes."""
    options = pipeline_options(settings, workers)
    runner = options.view_as(StandardOptions).runner or (
        f"FnApiRunner with {options.view_as(DirectOptions).direct_num_workers} worker processes"
    )
    archive = settings.archive_root
    files = archive_files(archive, since_ms, WindowConfig(settings.flow).retention_ms)
    return (
        f"backfill {version}: trajectories starting in [{_span(since_ms, 'the start')}, {_span(until_ms, 'the end')}) "
        f"from {len(files):,} archive files in {archive}; runner {runner}; output "
        f"{out_dir(settings, version, since_ms, until_ms)} and ClickHouse {settings.clickhouse.database}.rewards"
    )


@contextlib.contextmanager
def _worker_output(path: Path | None) -> Iterator[None]:
    """Local worker processes inherit this process's stderr and log every start at INFO there: send it to
    ``path`` while they run (their errors still reach the pipeline's result), or leave it (None)."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def backfill(
    settings: Settings,
    version: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    *,
    client: Any = None,
    workers: int | None = None,
    extra_options: Sequence[str] = (),
    now_ms: int | None = None,
    worker_log: bool = True,
) -> BackfillResult:
    """Score the archive under ``version`` for trajectories starting in [since_ms, until_ms) (None: open-ended),
    write Parquet and ClickHouse (idempotent). ``client`` is the ClickHouse client (one is set up if None);
    ``worker_log`` sends local worker processes' stderr to ``<data_dir>/logs/backfill-workers.log``."""
    if since_ms is not None and until_ms is not None and until_ms <= since_ms:
        raise ConfigError(f"--to ({until_ms}) must be after --from ({since_ms}); fix: swap or widen the range")
    reg = registry(settings)
    chosen = reg.select([version], "--reward-version")[0]
    options = pipeline_options(settings, workers, extra_options)
    window = WindowConfig(settings.flow)
    archive = settings.archive_root
    files = archive_files(archive, since_ms, window.retention_ms)
    out = out_dir(settings, version, since_ms, until_ms)
    runner = options.view_as(StandardOptions).runner
    local_paths = [p for p in (archive, out) if "://" not in p]
    if runner and local_paths:
        where = (
            f"runner {runner} runs the workers elsewhere, and they cannot reach the local paths {local_paths}; fix: "
            "set flow.archive_dir and backfill.out_dir to shared storage (gs://, s3://, hdfs://) that this machine "
            "and the workers reach (deploy/beam/README.md)"
        )
        if runner == "DataflowRunner":  # always remote workers
            raise ConfigError(where)
        log.warning("%s, unless the cluster's workers share this machine's disk (a local Flink or Spark)", where)
    if "://" not in out:
        shutil.rmtree(out, ignore_errors=True)  # a rerun replaces the previous output, never adds to it
    else:
        existing = [m.path for r in FileSystems.match([f"{out}/**"]) for m in r.metadata_list]
        if existing:
            FileSystems.delete(existing)
    stamp = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    if client is None:
        client = clickhouse.setup_from(settings)
    spec = Spec(
        chosen.config,
        window,
        out,
        since_ms,
        until_ms,
        settings.sdk.max_event_bytes,
        stamp,
        verdict_kinds(settings),
        clickhouse.deny_list(client, settings.clickhouse.database),  # an archive restored from a backup included
    )
    register(client, settings.clickhouse.database, [chosen])  # refuses changed weights under a used name, first
    local = not options.view_as(StandardOptions).runner and options.view_as(DirectOptions).direct_num_workers > 1
    start = time.monotonic()
    with _worker_output(settings.data_path / "logs" / "backfill-workers.log" if local and worker_log else None):
        counts = run_pipeline(spec, files, options) if files else Counter()
    seconds = time.monotonic() - start
    result = BackfillResult(chosen, out, len(files), counts, seconds=seconds)
    rewards = _read_out(out, "rewards", Reward)
    dead = _read_out(out, "dead_letters", DeadLetter)
    result.written, result.unchanged = load(client, settings.clickhouse.database, version, rewards, dead)
    return result
