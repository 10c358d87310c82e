"""The reward and batch flows in-process, without a broker or ClickHouse.

Each flow is built with Bytewax's ``TestingSource`` in place of its Kafka sources and
``TestingSink`` in place of its ClickHouse and Kafka sinks (``build_flow(..., sources=, sinks=)``),
then run on one worker (``run_main``) and on two worker threads (``cluster_main``). The results
are checked against the flows' logic run offline over the same input (:mod:`flows.processor`,
:mod:`rewards`, :mod:`flows.batching`), and the two worker counts against each other. The
broker/ClickHouse versions of these checks live in tests/test_reward_flow.py and
tests/test_batch_flow.py.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict

import msgspec
import pytest
from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

from flows import batch_flow, reward_flow
from flows.batching import BatchBuilder
from flows.counts import FlowCounts
from flows.processor import Message, RewardProcessor
from flows.windowing import WindowConfig
from rewards import compute
from rtrl.errors import ConfigError
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import Invalid, JsonCodec, decode_batch, encode_batch, event_codec
from schemas.records import BatchStats, DeadLetter, MicroBatch, Reward, Rollout
from simulator.generate import generate
from tests.test_batching import ro, rw
from tests.test_reward_flow import HOSTILE_KINDS, _hostile

SALT = "inprocess-flow-salt"
VERSIONS = ["v2", "v1-discard-broken"]
PARTITIONS = 3
WORKERS = (1, 2)


def _settings():
    # no RTRL_KAFKA__BOOTSTRAP: building a Kafka source or sink would raise ConfigError at once; no delayed path:
    # the batch world's stale samples are dropped (tests/test_delayed_path.py trains them delayed)
    env = {"RTRL_SDK__SALT": SALT, "RTRL_REWARDS__VERSIONS": ",".join(VERSIONS), "RTRL_TRAIN__MAX_DELAYED_LAG": "0"}
    return load_settings(env=env)


def _run(flow, workers: int) -> None:
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, [], 0, worker_count_per_proc=workers)


def _decode_outputs(kafka: list, clickhouse: list) -> tuple[dict[str, list], dict[str, list]]:
    """What the flow sent, by Kafka topic (``(key, value)`` pairs) and by ClickHouse table (rows)."""
    topics, tables = defaultdict(list), defaultdict(list)
    for name, batch in kafka:
        assert name == "kafka"
        for topic, key, value in batch:
            topics[topic].append((key, value))
    for name, (table, rows) in clickhouse:
        assert name == "clickhouse" and rows
        tables[table] += rows
    return topics, tables


def _canonical(records, **zeroed) -> list[bytes]:
    """Records as sorted JSON with the wall-clock stamps zeroed: a multiset comparable across runs."""
    return sorted(msgspec.json.encode(msgspec.structs.replace(r, **zeroed) if zeroed else r) for r in records)


# ---------------------------------------------------------------- reward flow


def _reward_input() -> tuple[list[tuple[str, Message]], dict[str, bytes | None], int, int]:
    """Simulated events (duplicates, reordering, hours-late checks, then a later phase cut off midway,
    so that trajectories are still open when the input ends and close at end of input) spread over PARTITIONS partitions by trajectory,
    as the keyed Kafka source emits them, then every kind of bad input on the partition of the first
    event. Returns the items, the bad inputs, their partition and first offset."""
    codec = event_codec()
    phase1 = generate(SimulatorSettings(trajectories=120, seed=31, duplicate_rate=0.05, late_check_rate=0.2), SALT)
    start = max(e.event.ts for e in phase1) + 3_600_000
    phase2 = generate(SimulatorSettings(trajectories=40, seed=32, late_check_rate=0.0, start_ms=start), SALT)
    phase2 = phase2[: len(phase2) // 2]
    offsets: Counter[int] = Counter()
    items = []

    def add(key: bytes, value: bytes | None, p: int) -> None:
        items.append((str(p), Message(key, value, p, offsets[p])))
        offsets[p] += 1

    for e in phase1 + phase2:
        key = e.event.trajectory_id.encode()
        add(key, codec.encode(e.event), zlib.crc32(key) % PARTITIONS)
    first_key = items[0][1].key
    p0 = zlib.crc32(first_key) % PARTITIONS
    hostile, start = _hostile(items[0][1].value), offsets[p0]
    for value in hostile.values():
        add(first_key, value, p0)
    return items, hostile, p0, start


def _run_reward_flow(items, workers: int) -> tuple[dict, dict]:
    kafka, clickhouse = [], []
    flow = reward_flow.build_flow(
        _settings(),
        sources={"events": TestingSource(items, batch_size=64)},
        sinks={"clickhouse": TestingSink(clickhouse), "kafka": TestingSink(kafka)},
    )
    _run(flow, workers)
    return _decode_outputs(kafka, clickhouse)


@pytest.fixture(scope="module")
def reward_world():
    items, hostile, p0, start = _reward_input()
    return items, hostile, p0, start, {w: _run_reward_flow(items, w) for w in WORKERS}


def _offline_rewards(items) -> tuple[dict[str, list], int]:
    """The reward processor run directly over each partition's messages, in order: rows by table."""
    settings = _settings()
    by_partition = defaultdict(list)
    for key, m in items:
        by_partition[key].append(m)
    tables: dict[str, list] = defaultdict(list)
    discarded = 0
    for msgs in by_partition.values():
        proc = RewardProcessor(
            settings.topic("events"), WindowConfig(settings.flow), VERSIONS, settings.sdk.max_event_bytes
        )
        out = proc.process(msgs)
        out.extend(proc.finish())
        tables["events"] += list(zip(out.events, out.coords))  # what the archive gets: (event, (partition, offset))
        tables["rewards"] += out.rewards
        tables["trajectories"] += out.summaries
        tables["dead_letters"] += out.dead_letters
        discarded += out.discarded
    return tables, discarded


