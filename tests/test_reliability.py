"""The closed loop as separate processes (app.supervisor): kill -9 each part mid-cycle - reward flow,
batch flow, trainer, policy server - and the loop goes on; ClickHouse then shows no reward lost or
duplicated (the rewards equal an uninterrupted reference run over the same events) and no
micro-batch or sample trained twice. In the same run the trainer is first stopped cleanly (SIGTERM) in
cycle 1 and resumes at the very next step, and at the end every other part stops on SIGTERM with exit 0.
(Clean stops of the flows and of `rtrl run`: tests/test_clean_stop.py.)"""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import pytest

from app.loop import loop_settings
from app.supervisor import Supervisor
from flows.processor import Message, RewardProcessor
from flows.reward_flow import window_config
from rtrl import clickhouse
from rtrl.kafka import read_topic
from rtrl.settings import load_settings

pytestmark = pytest.mark.slow  # the loop as processes, killed and restarted (minutes)

CYCLES = 5
#: (part, cycle, trainer steps of that cycle done before the kill): each part once, while a cycle trains
KILLS = [("rewards", 2, 2), ("batches", 3, 3), ("train", 4, 5), ("serve", 5, 2)]
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
        proc = RewardProcessor(topic, window_config(settings), settings.rewards.versions)
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


@pytest.mark.timeout(900)
def test_kill_9_each_part_mid_cycle_loses_and_repeats_nothing(tmp_path):
    settings = load_settings(
        env={
            "RTRL_DATA_DIR": str(tmp_path),
            "RTRL_LOOP__CYCLES": str(CYCLES),
            "RTRL_LOOP__SAMPLES_PER_CYCLE": "512",
            "RTRL_LOOP__WARM_START_STEPS": "150",
            "RTRL_LOOP__EVAL_TASKS": "100",
            "RTRL_LOOP__CHECKPOINT_EVERY": "2",
            "RTRL_LOOP__PROCESSES": "true",
        }
    )
    sup = Supervisor(settings)
    sup.start_services()
    ch, db = sup.ch, settings.clickhouse.database
    killed: list[tuple[str, int, int]] = []
    stopped: list[int] = []  # cycle 1's steps done when the trainer got SIGTERM

    def steps_done(version: int) -> int:
        return ch.query(f"SELECT max(step) FROM {db}.train_metrics WHERE run_id = 'loop-0-v{version}'").result_rows[0][
            0
        ]

    def cycle_steps(version: int) -> list[int]:
        rows = ch.query(f"SELECT step FROM {db}.train_metrics FINAL WHERE run_id = 'loop-0-v{version}' ORDER BY step")
        return [s for (s,) in rows.result_rows]

    def tick() -> None:
        if not stopped:
            if len(done := cycle_steps(1)) >= CLEAN_STOP_STEPS:
                os.kill(sup.pid("train"), signal.SIGTERM)  # to the process, not its group
                stopped.append(len(done))
        elif len(killed) < len(KILLS):
            part, cycle, steps = KILLS[len(killed)]
            if steps_done(cycle) >= steps:
                killed.append((part, cycle, sup.kill(part)))

    try:
        sup.start_all()
        sup.wait(720, tick)
    except BaseException:
        sup.close()  # a part that kept dying: stop the services too (the checks below never run)
        raise
    finally:
        sup.stop_parts()
    try:
        sup.drain_rewards()
        # every kill happened mid-cycle and each part came back once; the trainer resumed its cycle
        assert [k[:2] for k in killed] == [k[:2] for k in KILLS]
        assert dict(sup.restarts) == {part: 1 for part, _, _ in KILLS} | {"train": 2}  # the clean stop too
        log = (tmp_path / "logs" / "train.log").read_text()
        assert "resumed: 3 decisions made" in log

        # the clean stop: exit 0 without a decision, and the restarted trainer went on from the step it
        # stopped at (steps 1..n of cycle 1 once each, none lost, none trained again)
        assert stopped, "the trainer was never stopped cleanly"
        assert sup.exits.count(("train", 0)) == 2  # the clean stop, then the end of the run
        assert "stopped during cycle 1" in log and "stopped cleanly" in log and "resumed: 0 decisions made" in log
        cycle1 = cycle_steps(1)
        assert cycle1 == list(range(1, len(cycle1) + 1)) and len(cycle1) > stopped[0]
        raw = ch.query(f"SELECT count() FROM {db}.train_metrics WHERE run_id = 'loop-0-v1'").result_rows[0][0]
        assert raw == len(cycle1)
        # the other parts, stopped by the supervisor with SIGTERM at the end: exit 0, no panic
        assert dict(sup.exits[-3:]) == {"serve": 0, "rewards": 0, "batches": 0}, sup.exits
        for part in ("train", "serve", "rewards", "batches"):
            text = (tmp_path / "logs" / f"{part}.log").read_text()
            assert "panic" not in text.lower() and "Traceback" not in text, (part, text[-2000:])

        # the loop went on: every cycle ended in a recorded decision
        decided = ch.query(
            f"SELECT version, argMax(status, created_at) FROM {db}.checkpoints FINAL GROUP BY version ORDER BY version"
        ).result_rows
        assert [v for v, _ in decided] == list(range(CYCLES + 1))
        assert all(status in ("promoted", "rejected") for _, status in decided)

        # no reward lost or duplicated: ClickHouse holds exactly what an uninterrupted run computes
        expected = _reference_rewards(loop_settings(settings), sup.bootstrap)
        stored = {
            (r.trajectory_id, r.reward_version, r.revision): (r.reward, dict(r.components), list(r.flags))
            for r in clickhouse.select(ch, db, "rewards")
        }
        assert len(expected) > 2000
        assert stored == expected
        raw, final = ch.query(
            f"SELECT count(), uniqExact(trajectory_id, reward_version, revision) FROM {db}.rewards FINAL"
        ).result_rows[0]
        assert raw == final

        # no micro-batch and no sample trained twice, and each trained sample had its reward
        batches, samples = trained_counts(ch, db)
        assert batches[0] == batches[1] > 0 and samples[0] == samples[1] >= CYCLES * 400
        assert unrewarded_samples(ch, db, settings.rewards.train_version) == 0
    finally:
        sup.close()
    assert _processes_of(tmp_path) == []  # nothing left behind, not even what a killed part had forked


def _processes_of(data_dir) -> list[int]:
    """Live processes whose environment points at ``data_dir`` (the parts and anything they forked)."""
    import os
    from pathlib import Path

    marker = f"RTRL_DATA_DIR={data_dir}".encode()
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if marker in (p / "environ").read_bytes().split(b"\0"):
                found.append(int(p.name))
        except OSError:
            continue
    return found
