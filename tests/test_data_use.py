"""Data-use classes (issue 38, point 1): the stricter of the product's choice and the org's policy, enforced at
every hop. Each hop has its own test: the SDK on the real broker, the reward flow's processor, the batch flow's
builder and router, the batch flow on the real broker and engine, and the trainer's input stream."""

from __future__ import annotations

import msgspec
import pytest
from bytewax.testing import run_main
from prometheus_client import REGISTRY

from client import RtrlClient
from flows.adapters import OrgRouter
from flows.batch_flow import build_flow
from flows.batching import BatchBuilder
from flows.processor import Message, RewardProcessor
from flows.windowing import WindowConfig
from rtrl.errors import ConfigError
from rtrl.kafka import ensure_topics, read_topic
from rtrl.sections.client import GovernanceSettings
from rtrl.sections.trainer import AdapterSettings
from rtrl.settings import load_settings
from schemas.codec import Invalid, JsonCodec, decode_batch, encode_batch, event_codec
from schemas.data_use import DATA_USES, stricter
from schemas.records import DeadLetter, MicroBatch, Reward, Rollout, event_type
from tests.test_batch_flow import _produce
from tests.test_batching import config, ro, rw
from tests.test_trainer_data import _batch
from tests.test_trainer_data import _produce as _produce_batches
from trainer.batch import BatchLimits, to_batch
from trainer.data import BatchStream

SALT = "data-use-salt"


def _metric(name: str, **labels: str) -> float:
    """A Prometheus sample of this process (rtrl.metrics), 0 before its first count."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _rollout(tid: str, org: str = "acme") -> Rollout:
    return ro(tid, org=org)


# ---------------------------------------------------------------- the classes and the settings


def test_the_stricter_class_wins_and_the_org_policy_comes_from_settings(tmp_path):
    """Classes order train < adapter_only < monitor_only < none. The org's policy bounds the product's choice:
    the stricter of the two wins, whichever says it. A class that does not exist is refused, naming the setting."""
    assert DATA_USES == ("train", "adapter_only", "monitor_only", "none")
    assert stricter("train", "monitor_only") == stricter("monitor_only", "train") == "monitor_only"
    assert stricter() == "train" and stricter("none", "adapter_only") == "none"
    toml = tmp_path / "rtrl.toml"
    toml.write_text('[governance]\ndefault = "adapter_only"\n[governance.orgs]\nopen = "train"\nbank = "none"\n')
    g = load_settings(toml, env={}).governance
    assert (g.policy("open"), g.policy("bank"), g.policy("other")) == ("train", "none", "adapter_only")
    assert g.effective("open", "monitor_only") == "monitor_only"  # the product is stricter than its org
    assert g.effective("other", "train") == "adapter_only"  # the org is stricter than the product
    env = load_settings(env={"RTRL_GOVERNANCE__ORGS": '{"bank": "monitor_only"}'}).governance
    assert env.policy("bank") == "monitor_only" and env.policy("x") == "train"
    with pytest.raises(ConfigError, match="governance.default"):
        load_settings(env={"RTRL_GOVERNANCE__DEFAULT": "sometimes"})


# ---------------------------------------------------------------- the SDK


def test_the_sdk_sends_nothing_for_none_and_no_tokens_for_monitor_only(broker, topic_prefix):
    """On the real broker: a `none` trajectory sends no event and no rollout; a `monitor_only` one sends its
    events, its start saying monitor_only, and no rollout; an `adapter_only` one and a `train` one send their
    rollouts stamped with their class. The org's policy tightens the product's choice. What stays in the SDK is
    counted."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)
    before = {u: _metric("rtrl_sdk_withheld_total", data_use=u) for u in ("none", "monitor_only")}
    gov = GovernanceSettings(orgs={"bank": "monitor_only"})
    events, rollouts = topic_prefix + "events", topic_prefix + "rollouts"
    with RtrlClient(broker.bootstrap, salt=SALT, topic=events, rollouts_topic=rollouts, governance=gov) as c:
        sent = {}
        for tid, org, asked in [
            ("t-train", "acme", "train"),
            ("t-adapter", "acme", "adapter_only"),
            ("t-monitor", "acme", "monitor_only"),
            ("t-none", "acme", "none"),
            ("t-bank", "bank", "train"),  # the bank's policy makes it monitor_only
        ]:
            t = c.start_trajectory(
                org_id=org, user_id="u", task_kind="bugfix", policy_version=1, trajectory_id=tid, data_use=asked
            )
            t.tool_call("grep", valid=True)
            t.end()
            sent[tid] = t.rollout(_rollout(tid, org))
        stats = c.close()
    assert sent == {"t-train": True, "t-adapter": True, "t-monitor": False, "t-none": False, "t-bank": False}
    codec = event_codec()
    got = [codec.decode(m.value()) for m in read_topic(broker.bootstrap, events, timeout_s=30)]
    assert {e.trajectory_id for e in got} == {"t-train", "t-adapter", "t-monitor", "t-bank"}  # none: nothing
    starts = {e.trajectory_id: e.data_use for e in got if event_type(e) == "trajectory_started"}
    assert starts == {
        "t-train": "train",
        "t-adapter": "adapter_only",
        "t-monitor": "monitor_only",
        "t-bank": "monitor_only",
    }
    rc = JsonCodec(Rollout)
    published = {
        r.trajectory_id: r.data_use for r in (rc.decode(m.value()) for m in read_topic(broker.bootstrap, rollouts))
    }
    assert published == {"t-train": "train", "t-adapter": "adapter_only"}
    # withheld: the none trajectory's 3 events and its rollout, and the rollouts of the two monitor_only ones
    assert stats.withheld == 6 and stats.failed == 0 and stats.dropped == 0
    after = {u: _metric("rtrl_sdk_withheld_total", data_use=u) - before[u] for u in before}
    assert after == {"none": 4, "monitor_only": 2}  # and Prometheus sees them by class