@pytest.mark.parametrize("workers", WORKERS)
def test_reward_flow_matches_the_processor_offline(reward_world, workers):
    """Every table the flow writes holds exactly what the processor computes offline over the same
    partitions (wall-clock stamps aside); the Kafka output carries the same rewards and dead letters."""
    items, _, _, _, runs = reward_world
    topics, tables = runs[workers]
    expected, discarded = _offline_rewards(items)
    assert discarded > 0 and set(tables) == set(expected) == {"events", "rewards", "trajectories", "dead_letters"}
    assert sorted(msgspec.json.encode(row) for row in tables["events"]) == sorted(
        msgspec.json.encode(row) for row in expected["events"]
    )
    assert _canonical(tables["trajectories"]) == _canonical(expected["trajectories"])
    assert _canonical(tables["rewards"], emitted_at=0) == _canonical(expected["rewards"], emitted_at=0)
    assert _canonical(tables["dead_letters"], at=0) == _canonical(expected["dead_letters"], at=0)

    settings = _settings()
    rewards_topic, dl_topic = settings.topic("rewards"), settings.topic("dead_letters")
    assert set(topics) == {rewards_topic, dl_topic}
    sent = [(k, JsonCodec(Reward).decode(v)) for k, v in topics[rewards_topic]]
    assert all(k == r.trajectory_id.encode() for k, r in sent)
    assert _canonical([r for _, r in sent]) == _canonical(tables["rewards"])
    dead = [(k, JsonCodec(DeadLetter).decode(v)) for k, v in topics[dl_topic]]
    assert all(k == d.source.encode() for k, d in dead)
    assert _canonical([d for _, d in dead]) == _canonical(tables["dead_letters"])


