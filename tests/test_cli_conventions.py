"""A CLI that follows conventions (issue point 3).

Every subcommand and argument has help text; ``--version``; ``--config`` and ``-v`` before or after the
command name; versions written ``3`` or ``v3``; a user's mistake is one ``error:`` line with a non-zero exit
code and no traceback; ``rtrl run`` says what it deletes and ``--keep-data`` deletes nothing.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter

import pytest

import app.job
import app.run
from app.cli import _version, distribution_version, parser
from rtrl.files import MARKER, data_folder
from rtrl.settings import load_settings
from tests.test_operator_errors import _cli, _one_error_line


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, read from the parser itself (so a new subcommand is covered)."""
    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


SUBCOMMANDS = sorted(_subcommands())


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_subcommands_are_found():
    assert {"run", "rollback", "simulate", "config", "broker", "flow"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_help_has_a_description_and_argument_help(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width and breaks words at hyphens
    sub = _subcommands()[name]
    rc, lines = _cli([name, "--help"], {}, capsys, monkeypatch)
    assert rc == 0, lines
    shown = _words("\n".join(lines))
    assert sub.description and _words(sub.description) in shown, (name, sub.description)
    for action in sub._actions:
        assert action.help and action.help is not argparse.SUPPRESS, (name, action.dest)
        help_text = action.help % {"default": action.default, "prog": sub.prog} if "%(" in action.help else action.help
        assert _words(help_text) in shown, (name, action.dest, help_text)
    rc, lines = _cli(["--help"], {}, capsys, monkeypatch)  # and the main --help lists it
    assert rc == 0 and any(line.split()[:1] == [name] for line in lines), lines


def test_version_prints_the_distribution_version(capsys, monkeypatch):
    rc, lines = _cli(["--version"], {}, capsys, monkeypatch)
    assert rc == 0
    assert lines == [f"rtrl {distribution_version()}"]
    assert distribution_version()[0].isdigit()


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "{cfg}", "config"],
        ["config", "--config", "{cfg}"],
        ["-v", "config", "--config", "{cfg}"],
        ["--config", "{cfg}", "config", "-v"],
    ],
)
def test_global_options_before_or_after_the_subcommand(argv, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "f.toml"
    cfg.write_text("[kafka]\npartitions = 7\n")
    rc, lines = _cli([a.format(cfg=cfg) for a in argv], {}, capsys, monkeypatch)
    assert rc == 0, lines
    assert any(line.startswith("kafka.partitions = 7 ") for line in lines), lines


def test_config_after_the_subcommand_overrides_the_one_before(tmp_path, capsys, monkeypatch):
    before, after = tmp_path / "before.toml", tmp_path / "after.toml"
    before.write_text("[kafka]\npartitions = 5\n")
    after.write_text("[kafka]\npartitions = 9\n")
    args = parser().parse_args(["--config", str(before), "config", "--config", str(after)])
    assert args.config == str(after)
    args = parser().parse_args(["--config", str(before), "config"])  # not given after: the one before stays
    assert args.config == str(before) and args.verbose is False
    assert parser().parse_args(["config", "-v"]).verbose is True


@pytest.mark.parametrize("text", ["3", "v3", "V3"])
def test_a_version_is_written_3_or_v3(text):
    assert _version(text) == 3
    assert parser().parse_args(["rollback", text]).version == 3
    assert parser().parse_args(["simulate", "--policy-version", text]).policy_version == 3


@pytest.mark.parametrize("text", ["v", "vv3", "three", "v-1", "3.0"])
def test_a_bad_version_is_one_line(text, capsys, monkeypatch):
    rc, lines = _cli(["rollback", text], {}, capsys, monkeypatch)
    assert rc == 2 and "argument version" in _one_error_line(lines)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_an_unknown_flag_is_one_line_for_every_subcommand(name, capsys, monkeypatch):
    positionals = {"rollback": ["3"], "broker": ["status"], "clickhouse": ["serve"], "part": ["rewards"]}
    positionals |= {"flow": ["rewards"], "model": ["init", "DIR"], "fleet": ["follow"], "rewards": ["list"]}
    positionals |= {"backfill": ["--reward-version", "v2"], "retention": ["apply"], "erase": ["--org", "o"]}
    rc, lines = _cli([name, *positionals.get(name, []), "--no-such-flag"], {}, capsys, monkeypatch)
    assert rc == 2 and "--no-such-flag" in _one_error_line(lines)


@pytest.mark.parametrize(
    "argv",
    [
        ["broker", "sideways"],
        ["part", "everything"],
        ["flow", "nonsense"],
        ["clickhouse", "stop"],
        ["rollback"],
        ["rollback", "three"],
        ["simulate", "--policy-version", "x"],
        ["flow", "rewards", "-w", "many"],
        ["broker", "up", "--port", "-1"],
        ["nosuchcommand"],
        [],
    ],
)
def test_a_bad_argument_value_is_one_line(argv, capsys, monkeypatch):
    rc, lines = _cli(argv, {}, capsys, monkeypatch)
    line = _one_error_line(lines)
    assert rc == 2 and line.startswith("rtrl"), line


@pytest.mark.slow
def test_rollback_of_a_version_that_does_not_exist_is_one_line(tmp_path):
    """Needs the local broker and the embedded ClickHouse of a fresh data folder: in its own process (one
    process holds one chdb folder, and the test session already holds one)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"RTRL_DATA_DIR": str(tmp_path / "d")}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "rollback", "v99"],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    line = _one_error_line(lines)
    assert proc.returncode == 2 and "no checkpoint v99" in line and "known versions: none" in line, lines
    assert len(lines) == 1, lines


def _marked_data_folder(tmp_path):
    data = data_folder(tmp_path / "data")
    for part in ("loop", "recovery", "logs", "broker", "clickhouse", "archive"):
        (data / part).mkdir()
        (data / part / "kept.txt").write_text(part)
    return data


@pytest.fixture
def no_loop(monkeypatch):
    """``run_loop`` replaced by what it does before the loop: afresh deletes, with resume nothing."""
    calls: list[bool] = []

    def run_loop(settings, console=None, resume=False):
        calls.append(resume)
        if not resume:
            app.job.fresh_start(settings)
        return []

    monkeypatch.setattr(app.run, "run_loop", run_loop)
    return calls


@pytest.mark.parametrize("flag", ["--keep-data", "--resume"])
def test_keep_data_deletes_nothing(flag, tmp_path, no_loop, capsys, monkeypatch):
    data = _marked_data_folder(tmp_path)
    rc, lines = _cli(["run", flag], {"RTRL_DATA_DIR": str(data)}, capsys, monkeypatch)
    assert rc == 0 and no_loop == [True], lines
    assert lines == [f"keeping {data}: nothing is deleted (--resume/--keep-data)"]
    for part in ("loop", "recovery", "logs", "broker", "clickhouse", "archive"):
        assert (data / part / "kept.txt").read_text() == part
    assert (data / MARKER).exists()


def test_run_says_what_it_deletes(tmp_path, no_loop, capsys, monkeypatch):
    data = _marked_data_folder(tmp_path)
    expected = [data / p for p in ("broker", "clickhouse", "archive", "loop", "recovery", "logs")]
    assert app.job.fresh_start_plan(load_settings(env={"RTRL_DATA_DIR": str(data)})) == expected
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(data)}, capsys, monkeypatch)
    assert rc == 0 and no_loop == [False], lines
    assert lines == [f"fresh start: deleting {', '.join(map(str, expected))} (keep them: --keep-data)"]
    assert sorted(p.name for p in data.iterdir()) == [MARKER]
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(data)}, capsys, monkeypatch)  # nothing left to delete
    assert lines == [f"fresh start: nothing to delete in {data}"]


def test_run_refuses_a_folder_it_did_not_create_before_deleting(tmp_path, no_loop, capsys, monkeypatch):
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "logs" / "mine.txt").write_text("mine")
    rc, lines = _cli(["run"], {"RTRL_DATA_DIR": str(project)}, capsys, monkeypatch)
    assert rc == 2 and "was not created by rtrl" in _one_error_line(lines) and no_loop == []
    assert (project / "logs" / "mine.txt").read_text() == "mine"


# ---------------------------------------------------------------- what each part says when it ends (issue 12, point 2)


def _services_env(broker, topic_prefix: str, tmp_path) -> dict[str, str]:
    """The session's broker and this test's topics; the command's own embedded ClickHouse in ``tmp_path``."""
    return {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_DATA_DIR": str(tmp_path / "data"),
    }


def _lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.slow
def test_flow_rewards_ends_with_one_line_of_what_it_read_and_wrote(broker, topic_prefix, tmp_path):
    """`rtrl flow rewards` to the end of its topic: the last line counts the events it read, the trajectories
    and rewards it wrote and the dead letters by kind, equal to the reward logic run over the same messages."""
    from flows.processor import Message, RewardProcessor
    from flows.windowing import WindowConfig
    from rtrl.sections.simulator import SimulatorSettings
    from schemas.codec import event_codec
    from simulator.generate import generate
    from tests.test_cli import _run
    from tests.test_reward_flow import _hostile, _produce

    sim = SimulatorSettings(trajectories=12, seed=3, duplicate_rate=0.05)
    values = [event_codec().encode(e.event) for e in generate(sim, "summary-salt")]
    hostile = _hostile(values[0])
    values += [hostile["malformed"], hostile["unknown_type"], hostile["too_late"], values[1]]  # + a duplicate
    _produce(broker.bootstrap, topic_prefix + "events", [(b"k", v) for v in values])  # one partition, in order
    env = _services_env(broker, topic_prefix, tmp_path) | {"RTRL_FLOW__TAIL": "false"}

    settings = load_settings(env=env)
    proc = RewardProcessor(settings.topic("events"), WindowConfig(settings.flow), ["v2"], settings.sdk.max_event_bytes)
    out = proc.process([Message(b"k", v, 0, i) for i, v in enumerate(values)])
    out.extend(proc.finish())
    kinds = Counter(d.kind for d in out.dead_letters)
    assert kinds == {"malformed": 1, "unknown_type": 1, "too_late": 1, "duplicate": kinds["duplicate"]}
    detail = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    expected = (
        f"reward flow: {len(values)} events, {len(out.summaries)} trajectories closed, {len(out.rewards)} rewards (v2), "
        f"{len(out.dead_letters)} dead letters ({detail}) in "
    )

    run = _run(["flow", "rewards"], env, timeout=300)
    lines = _lines(run)
    assert run.returncode == 0, lines
    assert len(out.rewards) == 12 and lines[-1].startswith(expected), (expected, lines)
    assert re.fullmatch(r"in \d+\.\ds", lines[-1][len(expected) - 3 :]), lines[-1]
    assert not any("Warning" in line or "Traceback" in line for line in lines), lines


@pytest.mark.slow
def test_flow_batches_ends_with_one_line_of_what_it_joined_sent_and_dropped(broker, topic_prefix, tmp_path):
    """`rtrl flow batches` to the end of its topics: the last line counts the records read, the samples joined,
    the micro-batches (and samples) it sent, what it dropped and the dead letters, as the topics hold them."""
    from rtrl.kafka import read_topic
    from schemas.codec import decode_batch
    from tests.test_cli import _run
    from tests.test_flows_inprocess import _batch_input
    from tests.test_reward_flow import _produce

    rollouts, rewards = _batch_input()  # two cohorts: stale, unmatched and duplicate input, one bad record each
    _produce(broker.bootstrap, topic_prefix + "rollouts", [(b"k", m.value) for m in rollouts])
    _produce(broker.bootstrap, topic_prefix + "rewards", [(b"k", m.value) for m in rewards])
    env = _services_env(broker, topic_prefix, tmp_path) | {"RTRL_BATCHING__TAIL": "false"}
    env["RTRL_TRAIN__MAX_DELAYED_LAG"] = "0"  # the stale samples are dropped, not delayed
    run = _run(["flow", "batches"], env, timeout=300)
    lines = _lines(run)
    assert run.returncode == 0, lines
    batches = [decode_batch(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "batches")]
    sent = sum(len(b.sample_ids) for b in batches)
    assert batches and sent == 28, sent
    assert re.fullmatch(
        rf"batch flow: {len(rollouts)} rollouts, {len(rewards)} rewards; {sent + 4} samples joined, "
        rf"{len(batches)} micro-batches sent \({sent} samples\); dropped 4 stale, 2 unmatched, 1 duplicate rollouts; "
        r"2 dead letters \(invalid 1, malformed 1\) in \d+\.\ds",
        lines[-1],
    ), lines


@pytest.mark.slow
def test_train_with_no_micro_batch_says_why_and_what_to_start(broker, topic_prefix, tmp_path):
    """`rtrl train` on an empty batches topic trains nothing, says so with the topic, the broker and the wait,
    and names what feeds it; nothing went wrong, so it exits 0."""
    from tests.test_cli import _run
    from trainer.run import FEEDERS

    env = _services_env(broker, topic_prefix, tmp_path) | {"RTRL_TRAIN__IDLE_TIMEOUT_S": "1"}
    run = _run(["train"], env, timeout=300)
    lines = _lines(run)
    assert run.returncode == 0, lines
    assert lines[-2:] == [
        f"trained nothing: no micro-batch on {topic_prefix}batches at {broker.bootstrap} within 1s",
        FEEDERS,
    ], lines
    assert len(lines) == 4 and lines[0].startswith("model: 2 layers") and lines[1].startswith("training "), lines


def test_simulate_prints_readable_lines(broker, topic_prefix, tmp_path, capsys, monkeypatch):
    """`rtrl simulate` says what it simulated and how it went in sentences, not a Python dict."""
    env = _services_env(broker, topic_prefix, tmp_path) | {"RTRL_SIMULATOR__TRAJECTORIES": "20"}
    rc, lines = _cli(["simulate"], env, capsys, monkeypatch)
    assert rc == 0, lines
    assert not any("{" in line for line in lines), lines
    assert len(lines) == 4 and lines[0].startswith("simulating users "), lines  # the progress bar, at its end
    assert re.fullmatch(
        r"simulated v0: 20 trajectories, [\d,]+ events, \d+ duplicates, \d+ reordered, \d+ late checks", lines[1]
    ), lines
    assert re.fullmatch(
        r"behaviour: broken tool calls [\d.]+%, clarifying [\d.]+%, edits [\d.]+% \([\d.]+% accepted, "
        r"[\d.]+% persisted\)",
        lines[2],
    ), lines
    assert re.fullmatch(r"sent [\d,]+ in [\d.]+s; delivered [\d,]+, failed 0, dropped 0, undelivered 0", lines[-1])
    assert all(len(line) <= 100 for line in lines), lines


# ---------------------------------------------------------------- everything printed fits 100 columns


def _render(*renderables) -> list[str]:
    """What a 100-column console shows of ``renderables``: its lines, each checked to fit uncut."""
    from rich.console import Console

    console = Console(width=100, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 - closed with the console
    for r in renderables:
        console.print(r, highlight=False)
    lines = console.export_text().splitlines()
    console.file.close()
    assert all(len(line) <= 100 for line in lines), "\n".join(line for line in lines if len(line) > 100)
    assert not any("…" in line for line in lines), "\n".join(lines)
    return lines


def _checkpoint_rows(n: int) -> list[dict]:
    """``n`` checkpoints as app.report.checkpoint_rows returns them, with the widest values they take."""
    import random

    rng = random.Random(4)
    rows = []
    for v in range(n):
        status = "promoted" if v == 0 else ("promoted", "rejected", "rolled_back")[v % 3]
        rows.append(
            {
                "version": v,
                "parent": None if v == 0 else v - 1,
                "status": status,
                "reason": "the gate's reason, long and not shown in the table " * 3,
                "reward_version": "" if v == 0 else ("v1-discard-broken" if v < 12 else "v2"),  # switched mid-run
                "reward_checksum": "" if v == 0 else "ab" * 32,
                "solve_rate": rng.random(),
                "on_policy_fraction": None if v == 0 else rng.random(),
                "trajectories": 0 if status == "rejected" else rng.randint(0, 999_999),
                "edit_persistence": None if status == "rejected" else rng.random(),
                "dissatisfied_rate": None if status == "rejected" else rng.random() / 100,
                "latency_p50_ms": None if status == "rejected" else rng.uniform(10, 99_999),
                "broken_tool_call_rate": None if status == "rejected" else rng.random() / (1 + 99 * (v == 0)),
                "clarification_rate": None if status == "rejected" else rng.random(),
                "reward_mean": None if status == "rejected" else rng.uniform(-10, 10),
            }
        )
    return rows


def test_the_checkpoint_table_fits_100_columns():
    """The main job's table per checkpoint (24 cycles) keeps every header, value, change and status whole."""
    from app import report

    rows = _checkpoint_rows(25)
    text = "\n".join(
        _render(report.checkpoint_table(rows, "Checkpoints (reward v1-discard-broken): eval gate, live behaviour"))
    )
    for word in ("held-out", "on-policy", "rolled back", "rejected", "v24 ← v23", "×", "dissat.: dissatisfied"):
        assert word in text, word


def test_the_per_version_table_with_intervals_fits_100_columns():
    """`rtrl ab`'s table: each version's metrics, change and 95% interval, all whole."""
    from app import report

    rows, ab = [], []
    for v in range(4):
        row = {"policy_version": v, "trajectories": 123_456 * (v + 1)}
        row |= {name: (0.05 + 0.3 * v) for name, _, _ in report.METRICS if name != "trajectories"}
        row |= {"reward_mean": -0.4 + v, "latency_p50_ms": 1_234.0 * (v + 1), "latency_p95_ms": 98_765.0 * (v + 1)}
        rows.append(row)
        ci = {"policy_version": v}
        for name, _, _ in report.METRICS:
            ci |= (
                {f"{name}_ci_low": None, f"{name}_ci_high": None}
                if v == 0
                else {
                    f"{name}_ci_low": -0.5 * v,
                    f"{name}_ci_high": 1.7 * v,
                }
            )
        ab.append(ci)
    text = "\n".join(_render(report.table(rows, "Behaviour and reward (v2) per policy version: simulated", ab)))
    for word in ("+1.000", "±", "p95", "edits kept: edit persistence", "95% CI"):
        assert word in text, word


def test_rtrl_config_fits_100_columns():
    """`rtrl config`: each setting's name and value stay on one line, long help and long values wrap in their
    column; nothing is cut."""
    from app.cli_services import settings_grid
    from rtrl.settings import describe

    dsn = "https://rtrl_writer@clickhouse-0.clickhouse.analytics.svc.cluster.local:8443/?password_file=/run/w"
    settings = load_settings(env={"RTRL_SDK__SALT": "a-secret-salt-of-ours", "RTRL_CLICKHOUSE__DSN": dsn})
    lines = _render(settings_grid(describe(settings)))
    assert any(line.startswith("kafka.partitions = 4 ") for line in lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("clickhouse.dsn ="))
    first_column = "".join(line[:40].strip() for line in lines[at : at + 4])  # the value wraps in its column
    assert f"clickhouse.dsn='{dsn}'" in first_column.replace(" ", ""), lines[at : at + 4]


def _step(n: int, tokens: int, loss: float):
    """A train_metrics row of step ``n`` with these tokens and loss (the rest zero)."""
    from schemas.records import TrainStep

    fields: dict = {f: 0 for f in TrainStep.__struct_fields__}
    fields |= {"run_id": "r", "lag_histogram": {}, "batch_ids": [], "sample_ids": []}
    return TrainStep(**fields | {"step": n, "tokens": tokens, "loss": loss})


def test_the_summaries_fit_100_columns():
    """The lines `rtrl simulate` and `rtrl train` end with fit 100 columns for realistic numbers."""
    from pathlib import Path

    from app.cli_loop import simulated
    from trainer.run import summary

    settings = load_settings(env={})
    stats = {"trajectories": 10_000, "events": 100_164, "duplicates": 985, "reordered": 1_841, "late_checks": 266}
    stats |= {"broken_tool_call_rate": 0.085, "clarification_rate": 0.19, "edit_rate": 0.702, "accept_rate": 0.616}
    stats |= {"mean_persisted_fraction": 0.663}
    step = _step(20, 98_304, 0.123)
    ckpt = Path("/srv/rtrl/checkpoints/run-2024-06-01")
    boot = "kafka-0.kafka.svc.cluster.local:9092"
    lines = _render(
        *simulated(stats, 12),
        *summary(settings, boot, [step] * 20, 0, 0, 0, "run-2024-06-01", ckpt),
        *summary(settings, boot, [], 0, 0, 0, "run", ckpt),
        *summary(settings, boot, [], 0, 3, 3, "run", ckpt),
        *summary(settings, boot, [], 0, 1, 0, "run", ckpt),
        *summary(settings, boot, [], 20, 0, 0, "run-2024-06-01", ckpt),
    )
    assert len(lines) == 13, lines  # none wrapped


def test_train_says_what_it_trained_or_why_nothing():
    """Each way `rtrl train` can end, in its words: steps, tokens and the last loss (and why it stopped short of
    train.steps), or why it trained nothing - no micro-batch, only invalid ones, too few for a step, or a run
    already at train.steps - and what to do."""
    from pathlib import Path

    from trainer.run import FEEDERS, summary

    settings = load_settings(env={"RTRL_TRAIN__STEPS": "5", "RTRL_TRAIN__IDLE_TIMEOUT_S": "30"})
    ckpt, boot = Path("/ck"), "b:9092"
    done = [_step(n, 1_024, 0.5 / n) for n in (4, 5)]
    assert summary(settings, boot, done, 3, 0, 0, "r", ckpt) == [
        "trained 2 steps, 2,048 tokens, last loss +0.1000 (step 5 of 5)",
        "checkpoints of run r in /ck",
    ]
    assert summary(settings, boot, done[:1], 3, 1, 0, "r", ckpt)[0] == (
        "trained 1 step, 1,024 tokens, last loss +0.1250 (step 4 of 5: too few micro-batches within 30s)"
    )
    assert summary(settings, boot, [], 0, 0, 0, "r", ckpt) == [
        "trained nothing: no micro-batch on rtrl.batches at b:9092 within 30s",
        FEEDERS,
    ]
    assert summary(settings, boot, [], 0, 2, 2, "r", ckpt) == [
        "trained nothing: only invalid micro-batches on rtrl.batches within 30s (2 dead-lettered)",
        FEEDERS,
    ]
    assert summary(settings, boot, [], 0, 1, 0, "r", ckpt) == [
        "trained nothing: 1 micro-batch within 30s, a step takes 2 (train.micro_batches_per_step)",
        FEEDERS,
    ]
    assert summary(settings, boot, [], 5, 0, 0, "r", ckpt) == [
        "trained nothing: run r is at step 5, train.steps is 5",
        "checkpoints of run r in /ck",
        "raise train.steps (RTRL_TRAIN__STEPS) to train on, or set a new train.checkpoint_dir for a new run",
    ]


def test_the_loop_plot_shows_intervals_on_shared_axes_from_zero_and_labels_its_sources(tmp_path):
    """Every estimate per checkpoint has its 95% interval drawn as an error bar, the charts share the checkpoint
    axis, every scale holds 0 and rates start there (noise is not drawn as a trend), and each chart says eval suite, live or trainer."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from app import report

    rows = _checkpoint_rows(6)
    for r in rows:
        for name, _, _ in report.CHECKPOINT_METRICS:
            if r.get(name) is not None and name != "on_policy_fraction":
                r[f"{name}_low"], r[f"{name}_high"] = r[name] - abs(r[name]) / 10, r[name] + abs(r[name]) / 10
    fig = report.checkpoint_figure(rows, "test")
    try:
        axes = fig.axes
        assert all(axes[0].get_shared_x_axes().joined(axes[0], ax) for ax in axes)
        by_title = {ax.get_title().split(" [")[0]: ax for ax in axes}
        for name, label, _ in report.CHECKPOINT_METRICS:
            ax = by_title[label]
            assert f"[{report.SOURCE[name]}]" in ax.get_title()
            bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
            assert bars and all(c.has_yerr for c in bars) == (name != "on_policy_fraction")
            low, high = ax.get_ylim()
            assert low <= 0 <= high
            if name in ("solve_rate", "broken_tool_call_rate", "dissatisfied_rate", "latency_p50_ms"):
                assert low == 0
        assert "eval suite" in fig._suptitle.get_text() and "live" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
    assert report.checkpoint_plot(rows, tmp_path / "loop.png", "t").read_bytes()[:4] == b"\x89PNG"


def test_the_summary_says_when_no_promoted_candidate_has_served_yet():
    """A run whose only promotion came at its last decision has no live figures of a trained version: the summary
    says so instead of comparing, and still counts the decisions (no ClickHouse read is needed for that)."""
    from app import report

    rows = [
        {"version": 0, "status": "promoted", "trajectories": 500},
        {"version": 1, "status": "rejected", "trajectories": 0},
        {"version": 2, "status": "promoted", "trajectories": 0},
    ]
    lines = report.summary_lines(None, "rtrl", rows, "v2")
    assert len(lines) == 3 and "nothing to compare with v0 live" in lines[0]
    assert lines[2].startswith("2 candidates: 1 promoted, 1 refused; v2 serves (not live: v0's figures)")
    assert all(len(line) <= 100 for line in lines)


def test_the_summary_quotes_the_final_live_ab_when_there_is_one(tmp_path):
    """With the main job's final A/B the three lines quote its randomised comparisons (relative change with the
    95% interval in points, the reward's difference), each line at most 100 characters; the table and the plot
    show every metric, a metric without enough users says so."""
    import numpy as np

    from app import report
    from app.job import FinalAB
    from monitors.queries import LIVE_AB_METRICS, ABRow
    from monitors.stats import Users, compare

    rng = np.random.default_rng(3)

    def arm(p):
        return Users(rng.binomial(20, p, 300).astype(float), np.full(300, 20.0))

    rows = [
        ABRow(m, label, better, compare(arm(0.4), arm(0.3 if better == "down" else 0.5)))
        for m, label, better in LIVE_AB_METRICS[:-1]
    ] + [ABRow("reward_mean", "reward", "up", None, "the control arm has 1 user(s) ...; need at least 2 per arm")]
    ab = FinalAB(
        final=24, since_ms=0, trajectories={"ab-v0": 4000, "ab-final": 4010}, rows=rows, seconds=61.0, wanted=4000
    )
    cps = [{"version": 0, "status": "promoted", "trajectories": 500}] + [
        {"version": v, "status": "promoted" if v % 4 else "rejected", "trajectories": 100} for v in range(1, 25)
    ]
    lines = report.summary_lines(None, "rtrl", cps, "v2", ab=ab)
    assert lines[0].startswith("v0 -> v24 (A/B): edits kept +") and "dissatisfied -" in lines[0]
    assert "latency -" in lines[1] and lines[1].endswith("reward (v2) -")
    assert lines[2] == "24 candidates: 18 promoted, 6 refused; v23 serves; live A/B by user, 95% CI"
    assert all(len(line) <= 100 for line in lines)
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(report.final_ab_table(ab, "v2"))
    text = console.export_text()
    assert "Live A/B, v24 against v0" in text and "too few users" in text
    for _, label, _ in LIVE_AB_METRICS[:-1]:
        assert label in text
    assert report.final_ab_plot(ab, tmp_path / "ab.png", "v2").read_bytes()[:4] == b"\x89PNG"
