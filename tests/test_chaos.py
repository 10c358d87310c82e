"""The closed loop as separate processes (app.supervisor) through a clean stop and a seeded kill schedule.

The trainer is first stopped with SIGTERM a few steps into cycle 1.
It exits 0 without a decision, and its restart resumes at the next step.
Then a seeded random schedule sends SIGKILL by PID (not by process group) to every part and to the embedded
ClickHouse front, one part twice within 2 s.
The supervisor restarts each, the front on the same port and token files.
The loop finishes its cycles and keeps every data invariant:

- the rewards equal an uninterrupted run of the reward logic over every event in Kafka;
- no micro-batch or sample is trained twice, and every trained sample has its reward;
- the deployments topic agrees with the checkpoints table, and with adapter_checkpoints for the per-org adapters;
- each org's adapter trains on that org's samples only.

At the end the parts stop on SIGTERM with exit 0, and no part's log holds a panic or a traceback.
No process of the run is left alive afterwards, not even the helpers a killed part had forked.
(Clean stops of the flows and of `rtrl run`: tests/test_clean_stop.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from app.loop_config import loop_settings
from app.parts import PARTS
from app.supervisor import CLICKHOUSE, Supervisor
from flows.processor import Message, RewardProcessor
from flows.windowing import WindowConfig
from rtrl import clickhouse
from rtrl.kafka import read_topic
from rtrl.settings import load_settings
from trainer import checkpoint

pytestmark = pytest.mark.slow  # the loop as processes under a clean stop and a kill schedule (minutes)

CYCLES = 3
SEED = 11
#: trainer steps of cycle 1 done before the clean stop (SIGTERM): not a multiple of loop.checkpoint_every
#: (2), so what the stop saves is more than the periodic checkpoint
CLEAN_STOP_STEPS = 5


def _reference_rewards(settings, bootstrap: str) -> dict[tuple, tuple]:
    """An uninterrupted run of the reward logic over every event in Kafka, partition by partition."""
    topic = settings.topic("events")
    by_partition = defaultdict(list)
    for m in read_topic(bootstrap, topic, timeout_s=60):
        by_partition[m.partition()].append(Message(m.key(), m.value(), m.partition(), m.offset()))
    out = {}
    for msgs in by_partition.values():
        proc = RewardProcessor(topic, WindowConfig(settings.flow), settings.rewards.versions)
        res = proc.process(sorted(msgs, key=lambda m: m.offset))
        res.rewards.extend(proc.finish().rewards)
        for r in res.rewards:
            out[(r.trajectory_id, r.reward_version, r.revision)] = (r.reward, dict(r.components), list(r.flags))
    return out


def trained_counts(ch, db: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, distinct) of the trained micro-batch ids and of the trained sample ids in train_metrics, per
    trained stream (the shared policy, each org's adapter: a sample may train one of each): equal counts mean
    nothing was trained twice."""
    out = []
    for column in ("batch_ids", "sample_ids"):
        n, distinct = ch.query(
            f"SELECT count(), uniqExact(adapter, x) FROM {db}.train_metrics FINAL ARRAY JOIN {column} AS x"
        ).result_rows[0]
        out.append((n, distinct))
    return out[0], out[1]


def unrewarded_samples(ch, db: str, reward_version: str) -> int:
    """Trained samples with no reward of ``reward_version`` in ClickHouse."""
    return ch.query(
        f"SELECT count() FROM (SELECT s FROM {db}.train_metrics FINAL ARRAY JOIN sample_ids AS s) "
        f"WHERE s NOT IN (SELECT trajectory_id FROM {db}.rewards FINAL WHERE reward_version = '{reward_version}')"
    ).result_rows[0][0]


def _schedule(rng: random.Random) -> list[str]:
    """Every part and the ClickHouse front once, three more at random, shuffled; the double kill comes apart."""
    targets = [*PARTS, CLICKHOUSE]
    kills = targets + [rng.choice(targets) for _ in range(3)]
    rng.shuffle(kills)
    return kills