@pytest.mark.parametrize("workers", WORKERS)
def test_reward_flow_rewards_every_trajectory_once_per_version(reward_world, workers):
    """Per trajectory and version exactly one reward per revision 0..n (late checks add revisions), and
    the final revision equals the reward of the trajectory's distinct events computed directly; v2
    rewards every trajectory, v1-discard-broken every one without a broken tool call."""
    items, _, _, _, runs = reward_world
    _, tables = runs[workers]
    codec = event_codec()
    by_traj: dict[str, dict] = defaultdict(dict)
    for _, m in items:
        try:
            e = codec.decode(m.value)
        except Invalid:  # the bad inputs that do not parse
            e = None
        if e is not None and e.trajectory_id not in {"ghost", "ancient"} and e.event_id != "future-1":
            by_traj[e.trajectory_id][e.event_id] = e
    revisions: dict[tuple[str, str], list[int]] = defaultdict(list)
    final: dict[tuple[str, str], Reward] = {}
    for r in tables["rewards"]:
        revisions[(r.trajectory_id, r.reward_version)].append(r.revision)
        if r.revision >= final.get((r.trajectory_id, r.reward_version), r).revision:
            final[(r.trajectory_id, r.reward_version)] = r
    assert all(sorted(revs) == list(range(len(revs))) for revs in revisions.values())
    assert any(len(revs) > 1 for revs in revisions.values())  # late persistence checks revised some
    # closed by the trajectory's end, by a late event, and at the end of input (the cut-off phase)
    assert {r.close_reason for r in tables["rewards"]} == {"ended", "late", "deadline"}
    assert {t for t, v in final if v == "v2"} == set(by_traj)
    broken = {t for t, evs in by_traj.items() if any(getattr(e, "valid", True) is False for e in evs.values())}
    assert broken and {t for t, v in final if v == "v1-discard-broken"} == set(by_traj) - broken
    for (tid, version), r in final.items():
        expected = compute(by_traj[tid].values(), version)
        assert (r.reward, r.components, r.flags) == (expected.reward, expected.components, expected.flags)
    summaries = Counter(s.trajectory_id for s in tables["trajectories"])  # one per close, as v2's rewards
    assert summaries == {t: len(revisions[(t, "v2")]) for t in by_traj}


@pytest.mark.parametrize("workers", WORKERS)
def test_reward_flow_dead_letters_bad_input_with_its_reason(reward_world, workers):
    """Every kind of bad input lands in the dead-letter outputs with its kind, reason and source
    position; the duplicates the simulator sent are dead-lettered too, and nothing else is."""
    items, hostile, p0, start, runs = reward_world
    _, tables = runs[workers]
    dead = tables["dead_letters"]
    ids = [msgspec.json.decode(m.value)["event_id"] for _, m in items[: len(items) - len(hostile)]]
    kinds = Counter(d.kind for d in dead)
    assert kinds.pop("duplicate") == len(ids) - len(set(ids))
    assert kinds == HOSTILE_KINDS
    settings = _settings()
    assert all(d.source == settings.topic("events") for d in dead)
    bad = [d for d in dead if d.kind != "duplicate"]
    assert sorted(d.offset for d in bad) == list(range(start, start + len(hostile))) and {d.partition for d in bad} == {
        p0
    }
    # a duplicate is reported on its trajectory's partition, keyed by the trajectory
    assert all(d.partition == zlib.crc32(d.key.encode()) % PARTITIONS for d in dead if d.kind == "duplicate")
    reasons = {d.kind: d.field + " " + d.reason for d in dead}
    assert "allowed lateness" in reasons["too_late"] and "never sent trajectory_started" in reasons["never_started"]
    assert "org_id" in next(d.field + d.reason for d in dead if d.offset == start + list(hostile).index("missing"))
    assert all(d.reason for d in dead)


def test_reward_flow_two_workers_equal_one(reward_world):
    """The same input on two worker threads gives exactly the single-worker results."""
    *_, runs = reward_world
    (t1, c1), (t2, c2) = runs[1], runs[2]
    zero = {"rewards": {"emitted_at": 0}, "dead_letters": {"at": 0}}
    for table in ("events", "rewards", "trajectories", "dead_letters"):
        assert _canonical(c1[table], **zero.get(table, {})) == _canonical(c2[table], **zero.get(table, {})), table
    assert {t: len(v) for t, v in t1.items()} == {t: len(v) for t, v in t2.items()}


