"""The command line and the main job, run as a user would (subprocesses on a fresh data folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

RTRL = [sys.executable, "-m", "app.cli"]


def _run(args, env_extra, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | env_extra
    return subprocess.run(RTRL + args, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_rtrl_ab_runs_end_to_end(tmp_path):
    """`rtrl ab` on the embedded defaults starts its broker, moves every simulated event through the SDK,
    Kafka and the reward flow into ClickHouse (one reward and one summary per trajectory, duplicates
    dead-lettered), prints the per-version table, writes the PNG, and stops the broker."""
    proc = _run(["ab"], {"RTRL_DATA_DIR": str(tmp_path), "RTRL_SIMULATOR__TRAJECTORIES": "150"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    delivered = int(re.search(r"; ([\d,]+) delivered, 0 failed, 0 dropped", out)[1].replace(",", ""))
    flow = re.search(
        r"reward flow: [\d.]+s; events ([\d,]+), rewards ([\d,]+), trajectories ([\d,]+), "
        r"dead_letters ([\d,]+)",
        out,
    )
    events, rewards, trajectories, dead = (int(flow[i].replace(",", "")) for i in range(1, 5))
    assert rewards == trajectories == 300
    assert events + dead == delivered > 0  # every delivered event is stored once or dead-lettered as a duplicate
    assert re.search(r"^\s+v0\s+150\s", out, re.M) and re.search(r"^\s+v1\s+150\s", out, re.M)  # version, served
    png = tmp_path / "reports" / "behaviour.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status = _run(["broker", "status"], {"RTRL_DATA_DIR": str(tmp_path)})
    assert status.stdout.strip() == "not running"


def test_config_errors_exit_2_with_the_setting(tmp_path):
    """A bad setting stops any command with one line naming it, not a traceback."""
    proc = _run(["config"], {"RTRL_KAFKA__PARTITIONS": "-3", "RTRL_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert "kafka.partitions" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert "under [kafka]" in proc.stdout.replace("\n", "")  # the section survives the console's markup


def test_unreachable_broker_exits_2_naming_it(tmp_path):
    """Pointing at a broker nobody runs reports its address within kafka.timeout_s."""
    proc = _run(
        ["topics"],
        {"RTRL_KAFKA__BOOTSTRAP": "127.0.0.1:9", "RTRL_KAFKA__TIMEOUT_S": "1", "RTRL_DATA_DIR": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "127.0.0.1:9" in proc.stdout


@pytest.mark.slow
def test_broker_up_status_down(tmp_path):
    """`rtrl broker up` prints the address, status finds it, down stops it."""
    env = {"RTRL_DATA_DIR": str(tmp_path)}
    up = _run(["broker", "up"], env)
    assert up.returncode == 0 and up.stdout.strip().startswith("127.0.0.1:")
    assert _run(["broker", "status"], env).stdout.strip() == up.stdout.strip()
    assert _run(["broker", "down"], env).returncode == 0
    assert _run(["broker", "status"], env).returncode == 1


@pytest.mark.slow
def test_simulate_then_reward_flow_with_recovery(tmp_path):
    """`rtrl simulate` then `rtrl flow rewards` (bounded with RTRL_FLOW__TAIL=false): the flow initialises its
    Bytewax recovery folder, processes the topic and exits cleanly; a rerun resumes and exits too."""
    env = {"RTRL_DATA_DIR": str(tmp_path), "RTRL_SIMULATOR__TRAJECTORIES": "40", "RTRL_FLOW__TAIL": "false"}
    try:
        assert _run(["simulate"], env).returncode == 0
        first = _run(["flow", "rewards"], env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert any((tmp_path / "recovery" / "rewards").iterdir())
        again = _run(["flow", "rewards"], env)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        _run(["broker", "down"], env)
