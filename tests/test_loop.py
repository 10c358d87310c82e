"""The closed loop's reward hack: the main job run as a user would on the buggy v1 reward and on v2, and the
helpers other main-job tests share. (The whole loop with its records in ClickHouse, the final live A/B and a
rollback: test_make_demo in tests/test_readme_main_job.py; the gate's pure decisions: tests/test_evalgate.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.test_cli import _run
from tests.test_readme_commands import _decisions, _flat, _out, doc_command, sh

pytestmark = pytest.mark.slow  # whole main-job runs (minutes)


def _small_loop(tmp_path) -> dict[str, str]:
    """A two-cycle main job small enough for a test (a fresh data folder)."""
    return {
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_LOOP__CYCLES": "2",
        "RTRL_LOOP__SAMPLES_PER_CYCLE": "256",
        "RTRL_LOOP__EVAL_TASKS": "50",
        "RTRL_LOOP__WARM_START_STEPS": "100",
        "RTRL_LOOP__RATE": "40",
        "RTRL_LOOP__FINAL_AB_TRAJECTORIES": "150",  # the final A/B: enough users per arm for a table, in seconds
    }


DUMP = """
import json, sys
from rtrl import clickhouse

ch = clickhouse.connect(sys.argv[1])
rows = ch.query("SELECT version, parent, status, reason, eval_results FROM rtrl.checkpoints FINAL ORDER BY version").result_rows
steps = ch.query("SELECT count(), sum(tokens), min(on_policy_fraction) FROM rtrl.train_metrics FINAL").result_rows[0]
rewards = ch.query("SELECT count() FROM rtrl.rewards FINAL").result_rows[0][0]
stats = ch.query("SELECT sum(samples) FROM rtrl.batch_stats FINAL").result_rows[0][0]
arms = ch.query("SELECT policy_version, arm, count() FROM rtrl.trajectories FINAL GROUP BY 1, 2").result_rows
users = {a: {u for (u,) in ch.query("SELECT DISTINCT user_hash FROM rtrl.trajectories FINAL WHERE arm = {a:String}",
                                    parameters={"a": a}).result_rows} for a in ("ab-v0", "ab-final")}
# trajectories the reward flow read events of and closed no window for: none once a run's end drained the flows
served = ch.query("SELECT uniqExact(trajectory_id) FROM rtrl.events").result_rows[0][0]
unrewarded = ch.query("SELECT count() FROM (SELECT DISTINCT trajectory_id FROM rtrl.events) "
                      "WHERE trajectory_id NOT IN (SELECT trajectory_id FROM rtrl.rewards)").result_rows[0][0]
print(json.dumps({"checkpoints": [[v, p, s, r, dict(e)] for v, p, s, r, e in rows], "steps": list(steps),
                  "rewards": rewards, "batched": stats, "served": served, "unrewarded": unrewarded, "arms": [[v, a, n] for v, a, n in arms],
                  "final_ab_users": [len(users["ab-v0"]), len(users["ab-final"]),
                                     len(users["ab-v0"] & users["ab-final"])]}))
"""


USERS_IN_BOTH_ARMS = """
import json, sys
from rtrl import clickhouse

ch = clickhouse.connect(sys.argv[1])
both = users = 0
for (v, lo, hi) in ch.query("SELECT policy_version, min(first_event_ts), max(first_event_ts) FROM rtrl.trajectories "
                            "FINAL WHERE arm = 'candidate' GROUP BY 1").result_rows:
    cand = {u for (u,) in ch.query(f"SELECT DISTINCT user_hash FROM rtrl.trajectories FINAL WHERE arm = 'candidate' "
                                   f"AND policy_version = {v}").result_rows}
    ctrl = {u for (u,) in ch.query("SELECT DISTINCT user_hash FROM rtrl.trajectories FINAL WHERE arm = 'control' "
                                   "AND first_event_ts > {lo:DateTime64(3)} AND first_event_ts < {hi:DateTime64(3)}",
                                   parameters={"lo": lo, "hi": hi}).result_rows}
    both += len(cand & ctrl)
    users += len(cand)