# ---------------------------------------------------------------- batch flow

LONG = {"prompt": 30, "completion": 30}  # 60 tokens: two samples per 128-token row, 16 per micro-batch


def _batch_world() -> tuple[list[Rollout], list[Reward], list[Reward]]:
    """Rollouts and rewards of two cohorts, built so that what the flow trains on does not depend on
    how its two inputs interleave: one event time for all, each cohort's newest policy version first
    among its rollouts (the serving version is known before any join), groups that close when full,
    at most one group of one per cohort (the running baseline of several would depend on join order)
    and rewards whose group means are exact.

    Returns the rollouts, the rewards, and the rewards that must not be trained on."""
    rollouts, rewards, ignored = [], [], []
    # cohort o/bugfix, serving version 2 (lag limit 1): ten groups of two at versions 1-2, one group
    # of three, two stale samples (version 0), one singleton, one rollout without a reward
    rollouts += [ro(f"n{i}", group="gn", size=3, version=2, **LONG) for i in range(3)]
    for g in range(10):
        rollouts += [ro(f"g{g}{s}", group=f"g{g}", size=2, version=1 + g % 2, **LONG) for s in "ab"]
    rollouts += [ro(f"old{i}", group="gold", size=2, version=0, **LONG) for i in range(2)]
    rollouts += [ro("solo", group="gsolo", version=2, **LONG), ro("nor", group="gnor", version=2, **LONG)]
    rollouts.append(ro("g0a", group="g0", size=2, version=1, **LONG))  # a duplicate rollout
    rewards += [rw(f"n{i}", float(i), policy=2) for i in range(3)]
    rewards += [rw(f"g{g}{s}", 0.5 * g + (1.0 if s == "a" else 0.0), policy=1 + g % 2) for g in range(10) for s in "ab"]
    rewards += [rw("old0", 1.0, policy=0), rw("old1", 0.0, policy=0), rw("solo", 0.75, policy=2)]
    ignored += [
        rw("ghost", 1.0),
        rw("g1a", 0.25, version="v1-discard-broken"),
        rw("g2a", 2.0, revision=1),
        rw("g3b", 3.0),
    ]  # unmatched, other version, later revision, duplicate
    # cohort p/test, serving version 5: one group of four, one stale pair (version 3)
    rollouts += [ro(f"p{i}", group="gp", size=4, version=5, org="p", kind="test", **LONG) for i in range(4)]
    rollouts += [ro(f"q{i}", group="gq", size=2, version=3, org="p", kind="test", **LONG) for i in range(2)]
    rewards += [rw(f"p{i}", [-1.0, 0.0, 0.5, 2.5][i], policy=5, org="p", kind="test") for i in range(4)]
    rewards += [rw(f"q{i}", 1.0, policy=3, org="p", kind="test") for i in range(2)]
    return rollouts, rewards, ignored


def _batch_input() -> tuple[list[Message], list[Message]]:
    rollouts, rewards, ignored = _batch_world()
    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)
    ro_values = [(r.trajectory_id.encode(), rc.encode(r)) for r in rollouts] + [(b"x", b"{not json")]
    rw_values = [(r.trajectory_id.encode(), wc.encode(r)) for r in rewards + ignored] + [
        (b"y", b'{"trajectory_id": 5}')
    ]
    return (
        [Message(k, v, 0, i) for i, (k, v) in enumerate(ro_values)],
        [Message(k, v, 0, i) for i, (k, v) in enumerate(rw_values)],
    )


def _run_batch_flow(workers: int) -> tuple[dict, dict]:
    ro_msgs, rw_msgs = _batch_input()
    kafka, clickhouse = [], []
    flow = batch_flow.build_flow(
        _settings(),
        sources={"rollouts": TestingSource(ro_msgs, batch_size=8), "rewards": TestingSource(rw_msgs, batch_size=8)},
        sinks={"kafka": TestingSink(kafka), "clickhouse": TestingSink(clickhouse)},
    )
    _run(flow, workers)
    return _decode_outputs(kafka, clickhouse)


