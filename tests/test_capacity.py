"""The capacity model (issue 18, bench/capacity.py): measured figures in, a deployment's size out.

Its stream-side figures are quoted from bench/RESULTS.md (checked here, so neither drifts), its storage figures are
measured on the real engine (re-measured here and compared), the worked example in docs/production.md is what the
model prints, and each derived size is the least that does the work (whole nodes of GPUs, workers and partitions
that carry the peak with the headroom asked for).
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("capacity", ROOT / "bench" / "capacity.py")
assert _spec is not None and _spec.loader is not None
capacity = importlib.util.module_from_spec(_spec)
sys.modules["capacity"] = capacity
_spec.loader.exec_module(capacity)
Target = capacity.Target


def _flat(text: str) -> str:
    return " ".join(text.split())


def _value(lines, what: str) -> str:
    return next(line.value for line in lines if line.what == what)


def test_every_measured_figure_is_quoted_from_the_results_and_matches_its_number():
    results = _flat((ROOT / "bench" / "RESULTS.md").read_text())
    for name, fig in capacity.MEASURED.items():
        assert fig.quote and _flat(fig.quote) in results, (name, fig.quote)
        numbers = [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", fig.quote)]
        assert fig.number in numbers, (name, fig.number, numbers)
    per_event = capacity.MEASURED["event_json_bytes"].value
    assert 250 < per_event < 320  # 58.2 MB over 202,593 events


def test_the_documented_worked_example_is_what_the_model_prints(capsys):
    doc = (ROOT / "docs" / "production.md").read_text()
    section = doc.split("\n## Sizing a deployment\n", 1)[1].split("\n## ", 1)[0]
    command, shown = re.findall(r"```bash\n(.*?)```\s*```text\n(.*?)```", section, flags=re.S)[0]
    assert command.strip() == ".venv/bin/python bench/capacity.py"
    assert capacity.main([]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown.rstrip("\n")
    # and what the prose says of it
    lines = capacity.plan(Target())
    gpus = _value(lines, "trainer GPUs (H200 SXM)").split()[0]
    assert f"{gpus} H200s" in section and capacity.trainer_gpus(Target())[0] == int(gpus)
    assert _value(lines, "reward-flow workers") == "1"
    # the batches topic holds a partition per data-parallel rank; one ClickHouse writer per flow
    assert int(_value(lines, "batches topic partitions")) == int(gpus) // Target().model_parallel
    assert float(_value(lines, "inserts/s per table (flow sinks)")) == 1 / Target().flush_s


def test_flops_per_token_count_forward_backward_per_update_and_the_reference_forward():
    t = Target(params=1e9, layers=2, hidden=10, seq_len=100, updates_per_step=1, kl_reference=False)
    assert capacity.flops_per_token(t) == 6e9 + 12 * 2 * 10 * 100
    both = replace(t, kl_reference=True, updates_per_step=3)
    assert capacity.flops_per_token(both) == 3 * (6e9 + 24_000) + 2e9 + 4 * 2 * 10 * 100
    # attention spans a sample, not the packed row (masked per sample): 40 tokens of a 100-token row
    short = replace(t, tokens_per_trajectory=40)
    assert capacity.flops_per_token(short) == 6e9 + 12 * 2 * 10 * 40


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tokens_per_cycle": 3.3e9, "gpu": "h100", "mfu": 0.31},
        {"params": 8e9, "layers": 32, "hidden": 4096, "cycle_hours": 2.0, "train_share": 0.8},
        {"params": 70e9, "layers": 80, "hidden": 8192, "gpu": "a100", "seq_len": 8192},
    ],
)
def test_trainer_gpus_are_the_fewest_whole_nodes_that_train_a_cycle_in_time(changes):
    t = replace(Target(), **changes)
    gpus, compute, memory = capacity.trainer_gpus(t)
    gpu = capacity.GPUS[t.gpu]
    per_gpu = gpu.bf16_tflops * 1e12 * t.mfu * t.cycle_hours * 3600 * t.train_share  # FLOPs in the window
    need = t.tokens_per_cycle * capacity.flops_per_token(t)
    assert gpus % 8 == compute % 8 == memory % 8 == 0 and gpus == max(compute, memory)
    assert compute * per_gpu >= need > (compute - 8) * per_gpu  # enough, and a node fewer is not


def test_a_large_model_with_few_tokens_is_bound_by_memory():
    t = Target(params=400e9, layers=126, hidden=16384, tokens_per_cycle=1e7, gpu="a100")
    gpus, compute, memory = capacity.trainer_gpus(t)
    assert memory > compute and gpus == memory
    state = 400e9 * (18 + 2)  # bytes of model states and the reference
    assert memory * 80e9 * 0.6 >= state > (memory - 8) * 80e9 * 0.6


def test_workers_and_partitions_carry_the_peak_with_headroom_and_grow_with_traffic():
    small = capacity.plan(Target())
    big_t = Target(trajectories_per_day=2e9)  # a load far beyond one worker
    big = capacity.plan(big_t)
    workers, partitions = int(_value(big, "reward-flow workers")), int(_value(big, "events topic partitions"))
    peak = 2e9 / 86_400 * big_t.events_per_trajectory * big_t.peak_to_mean
    per_worker = capacity.MEASURED["flow_events_per_s"].value
    assert workers * per_worker >= peak * big_t.headroom > (workers - 1) * per_worker
    assert partitions >= workers and partitions % workers == 0
    assert workers > int(_value(small, "reward-flow workers"))
    mb_s = peak * capacity.MEASURED["event_json_bytes"].value / 1e6
    assert partitions * big_t.partition_mb_s >= mb_s


def test_training_more_than_a_cycle_serves_is_said():
    lines = capacity.plan(Target(trajectories_per_day=1e4))
    row = next(line for line in lines if line.what.startswith("samples trained per cycle"))
    assert "MORE than the traffic of a cycle" in row.how
    assert "MORE" not in next(line for line in capacity.plan(Target()) if line.what == row.what).how


@pytest.mark.slow
def test_storage_measured_here_on_the_real_engine_is_the_recorded_figure():
    """``--measure-storage`` as a user runs it (a process of its own: one embedded ClickHouse folder a process)."""
    run = subprocess.run(
        [sys.executable, "bench/capacity.py", "--measure-storage"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.splitlines()[0]
    got = {
        "events_row_bytes": float(re.search(r"events ([\d.]+) B/row", line)[1]),
        "rewards_row_bytes": float(re.search(r"rewards ([\d.]+) B/row", line)[1]),
        "trajectories_row_bytes": float(re.search(r"trajectories ([\d.]+) B/row", line)[1]),
        "rollout_token_bytes": float(re.search(r"rollouts ([\d.]+) B/token", line)[1]),
    }
    for key, value in got.items():  # the recorded run's size and seed
        recorded = capacity.MEASURED[key].value
        assert math.isclose(value, recorded, rel_tol=0.1), (key, value, recorded)
    rows = [int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+)(?: rows)?\)", line)]
    events, rewards, trajectories = rows
    assert events > 5 * trajectories > 0 and rewards > trajectories


def test_the_cli_draws_the_plot_and_refuses_bad_input(tmp_path, capsys):
    png = tmp_path / "capacity.png"
    assert capacity.main(["--tokens-per-cycle", "1e9", "--gpu", "h100", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "trainer GPUs (H100 SXM)" in out and f"wrote {png}" in out
    with pytest.raises(SystemExit) as bad:
        capacity.main(["--gpu", "tpu"])
    assert bad.value.code == 2
    for flag, value in (("--train-share", "1.5"), ("--mfu", "0"), ("--params", "-1"), ("--cycle-hours", "0")):
        with pytest.raises(SystemExit) as bad:
            capacity.main([flag, value])
        assert bad.value.code == 2
        assert flag in capsys.readouterr().err
