"""Reward versions as data (rewards.versions, flows.reward_versions): defined in TOML or the settings tree without a
code change, registered in the real ClickHouse engine with a content checksum, immutable once they scored, and
shadow-scored by the live reward flow."""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter

import msgspec
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main

from app.cli import main
from flows import reward_flow
from flows.batch_flow import batch_config
from flows.processor import Message
from flows.reward_versions import RewardVersionImmutable, register, register_settings, registered, scored
from flows.sinks import ClickHouseSink
from rewards import compute
from rewards.functions import V1_DISCARD_BROKEN, V2
from rewards.versions import BUILTIN, WEIGHTS, registry
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from simulator.generate import generate

SALT = "versions-test-salt"
HARSH = {"parent": "v2", "reason": "broken calls cost double", "author": "reward-team", "weights": {"w_broken": 0.5}}


def _settings(**env):
    return load_settings(env={"RTRL_SDK__SALT": SALT} | env)


def _define(**versions) -> dict[str, str]:
    return {"RTRL_REWARDS__DEFINE": json.dumps(versions)}


# ---------------------------------------------------------------- defining versions


def test_builtins_stay_and_a_version_is_defined_in_the_settings_tree():
    reg = registry(_settings(**_define(v3=HARSH)))
    assert reg["v2"].config is V2 and reg["v1-discard-broken"].config is V1_DISCARD_BROKEN
    assert reg["v2"].builtin and reg["v2"].parent == "v1-discard-broken" and "negative" in reg["v2"].reason
    v3 = reg["v3"]
    assert (v3.parent, v3.reason, v3.author, v3.source) == (
        "v2",
        "broken calls cost double",
        "reward-team",
        "rewards.define.v3",
    )
    assert v3.config.w_broken == 0.5 and all(
        getattr(v3.config, w) == getattr(V2, w) for w in WEIGHTS if w != "w_broken"
    )
    assert len(v3.checksum) == 64 and v3.checksum != reg["v2"].checksum
    # the checksum is the content: the same weights under another name give the same checksum
    twin = registry(_settings(**_define(twin=HARSH | {"weights": {"w_broken": 0.5}})))["twin"]
    assert twin.checksum == v3.checksum
    assert registry(_settings(**_define(same=HARSH | {"weights": {}})))["same"].checksum == reg["v2"].checksum


def test_versions_from_a_toml_file_with_parents_in_any_order(tmp_path):
    f = tmp_path / "versions.toml"
    f.write_text(
        """
[versions.v4-child]
parent = "v3-file"
reason = "and errors cost more"
author = "a@example.com"
weights = { w_error = 1.0 }

[versions.v3-file]
parent = "v1-discard-broken"
reason = "keep v1's discards but cap deferral"
author = "a@example.com"
weights = { deferral_ceiling = 0.0, broken_cap = 2 }
"""
    )
    reg = registry(_settings(RTRL_REWARDS__FILE=str(f), **_define(v5=HARSH | {"parent": "v4-child"})))
    child = reg["v4-child"].config
    assert child.discard_broken and child.deferral_ceiling == 0.0 and child.broken_cap == 2 and child.w_error == 1.0
    assert reg["v5"].config.w_broken == 0.5 and reg["v5"].config.discard_broken
    assert reg["v3-file"].source == f"{f} [versions.v3-file]"


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ({"v2": HARSH}, "redefines the built-in reward version 'v2'"),
        ({"v3": HARSH | {"parent": "v9"}}, "rewards.define.v3.parent = 'v9' is an unknown version"),
        ({"a": HARSH | {"parent": "b"}, "b": HARSH | {"parent": "a"}}, "a cycle of parents"),
        (
            {"v3": HARSH | {"weights": {"w_brokn": 1.0}}},
            "rewards.define.v3.weights.w_brokn is not a reward weight; did you mean w_broken",
        ),
        (
            {"v3": HARSH | {"weights": {"w_broken": -1.0}}},
            "rewards.define.v3: w_broken must be a finite magnitude >= 0",
        ),
        (
            {"v3": HARSH | {"weights": {"broken_cap": 1.5}}},
            "rewards.define.v3.weights.broken_cap = 1.5 is not a whole number",
        ),
        ({"v3": HARSH | {"weights": {"discard_broken": 1.0}}}, "is not true or false"),
        ({"bad name!": HARSH}, "is not a valid version name"),
    ],
)
def test_bad_definitions_name_the_setting_and_the_fix(versions, message):
    with pytest.raises(ConfigError, match="fix") as e:
        registry(_settings(**_define(**versions)))
    assert message in str(e.value)