@pytest.fixture(scope="module")
def batch_runs():
    return {w: _run_batch_flow(w) for w in WORKERS}


def _samples(batches: list[MicroBatch]) -> dict[str, tuple]:
    """Each packed sample's content: (policy version, advantage, its tokens, loss mask, log-probs);
    fails on a sample packed twice."""
    out: dict[str, tuple] = {}
    for b in batches:
        for i, sid in enumerate(b.sample_ids):
            cells = [(r, c) for r, seg in enumerate(b.segment_ids) for c, s in enumerate(seg) if s == i]
            advs = {b.advantages[r][c] for r, c in cells if b.loss_mask[r][c]}
            assert len(advs) == 1, sid
            assert sid not in out, f"{sid} packed twice"
            out[sid] = (
                b.policy_versions[i],
                advs.pop(),
                tuple(b.token_ids[r][c] for r, c in cells),
                tuple(b.loss_mask[r][c] for r, c in cells),
                tuple(b.behaviour_logprobs[r][c] for r, c in cells),
            )
    return out


def _final_stats(rows: list[BatchStats]) -> dict[str, BatchStats]:
    """The newest counters per cohort (a cohort's rows come from one worker, in order)."""
    return {r.cohort: r for r in rows}


def _offline_batches() -> tuple[dict[str, tuple], dict[str, BatchBuilder]]:
    """Each cohort's BatchBuilder fed directly: all rollouts, then all rewards, then the end of input."""
    rollouts, rewards, ignored = _batch_world()
    cfg = batch_flow.batch_config(_settings())
    builders: dict[str, BatchBuilder] = {}
    batches = []
    for rec in rollouts + rewards + ignored:
        bb = builders.setdefault(batch_flow.cohort_of(rec.org_id, rec.task_kind), BatchBuilder(cfg))
        if isinstance(rec, Rollout):
            bb.set_serving_version(rec.policy_version)
            batches += bb.add_rollout(rec)
        else:
            batches += bb.add_reward(rec)
    for bb in builders.values():
        batches += bb.flush()
    return _samples([decode_batch(encode_batch(b)) for b in batches]), builders


@pytest.mark.parametrize("workers", WORKERS)
def test_batch_flow_packs_each_fresh_sample_once(batch_runs, workers):
    """Every joined sample within the lag limit is packed into exactly one micro-batch, with its
    tokens and its group-relative advantage, as the cohort's BatchBuilder computes offline; stale
    samples are dropped and counted per lag; unmatched, duplicate, later-revision and other-version
    input is counted, never trained on."""
    topics, tables = batch_runs[workers]
    settings = _settings()
    sent = topics[settings.topic("batches")]
    batches = [decode_batch(v) for _, v in sent]
    assert all(k == b.batch_id.encode() for (k, _), b in zip(sent, batches))
    assert len({b.batch_id for b in batches}) == len(batches) >= 2
    assert all(len(b.token_ids) <= 8 and b.seq_len == 128 for b in batches)
    got = _samples(batches)
    expected, builders = _offline_batches()
    assert got == expected
    rollouts = {r.trajectory_id: r for r in _batch_world()[0]}
    for sid, (_, _, tokens, mask, _) in got.items():
        assert tokens == tuple(rollouts[sid].prompt_ids + rollouts[sid].completion_ids)
        assert mask == (0,) * 30 + (1,) * 30
    assert set(got) == {f"n{i}" for i in range(3)} | {f"g{g}{s}" for g in range(10) for s in "ab"} | {"solo"} | {
        f"p{i}" for i in range(4)
    }
    assert [got[f"n{i}"][1] for i in range(3)] == [-1.0, 0.0, 1.0] and got["solo"][1] == 0.0
    assert [got[f"p{i}"][1] for i in range(4)] == [-1.5, -0.5, 0.0, 2.0]

    stats = _final_stats(tables["batch_stats"])
    assert set(stats) == {"o/bugfix", "p/test"}
    for cohort, s in stats.items():
        bb = builders[cohort]
        assert (s.counts, s.lag_accepted, s.lag_dropped) == (
            dict(bb.counts),
            {str(k): v for k, v in bb.lag_counts.items()},
            {str(k): v for k, v in bb.dropped_lag.items()},
        )
        assert s.samples == sum(1 for sid in got if rollouts[sid].org_id + "/" + rollouts[sid].task_kind == cohort)
    assert stats["o/bugfix"].counts == {
        "unmatched_rollout": 1,
        "unmatched_reward": 1,
        "other_reward_version": 1,
        "later_revision_or_duplicate": 2,
        "duplicate_rollout": 1,
    }
    assert stats["o/bugfix"].lag_dropped == {"2": 2} and stats["p/test"].lag_dropped == {"2": 2}
    assert sum(s.batches for s in stats.values()) == len(batches)