# ---------------------------------------------------------------- the reward flow


def test_the_reward_flow_carries_the_class_to_rewards_and_summaries():
    """The class of a trajectory's start reaches each of its rewards and its summary; a start that does not say
    (an event written before the field) reads as train."""
    codec = event_codec()
    base = {"org_id": "acme", "user_hash": "0" * 32, "policy_version": 1, "arm": "control"}
    raw = []
    for tid, use in (("m", "monitor_only"), ("a", "adapter_only"), ("old", None)):
        start = {"type": "trajectory_started", "event_id": f"{tid}0", "trajectory_id": tid, "ts": 1000}
        start |= base | {"task_kind": "bugfix"} | ({"data_use": use} if use else {})
        end = {
            "type": "trajectory_ended",
            "event_id": f"{tid}1",
            "trajectory_id": tid,
            "ts": 1001,
            "status": "completed",
        }
        raw += [msgspec.json.encode(start), msgspec.json.encode(end | base)]
    settings = load_settings(env={"RTRL_SDK__SALT": SALT})
    proc = RewardProcessor("rtrl.events", WindowConfig(settings.flow), ["v2"])
    out = proc.process([Message(b"k", v, 0, i) for i, v in enumerate(raw)])
    out.extend(proc.finish())
    assert not out.dead_letters and codec.decode(raw[0]).data_use == "monitor_only"
    assert {r.trajectory_id: r.data_use for r in out.rewards} == {
        "m": "monitor_only",
        "a": "adapter_only",
        "old": "train",
    }
    assert {s.trajectory_id: s.data_use for s in out.summaries} == {
        "m": "monitor_only",
        "a": "adapter_only",
        "old": "train",
    }


# ---------------------------------------------------------------- the batch flow's logic


def _use(x, use):
    return msgspec.structs.replace(x, data_use=use)


def test_the_builder_trains_only_what_each_class_allows_and_counts_the_rest():
    """A sample's class is the strictest of its rollout's, its reward's and its org's policy. monitor_only and
    none never become samples; adapter_only does only for an org that may have an adapter; each exclusion is
    counted by reason, once per trajectory, when the first record that rules it out arrives. A micro-batch holds
    one class, and says it per sample."""
    cfg = config(
        flush_s=10,
        seq_len=16,
        rows=4,
        governance=GovernanceSettings(orgs={"o": "train"}),
        adapters=AdapterSettings(orgs=["o"]),
    )
    bb = BatchBuilder(cfg, serving_version=1)
    out = []
    cases = {
        "t": ("train", "train"),
        "a": ("adapter_only", "train"),  # the rollout says adapter_only
        "r": ("train", "adapter_only"),  # the trajectory's start said adapter_only
        "m": ("train", "monitor_only"),
        "n": ("none", "train"),
    }
    for i, (tid, (ro_use, rw_use)) in enumerate(cases.items()):
        out += bb.add_rollout(_use(ro(tid, group=tid, at=1000 + i), ro_use))
        out += bb.add_reward(_use(rw(tid, 1.0, at=1000 + i), rw_use))
    out += bb.add_reward(_use(rw("w", 1.0, at=1010), "monitor_only"))  # no rollout comes: the SDK withheld it
    out += bb.add_reward(_use(rw("w", 1.0, at=1011, revision=1), "monitor_only"))  # counted once per trajectory
    out += bb.flush()
    by_class = {tuple(b.data_use) or ("train",): b.sample_ids for b in out}
    assert by_class == {("train",): ["t"], ("adapter_only", "adapter_only"): ["a", "r"]}
    assert +bb.counts == {"data_use:monitor_only": 2, "data_use:none": 1}  # and nothing unmatched
    # the org's policy is stricter than the records; and an org that may have no adapter keeps no adapter_only
    strict = BatchBuilder(
        config(flush_s=0, seq_len=16, governance=GovernanceSettings(default="adapter_only")), serving_version=1
    )
    strict.add_rollout(ro("x"))
    strict.add_reward(rw("x", 1.0))
    assert strict.flush() == [] and +strict.counts == {"data_use:adapter_only_without_adapter": 1}


