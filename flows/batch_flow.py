"""The batch flow: Kafka ``rtrl.rollouts`` + ``rtrl.rewards`` -> packed micro-batches on ``rtrl.batches``.

    python -m bytewax.run flows.batch_flow:flow -r <recovery dir> -s 2   (needs kafka.bootstrap; or: rtrl flow batches)

Steps (stable step ids key the recovery state):

``rollouts_in``, ``rewards_in``  Kafka sources (built after a bounded broker check)
``parse_*``     decode and validate; failures go to ``rtrl.dead_letters`` with the reason
``batches``     per cohort ``org_id/task_kind``: join (a kind awaiting a verdict: its final reward),
                staleness filter (delayed samples kept, marked), advantages, packing
                (:mod:`flows.batching`), once per trainable reward version (``rewards.trainable()``: each
                micro-batch names its version, and a trainer trains only its cycle's); the cohort's state
                is snapshotted with the input offsets
``route_adapters``  per org ``adapters.wants``: its batches to the shared stream until it passed
                ``adapters.min_samples`` samples, then to its adapter stream (and, with
                ``adapters.shared_traffic`` served or all, a copy to the shared one, under served split per
                serving adapter version): :mod:`flows.adapters`; its state
                is one sample counter per org
``kafka``       micro-batches (Arrow IPC): the shared policy's on ``rtrl.batches`` (key ``batch_id``; an
                unwanted org's split per serving adapter version under served), the org adapters' on
                ``rtrl.adapter-batches`` (key the org); and dead letters
``clickhouse``  the cohort's running counters (``batch_stats``: unmatched, stale per lag, ...)
                and the dead letters

The cohort clock is event time (rollouts' ``created_at``, rewards' ``emitted_at``), so a replay
emits the same micro-batches with the same ids. The one wall-clock rule: a cohort with samples
ready but no new input for ``batching.idle_flush_s`` sends them as a partial micro-batch instead
of waiting for more data. The serving version against which lag is measured is the newest
``policy_version`` seen in the cohort's rollouts (the policy server samples with the promoted one).

The inputs and the outputs are injectable: :func:`build_flow` takes ``sources`` (by input name, see
:data:`INPUTS`) and ``sinks`` (by output name, see :data:`OUTPUTS`), so the flow runs in-process on
Bytewax's ``TestingSource``/``TestingSink`` without a broker or ClickHouse. Left out, they are
:func:`kafka_inputs` and :func:`service_outputs`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import Source
from bytewax.operators import StatefulBatchLogic
from bytewax.outputs import Sink

from flows.adapters import OrgRouter, unrouted
from flows.batching import BatchBuilder, BatchConfig
from flows.counts import FlowCounts, by_kind, dead_letters
from flows.kafka_io import kafka_source, paused
from flows.processor import Message
from flows.sinks import ClickHouseSink, KafkaSink
from flows.wiring import injected, require_bootstrap
from rewards.versions import registry
from rtrl import clickhouse, metrics
from rtrl.clickhouse_cluster import cluster_of
from rtrl.settings import Settings, load_settings
from schemas.codec import Invalid, JsonCodec, dead_letter, encode_batch
from schemas.erasure import DenySource
from schemas.records import BatchStats, DeadLetter, MicroBatch, Reward, Rollout

#: the flow's inputs: each yields :class:`flows.processor.Message` tuples (unkeyed)
INPUTS = ("rollouts", "rewards")
#: the flow's outputs: ``kafka`` takes ``("kafka", [(topic, key, value), ...])`` items (micro-batches
#: and dead letters), ``clickhouse`` takes ``("clickhouse", (table, rows))`` items (batch_stats, dead_letters)
OUTPUTS = ("kafka", "clickhouse")


def batch_configs(settings: Settings) -> dict[str, BatchConfig]:
    """One builder config per reward version the flow makes micro-batches for (``rewards.trainable()``: the
    trained version first, then the train_schedule's and batch_versions), each tagging its batches."""
    reg = registry(settings)
    reg.check(settings.rewards.trainable(), "rewards.train_schedule / rewards.batch_versions")
    return {v: batch_config(settings, v) for v in settings.rewards.trainable()}


def batch_config(settings: Settings, reward_version: str | None = None) -> BatchConfig:
    """The pure builder's config for ``reward_version`` (default: the trained one): the sections it reads."""
    if reward_version is None:
        registry(settings).check([settings.rewards.train_version], "rewards.train_version")
    s = settings
    version = s.rewards.train_version if reward_version is None else reward_version
    return BatchConfig(
        version, batching=s.batching, train=s.train, flow=s.flow, governance=s.governance, adapters=s.adapters
    )


def _configured(builder: BatchBuilder | None, config: BatchConfig) -> BatchBuilder:
    """``builder`` (resumed from a snapshot) under ``config``, or a new one."""
    if builder is None:
        return BatchBuilder(config)
    builder.config = config
    return builder


def cohort_of(org_id: str, task_kind: str) -> str:
    return f"{org_id}/{task_kind}"


def stats_row(cohort: str, bb: BatchBuilder, samples: int, batches: int) -> BatchStats:
    return BatchStats(
        cohort=cohort,
        samples=samples,
        batches=batches,
        counts=dict(bb.counts),
        lag_accepted={str(k): v for k, v in bb.lag_counts.items()},
        lag_dropped={str(k): v for k, v in bb.dropped_lag.items()},
        clock=bb.clock,
    )


def _governed(bb: BatchBuilder) -> Counter[str]:
    """A builder's trajectories kept from training by their data-use class, by reason (monitor_only, ...)."""
    return Counter({k.split(":", 1)[1]: n for k, n in bb.counts.items() if k.startswith("data_use:")})


def _builder_totals(bb: BatchBuilder) -> Counter[str]:
    """A builder's running totals as :class:`FlowCounts` names: ``joined``, ``stale``, ``dropped:<reason>``."""
    totals: Counter[str] = Counter({f"dropped:{k}": v for k, v in bb.counts.items()})
    totals["joined"], totals["stale"] = len(bb.joined), sum(bb.dropped_lag.values())
    return totals


def summary(counts: FlowCounts, seconds: float | None = None) -> str:
    """The line the batch flow prints when it ends, e.g. ``batch flow: 300 rollouts, 600 rewards; 300 samples
    joined, 12 micro-batches sent (290 samples); dropped 10 stale, 0 unmatched; 0 dead letters in 4.2s``.
    Rewards of another reward version and later revisions of a reward are skipped, not counted as dropped:
    they never make samples. Joined, sent and dropped are the trained version's (``rewards.train_version``); with
    org adapters (``adapters.orgs``) the line says how many of the micro-batches went to an org's adapter."""
    c = counts.snapshot()
    dropped = by_kind(c, "dropped:")
    unmatched = dropped.get("unmatched_rollout", 0) + dropped.get("unmatched_reward", 0)
    extra = (("too_long", "too long"), ("duplicate_rollout", "duplicate rollouts"))
    more = "".join(f", {dropped[k]:,} {label}" for k, label in extra if dropped.get(k))
    governed = sum(n for k, n in dropped.items() if k.startswith("data_use:"))
    more += f", {governed:,} not for training by data use" if governed else ""
    return (
        f"batch flow: {c['read:rollout']:,} rollouts, {c['read:reward']:,} rewards; {c['joined']:,} samples joined, "
        f"{c['batches']:,} micro-batches sent ({c['sent']:,} samples"
        + (f"; {c['adapter_batches']:,} batches to org adapters" if c["adapter_batches"] else "")
        + f"); dropped {c['stale']:,} stale, "
        f"{unmatched:,} unmatched{more}; {dead_letters(c)}" + ("" if seconds is None else f" in {seconds:.1f}s")
    )


class _CohortLogic(StatefulBatchLogic):
    """Bytewax wrapper around one cohort's :class:`BatchBuilder` per reward version (the snapshotted state):
    every rollout goes to each builder, each reward to its version's; ``bb`` is the trained version's."""

    def __init__(
        self,
        state: dict,
        idle_s: float,
        stop: threading.Event | None = None,
        counts: FlowCounts | None = None,
        configs: Mapping[str, BatchConfig] | None = None,
    ):
        self.state, self.idle_s, self.stop, self.counts = state, idle_s, stop, counts
        # a resumed state holds the builders of the versions trainable when it was snapshotted: keep those still
        # trainable, make the new ones, and make the trained version's the one counted (batch_stats, summary)
        have = {b.config.reward_version: b for b in [state["builder"], *state.get("others", {}).values()]}
        if configs:
            # a resumed builder takes the current settings' config (lags, waits, verdict kinds), not its snapshot's
            have = {v: _configured(have.get(v), cfg) for v, cfg in configs.items()}
            trained = next(iter(configs))  # batch_configs puts the trained version first
        else:
            trained = state["builder"].config.reward_version
        self.bb: BatchBuilder = have[trained]
        state["builder"], state["others"] = self.bb, {v: b for v, b in have.items() if v != trained}
        self.builders: dict[str, BatchBuilder] = {trained: self.bb, **state["others"]}
        self.quiet_since: datetime | None = None
        self.counted = _builder_totals(self.bb)  # a resumed cohort's totals so far belong to earlier runs
        # as counted so far, for the staleness metrics (a resumed cohort's belong to earlier runs)
        self.lags_seen, self.dropped_seen = Counter(self.bb.lag_counts), Counter(self.bb.dropped_lag)
        self.governed_seen = _governed(self.bb)

    def _out(self, batches: list[MicroBatch]) -> list:
        # what is counted (batch_stats, the summary) is the trained version's; other versions' batches go out too
        mine = [b for b in batches if b.reward_version == self.bb.config.reward_version]
        sent = sum(len(b.sample_ids) for b in mine)
        self.state["batches"] += len(mine)
        self.state["samples"] += sent
        if self.counts is not None:
            totals = _builder_totals(self.bb)
            tally = totals - self.counted
            tally["batches"], tally["sent"] = len(mine), sent
            self.counts.add(tally)
            self.counted = totals
        lags, dropped = Counter(self.bb.lag_counts), Counter(self.bb.dropped_lag)
        metrics.observe_lags(
            {str(lag): n for lag, n in (lags - self.lags_seen).items()},
            {str(lag): n for lag, n in (dropped - self.dropped_seen).items()},
        )
        self.lags_seen, self.dropped_seen = lags, dropped
        governed = _governed(self.bb)
        for reason, n in (governed - self.governed_seen).items():
            metrics.DATA_USE_EXCLUDED.labels(reason).inc(n)
        self.governed_seen = governed
        metrics.BATCHES.inc(len(mine))
        stats = stats_row(self.state["cohort"], self.bb, self.state["samples"], self.state["batches"])
        return [(batches, stats, self.org)]

    @property
    def org(self) -> str:
        """The cohort's org (a state snapshotted before the org was kept: read from the cohort key)."""
        return self.state.get("org") or self.state["cohort"].rsplit("/", 1)[0]

    def on_batch(self, values: list) -> tuple[list, bool]:
        out: list[MicroBatch] = []
        if self.counts is not None:
            self.counts.add(Counter(f"read:{kind}" for kind, _ in values))
        metrics.count_flow("batches", len(values), ())
        self.state["cohort"] = self.state["cohort"] or cohort_of(values[0][1].org_id, values[0][1].task_kind)
        self.state["org"] = self.state.get("org") or values[0][1].org_id
        for kind, rec in values:
            if kind == "rollout":
                for bb in self.builders.values():
                    bb.set_serving_version(rec.policy_version)
                    out += bb.add_rollout(rec)
            else:  # a version no builder takes is counted (other_reward_version) by the trained one's
                out += self.builders.get(rec.reward_version, self.bb).add_reward(rec)
        self.quiet_since = datetime.now(UTC)
        return self._out(out), StatefulBatchLogic.RETAIN

    def notify_at(self) -> datetime | None:
        if not any(bb.ready for bb in self.builders.values()) or self.quiet_since is None:
            return None
        return self.quiet_since + timedelta(seconds=self.idle_s)

    def on_notify(self) -> tuple[list, bool]:
        self.quiet_since = None
        return self._out([b for bb in self.builders.values() for b in bb.flush_ready()]), StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list, bool]:
        if paused(self.stop):  # stopped, not the end of the input: what waits stays in the snapshot
            return [], StatefulBatchLogic.RETAIN
        return self._out([b for bb in self.builders.values() for b in bb.flush()]), StatefulBatchLogic.RETAIN

    def snapshot(self) -> dict:
        return self.state