@pytest.mark.parametrize("workers", WORKERS)
def test_batch_flow_dead_letters_bad_input(batch_runs, workers):
    """A malformed rollout and a mistyped reward go to both dead-letter outputs with their reasons."""
    topics, tables = batch_runs[workers]
    settings = _settings()
    dead = [JsonCodec(DeadLetter).decode(v) for _, v in topics[settings.topic("dead_letters")]]
    assert sorted((d.kind, d.source, d.offset) for d in dead) == [
        ("invalid", settings.topic("rewards"), len(_batch_input()[1]) - 1),
        ("malformed", settings.topic("rollouts"), len(_batch_input()[0]) - 1),
    ]
    assert "trajectory_id" in next(d.field + d.reason for d in dead if d.kind == "invalid")
    assert _canonical(dead) == _canonical(tables["dead_letters"])


def test_batch_flow_two_workers_equal_one(batch_runs):
    """Two worker threads train on the same samples with the same advantages and count the same as one."""
    (t1, c1), (t2, c2) = batch_runs[1], batch_runs[2]
    settings = _settings()
    batches = {w: [decode_batch(v) for _, v in t[settings.topic("batches")]] for w, t in ((1, t1), (2, t2))}
    assert _samples(batches[1]) == _samples(batches[2])

    def strip(rows):
        return {c: msgspec.structs.replace(s, batches=0) for c, s in _final_stats(rows).items()}

    assert strip(c1["batch_stats"]) == strip(c2["batch_stats"])
    assert _canonical(c1["dead_letters"], at=0) == _canonical(c2["dead_letters"], at=0)


# ---------------------------------------------------------------- counts: the one-line summaries


@pytest.mark.parametrize("workers", WORKERS)
def test_reward_flow_counts_what_it_read_and_wrote(workers):
    """The counts a run adds up from its worker threads equal what its sinks received: messages read,
    trajectories, rewards per version and dead letters per kind; the summary line says them."""
    items, *_ = _reward_input()
    kafka, clickhouse, counts = [], [], FlowCounts()
    flow = reward_flow.build_flow(
        _settings(),
        sources={"events": TestingSource(items, batch_size=64)},
        sinks={"clickhouse": TestingSink(clickhouse), "kafka": TestingSink(kafka)},
        counts=counts,
    )
    _run(flow, workers)
    _, tables = _decode_outputs(kafka, clickhouse)
    c = counts.snapshot()
    rewards = Counter(r.reward_version for r in tables["rewards"])
    dead = Counter(d.kind for d in tables["dead_letters"])
    assert c == Counter(
        {"events": len(items), "trajectories": len(tables["trajectories"])}
        | {f"rewards:{v}": n for v, n in rewards.items()}
        | {f"dead:{k}": n for k, n in dead.items()}
    )
    kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(dead.items(), key=lambda kv: (-kv[1], kv[0])))
    assert reward_flow.summary(counts, VERSIONS, 1.25) == (
        f"reward flow: {len(items):,} events, {len(tables['trajectories']):,} trajectories closed, "
        f"{sum(rewards.values()):,} rewards (v2 {rewards['v2']:,}, v1-discard-broken {rewards['v1-discard-broken']:,}), "
        f"{sum(dead.values())} dead letters ({kinds}) in 1.2s"
    )
    empty = FlowCounts()
    assert (
        reward_flow.summary(empty, ["v2"])
        == "reward flow: 0 events, 0 trajectories closed, 0 rewards (v2), 0 dead letters"
    )