def test_missing_reason_or_author_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="rewards.define.v3.reason"):
        _settings(**_define(v3={"parent": "v2", "author": "x"}))
    bad = tmp_path / "bad.toml"
    bad.write_text("[versions.v3]\nparent = 'v2'\nauthor = 'x'\n")
    with pytest.raises(ConfigError, match=r"bad.toml \[versions.v3\]: reason: Field required"):
        registry(_settings(RTRL_REWARDS__FILE=str(bad)))
    bad.write_text("[versions.v3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        registry(_settings(RTRL_REWARDS__FILE=str(bad)))
    with pytest.raises(ConfigError, match="rewards.file = .*cannot be read"):
        registry(_settings(RTRL_REWARDS__FILE=str(tmp_path / "missing.toml")))
    both = tmp_path / "both.toml"
    both.write_text("[versions.v3]\nparent = 'v2'\nreason = 'r'\nauthor = 'x'\n")
    with pytest.raises(ConfigError, match="defined both in rewards.file"):
        registry(_settings(RTRL_REWARDS__FILE=str(both), **_define(v3=HARSH)))


def test_active_and_trained_versions_are_checked_against_the_registry():
    s = _settings(RTRL_REWARDS__VERSIONS="v2,v3", RTRL_REWARDS__TRAIN_VERSION="v3", **_define(v3=HARSH))
    assert batch_config(s).reward_version == "v3"
    with pytest.raises(ConfigError, match="rewards.train_version"):
        batch_config(_settings(RTRL_REWARDS__VERSIONS="v2,v9", RTRL_REWARDS__TRAIN_VERSION="v9"))
    with pytest.raises(ConfigError, match=r"setting rewards.versions = \['v2', 'v9'\] names unknown"):
        reward_flow.build_flow(
            _settings(RTRL_REWARDS__VERSIONS="v2,v9"),
            sources={"events": TestingSource([])},
            sinks={"clickhouse": TestingSink([]), "kafka": TestingSink([])},
        )


# ---------------------------------------------------------------- ClickHouse: registered, immutable once used


def test_register_is_idempotent_and_a_used_version_is_immutable(ch_client, ch_db):
    s = _settings(RTRL_CLICKHOUSE__DATABASE=ch_db, **_define(v3=HARSH))
    reg = registry(s)
    assert register(ch_client, ch_db, reg.values(), now_ms=1_000) == ["v2", "v1-discard-broken", "v3"]
    assert register(ch_client, ch_db, reg.values(), now_ms=2_000) == []  # same checksums: nothing new
    rows = registered(ch_client, ch_db)
    assert rows["v3"].checksum == reg["v3"].checksum and json.loads(rows["v3"].weights)["w_broken"] == 0.5
    assert rows["v3"].parent == "v2" and rows["v3"].author == "reward-team" and not rows["v3"].builtin
    assert rows["v2"].builtin
    # other weights under the name while it has scored nothing: the newest registration wins
    changed = registry(_settings(**_define(v3=HARSH | {"weights": {"w_broken": 0.75}})))["v3"]
    assert register(ch_client, ch_db, [changed], now_ms=3_000) == ["v3"]
    assert registered(ch_client, ch_db)["v3"].checksum == changed.checksum
    # once it scored a trajectory, it is immutable
    events = [e.event for e in generate(SimulatorSettings(trajectories=3, seed=1), SALT)]
    tid = events[0].trajectory_id
    from rewards.features import features
    from rewards.functions import reward

    f = features([e for e in events if e.trajectory_id == tid])
    res = reward(f, changed.config)
    assert res is not None
    from schemas.records import Reward

    clickhouse.insert(
        ch_client,
        ch_db,
        "rewards",
        [
            Reward(
                trajectory_id=tid, policy_version=0, reward_version="v3", revision=0, reward=res.reward,
                components=res.components, flags=res.flags, close_reason="ended", org_id=f.org_id, arm=f.arm,
                task_kind=f.task_kind or "unknown", n_events=f.n_events, event_counts=f.event_counts,
                first_event_ts=f.first_ts, last_event_ts=f.last_ts, emitted_at=1,
            )
        ],
    )  # fmt: skip
    assert scored(ch_client, ch_db, "v3") == 1
    with pytest.raises(
        RewardVersionImmutable,
        match=r"has scored 1 trajectories.*immutable; fix: define these weights under a new name",
    ):
        register(ch_client, ch_db, [reg["v3"]], now_ms=4_000)
    assert register(ch_client, ch_db, [changed], now_ms=5_000) == []  # the same weights again: fine
    with pytest.raises(RewardVersionImmutable):
        register_settings(s, ["v2", "v3"], client=ch_client)


def test_live_flow_shadow_scores_every_active_version_and_registers_them(ch_dsn, ch_client, ch_db, tmp_path):
    """The reward flow scores each listed version (a defined one too) for every trajectory, its ClickHouse sink
    registers them before its first write, and a changed definition of a used name stops it with the fix."""
    env = {"RTRL_CLICKHOUSE__DATABASE": ch_db, "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken,v3"}
    s = _settings(**env, **_define(v3=HARSH))
    codec, items, offsets = event_codec(), [], Counter()
    emissions = generate(SimulatorSettings(trajectories=60, seed=3, duplicate_rate=0.0), SALT)
    for e in emissions:
        p = zlib.crc32(e.event.trajectory_id.encode()) % 2
        items.append((str(p), Message(e.event.trajectory_id.encode(), codec.encode(e.event), p, offsets[p])))
        offsets[p] += 1

    def run(settings) -> None:
        sink = ClickHouseSink(
            ch_dsn,
            ch_db,
            archive=tmp_path / "archive",
            reward_versions=registry(settings).select(settings.rewards.versions),
        )
        run_main(
            reward_flow.build_flow(
                settings, sources={"events": TestingSource(items)}, sinks={"clickhouse": sink, "kafka": TestingSink([])}
            )
        )

    run(s)
    counts = dict(
        ch_client.query(
            f"SELECT reward_version, count() FROM {ch_db}.rewards FINAL GROUP BY reward_version"
        ).result_rows
    )
    trajectories = {e.event.trajectory_id for e in emissions}
    assert counts["v2"] == counts["v3"] == len(trajectories) > counts["v1-discard-broken"] > 0
    assert set(registered(ch_client, ch_db)) == {"v2", "v1-discard-broken", "v3"}
    stored = {r.trajectory_id: r for r in clickhouse.select(ch_client, ch_db, "rewards", "WHERE reward_version = 'v3'")}
    one = next(iter(trajectories))
    assert stored[one].reward == pytest.approx(
        compute([e.event for e in emissions if e.event.trajectory_id == one], "v2").reward
        + min(0, stored[one].components["broken_tool_calls"] / 2)
    )
    with pytest.raises(Exception) as err:  # Bytewax wraps the sink's error: the ConfigError is its cause
        run(_settings(**env, **_define(v3=HARSH | {"weights": {"w_broken": 0.9}})))
    chain, e = [], err.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, RewardVersionImmutable) and "v3" in str(c) for c in chain), chain