def test_an_adapter_only_batch_goes_to_its_orgs_adapter_alone():
    """Before and after the org passes adapters.min_samples, whatever adapters.shared_traffic says, a batch of
    adapter_only samples reaches the org's adapter stream only; a train batch is routed as before."""
    adapter_only = msgspec.structs.replace(_batch(1), data_use=["adapter_only"])
    for traffic in ("all", "served", "unadapted"):
        for samples in (0, 10_000):
            router = OrgRouter("acme", min_samples=100, shared_traffic=traffic, samples=samples)
            sent = router.route(adapter_only)
            assert [(b.adapter, b.data_use) for b in sent] == [("acme", ["adapter_only"])]
    train = OrgRouter("acme", min_samples=100, shared_traffic="all").route(_batch(2))
    assert [b.adapter for b in train] == [""]  # under min_samples: the shared policy's


# ---------------------------------------------------------------- the trainer


def test_the_trainer_refuses_a_batch_holding_a_sample_its_class_forbids():
    """The shared policy's batches hold train samples only; an org's adapter batches hold train or adapter_only
    ones, under that org's policy as the trainer's settings say it."""
    limits = BatchLimits(governance=GovernanceSettings(orgs={"bank": "monitor_only"}))
    ok = [
        _batch(0),
        msgspec.structs.replace(_batch(1), data_use=["train"]),
        msgspec.structs.replace(_batch(2), data_use=["adapter_only"], adapter="acme"),
    ]
    for mb in ok:
        assert to_batch(encode_batch(mb), 0, 0, limits).batch_id == mb.batch_id
    refused = [
        (msgspec.structs.replace(_batch(3), data_use=["adapter_only"]), "may not train the shared policy"),
        (msgspec.structs.replace(_batch(4), data_use=["monitor_only"], adapter="acme"), "acme's adapter"),
        (msgspec.structs.replace(_batch(5), adapter="bank"), "monitor_only"),  # the bank's policy forbids it
    ]
    for mb, why in refused:
        with pytest.raises(Invalid, match=why) as e:
            to_batch(encode_batch(mb), 0, 0, limits)
        assert e.value.kind == "data_use" and e.value.field == "$.data_use[0]"
    with pytest.raises(ValueError, match="one entry per sample"):
        MicroBatch(**(msgspec.structs.asdict(_batch(6)) | {"data_use": ["train", "train"]}))


def test_the_trainers_stream_dead_letters_a_forbidden_batch_without_its_tokens(broker, topic_prefix):
    """On the real broker: the refused batch goes to the dead letters with kind data_use and its reason, and
    without its payload; the stream goes on with the next batch."""
    topic = topic_prefix + "batches"
    bad = msgspec.structs.replace(_batch(1), data_use=["monitor_only"])
    _produce_batches(broker.bootstrap, topic, [(0, encode_batch(bad)), (0, encode_batch(_batch(2)))])
    refused = _metric("rtrl_dead_letters_total", flow="trainer", kind="data_use")
    stream = BatchStream(broker.bootstrap, topic, topic_prefix + "dead_letters")
    try:
        got = stream.get(timeout_s=20)
        assert got is not None and got.batch_id == "b002" and stream.dead_letters == 1
    finally:
        stream.close()
    (dl,) = [
        JsonCodec(DeadLetter).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "dead_letters")
    ]
    assert dl.kind == "data_use" and "sample t1 is monitor_only" in dl.reason and dl.payload == ""
    assert _metric("rtrl_dead_letters_total", flow="trainer", kind="data_use") == refused + 1


# ---------------------------------------------------------------- the batch flow on the real broker and engine