@pytest.mark.parametrize("workers", WORKERS)
def test_batch_flow_counts_what_it_joined_sent_and_dropped(workers):
    """The batch flow's counts equal its outputs and its builders' counters: records read, samples joined,
    micro-batches and samples sent, stale and unmatched samples dropped, dead letters per kind."""
    ro_msgs, rw_msgs = _batch_input()
    kafka, clickhouse, counts = [], [], FlowCounts()
    flow = batch_flow.build_flow(
        _settings(),
        sources={"rollouts": TestingSource(ro_msgs, batch_size=8), "rewards": TestingSource(rw_msgs, batch_size=8)},
        sinks={"kafka": TestingSink(kafka), "clickhouse": TestingSink(clickhouse)},
        counts=counts,
    )
    _run(flow, workers)
    topics, _ = _decode_outputs(kafka, clickhouse)
    batches = [decode_batch(v) for _, v in topics[_settings().topic("batches")]]
    _, builders = _offline_batches()
    c = counts.snapshot()
    sent = sum(len(b.sample_ids) for b in batches)
    stale = sum(sum(bb.dropped_lag.values()) for bb in builders.values())
    assert (c["read:rollout"], c["read:reward"]) == (len(ro_msgs), len(rw_msgs))
    assert (c["batches"], c["sent"], c["stale"]) == (len(batches), sent, stale) and stale == 4
    assert c["joined"] == sum(len(bb.joined) for bb in builders.values()) == sent + stale
    assert {k: v for k, v in c.items() if k.startswith("dropped:")} == {
        f"dropped:{k}": v for k, v in sum((bb.counts for bb in builders.values()), Counter()).items()
    }
    assert (c["dead:malformed"], c["dead:invalid"]) == (1, 1)
    assert batch_flow.summary(counts) == (
        f"batch flow: {len(ro_msgs)} rollouts, {len(rw_msgs)} rewards; {sent + stale} samples joined, "
        f"{len(batches)} micro-batches sent ({sent} samples); dropped 4 stale, 2 unmatched, 1 duplicate rollouts; "
        "2 dead letters (invalid 1, malformed 1)"
    )


# ---------------------------------------------------------------- injection


def test_injected_flows_touch_no_service(monkeypatch):
    """With sources and sinks given, neither builder builds a Kafka source or sink nor a ClickHouse
    sink (and needs no broker address); without them and without an address it says what to fix;
    a sources/sinks mapping must name exactly the flow's inputs/outputs."""

    def refuse(*args, **kwargs):
        raise AssertionError("a service was touched")

    for mod in (reward_flow, batch_flow):
        for name in ("kafka_source", "KafkaSink", "ClickHouseSink"):
            monkeypatch.setattr(mod, name, refuse)
    settings = _settings()
    assert not settings.kafka.bootstrap
    sinks = {name: TestingSink([]) for name in ("kafka", "clickhouse")}
    reward_flow.build_flow(settings, sources={"events": TestingSource([])}, sinks=sinks)
    batch_flow.build_flow(settings, sources={"rollouts": TestingSource([]), "rewards": TestingSource([])}, sinks=sinks)
    for build in (reward_flow.build_flow, batch_flow.build_flow):
        with pytest.raises(ConfigError, match="kafka.bootstrap"):
            build(settings, sinks=sinks)
    with pytest.raises(ValueError, match="rewards"):
        batch_flow.build_flow(settings, sources={"rollouts": TestingSource([])}, sinks=sinks)
    with pytest.raises(ValueError, match="clickhouse"):
        reward_flow.build_flow(settings, sources={"events": TestingSource([])}, sinks={"kafka": TestingSink([])})
