"""A CLI that follows conventions (issue point 3).

Every subcommand and argument has help text; ``--version``; ``--config`` and ``-v`` before or after the
command name; versions written ``3`` or ``v3``; a user's mistake is one ``error:`` line with a non-zero exit
code and no traceback; ``rtrl run`` says what it deletes and ``--keep-data`` deletes nothing.
"""

from __future__ import annotations

import argparse

import pytest

import app.loop
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
    positionals |= {"flow": ["rewards"]}
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
    for part in ("loop", "recovery", "logs", "broker", "clickhouse"):
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
            app.loop.fresh_start(settings)
        return []

    monkeypatch.setattr(app.loop, "run_loop", run_loop)
    return calls


@pytest.mark.parametrize("flag", ["--keep-data", "--resume"])
def test_keep_data_deletes_nothing(flag, tmp_path, no_loop, capsys, monkeypatch):
    data = _marked_data_folder(tmp_path)
    rc, lines = _cli(["run", flag], {"RTRL_DATA_DIR": str(data)}, capsys, monkeypatch)
    assert rc == 0 and no_loop == [True], lines
    assert lines == [f"keeping {data}: nothing is deleted (--resume/--keep-data)"]
    for part in ("loop", "recovery", "logs", "broker", "clickhouse"):
        assert (data / part / "kept.txt").read_text() == part
    assert (data / MARKER).exists()


def test_run_says_what_it_deletes(tmp_path, no_loop, capsys, monkeypatch):
    data = _marked_data_folder(tmp_path)
    expected = [data / p for p in ("broker", "clickhouse", "loop", "recovery", "logs")]
    assert app.loop.fresh_start_plan(load_settings(env={"RTRL_DATA_DIR": str(data)})) == expected
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