def test_rtrl_rewards_list(ch_dsn, ch_db, tmp_path, monkeypatch, capsys):
    for k, v in {
        "RTRL_SDK__SALT": SALT,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_DATA_DIR": str(tmp_path),
        "COLUMNS": "250",  # a wide terminal: no cell folds
        **_define(v3=HARSH),
    }.items():
        monkeypatch.setenv(k, v)
    assert main(["rewards", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("v2", "v1-discard-broken", "v3"):
        assert name in out
    assert BUILTIN["v2"].checksum[:12] in out and "rewards.define.v3" in out and "trains, live" in out


# ---------------------------------------------------------------- comparing two versions


def test_comparison_statistics_on_hand_made_pairs():
    """The paired shift, its interval, flips, discards and flags, against figures computed here."""
    from scipy import stats as sps

    from monitors.reward_compare import Pair, by_policy_version, flag_rows, flipped, movers

    rows = [
        Pair("t1", 1, "acme", "bugfix", 0.5, 0.25, ("deferred_edit",), ("deferred_edit",)),
        Pair("t2", 1, "acme", "bugfix", 0.2, -0.3),  # flips + -> -
        Pair("t3", 1, "globex", "feature", -0.4, 0.1),  # flips - -> +
        Pair("t4", 1, "globex", "feature", None, -0.8, (), ("invalid_tool_call",), broken_tool_calls=2),
        Pair("t5", 1, "globex", "feature", 0.9, 0.7),
        Pair("t6", 2, "acme", "bugfix", 0.3, None),  # discarded by B
    ]
    v1 = by_policy_version(rows)
    assert [(s.policy_version, s.group) for s in v1] == [(1, "*"), (1, "acme"), (1, "globex"), (2, "*"), (2, "acme")]
    s = v1[0]
    d = [0.25 - 0.5, -0.3 - 0.2, 0.1 + 0.4, 0.7 - 0.9]
    ci = sps.t.interval(0.95, len(d) - 1, loc=sum(d) / 4, scale=sps.sem(d))
    assert (s.trajectories, s.scored_a, s.scored_b, s.both) == (5, 4, 5, 4)
    assert s.shift == pytest.approx(sum(d) / 4) and (s.shift_low, s.shift_high) == pytest.approx(ci)
    assert (s.to_negative, s.to_positive, s.discarded_by_a, s.discarded_by_a_negative_b) == (1, 1, 1, 1)
    assert s.ks == pytest.approx(sps.ks_2samp([0.5, 0.2, -0.4, 0.9], [0.25, -0.3, 0.1, -0.8, 0.7]).statistic)
    assert s.spearman == pytest.approx(sps.spearmanr([0.5, 0.2, -0.4, 0.9], [0.25, -0.3, 0.1, 0.7]).statistic)
    assert v1[3].discarded_by_b == 1 and v1[3].shift is None
    assert s.change == pytest.approx(s.mean_b - s.mean_a) and s.change_low < s.change < s.change_high
    flags = {r.flag: r for r in flag_rows(rows)}
    broken = flags["broken tool call"]
    assert (broken.n_a, broken.n_b, broken.mean_b) == (0, 1, pytest.approx(-0.8))  # A never scored it
    assert flags["invalid_tool_call"].share_b == pytest.approx(1 / 5)
    assert flags["deferred_edit"].mean_a == pytest.approx(0.5) and flags["deferred_edit"].share_a == pytest.approx(0.2)
    top = movers(rows)  # acme/bugfix: (-0.25 - 0.5) / 2 = -0.375 (t6 has no B); globex/feature: +0.15
    assert [(m.group, round(m.shift, 3)) for m in top] == [("acme/bugfix", -0.375), ("globex/feature", 0.15)]
    assert {p.trajectory_id for p in flipped(rows)} == {"t2", "t3", "t4", "t6"}


@pytest.mark.slow
def test_compare_v1_with_v2_on_the_v1_trained_period(ch_dsn, ch_client, ch_db, tmp_path, monkeypatch, capsys):
    """The stream scored only v1-discard-broken (the seed's v1-trained period, a policy breaking many tool
    calls); v2 is backfilled over the archive; `rtrl rewards compare v1-discard-broken v2` shows the broken-call
    trajectories v1 discarded as negatives under v2, in its tables and in a PNG."""
    from flows import backfill as bf
    from monitors.queries import reward_pairs
    from monitors.reward_compare import by_policy_version, flag_rows
    from simulator.population import PolicyProfile

    env = {
        "RTRL_SDK__SALT": SALT,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_REWARDS__VERSIONS": "v1-discard-broken",
        "RTRL_REWARDS__TRAIN_VERSION": "v1-discard-broken",
        "COLUMNS": "250",
    }
    s = load_settings(env=env)
    codec, items, offsets = event_codec(), [], Counter()
    sim = SimulatorSettings(trajectories=160, seed=11, duplicate_rate=0.0)
    for e in generate(sim, SALT, profiles={1: PolicyProfile(p_broken_tool_call=0.3)}, policy_version=1):
        p = zlib.crc32(e.event.trajectory_id.encode()) % 2
        items.append((str(p), Message(e.event.trajectory_id.encode(), codec.encode(e.event), p, offsets[p])))
        offsets[p] += 1
    sink = ClickHouseSink(
        ch_dsn,
        ch_db,
        archive=s.data_path / "archive" / "events",
        reward_versions=registry(s).select(["v1-discard-broken"]),
    )
    run_main(
        reward_flow.build_flow(
            s, sources={"events": TestingSource(items)}, sinks={"clickhouse": sink, "kafka": TestingSink([])}
        )
    )
    bf.backfill(s, "v2", client=ch_client, workers=1)

    pairs = reward_pairs(ch_client, ch_db, "v1-discard-broken", "v2")
    discarded = [p for p in pairs if p.reward_a is None]
    assert len(pairs) == 160 and len(discarded) > 20
    assert all(p.broken_tool_calls > 0 and p.reward_b is not None for p in discarded)  # v1 dropped broken calls
    # v2 charges each of them for its broken calls: mostly negative, and well below what both versions scored
    v2 = {r.trajectory_id: r for r in clickhouse.select(ch_client, ch_db, "rewards", "WHERE reward_version = 'v2'")}
    assert all(v2[p.trajectory_id].components["broken_tool_calls"] < 0 for p in discarded)
    assert sum(p.reward_b < 0 for p in discarded) > 0.6 * len(discarded)
    kept = [p.reward_b for p in pairs if p.reward_a is not None]
    assert sum(p.reward_b for p in discarded) / len(discarded) < min(0.0, sum(kept) / len(kept))
    everyone = by_policy_version(pairs)[0]
    assert (everyone.group, everyone.discarded_by_a, everyone.discarded_by_b) == ("*", len(discarded), 0)
    assert everyone.discarded_by_a_negative_b == sum(p.reward_b < 0 for p in discarded)
    broken = next(r for r in flag_rows(pairs) if r.flag == "broken tool call")
    assert broken.n_a == 0 < broken.n_b and broken.mean_b < 0

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert main(["rewards", "compare", "v1-discard-broken", "v2"]) == 0
    out = capsys.readouterr().out
    assert "reward v2 against v1-discard-broken" in out and "cohorts that move most" in out
    assert f"({everyone.discarded_by_a_negative_b} < 0)" in out
    png = tmp_path / "reports" / "rewards-v1-discard-broken-vs-v2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["rewards", "compare", "v1-discard-broken", "v2", "--from", "2100-01-01"]) == 1  # nothing there


# ---------------------------------------------------------------- switching the trained version


SWITCH_DUMP = """
import json, sys
from rtrl import clickhouse

ch = clickhouse.connect(sys.argv[1])
cps = ch.query("SELECT version, status, reward_version, reward_checksum FROM rtrl.checkpoints FINAL ORDER BY version")
steps = ch.query("SELECT run_id, step, reward_version, sample_ids FROM rtrl.train_metrics FINAL ORDER BY run_id, step")
broken = ch.query("SELECT trajectory_id FROM rtrl.trajectories FINAL WHERE broken_tool_calls > 0")
print(json.dumps({"checkpoints": [list(r) for r in cps.result_rows], "steps": [list(r) for r in steps.result_rows],
                  "broken": [t for (t,) in broken.result_rows]}))
"""


@pytest.mark.slow
def test_the_loop_switches_v1_to_v2_at_a_cycle_boundary(tmp_path):
    """`rtrl run`, two cycles: the first trains v1-discard-broken, rewards.train_schedule switches the second to v2.
    Every checkpoint and every trainer step records the version (with its checksum); the first cycle trained no
    trajectory with a broken tool call (v1 discards them, so no v1 micro-batch holds one), the second did (v2's
    batches score them negative); the loop's table shows the version under each checkpoint."""
    import subprocess
    import sys

    from tests.test_cli import _run
    from tests.test_loop import _small_loop

    env = _small_loop(tmp_path) | {
        "RTRL_LOOP__FINAL_AB_TRAJECTORIES": "0",
        "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken",
        "RTRL_REWARDS__TRAIN_VERSION": "v1-discard-broken",
        "RTRL_REWARDS__TRAIN_SCHEDULE": json.dumps({"2": "v2"}),
        "COLUMNS": "100",
    }
    proc = _run(["run"], env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dump = subprocess.run(
        [sys.executable, "-c", SWITCH_DUMP, f"chdb://{tmp_path}/clickhouse"], capture_output=True, text=True
    )
    assert dump.returncode == 0, dump.stderr
    d = json.loads(dump.stdout.strip().splitlines()[-1])
    trained = {v: (rv, cs) for v, _, rv, cs in d["checkpoints"]}
    assert trained == {
        0: ("", ""),
        1: ("v1-discard-broken", BUILTIN["v1-discard-broken"].checksum),
        2: ("v2", BUILTIN["v2"].checksum),
    }
    by_cycle: dict[str, set] = {}
    samples: dict[str, set] = {}
    for run_id, _, rv, ids in d["steps"]:
        by_cycle.setdefault(run_id, set()).add(rv)
        samples.setdefault(run_id, set()).update(ids)
    first, second = sorted(by_cycle)  # loop-<seed>-v1, loop-<seed>-v2
    assert by_cycle == {first: {"v1-discard-broken"}, second: {"v2"}}
    broken = set(d["broken"])
    assert samples[first] and not samples[first] & broken  # v1 never makes a sample of a broken trajectory
    assert samples[second] & broken  # v2 does: the switch took effect at the boundary
    table = proc.stdout[proc.stdout.index("Checkpoints (reward") :]
    rows = table.split("\n", 2)[2]  # under the title: each checkpoint's third line is what it trained on
    assert re.search(r"^\s*v1-discard-broken\s*$", rows, re.M) and re.search(r"^\s*v2\s*$", rows, re.M), table


def test_rtrl_rewards_train_requests_a_switch_for_the_next_cycle(tmp_path, monkeypatch, capsys):
    """`rtrl rewards train V` leaves a request the loop reads at its next cycle's start; a version the batch flow
    makes no micro-batches for is refused with the setting to change, and such a request left in the folder is
    ignored rather than starving the trainer."""
    from app.loop import requested_reward, reward_switch_path

    env = {
        "RTRL_SDK__SALT": SALT,
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken,v3",
        "RTRL_REWARDS__TRAIN_VERSION": "v1-discard-broken",
        "RTRL_REWARDS__TRAIN_SCHEDULE": json.dumps({"3": "v2"}),
        **_define(v3=HARSH),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    assert [requested_reward(s, c) for c in (1, 2, 3, 4)] == ["v1-discard-broken"] * 2 + ["v2"] * 2  # the schedule
    assert main(["rewards", "train", "v3"]) == 2  # not trainable: no micro-batches carry v3
    out = capsys.readouterr()
    assert "rewards.batch_versions" in out.out + out.err
    monkeypatch.setenv("RTRL_REWARDS__BATCH_VERSIONS", "v3")
    assert main(["rewards", "train", "v3"]) == 2  # no loop has run in this folder: nothing to switch
    assert "no loop has run" in "".join(capsys.readouterr())
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "state.json").write_text("{}")  # a loop's folder (what Loop._save_state leaves)
    assert main(["rewards", "train", "v3"]) == 0
    assert "from its next cycle on" in capsys.readouterr().out
    assert json.loads(reward_switch_path(load_settings()).read_text())["reward_version"] == "v3"
    assert requested_reward(load_settings(), 1) == "v3"  # the request wins over the schedule from then on
    assert requested_reward(s, 1) == "v1-discard-broken"  # a flow without v3 batches: ignored, with a warning
    reward_switch_path(s).write_text("[not a request")
    assert requested_reward(s, 3) == "v2"  # a damaged request is ignored, with a warning
    with pytest.raises(ConfigError, match="rewards.train_schedule names 'v9'"):
        _settings(RTRL_REWARDS__TRAIN_SCHEDULE=json.dumps({"2": "v9"}))


def test_the_batch_flow_makes_batches_for_each_trainable_version_and_counts_the_trained_one():
    """With rewards.batch_versions the batch flow makes micro-batches for a second version from the same rollouts:
    each batch names its version, ids never collide, the trained version's batches and counters are exactly those
    of a single-version run (the trainer's filter on the version: test_the_loop_switches_v1_to_v2_at_a_cycle_boundary)."""
    from flows import batch_flow
    from schemas.codec import JsonCodec, decode_batch
    from schemas.records import Reward, Rollout
    from tests.test_flows_inprocess import _batch_world, _decode_outputs, _final_stats, _samples

    rollouts, rewards, _ = _batch_world()
    v1 = [msgspec.structs.replace(r, reward_version="v1-discard-broken", reward=-r.reward) for r in rewards]
    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)

    def run(env: dict[str, str], with_v1: bool) -> tuple[dict, dict]:
        ro_msgs = [Message(r.trajectory_id.encode(), rc.encode(r), 0, i) for i, r in enumerate(rollouts)]
        rw_msgs = [
            Message(r.trajectory_id.encode(), wc.encode(r), 0, i)
            for i, r in enumerate(rewards + (v1 if with_v1 else []))
        ]
        kafka, ch = [], []
        settings = load_settings(env={"RTRL_SDK__SALT": SALT, "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken"} | env)
        run_main(
            batch_flow.build_flow(
                settings,
                sources={
                    "rollouts": TestingSource(ro_msgs, batch_size=8),
                    "rewards": TestingSource(rw_msgs, batch_size=8),
                },
                sinks={"kafka": TestingSink(kafka), "clickhouse": TestingSink(ch)},
            )
        )
        return _decode_outputs(kafka, ch)

    one_topics, one_tables = run({}, with_v1=False)
    topics, tables = run({"RTRL_REWARDS__BATCH_VERSIONS": "v1-discard-broken"}, with_v1=True)
    batches = [decode_batch(v) for _, v in next(iter(topics.values()))]
    single = [decode_batch(v) for _, v in next(iter(one_topics.values()))]
    by_version: dict[str, list] = {}
    for b in batches:
        by_version.setdefault(b.reward_version, []).append(b)
    assert set(by_version) == {"v2", "v1-discard-broken"} and {b.reward_version for b in single} == {"v2"}
    assert len({b.batch_id for b in batches}) == len(batches)  # the same samples under two versions: two ids
    assert _samples(by_version["v2"]) == _samples(single)  # the trained version is unchanged by the second
    v1_samples, v2_samples = _samples(by_version["v1-discard-broken"]), _samples(single)
    assert set(v1_samples) == set(v2_samples)
    assert all(v1_samples[t][1] == pytest.approx(-v2_samples[t][1]) for t in v2_samples)  # its own advantages
    assert _final_stats(tables["batch_stats"]) == _final_stats(one_tables["batch_stats"])  # counts: trained only