def _parser(codec: JsonCodec, kind: str, source: str, deny: DenySource | None = None):
    def parse(m: Message) -> list:
        try:
            rec = codec.decode(m.value)
        except Invalid as e:
            if deny is not None and deny.current().names(m.value, m.key):  # an erased subject's malformed record
                metrics.ERASED_SKIPPED.labels(consumer="batch_flow").inc()
                return []
            return [
                (
                    "dead",
                    dead_letter(
                        e.kind,
                        e.field,
                        e.reason,
                        source,
                        m.partition,
                        m.offset,
                        m.key,
                        m.value,
                        time.time_ns() // 1_000_000,
                    ),
                )
            ]
        if deny is not None and deny.current().denies(rec.trajectory_id, rec.org_id):
            metrics.ERASED_SKIPPED.labels(consumer="batch_flow").inc()  # erased (`rtrl erase`): never trained
            return []
        return [(cohort_of(rec.org_id, rec.task_kind), (kind, rec))]

    return parse


def kafka_inputs(
    settings: Settings, bootstrap: str | None = None, stop: threading.Event | None = None
) -> dict[str, Source]:
    """The flow's default inputs (after a bounded broker check): rtrl.rollouts and rtrl.rewards."""
    bootstrap, k, tail = require_bootstrap(settings, bootstrap), settings.kafka, settings.batching.tail
    return {
        name: kafka_source(
            bootstrap, [settings.topic(name)], k.timeout_s, tail=tail, idle_s=k.idle_backoff_s, stop=stop
        )
        for name in INPUTS
    }


