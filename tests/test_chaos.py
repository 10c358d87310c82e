"""Chaos: a seeded random schedule of SIGKILLs by PID (not by process group) against every part of the
process-mode loop and the embedded ClickHouse front, one part twice within 2 s. The supervisor restarts
each (the front on the same port and token files); the loop finishes its cycles and keeps every data
invariant: rewards equal an offline recomputation, no micro-batch or sample trained twice, every trained
sample has its reward, the deployments topic agrees with the checkpoints table (and with adapter_checkpoints for
the per-org adapters the loop trains too, each on its own org's samples only), and no process of the run is left
alive afterwards - not even the helpers a killed part had forked."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from app.loop import loop_settings
from app.parts import PARTS
from app.supervisor import CLICKHOUSE, Supervisor
from rtrl import clickhouse
from rtrl.kafka import read_topic
from rtrl.settings import load_settings
from tests.test_reliability import _reference_rewards, trained_counts, unrewarded_samples

pytestmark = pytest.mark.slow  # the loop as processes under a kill schedule (minutes)

CYCLES = 3
SEED = 11


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
    state: dict = {"next": None, "i": 0, "double_done": False}
    sup = Supervisor(settings)
    sup.start_services()
    ch, db = sup.ch, settings.clickhouse.database
    train_log = tmp_path / "logs" / "train.log"

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

    def tick() -> None:
        now = time.monotonic()
        if state["next"] is None:  # the first kill once training runs (v0 made), then one every 3-7 s
            if train_log.exists() and "v0 (warm start)" in train_log.read_text():
                state["next"] = now + 2
            return
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
        sup.wait(720, tick)  # three cycles, each with two orgs' adapters, under the kills
        sup.stop_parts()
        sup.drain_rewards()

        # the schedule ran: >= 8 SIGKILLs by pid, every part and the front, one part twice within 2 s
        targets = [t for _, t, _ in killed]
        assert len(killed) >= 8 and set(targets) == {*PARTS, CLICKHOUSE}, killed
        twice = [(a, b) for a, b in zip(killed, killed[1:]) if a[1] == b[1] == double and b[0] - a[0] < 2.0]
        assert twice and twice[0][0][2] != twice[0][1][2], killed
        assert sup.restarts[CLICKHOUSE] >= 1 and all(sup.restarts[p] >= 1 for p in PARTS)

        # every cycle decided, and the deployments topic says what the checkpoints table says
        decided = dict(
            ch.query(
                f"SELECT version, argMax(status, created_at) FROM {db}.checkpoints FINAL GROUP BY version"
            ).result_rows
        )
        assert sorted(decided) == list(range(CYCLES + 1)), decided
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