@pytest.mark.slow
def test_the_batch_flow_counts_every_exclusion_by_reason(broker, topic_prefix, ch_client, ch_dsn, ch_db, tmp_path):
    """The batch flow on the real broker and engine, with one org per class: only the train org's samples reach
    the shared stream, only the adapter_only org's reach its adapter stream, and batch_stats counts every other
    sample by reason, in ClickHouse and in Prometheus."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)
    orgs = {"open": "train", "private": "adapter_only", "watch": "monitor_only", "closed": "none"}
    rollouts, rewards = [], []
    for n, org in enumerate(orgs):
        for i in range(4):
            tid = f"{org}-{i}"
            rollouts.append(ro(tid, group=tid, org=org, at=1000 + 10 * n + i))
            rewards.append(rw(tid, float(i), org=org, at=1100 + 10 * n + i))
    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)
    _produce(broker.bootstrap, topic_prefix + "rollouts", [(r.trajectory_id.encode(), rc.encode(r)) for r in rollouts])
    _produce(broker.bootstrap, topic_prefix + "rewards", [(r.trajectory_id.encode(), wc.encode(r)) for r in rewards])
    env = {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_BATCHING__TAIL": "false",
        "RTRL_BATCHING__SEQ_LEN": "16",
        "RTRL_GOVERNANCE__ORGS": msgspec.json.encode(orgs).decode(),
        "RTRL_ADAPTERS__ORGS": "private",
        "RTRL_DATA_DIR": str(tmp_path),
    }
    excluded = {r: _metric("rtrl_data_use_excluded_total", reason=r) for r in ("monitor_only", "none")}
    run_main(build_flow(load_settings(env=env)))
    assert {r: _metric("rtrl_data_use_excluded_total", reason=r) - n for r, n in excluded.items()} == {
        "monitor_only": 4,
        "none": 4,
    }

    def samples(topic: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for m in read_topic(broker.bootstrap, topic_prefix + topic):
            b = decode_batch(m.value())
            for sid, use in zip(b.sample_ids, b.data_use or ["train"] * len(b.sample_ids)):
                out.setdefault(use, []).append(sid)
        return out

    assert {k: sorted(v) for k, v in samples("batches").items()} == {"train": [f"open-{i}" for i in range(4)]}
    adapter = {k: sorted(v) for k, v in samples("adapter-batches").items()}
    assert adapter == {"adapter_only": [f"private-{i}" for i in range(4)]}
    rows = ch_client.query(f"SELECT cohort, counts FROM {ch_db}.batch_stats FINAL").result_rows
    stats = {cohort: {k: n for k, n in counts.items() if n} for cohort, counts in rows}
    assert stats["watch/bugfix"] == {"data_use:monitor_only": 4} and stats["closed/bugfix"] == {"data_use:none": 4}
    assert stats["open/bugfix"] == {} and stats["private/bugfix"] == {}


# ---------------------------------------------------------------- stores written before the classes


def test_events_and_archives_written_before_the_classes_read_as_train(tmp_path):
    """An archive file without the data_use column, and event rows whose data_use is null (ClickHouse rows written
    before migration 0023), read as train: the archive reader and the backfill see no schema drift."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.backfill import conform, to_events
    from flows.sinks import read_archive, with_coords
    from rtrl import clickhouse
    from schemas.records import TrajectoryStarted
    from schemas.types import from_arrow, to_arrow

    start = TrajectoryStarted(
        event_id="e1", trajectory_id="t1", ts=1000, org_id="o", user_hash="0" * 32, policy_version=1, arm="a",
        task_kind="bugfix", data_use="monitor_only",
    )  # fmt: skip
    table = to_arrow([start], clickhouse.TABLES["events"])
    nulls = table.set_column(
        table.schema.get_field_index("data_use"), "data_use", pa.nulls(1, table.schema.field("data_use").type)
    )
    assert from_arrow(table, clickhouse.TABLES["events"])[0].data_use == "monitor_only"
    assert from_arrow(nulls, clickhouse.TABLES["events"])[0].data_use == "train"
    old = with_coords(table, [(0, 7)]).drop_columns(["data_use"])
    (tmp_path / "date=1970-01-01").mkdir()
    pq.write_table(old, tmp_path / "date=1970-01-01" / "part-old.parquet")
    read = read_archive(tmp_path)
    assert read.column("data_use").to_pylist() == [None] and read.column("event_id").to_pylist() == ["e1"]
    conformed, drift = conform(pq.read_table(tmp_path / "date=1970-01-01" / "part-old.parquet"))
    assert conformed is not None and drift == []
    (row, event), *_ = to_events(conformed)[0]
    assert event.data_use == "train"