def service_outputs(settings: Settings, bootstrap: str | None = None) -> dict[str, Sink]:
    """The flow's default outputs: the Kafka topics and the ClickHouse tables."""
    return {
        "kafka": KafkaSink(
            require_bootstrap(settings, bootstrap), settings.sdk.delivery_timeout_s, settings.kafka.compression
        ),
        "clickhouse": ClickHouseSink(
            settings.clickhouse_dsn,
            settings.clickhouse.database,
            settings.flow.batch_rows,
            settings.flow.batch_seconds,
            settings.clickhouse.timeout_s,
            cluster=cluster_of(settings.clickhouse),
        ),
    }


def build_flow(
    settings: Settings,
    bootstrap: str | None = None,
    stop: threading.Event | None = None,
    *,
    sources: Mapping[str, Source] | None = None,
    sinks: Mapping[str, Sink] | None = None,
    counts: FlowCounts | None = None,
    deny: DenySource | None = None,
) -> Dataflow:
    """The batch flow for ``settings``.

    ``sources`` maps each name of :data:`INPUTS` to a Bytewax source and ``sinks`` each name of
    :data:`OUTPUTS` to a sink; left out, they are :func:`kafka_inputs` / :func:`service_outputs`
    (``bootstrap`` overrides ``kafka.bootstrap``; setting ``stop`` ends an in-process run cleanly,
    flushing what waits; a :class:`flows.kafka_io.Pause` keeps it for a restart from the recovery state).
    With both given the flow touches neither Kafka nor ClickHouse. ``counts`` (a :class:`flows.counts.FlowCounts`)
    counts what the run reads, joins, sends and drops: :func:`summary`. ``deny`` lists the erased subjects whose
    rollouts and rewards are skipped; with the service outputs it defaults to the one ClickHouse holds."""
    configs, bs = batch_configs(settings), settings.batching  # bad settings fail before any I/O
    cfg = configs[settings.rewards.train_version]
    sources = kafka_inputs(settings, bootstrap, stop) if sources is None else injected(sources, INPUTS, "sources")
    if deny is None and sinks is None:
        deny = clickhouse.deny_watch(settings)
    sinks = service_outputs(settings, bootstrap) if sinks is None else injected(sinks, OUTPUTS, "sinks")
    flow = Dataflow("rtrl_batches")
    parsed = []
    for name, cls in (("rollouts", Rollout), ("rewards", Reward)):
        topic = settings.topic(name)
        src = op.input(f"{name}_in", flow, sources[name])
        parsed.append(op.flat_map(f"parse_{name}", src, _parser(JsonCodec(cls), name[:-1], topic, deny)))
    items = op.merge("merge", *parsed)
    split = op.branch("split_dead", items, lambda kv: kv[0] != "dead")
    keyed = split.trues

    def build(resume: dict | None) -> _CohortLogic:
        return _CohortLogic(
            resume or {"builder": BatchBuilder(cfg), "cohort": "", "samples": 0, "batches": 0},
            bs.idle_flush_s,
            stop,
            counts,
            configs,
        )

    out = op.stateful_batch("batches", keyed, build)
    batches_topic, dl_topic = settings.topic("batches"), settings.topic("dead_letters")
    adapter_topic = settings.topic("adapter-batches")
    rollouts_topic = settings.topic("rollouts")
    dl_codec: JsonCodec[DeadLetter] = JsonCodec(DeadLetter)
    ad, trained = settings.adapters, settings.rewards.train_version

    def message(b: MicroBatch, org: str) -> tuple[str, bytes, bytes]:
        if b.adapter:  # an org's adapter batch: keyed by org, so the org's batches stay in order
            return (adapter_topic, org.encode(), encode_batch(b))
        return (batches_topic, b.batch_id.encode(), encode_batch(b))

    def to_kafka(kv: tuple[str, tuple[list[MicroBatch], BatchStats, str]]) -> list:
        batches, _, org = kv[1]
        if ad.wants(org):  # routed per org (route_adapters)
            return []
        batches = [c for b in batches for c in unrouted(b, ad.shared_traffic)]  # served: one version a batch
        return [("kafka", [message(b, org) for b in batches])] if batches else []

    def adapter_orgs(kv: tuple[str, tuple[list[MicroBatch], BatchStats, str]]) -> list:
        batches, _, org = kv[1]
        return [(org, (org, b)) for b in batches] if ad.wants(org) else []

    def route(state: dict | None, item: tuple[str, MicroBatch]) -> tuple[dict, list[MicroBatch]]:
        """One org's router under the current settings, from its snapshotted count (flows.adapters)."""
        org, batch = item
        router = OrgRouter.resume(state, org, ad.min_samples, ad.shared_traffic, trained)
        sent = router.route(batch)  # before the snapshot: it counts this batch
        return router.snapshot(), sent

    def routed_to_kafka(kv: tuple[str, list[MicroBatch]]) -> list:
        org, batches = kv
        if counts is not None:
            counts.add({"adapter_batches": sum(1 for b in batches if b.adapter and b.reward_version == trained)})
        return [("kafka", [message(b, org) for b in batches])] if batches else []

    wanted = op.flat_map("adapter_orgs", out, adapter_orgs)
    routed = op.stateful_map("route_adapters", wanted, route)

    def dead_to_kafka(kv: tuple[str, DeadLetter]) -> list:
        d = kv[1]
        if counts is not None:
            counts.add({f"dead:{d.kind}": 1, f"read:{'rollout' if d.source == rollouts_topic else 'reward'}": 1})
        metrics.count_flow("batches", 1, (d.kind,))
        return [("kafka", [(dl_topic, d.source.encode(), dl_codec.encode(d))])]

    op.output(
        "kafka",
        op.merge(
            "to_kafka",
            op.flat_map("batches_to_kafka", out, to_kafka),
            op.flat_map("adapter_batches_to_kafka", routed, routed_to_kafka),
            op.flat_map("dead_to_kafka", split.falses, dead_to_kafka),
        ),
        sinks["kafka"],
    )
    to_ch = op.merge(
        "to_clickhouse",
        op.map("stats", out, lambda kv: ("clickhouse", ("batch_stats", [kv[1][1]]))),
        op.map("dead_to_clickhouse", split.falses, lambda kv: ("clickhouse", ("dead_letters", [kv[1]]))),
    )
    op.output("clickhouse", to_ch, sinks["clickhouse"])
    return flow


def __getattr__(name: str) -> Dataflow:
    """``flows.batch_flow:flow`` is built on first access from the environment's settings."""
    if name == "flow":
        return build_flow(load_settings())
    raise AttributeError(name)