def _processes_of(data_dir: Path) -> list[tuple[int, str]]:
    """Live processes whose environment or command line names ``data_dir`` (parts, helpers, front, broker)."""
    marker, found = str(data_dir).encode(), []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            stat = (p / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            cmdline = (p / "cmdline").read_bytes()
            if marker in cmdline or f"RTRL_DATA_DIR={data_dir}".encode() in (p / "environ").read_bytes().split(b"\0"):
                found.append((int(p.name), cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.timeout(1000)
def test_seeded_kill_schedule_keeps_every_invariant(tmp_path):
    settings = load_settings(
        env={
            "RTRL_DATA_DIR": str(tmp_path),
            "RTRL_LOOP__PROCESSES": "true",
            "RTRL_LOOP__CYCLES": str(CYCLES),
            "RTRL_LOOP__SAMPLES_PER_CYCLE": "512",
            "RTRL_LOOP__WARM_START_STEPS": "100",
            "RTRL_LOOP__EVAL_TASKS": "50",
            "RTRL_LOOP__CHECKPOINT_EVERY": "2",
            "RTRL_LOOP__MAX_RESTARTS": "6",
            "RTRL_LOOP__RESTART_WINDOW_S": "60",
            # per-org adapters (issue 17): their stream, training, gate and state go through the kills too
            "RTRL_LOOP__SPECIALISED_ORGS": "2",
            "RTRL_ADAPTERS__ORGS": "org-1,org-2",
            "RTRL_ADAPTERS__MIN_SAMPLES": "64",
        }
    )
    rng = random.Random(SEED)
    schedule = _schedule(rng)
    double = rng.choice(PARTS)  # killed again within 2 s of its first kill
    killed: list[tuple[float, str, int]] = []  # (monotonic time, target, pid)
    # stopped: cycle 1's steps done at the SIGTERM; at_exit: (steps in ClickHouse, newest checkpoint's step)
    # when the stopped trainer had exited; next: when the next kill is due
    state: dict = {"stopped": None, "at_exit": None, "next": None, "i": 0, "double_done": False}
    sup = Supervisor(settings)
    sup.start_services()
    ch, db = sup.ch, settings.clickhouse.database
    cycle1_checkpoints = tmp_path / "loop" / "checkpoints" / "train" / "v1"

    def cycle_steps(version: int) -> list[int]:
        rows = ch.query(f"SELECT step FROM {db}.train_metrics FINAL WHERE run_id = 'loop-0-v{version}' ORDER BY step")
        return [s for (s,) in rows.result_rows]

    def kill(target: str) -> int:
        for _ in range(100):  # bounded: a target that just died is replaced within moments
            pid = sup.pid(target)
            try:
                os.kill(pid, signal.SIGKILL)  # the process only: its helpers are the supervisor's to end
            except ProcessLookupError:
                time.sleep(0.05)
                continue
            killed.append((time.monotonic(), target, pid))
            return pid
        raise AssertionError(f"{target} never came back to be killed")

    def clean_stop() -> None:
        """SIGTERM to the trainer a few steps into cycle 1; the kills start once its restart trains on."""
        if state["stopped"] is None:
            if len(done := cycle_steps(1)) >= CLEAN_STOP_STEPS:
                os.kill(sup.pid("train"), signal.SIGTERM)  # to the process, not its group
                state["stopped"] = len(done)
        elif state["at_exit"] is None:
            if ("train", 0) in sup.exits:  # read before the restarted trainer (seconds of imports) trains a step
                last = checkpoint.latest(cycle1_checkpoints)
                state["at_exit"] = (cycle_steps(1), checkpoint.read_extra(last)["step"] if last else 0)
        elif len(cycle_steps(1)) > len(state["at_exit"][0]):
            state["next"] = time.monotonic() + 2

    def tick() -> None:
        now = time.monotonic()
        if state["next"] is None:
            return clean_stop()
        if now < state["next"]:
            return
        if not state["double_done"] and state["i"] == 3:
            first = kill(double)
            for _ in range(36):  # bounded: its replacement appears within a fraction of a second
                time.sleep(0.05)
                if sup.pid(double) != first:
                    break
            kill(double)
            state["double_done"] = True
        elif state["i"] < len(schedule):
            kill(schedule[state["i"]])
            state["i"] += 1
        state["next"] = now + rng.uniform(3, 7)

    try:
        sup.start_all()
        sup.wait(720, tick)  # three cycles, each with two orgs' adapters, through the stop and the kills
        sup.stop_parts()
        sup.drain_flows()

        # the clean stop: exit 0 without a decision; the stop saved every step trained, so the restarted
        # trainer went on at the next one (cycle 1's steps 1..n once each, none lost, none trained again)
        log = (tmp_path / "logs" / "train.log").read_text()
        assert state["at_exit"], f"the trainer was never stopped cleanly: {state}"
        steps_at_exit, saved = state["at_exit"]
        assert steps_at_exit == list(range(1, saved + 1)) and saved >= state["stopped"], state
        assert "stopped during cycle 1" in log and "stopped cleanly" in log and "resumed: 0 decisions made" in log
        cycle1 = cycle_steps(1)
        assert cycle1 == list(range(1, len(cycle1) + 1)) and len(cycle1) > saved
        raw = ch.query(f"SELECT count() FROM {db}.train_metrics WHERE run_id = 'loop-0-v1'").result_rows[0][0]
        assert raw == len(cycle1)
        assert sup.exits.count(("train", 0)) == 2, sup.exits  # the clean stop, then the end of the run

        # the schedule ran: >= 8 SIGKILLs by pid, every part and the front, one part twice within 2 s
        targets = [t for _, t, _ in killed]
        assert len(killed) >= 8 and set(targets) == {*PARTS, CLICKHOUSE}, killed
        twice = [(a, b) for a, b in zip(killed, killed[1:]) if a[1] == b[1] == double and b[0] - a[0] < 2.0]
        assert twice and twice[0][0][2] != twice[0][1][2], killed
        # each came back after each kill (the trainer after the clean stop too); a part started while the front
        # is down exits with one error line and is restarted again, so a count may be higher
        wanted = Counter(targets) + Counter({"train": 1})
        assert all(sup.restarts[t] >= n for t, n in wanted.items()), (sup.restarts, killed)
        # a restarted trainer resumed, never started over (the one after the last kill made the decisions)
        assert log.count("v0 (warm start)") == 1 and log.count("resumed: ") >= 2, log[-3000:]

        # the parts the supervisor stopped with SIGTERM at the end: exit 0; no part's log holds a panic or a
        # traceback (a SIGKILL leaves none either: the process gets no chance to write one)
        assert dict(sup.exits[-3:]) == {"serve": 0, "rewards": 0, "batches": 0}, sup.exits
        for part in PARTS:
            text = (tmp_path / "logs" / f"{part}.log").read_text()
            assert "panic" not in text.lower() and "Traceback" not in text, (part, text[-2000:])

        # every cycle decided, and the deployments topic says what the checkpoints table says
        decided = dict(
            ch.query(
                f"SELECT version, argMax(status, created_at) FROM {db}.checkpoints FINAL GROUP BY version"
            ).result_rows
        )
        assert sorted(decided) == list(range(CYCLES + 1)), decided
        assert all(status in ("promoted", "rejected") for status in decided.values()), decided
        announced: dict[tuple[str, int], tuple[int, str]] = {}
        for m in read_topic(sup.bootstrap, settings.topic("deployments"), timeout_s=60):
            ck = json.loads(m.value())
            key = (ck.get("org", ""), ck["version"])
            if ck["created_at"] >= announced.get(key, (-1, ""))[0]:
                announced[key] = (ck["created_at"], ck["status"])
        assert {v: s for (org, v), (_, s) in announced.items() if not org} == decided
        # each org's adapter decisions: announced as the adapter_checkpoints table holds them
        adapters = {
            (org, v): status
            for org, v, status in ch.query(
                f"SELECT org, version, argMax(status, created_at) FROM {db}.adapter_checkpoints FINAL "
                "GROUP BY org, version"
            ).result_rows
        }
        assert adapters and {k: s for k, (_, s) in announced.items() if k[0]} == adapters
        assert {org for org, _ in adapters} == {"org-1", "org-2"}
        # an org's adapter trained on that org's samples only
        wrong = ch.query(
            f"SELECT count() FROM (SELECT adapter, s FROM {db}.train_metrics FINAL ARRAY JOIN sample_ids AS s "
            f"WHERE adapter != '') AS t JOIN (SELECT trajectory_id, org_id FROM {db}.trajectories FINAL) AS j "
            "ON t.s = j.trajectory_id WHERE j.org_id != t.adapter"
        ).result_rows[0][0]
        assert wrong == 0

        # rewards: exactly what the reward logic computes over every event in Kafka (newest revision kept)
        expected = _reference_rewards(loop_settings(settings), sup.bootstrap)
        latest: dict[tuple, int] = {}
        for t, v, r in expected:
            latest[(t, v)] = max(latest.get((t, v), -1), r)
        stored = {
            (r.trajectory_id, r.reward_version, r.revision): (r.reward, dict(r.components), list(r.flags))
            for r in clickhouse.select(ch, db, "rewards")
        }
        assert len(latest) > 1000
        assert stored == {(t, v, r): expected[(t, v, r)] for (t, v), r in latest.items()}
        raw, final = ch.query(
            f"SELECT count(), uniqExact(trajectory_id, reward_version, revision) FROM {db}.rewards FINAL"
        ).result_rows[0]
        assert raw == final == len(stored)

        # no micro-batch or sample trained twice; every trained sample has its reward
        batches, samples = trained_counts(ch, db)
        assert batches[0] == batches[1] > 0 and samples[0] == samples[1] >= CYCLES * 300
        assert unrewarded_samples(ch, db, settings.rewards.train_version) == 0
    finally:
        sup.close()
    deadline = time.monotonic() + 10
    while _processes_of(tmp_path) and time.monotonic() < deadline:  # bounded: exits take a moment
        time.sleep(0.2)
    assert _processes_of(tmp_path) == []  # nothing of the run left alive