print(json.dumps([both, users]))
"""


def _dump(data_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DUMP, f"chdb://{data_dir}/clickhouse"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loop_env(tmp_path, cycles: int, **settings: str) -> dict[str, str]:
    env = {
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_LOOP__CYCLES": str(cycles),
        "RTRL_LOOP__SAMPLES_PER_CYCLE": "2048",
        "RTRL_LOOP__FINAL_AB_TRAJECTORIES": "0",
    }
    return env | {f"RTRL_LOOP__{k.upper()}": v for k, v in settings.items()}


def _loop(tmp_path, reward_version: str, cycles: int, **settings: str) -> list:
    env = _loop_env(tmp_path, cycles, **settings) | {
        "RTRL_REWARDS__TRAIN_VERSION": reward_version,
        "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken",
    }
    proc = _run(["run"], env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _dump(tmp_path)["checkpoints"]


@pytest.mark.alone  # the hack's size depends on how fast the trainer keeps up with real-time traffic
@pytest.mark.timeout(1200)  # two main-job runs of two cycles each (~5-10 min on 2 cores)
def test_reward_hack_is_caught_with_the_buggy_reward_only(tmp_path):
    """Where failure is predictable from the prompt (the initial policy handles easy tasks, not hard
    ones) and advantages use the per-cohort baseline (one sample per task, as in production), training
    on v1-discard-broken raises the broken-tool-call rate - on hard prompts every valid call earns less
    than the cohort's mean while a broken one is never scored - so within two cycles a candidate's rate
    rises beyond the monitors' rule, and the gate refuses it: no candidate with a large rise is promoted.
    Trained on the current v2 the rate falls and no candidate is refused for it.
    (With groups, Dr. GRPO's per-prompt mean gives the broken-call logit no push: bench/RESULTS.md.) In the
    world of simulator/world.py the rise waits a cycle (users' noisier reactions); the v2 half holds for two
    cycles, not longer: the same cohort baseline pushes mass to tokens the policy never samples, which v2
    cannot see either, and a third v2 cycle once rose too (bench/RESULTS.md, "The reward-hack test's v2 half")."""
    # rate: each of the 15 cohorts flushes its own micro-batches, so at the default 100 tasks/s a cycle's 2,048
    # samples came in ~140 mostly partial steps; at 400/s the micro-batches fill and the cycle takes ~40 steps
    world = {"group_size": "1", "warm_right_easy": "0.9", "rate": "400"}
    # the v1 half is the README's reward-hack command as written (so it also checks that command: the flow computes
    # v1-discard-broken, the trainer gets its micro-batches and each cycle ends in a decision after trained steps)
    command = doc_command(r"RTRL_REWARDS__VERSIONS=\S+ RTRL_REWARDS__TRAIN_VERSION=v1-discard-broken make run")
    # the same reward versions as the v2 half's (_loop), so only the trained reward differs between the halves
    assert "RTRL_REWARDS__VERSIONS=v2,v1-discard-broken " in command
    run = sh(command, _loop_env(tmp_path / "v1", cycles=2, **world), timeout=1200)
    assert run.returncode == 0, _out(run)
    said = _flat(run.stdout)
    assert "training on reward v1-discard-broken" in said and "Checkpoints (reward v1-discard-broken)" in said
    assert "no micro-batch arrived" not in run.stdout
    computed = re.search(r"rewards \(v2 ([\d,]+), v1-discard-broken ([\d,]+)\)", said)
    assert computed and int(computed[2].replace(",", "")) > 0, _out(run)  # the flow computed the trained version
    decisions = _decisions(run.stdout)
    assert len(decisions) == 2 and all(d[3] > 0 for d in decisions), _out(run)
    v1 = _dump(tmp_path / "v1")["checkpoints"]
    v2 = _loop(tmp_path / "v2", "v2", cycles=2, **world)
    for name, cps in (("v1", v1), ("v2", v2)):
        print(
            name,
            [
                (v, s, round(e["broken_tool_call_rate"], 3), round(e["clarify_rate"], 3), r[:100])
                for v, _, s, r, e in cps
            ],
        )
    base = v1[0][4]["broken_tool_call_rate"]
    assert v2[0][4]["broken_tool_call_rate"] == base  # same seed, same v0
    v1_rates = [e["broken_tool_call_rate"] for *_, e in v1[1:]]
    v2_rates = [e["broken_tool_call_rate"] for *_, e in v2[1:]]
    assert len(v1_rates) == len(v2_rates) == 2
    assert max(v1_rates) > 1.25 * base  # the hack: risen beyond the rule's 25%
    refused = [r for _, _, s, r, _ in v1[1:] if s == "rejected" and "broken_tool_call_rate rose" in r]
    assert refused  # and caught by the gate
    assert all(e["broken_tool_call_rate"] < 1.5 * base for _, _, s, _, e in v1[1:] if s == "promoted")  # none got by
    assert sum(v2_rates) / len(v2_rates) < base  # does not rise under v2 (it falls)
    assert not any("broken_tool_call_rate rose" in r for _, _, s, r, _ in v2[1:] if s == "rejected")
    assert max(v1_rates) > max(v2_rates)
