"""An organisation's erasure on the real engine: how its statements find the org's samples in the micro-batches.

`rtrl erase --org` finds the org's trajectories, then every micro-batch and training step that holds one of
them as a sample id (app/erasure.py, `Plan.mine`). The set form (`x IN (subquery)`) is measured next to the
array form it replaced (`has((SELECT groupArray(...)), x)`), on the same rows in the same run, as a ratio.

    .venv/bin/python bench/erasure.py [--trajectories 50000] [--batches 5000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

from app.erasure import Plan, Subject
from rtrl import clickhouse
from rtrl.settings import load_settings


def timed(client, sql: str, rounds: int) -> tuple[float, int]:
    times, value = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        value = int(client.query(sql).result_rows[0][0] or 0)
        times.append(time.perf_counter() - t)
    return statistics.median(times), value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=50_000, help="the erased org's trajectories")
    ap.add_argument("--batches", type=int, default=5_000, help="micro-batches of 32 samples, half of them the org's")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        settings = load_settings(env={"RTRL_DATA_DIR": folder})
        client = clickhouse.setup_from(settings)
        db = settings.clickhouse.database
        n, b = a.trajectories, a.batches
        client.command(
            f"INSERT INTO {db}.events (event_id, trajectory_id, org_id, user_hash, type) "
            f"SELECT concat('e', toString(number)), concat('t', toString(number)), "
            f"if(number % 2 = 0, 'org-gone', 'org-stays'), lower(hex(MD5(toString(number % 1000)))), "
            f"'trajectory_started' FROM numbers({2 * n})"
        )
        # sample ids walk the trajectories in order: half of each batch's samples are the erased org's
        client.command(
            f"INSERT INTO {db}.batches (batch_id, sample_ids) SELECT concat('b', toString(number)), "
            f"arrayMap(i -> concat('t', toString((number * 32 + i) % {2 * n})), range(32)) FROM numbers({b})"
        )
        plan = Plan(db, Subject("org", "org-gone"))
        array = f"(SELECT groupArray(trajectory_id) FROM {plan.ids})"
        old = f"SELECT sum(arrayCount(x -> has({array}, x), sample_ids)) FROM {db}.batches"
        new = f"SELECT sum(arrayCount(x -> {plan.mine('x')}, sample_ids)) FROM {db}.batches"
        t_new, found_new = timed(client, new, a.rounds)
        t_old, found_old = timed(client, old, a.rounds)
        assert found_new == found_old == b * 16, (found_new, found_old)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, chdb")
    print(f"org with {n:,} trajectories, {b:,} micro-batches of 32 samples ({found_new:,} the org's)")
    print(f"array form (baseline): {t_old:.2f} s | set form (rtrl): {t_new:.3f} s | ratio {t_old / t_new:,.0f}x")


if __name__ == "__main__":
    main()
