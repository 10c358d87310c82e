"""The documents' main-job commands work as written: ``make run``, ``make demo`` and the processes mode.

Each runs the main job as a user would (``sh`` of tests/test_readme_commands.py: bash in the repository root,
shortened only through RTRL_* settings) and checks its stated outcome: ``RTRL_MODEL__HF_PATH=... make run`` on a
random Qwen2 from ``rtrl model init``, continued by ``rtrl run --keep-data`` and rolled back; ``make demo``'s
three cycles, final live A/B and rollback; ``RTRL_LOOP__PROCESSES=true make run`` crashed after its first decision
and resumed with ``rtrl run --resume``. tests/test_readme_commands.py's rules name these tests for those commands.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_readme_commands import BIN, ROOT, _clickhouse_counts, _decisions, _flat, _out, doc_command, sh


def _short_loop(data_dir: Path, cycles: int = 1, final_ab: int = 0) -> dict[str, str]:
    """The main job's settings cut to a test's size: fewer cycles, samples, eval tasks and warm-start steps, and
    no final live A/B unless the test checks it (``final_ab`` trajectories per arm)."""
    return {
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_LOOP__CYCLES": str(cycles),
        "RTRL_LOOP__SAMPLES_PER_CYCLE": "256",
        "RTRL_LOOP__EVAL_TASKS": "50",
        "RTRL_LOOP__WARM_START_STEPS": "100",
        "RTRL_LOOP__RATE": "40",
        "RTRL_LOOP__FINAL_AB_TRAJECTORIES": str(final_ab),
    }


def _processes_with_env(name: str, value: str) -> list[str]:
    """Command lines of live processes whose environment sets ``name=value`` (read from /proc)."""
    wanted = f"{name}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if wanted in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone, or not ours
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback(tmp_path):
    """The README's Hugging Face block, whose `RTRL_MODEL__HF_PATH=... make run` is also the test of `make run`
    (one short cycle): `rtrl model init` writes a random Qwen2 of the loop's shape, and the main job trains it
    from `model.hf_path` to one gated decision (v1 <- v0), the trainer's recomputed log-probs measured against
    the policy server's per step (train_metrics mismatch columns), then prints the table per checkpoint and
    writes the PNG. `rtrl run --keep-data` (two cycles, the same model) continues that run for one more cycle
    from what served when v2 trained; `rtrl rollback vN --reason R` then re-promotes the parent of the serving
    version, or, with nothing promoted, is refused in one line. The block's `.rtrl/` folder is moved to a
    scratch folder, as RTRL_DATA_DIR moves the data folder. (It holds the claims of the `make run` test it
    replaced, which ran its own main job.)"""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "model init" in b)
    block = block.replace(".rtrl/", f"{tmp_path}/models-root/")
    data = tmp_path / "data"
    env = _short_loop(data, cycles=1)
    run = sh(block, env)
    assert run.returncode == 0, _out(run)
    model = f"{tmp_path}/models-root/models/qwen2"
    assert f"model from {model}" in _flat(run.stdout), _out(run)
    decisions = _decisions(run.stdout)
    assert [d[:2] for d in decisions] == [(1, 0)] and decisions[0][3] > 0, _out(run)
    assert "Checkpoints (reward v2)" in _flat(run.stdout)
    assert (data / "reports" / "loop.png").read_bytes()[:4] == b"\x89PNG"
    code = (
        "import json, sys\nfrom rtrl import clickhouse\nch = clickhouse.connect(sys.argv[1])\n"
        "print(json.dumps(ch.query('SELECT count(), min(mismatch_k3), max(mismatch_max_abs_log_ratio), "
        "argMin(mismatch_max_abs_log_ratio, step) FROM rtrl.train_metrics FINAL').result_rows[0]))"
    )
    dump = subprocess.run(
        [sys.executable, "-c", code, f"chdb://{data}/clickhouse"], capture_output=True, text=True, timeout=120
    )
    assert dump.returncode == 0, dump.stderr
    steps, k3, worst, first = json.loads(dump.stdout.strip().splitlines()[-1])
    assert steps == decisions[0][3] and -1e-6 <= k3 < 1.0 and 0.0 <= worst < 15.0, (steps, k3, worst)
    # the first step's weights are the ones the server sampled with: the engine's log-probs are the trainer's
    assert first < 1e-3, f"first step: |behaviour - trainer log-prob| up to {first} on on-policy tokens"

    more = sh("rtrl run --keep-data", env | {"RTRL_LOOP__CYCLES": "2", "RTRL_MODEL__HF_PATH": model})
    assert more.returncode == 0, _out(more)
    parent = 1 if decisions[0][2] == "promoted" else 0  # what served when v2 trained: v1 if the gate promoted it
    assert "resumed: 1 decisions made" in _flat(more.stdout) and f"model from {model}" in _flat(more.stdout)
    assert "v0 (warm start)" not in more.stdout, _out(more)  # the data folder was kept, not wiped
    assert [d[:2] for d in _decisions(more.stdout)] == [(2, parent)], _out(more)
    counts = _clickhouse_counts(data)
    assert counts["checkpoints"] == 3 and counts["train_metrics"] > 0, counts

    promoted = [v for v, _, s, _ in _decisions(run.stdout + more.stdout) if s == "promoted"]
    if not promoted:
        refused = sh("rtrl rollback v0", {"RTRL_DATA_DIR": str(data)})
        assert refused.returncode != 0 and len(refused.stdout.strip().splitlines()) == 1, _out(refused)
        return
    serving = max(promoted)
    back = sh(f"rtrl rollback v{serving} --reason readme-test", {"RTRL_DATA_DIR": str(data)})
    assert back.returncode == 0, _out(back)
    assert "Traceback" not in back.stdout + back.stderr


def _run_groups(pid: int) -> set[int]:
    """The process groups of process ``pid`` and of everything it started and still runs (from /proc): the
    supervisor's group, and one per part, each of which leads its own."""
    from app.supervisor import process_table

    children: dict[int, list[tuple[int, int]]] = {}
    for child, _state, ppid, pgrp in process_table():
        children.setdefault(ppid, []).append((child, pgrp))
    groups, todo = set(), [pid]
    while todo:
        for child, pgrp in children.get(todo.pop(), []):
            groups.add(pgrp)
            todo.append(child)
    return groups - {os.getpgrp()}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_processes_mode_crashed_then_resumed(tmp_path):
    """`RTRL_LOOP__PROCESSES=true make run` (two short cycles): the supervisor runs each part (`app.parts`, what
    `rtrl part NAME` runs) as its own process. The run crashes after its first decision (SIGKILL to every
    process of it: the supervisor, the ClickHouse front and each part's group); `RTRL_LOOP__PROCESSES=true rtrl
    run --resume` keeps the data folder and continues from that decision: no new warm start, v1 not made again,
    each cycle decided once, the parent rule kept. The resumed run ends like the in-process one: the final live
    A/B (announced on rtrl.experiments, served by the serve part, users split by hash), the table per checkpoint
    from ClickHouse and the PNGs; a log per part; nothing is left running. (It holds the claims of the process
    mode's own test and of tests/test_supervision.py's resume test, each of which ran its own main job.)"""
    from app.supervisor import group_members
    from tests.test_loop import _dump

    env = _short_loop(tmp_path, cycles=2, final_ab=100)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"COLUMNS": "140"}
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"
    first_log = tmp_path / "first-run.log"
    with open(first_log, "w") as log:
        first = subprocess.Popen(
            ["bash", "-c", doc_command(r"RTRL_LOOP__PROCESSES=true make run")],
            cwd=ROOT,
            env=base | env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the crash below is the run's, not this test's
        )
    state = tmp_path / "loop" / "state.json"
    deadline = time.monotonic() + 600
    groups: set[int] = set()
    try:
        while time.monotonic() < deadline and first.poll() is None:
            try:
                if json.loads(state.read_text())["version"] >= 1:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        assert first.poll() is None, first_log.read_text()[-3000:]
        groups = _run_groups(first.pid) | {first.pid}
        for group in groups:  # the crash
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        first.wait(30)
        decided = json.loads(state.read_text())["version"]  # what the crashed run had decided when it died
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(group_members(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [g for g in groups if group_members(g)], "a process of the crashed run outlived its SIGKILL"
    assert len(groups) >= 1 + 4, groups  # the supervisor's group and one per part
    assert "one process per part" in _flat(first_log.read_text()), first_log.read_text()[-3000:]
    assert decided == 1

    run = sh("RTRL_LOOP__PROCESSES=true rtrl run --resume", env, timeout=900)
    assert run.returncode == 0, _out(run)
    out = _flat(run.stdout)
    assert "one process per part" in out and "resuming the run in" in out, _out(run)
    decisions = _decisions(run.stdout)
    assert [v for v, *_ in decisions] == [1, 2], _out(run)
    # each candidate's parent is what served when it trained: v1 if the gate promoted it, else still v0
    assert [p for _, p, *_ in decisions] == [0, 1 if decisions[0][2] == "promoted" else 0], _out(run)
    assert "Checkpoints (reward v2)" in out, _out(run)
    for part in ("rewards", "batches", "serve", "train"):
        assert (tmp_path / "logs" / f"{part}.log").is_file(), sorted(p.name for p in (tmp_path / "logs").iterdir())
    # the trainer's log holds both runs: the crashed one's warm start, then the resumed one's cycles only
    log = (tmp_path / "logs" / "train.log").read_text()
    assert f"resumed: {decided} decisions made" in log, log[-3000:]
    crashed, _, resumed = log.partition(f"resumed: {decided} decisions made")
    assert "v0 (warm start)" in crashed, crashed[-3000:]
    assert "v0 (warm start)" not in resumed, resumed[-3000:]  # the crashed run's data folder was kept, not wiped
    assert [int(v) for v in re.findall(r"^v(\d+) <- v\d+:", resumed, flags=re.M)] == [2], resumed[-3000:]
    # a trainer that made every decision says so; "stopped cleanly" is for a signal's stop only
    assert "done: 2 decisions made" in resumed and "stopped cleanly" not in resumed, resumed[-3000:]
    assert json.loads(state.read_text())["version"] == 2
    d = _dump(tmp_path)
    assert [c[0] for c in d["checkpoints"]] == [0, 1, 2], d["checkpoints"]
    # the supervisor's end drained the flows: every trajectory served has its reward in ClickHouse
    assert d["served"] > 0 and d["unrewarded"] == 0, (d["served"], d["unrewarded"])
    serving = max(c[0] for c in d["checkpoints"] if c[2] == "promoted")
    if serving:
        assert f"Live A/B, v{serving} against v0: users randomised by hashed user id" in out, _out(run)
        assert (tmp_path / "reports" / "final_ab.png").read_bytes()[:4] == b"\x89PNG"
        in_v0, in_final, in_both = d["final_ab_users"]
        assert in_v0 > 10 and in_final > 10 and in_both == 0  # each user saw one arm
        arms = {(v, a) for v, a, _ in d["arms"]}
        assert (0, "ab-v0") in arms and (serving, "ab-final") in arms
    else:
        assert "no final A/B: no candidate was promoted" in out, _out(run)
    assert (tmp_path / "reports" / "loop.png").stat().st_size > 10_000
    left = _processes_with_env("RTRL_DATA_DIR", str(tmp_path))  # the parts' command lines do not name the folder
    assert not left, f"processes of the run still alive: {left}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_demo(tmp_path):
    """`make demo`: three cycles of the main job on the defaults otherwise, each ending in a gated decision recorded
    in ClickHouse with its eval, trained on micro-batches the flows built from the served traffic; then the final
    live A/B against v0 (each user in one arm), the tables with their intervals and the PNGs; `rtrl rollback` then
    marks the serving version rolled back and re-promotes its parent. demo.toml's cycles, rate and final A/B, with
    smaller cycles, evals and warm start (as every test of the main job runs it): what is checked does not depend
    on them. (It also holds the checks of the main job's own test, which ran a fourth main job.)"""
    from tests.test_loop import _dump

    small = {"RTRL_LOOP__SAMPLES_PER_CYCLE": "512", "RTRL_LOOP__EVAL_TASKS": "50", "RTRL_LOOP__WARM_START_STEPS": "100"}
    run = sh(doc_command(r"make demo"), {"RTRL_DATA_DIR": str(tmp_path)} | small)
    assert run.returncode == 0, _out(run)
    assert "3 cycles of" in _flat(run.stdout)
    decisions = _decisions(run.stdout)
    assert [v for v, *_ in decisions] == [1, 2, 3] and all(p < v for v, p, *_ in decisions), _out(run)
    assert all(steps > 0 for *_, steps in decisions)
    assert (tmp_path / "reports" / "loop.png").read_bytes()[:4] == b"\x89PNG"
    out = run.stdout
    assert "Checkpoints (reward v2)" in out and "on-policy" in out
    summary = out[out.index("batch flow:") : out.index("Checkpoints (reward v2)")]  # the ending, up to the table
    assert re.search(r"3 candidates: \d promoted, \d refused", summary), summary
    lines = [
        line for line in summary.splitlines() if "candidates:" in line or "v0 -> v" in line or "reward (v2)" in line
    ]
    assert all(len(line) <= 100 for line in lines), lines
    # each headline change with its interval, or "-" where too few users have data for it
    change = r"(-|[+-][\d.]+% \[[+-][\d.]+, [+-][\d.]+\])"
    assert re.search(rf"v0 -> v\d( \(A/B\))?: edits kept {change}, dissatisfied {change}", summary) or (
        "nothing to compare with v0 live" in summary
    ), summary
    d = _dump(tmp_path)
    cps = d["checkpoints"]
    assert [c[0] for c in cps] == [0, 1, 2, 3] and cps[0][2] == "promoted" and cps[0][1] is None
    for _version, parent, status, reason, ev in cps[1:]:
        assert status in ("promoted", "rejected") and reason and parent in (0, 1, 2)
        assert {"solve_rate", "broken_tool_call_rate", "clarify_rate", "on_policy_fraction"} <= set(ev)
        assert 0.0 <= ev["on_policy_fraction"] <= 1.0
    n_steps, tokens, _ = d["steps"]
    assert n_steps > 0 and tokens > 0 and d["rewards"] > 0 and d["batched"] > 0
    # the run's end drained the flows: every trajectory served has its reward, none is left in an open window
    assert d["served"] > 0 and d["unrewarded"] == 0, (d["served"], d["unrewarded"])
    serving = max([0] + [v for v, _, status, *_ in decisions if status == "promoted"])
    if not serving:
        assert "no final A/B: no candidate was promoted" in out, _out(run)
        return
    # the seed's table, the final version against v0 live, users split by hash
    final = re.search(rf"Live A/B, v{serving} against v0: users randomised by hashed user id", out)
    assert final, _out(run)
    table = out[final.start() : out.index("Checkpoints (reward v2)")]
    for label in ("edit persistence", "dissatisfied follow-ups", "latency (mean ms)", "broken tool calls",
                  "clarifying questions", "reward (v2)"):  # fmt: skip
        row = next(line for line in table.splitlines() if line.strip().startswith(label))
        # v0, the final version, the change, its interval and a p-value, or why not
        assert re.search(r"[+-][\d.]+%? +\[[+-][\d.]+%?, [+-][\d.]+%?\] +(<1e-6|[\d.e+-]+)$", row.strip()) or (
            "too few users" in row or "v0 at 0" in row
        ), row
    assert (tmp_path / "reports" / "final_ab.png").read_bytes()[:4] == b"\x89PNG"
    in_v0, in_final, in_both = d["final_ab_users"]
    assert in_v0 > 10 and in_final > 10 and in_both == 0  # each user saw one arm
    assert "(A/B)" in summary and "live A/B by user" in summary
    back = sh(f"rtrl rollback {serving} --reason test", {"RTRL_DATA_DIR": str(tmp_path)}, timeout=120)
    assert back.returncode == 0, _out(back)
    after = {c[0]: c for c in _dump(tmp_path)["checkpoints"]}
    assert after[serving][2] == "rolled_back" and after[serving][3] == "test"
    parent = after[serving][1]
    assert after[parent][2] == "promoted" and "rollback" in after[parent][3]
