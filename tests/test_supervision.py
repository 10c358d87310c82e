"""Supervision an always-on system can live with (issue 11, point 7), piece by piece; the whole of it
under a seeded random kill schedule is tests/test_chaos.py.

- The restart budget is a rate (N restarts within a sliding window), not a count over the supervisor's life.
- Ending a dead part ends its whole process group: a helper it forked does not outlive it.
- The supervisor's own ClickHouse queries wait out a restart of the front, then fail as one line.
- ``rtrl run --resume`` continues a crashed run instead of wiping it: the process mode's end-to-end test,
  tests/test_readme_main_job.py::test_processes_mode_crashed_then_resumed, crashes its run after the first
  decision and resumes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.parts import SUPERVISOR_PID, PatientClickHouse
from app.supervisor import RestartBudget, end_group, group_members
from devservices.broker import free_port
from rtrl.errors import ServiceUnavailable

ROOT = Path(__file__).resolve().parent.parent


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_restart_budget_is_a_rate_within_a_sliding_window():
    clock = _Clock()
    budget = RestartBudget(limit=3, window_s=60.0, clock=clock)
    assert [budget.allow("train") for _ in range(3)] == [True, True, True]
    assert not budget.allow("train")  # a fourth death within the minute: give up
    assert budget.allow("rewards")  # per part
    clock.now += 60.0  # the first three fell out of the window
    assert budget.allow("train")
    # an always-on deployment that crashes once an hour never runs out (it died at its sixth crash before)
    steady = RestartBudget(limit=5, window_s=60.0, clock=clock)
    for _ in range(50):
        clock.now += 3600.0
        assert steady.allow("serve")
    assert steady.total["serve"] == 50


def test_ending_a_dead_part_ends_the_helpers_it_forked(tmp_path):
    """The part is killed by PID (as an OOM killer or an operator does): its forked helper stays alive in
    the part's process group until the supervisor ends the group."""
    pidfile = tmp_path / "helper.pid"
    script = (
        "import os, subprocess, sys, time\n"
        "h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(h.pid))\n"
        "time.sleep(120)\n"
    )
    part = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    helper = int(pidfile.read_text())
    os.kill(part.pid, signal.SIGKILL)
    part.wait(10)
    assert helper in group_members(part.pid)  # orphaned, still running: what the old supervisor left behind
    end_group(part.pid, timeout_s=5.0)
    assert group_members(part.pid) == []
    stat = Path(f"/proc/{helper}/stat")  # gone, or a zombie waiting for init to reap it: not running
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow  # waits 3 s for the part to be up
def test_a_part_stops_cleanly_when_its_supervisor_is_killed(tmp_path):
    """kill -9 of the supervisor: its parts notice their parent is gone and take the clean-stop path
    (SIGTERM to themselves) instead of running on, orphaned, for ever."""
    done = tmp_path / "stopped"
    part = (
        "import signal, sys, time\n"
        "from app.parts import _stop_with_supervisor\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(done)!r}, 'w').write('clean'), sys.exit(0)))\n"
        "_stop_with_supervisor(poll_s=0.05)\n"
        "time.sleep(120)\n"
    )
    supervisor = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, {SUPERVISOR_PID}=str(os.getpid()))\n"
        f"subprocess.Popen([sys.executable, '-c', {part!r}], env=env, cwd={str(ROOT)!r}, start_new_session=True)\n"
        "time.sleep(120)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", supervisor], cwd=ROOT)
    time.sleep(3.0)  # the part is up and watching
    assert not done.exists()
    sup.kill()
    sup.wait(10)
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done.read_text() == "clean"


def test_a_part_waits_for_the_restarting_clickhouse_front_and_the_others_do_not_queue(tmp_path, monkeypatch):
    """The ClickHouse front, the reward flow and the policy server die at once. The front restarts on a thread of
    its own and is ready 1.5 s later. The policy server, which writes nothing to ClickHouse, is restarted at once,
    not behind the front. The reward flow is restarted once the front is ready, and only once: it does not start
    against a missing front, fail and spend its restart budget. The parts and the front are real processes; what
    they run is a sleep, since the supervisor's restart order is what is tested."""
    from app.supervisor import CLICKHOUSE, Supervisor
    from rtrl.settings import load_settings

    sup = Supervisor(load_settings(env={"RTRL_DATA_DIR": str(tmp_path)}))
    started: list[tuple[str, float]] = []
    ready: list[float] = []

    def sleeper() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)

    def start(name: str, *args: str) -> subprocess.Popen:
        proc = sleeper()
        started.append((name, time.monotonic()))
        with sup.lock:
            sup.procs[name] = proc
        return proc

    def spawn_front() -> str:
        time.sleep(1.5)  # what a front takes to open its folder and answer (4-10 s with a real one)
        proc = sleeper()
        with sup.lock:
            sup.ch_proc = proc
        ready.append(time.monotonic())
        return "http://127.0.0.1:1"

    monkeypatch.setattr(sup, "start", start)
    monkeypatch.setattr(sup, "_spawn_clickhouse", spawn_front)
    sup.ch_proc = sleeper()
    try:
        sup.start_all()
        started.clear()
        for proc in (sup.ch_proc, sup.procs["rewards"], sup.procs["serve"]):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        again = dict(started)
        assert sorted(again) == ["rewards", "serve"] and len(ready) == 1, (started, ready)
        assert again["serve"] < ready[0] <= again["rewards"], (started, ready)
        assert sup.restarts == {CLICKHOUSE: 1, "rewards": 1, "serve": 1}, sup.restarts
        assert not sup.failed.is_set()
    finally:
        sup.close()


@pytest.mark.slow  # waits out its 2 s of patience
def test_the_supervisors_queries_fail_as_one_line_when_clickhouse_is_gone():
    dsn = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable) as err:
        PatientClickHouse(dsn, timeout_s=0.5, patience_s=2.0)
    message = str(err.value)
    assert "\n" not in message and dsn in message and "did not come back within 2s" in message
    assert time.monotonic() - t0 < 2.0 + 5.0


def _small_run(tmp_path: Path, cycles: int) -> dict[str, str]:
    """The main job's settings cut to a test's size (tests/test_clean_stop.py runs `rtrl run` with them)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return clean | {
        "RTRL_DATA_DIR": str(tmp_path),
        "RTRL_LOOP__CYCLES": str(cycles),
        "RTRL_LOOP__SAMPLES_PER_CYCLE": "256",
        "RTRL_LOOP__EVAL_TASKS": "50",
        "RTRL_LOOP__WARM_START_STEPS": "100",
        "RTRL_LOOP__RATE": "40",
        "RTRL_LOOP__FINAL_AB_TRAJECTORIES": "0",  # the final live A/B: test_make_demo checks it
    }
