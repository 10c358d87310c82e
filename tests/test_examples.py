"""The examples run as written: the SDK integration sends valid events through a real broker that the reward
logic scores, with user ids hashed. (`examples/analyst.py` runs in tests/test_analyst_queries.py against a
finished run.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from rewards import features, reward
from rewards.functions import REWARD_VERSIONS
from rtrl.kafka import read_topic
from schemas.codec import event_codec

ROOT = Path(__file__).resolve().parent.parent


def _example(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        cwd=ROOT,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sdk_integration_sends_events_the_reward_logic_scores(broker, topic_prefix):
    proc = _example(
        "sdk_integration.py",
        {"RTRL_KAFKA__BOOTSTRAP": broker.bootstrap, "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix},
        "--sessions",
        "4",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "for 4 sessions" in proc.stdout and "failed 0, dropped 0" in proc.stdout
    codec = event_codec()
    by_trajectory = defaultdict(list)
    for msg in read_topic(broker.bootstrap, f"{topic_prefix}events"):
        event = codec.decode(msg.value())  # raises Invalid on anything the flow would dead-letter
        assert msg.key().decode() == event.trajectory_id  # keyed so a trajectory stays on one partition
        by_trajectory[event.trajectory_id].append(event)
    assert len(by_trajectory) == 4
    for events in by_trajectory.values():
        assert {type(e).__struct_config__.tag for e in events} >= {
            "trajectory_started",
            "tool_call",
            "latency",
            "followup",
            "trajectory_ended",
        }
        assert all(not e.user_hash.startswith("user-") and len(e.user_hash) >= 16 for e in events)
        scored = reward(features(events), REWARD_VERSIONS["v2"])
        assert scored is not None and -10 < scored.reward < 10


@pytest.mark.slow
def test_the_readme_block_runs_as_written(tmp_path):
    """The README's two lines (a local broker, its address exported, the example) run as shown."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "sdk_integration.py" in b)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"RTRL_DATA_DIR": str(tmp_path)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        proc = subprocess.run(
            ["bash", "-ec", textwrap.dedent(block)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        subprocess.run([sys.executable, "-m", "app.cli", "broker", "down"], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "for 3 sessions" in proc.stdout and "failed 0, dropped 0" in proc.stdout


@pytest.mark.slow
def test_sdk_integration_with_a_wrong_address_is_one_line():
    proc = _example("sdk_integration.py", {"RTRL_KAFKA__BOOTSTRAP": "127.0.0.1:9", "RTRL_KAFKA__TIMEOUT_S": "2"})
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "127.0.0.1:9" in lines[0], proc.stderr


def test_sdk_integration_without_a_broker_is_one_line():
    proc = _example("sdk_integration.py", {})
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: set kafka.bootstrap") and len(proc.stderr.strip().splitlines()) == 1
