"""Every shell command the README and the docs show works as written.

The commands are extracted from the documents themselves (fenced ``bash``/``sh``/``console`` blocks and
inline code spans that start with a program: ``make``, ``rtrl``, ``python``, ``torchrun``, ``pip``, ``curl``),
so a command added to a document without a test fails :func:`test_every_documented_command_is_covered`.
Each one is run here as a user would run it (``bash -c`` in the repository root with the virtualenv's
``bin`` on ``PATH``), shortened only through the same settings path a user has (``RTRL_*`` variables:
fewer cycles, fewer samples, a bounded flow) or with ``make -n`` where the full command is the whole suite
or the benchmarks, and its stated outcome is checked. The few commands another test already runs in the
same shortened form (the reward hack's two-cycle runs, ``torchrun`` with TP=2 and PP=2) are named by that
test, which must exist. ``monitors/ANALYST_QUERIES.md`` has its own test (``tests/test_analyst_queries.py``)
and the generated pages under ``docs/reference/`` only restate the parser (``tests/test_docs_current.py``).
The main job's own commands (``make run`` with a Hugging Face model, ``make demo``, the processes mode crashed
then resumed) run in tests/test_readme_main_job.py, which the rules name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROGRAMS = {"make", "rtrl", "python", "python3", "torchrun", "pip", "curl"}


def documents() -> list[Path]:
    """The hand-written documents that tell a user what to run. Not ``docs/design.md``: the target design
    quotes commands as measured facts about the stack (how pip or Bytewax behave), not as instructions."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *docs]


_ENV = re.compile(r"[A-Z][A-Z0-9_]*=\S*")


def _split_env(command: str) -> tuple[list[str], str]:
    """``A=1 B=2 prog args`` -> (["A=1", "B=2"], "prog args")."""
    words = command.split()
    n = 0
    while n < len(words) and _ENV.fullmatch(words[n]):
        n += 1
    return words[:n], " ".join(words[n:])


def extract(text: str) -> tuple[list[str], list[list[str]]]:
    """(commands, environment-only spans) shown in one markdown text."""
    commands: list[str] = []
    env_only: list[list[str]] = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang not in ("bash", "sh", "shell", "console"):
            commands += [command for command, _ in _transcripts(body)]
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ ")).strip()  # a trailing comment
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        span = " ".join(span.replace("\\|", "|").split())
        env, rest = _split_env(span)
        if env and not rest:
            env_only.append(env)
        elif rest.split(" ", 1)[0] in PROGRAMS and len(rest.split()) > 1:
            commands.append(span)
    return commands, env_only


def _transcripts(body: str) -> list[tuple[str, str]]:
    """``$ command`` lines in a code block that shows a session, each with the output shown after it."""
    shown: list[tuple[str, str]] = []
    for chunk in re.split(r"^(?=\$ )", body, flags=re.M):
        if chunk.startswith("$ "):
            command, _, output = chunk.partition("\n")
            shown.append((" ".join(command[2:].split()), output.strip()))
    return shown


def transcripts() -> list[tuple[str, str]]:
    """Every shown session (command, output) in the documents' non-shell code blocks."""
    found = []
    for doc in documents():
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", doc.read_text(encoding="utf-8"), flags=re.S | re.M):
            if lang not in ("bash", "sh", "shell", "console"):
                found += _transcripts(body)
    return found


def documented() -> tuple[dict[str, list[Path]], list[list[str]]]:
    commands: dict[str, list[Path]] = {}
    env_only: list[list[str]] = []
    for doc in documents():
        found, env = extract(doc.read_text(encoding="utf-8"))
        for c in found:
            commands.setdefault(c, []).append(doc)
        env_only += env
    return commands, env_only


@dataclass(frozen=True)
class Rule:
    """Commands (a regex over the whole command) and the test that runs them."""

    pattern: str
    test: str  # a test of this module, or "tests/file.py::test_name"


RULES = (
    Rule(
        r"make run", "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback"
    ),
    Rule(r"make demo", "tests/test_readme_main_job.py::test_make_demo"),
    Rule(r"make (setup|test|test-fast|lint|bench)", "test_make_targets"),
    Rule(r"make -n \S+", "test_make_targets"),
    Rule(
        r"RTRL_REWARDS__VERSIONS=\S+ RTRL_REWARDS__TRAIN_VERSION=\S+ make run",
        "tests/test_loop.py::test_reward_hack_is_caught_with_the_buggy_reward_only",
    ),
    Rule(
        r"RTRL_LOOP__PROCESSES=true (make|rtrl) run",
        "tests/test_readme_main_job.py::test_processes_mode_crashed_then_resumed",
    ),
    Rule(
        r"make setup && \.venv/bin/rtrl model init \S+ --family \w+",
        "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback",
    ),
    Rule(
        r"RTRL_MODEL__HF_PATH=\S+ make run",
        "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback",
    ),
    Rule(
        r"rtrl model init( DIR| \S+)?( \[--family F\]| --family \w+)?",
        "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback",
    ),
    Rule(
        r"rtrl fleet follow( \[--url U\] \[--api sglang\|vllm\] \[--once\])?",
        "tests/test_registry.py::test_promotion_reaches_the_fleet_and_a_rollback_repoints_it",
    ),
    Rule(
        r"rtrl flow \.\.\.",
        "tests/test_clean_stop.py::test_reward_flow_stops_cleanly_and_resumes_without_loss_or_duplicates",
    ),
    Rule(
        r"rtrl backfill( --reward-version (V|\S+))?( \[--from T1\]| --from \S+)?( \[--to T2\]| --to \S+)?( \[-w N\])?",
        "tests/test_backfill.py::test_rtrl_backfill_command",
    ),
    Rule(r"rtrl rewards (list|list\|compare\|train)", "tests/test_reward_versions.py::test_rtrl_rewards_list"),
    Rule(
        r"rtrl rewards compare (A B|\S+ \S+)( \[--from T1\]| --from \S+)?( \[--to T2\]| --to \S+)?",
        "tests/test_reward_versions.py::test_compare_v1_with_v2_on_the_v1_trained_period",
    ),
    Rule(
        r"rtrl rewards train (V|\S+)",
        "tests/test_reward_versions.py::test_rtrl_rewards_train_requests_a_switch_for_the_next_cycle",
    ),
    Rule(r"rtrl --version", "test_version_config_and_a_refused_reward_version"),
    Rule(r"rtrl --config deploy/\S+\.toml config", "test_shown_sessions_print_what_the_documents_show"),
    Rule(r"rtrl config( \[--example\]| --example)?", "test_version_config_and_a_refused_reward_version"),
    Rule(
        r"rtrl COMMAND --help",
        "tests/test_cli_conventions.py::test_every_subcommand_help_has_a_description_and_argument_help",
    ),
    Rule(
        r"rtrl run( \[--resume \| --keep-data\]| --resume| --keep-data)?",
        "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback",
    ),
    Rule(
        r"rtrl rollback (V|v?\d+)( \[--reason R\])?",
        "tests/test_readme_main_job.py::test_make_run_on_a_hugging_face_model_then_keep_data_and_rollback",
    ),
    Rule(
        r"rtrl rollback (V|N|v?\d+)( \[--reason R\])? (\[--org ORG\]|--org \S+)",
        "tests/test_analyst_queries.py::test_the_main_job_trains_gates_and_serves_each_orgs_adapter_and_rolls_one_back",
    ),
    Rule(r"rtrl ab", "test_service_commands_in_order"),
    Rule(r"rtrl broker (up\|down\|status|up|down|status)", "test_service_commands_in_order"),
    Rule(r"rtrl (topics|migrate)", "test_service_commands_in_order"),
    Rule(
        r"(RTRL_CLICKHOUSE__CLUSTER=\S+ )?rtrl migrate --print( > \S+)?",
        "tests/test_cluster_ddl.py::test_the_committed_cluster_sql_is_what_rtrl_migrate_print_makes",
    ),
    Rule(
        r"rtrl retention apply( --dry-run| \[--dry-run\])?",
        "tests/test_retention.py::test_rtrl_retention_apply_on_a_data_folder",
    ),
    Rule(
        r"rtrl erase (--user ID|--user-hash H|--org ORG)( \[--dry-run\]| --dry-run)?",
        "tests/test_erasure.py::test_a_dry_run_lists_what_would_go_and_removes_nothing",
    ),
    Rule(r"rtrl clickhouse serve( \[--port P\]| --port \d+)?", "test_service_commands_in_order"),
    Rule(
        r"rtrl clickhouse serve --certfile \S+ --keyfile \S+",
        "tests/test_secure_connections.py::test_rtrl_clickhouse_serve_over_tls",
    ),
    Rule(r"rtrl part (rewards\|batches\|serve\|train|rewards|batches)( --to-end)?", "test_service_commands_in_order"),
    Rule(r"rtrl part (serve|train)", "tests/test_readme_main_job.py::test_processes_mode_crashed_then_resumed"),
    Rule(r"rtrl simulate( \[--policy-version N\])?", "test_service_commands_in_order"),
    Rule(r"rtrl flow (rewards|batches)( \[-w N\]| -w \d+)?", "test_service_commands_in_order"),
    Rule(r"rtrl train", "test_service_commands_in_order"),
    Rule(r"python -m bytewax\.run flows\.reward_flow:flow", "test_service_commands_in_order"),
    Rule(r"rtrl part NAME", "tests/test_readme_main_job.py::test_processes_mode_crashed_then_resumed"),
    Rule(r"python -m app\.parts", "tests/test_readme_main_job.py::test_processes_mode_crashed_then_resumed"),
    Rule(r"rtrl flow NAME", "test_service_commands_in_order"),
    Rule(
        r"python -m app\.local_cluster",
        "tests/test_local_cluster.py::test_the_local_cluster_ends_with_rewards_and_a_trained_step",
    ),
    Rule(
        r"rtrl flow rewards -w (W|\d+)( -i (N|\d+) -a \S+)?",
        "tests/test_local_cluster.py::test_two_reward_flow_processes_write_what_one_does",
    ),
    Rule(
        r"(\.venv/bin/)?python -m docs\.generate( --check)?",
        "tests/test_docs_current.py::test_make_docs_writes_every_page_and_the_diagram",
    ),
    Rule(r"make docs", "tests/test_docs_current.py::test_make_docs_writes_every_page_and_the_diagram"),
    Rule(r"\.venv/bin/python -m app\.deploy", "tests/test_deploy.py::test_the_files_are_what_app_deploy_makes"),
    Rule(
        r"\.venv/bin/python -m app\.deploy --config \S+ --out \S+",
        "tests/test_deploy.py::test_manifests_are_made_from_any_settings_file",
    ),
    Rule(
        r"\.venv/bin/python bench/capacity\.py",
        "tests/test_capacity.py::test_the_documented_worked_example_is_what_the_model_prints",
    ),
    Rule(r"pip install -e '\.\[gpu\]'", "test_the_gpu_extra_is_declared"),
    Rule(
        r"(export RTRL_KAFKA__BOOTSTRAP=\$\(rtrl broker up\)|python examples/sdk_integration\.py( --sessions \d+)?)",
        "tests/test_examples.py::test_the_readme_block_runs_as_written",
    ),
    Rule(
        r"python examples/analyst\.py( --dsn \S+)?( --out \S+)?",
        "tests/test_analyst_queries.py::test_chdb_steps_and_example_on_the_folder",
    ),
    Rule(
        r"python -m trainer( --config \S+)?",
        "tests/test_trainer_parallel_settings.py::test_fp8_on_a_cpu_machine_fails_with_the_clear_error",
    ),
    Rule(
        r"torchrun( --nproc_per_node (N|\d+))? -m trainer( --config \S+)?",
        "tests/test_trainer_parallel_settings.py::test_torchrun_tp2_from_a_settings_file_trains",
    ),
)


#: environment-only spans ("with `RTRL_A=1 RTRL_B=2` as well") and the test that runs that variant
ENV_RULES = (
    Rule(
        r"RTRL_LOOP__GROUP_SIZE=1 RTRL_LOOP__WARM_RIGHT_EASY=0\.9",
        "tests/test_loop.py::test_reward_hack_is_caught_with_the_buggy_reward_only",
    ),
    Rule(r"RTRL_TEST_CLICKHOUSE_DSN=\S+", "test_clickhouse_tests_run_against_a_server_dsn"),
)


def _rules_for(command: str) -> list[Rule]:
    return [r for r in RULES if re.fullmatch(r.pattern, command)]


def _test_exists(name: str) -> bool:
    if "::" not in name:
        return callable(globals().get(name))
    path, func = name.split("::")
    return re.search(rf"^def {re.escape(func)}\(", (ROOT / path).read_text(), flags=re.M) is not None


def doc_command(pattern: str) -> str:
    """The documented command matching ``pattern``: the test runs the text the documents show."""
    hits = [c for c in documented()[0] if re.fullmatch(pattern, c)]
    assert hits, f"no documented command matches {pattern!r} any more: update this test with the documents"
    return hits[0]


def sh(command: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``command`` as a user would: bash in the repository root, the virtualenv's bin first on PATH, no
    RTRL_* variables but ``env`` (the shortening)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"
    base["COLUMNS"] = "140"
    proc = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=timeout
    )
    return proc


def _out(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


#: one gated decision; in-process runs also say how many steps trained the candidate
_DECISION = re.compile(r"v(\d+) <- v(\d+): (promoted|rejected)(?: after (\d+) steps)?")


def _decisions(out: str) -> list[tuple[int, int, str, int]]:
    return [(int(v), int(p), s, int(n or -1)) for v, p, s, n in _DECISION.findall(out)]


def _flat(out: str) -> str:
    """The console text with wrapping undone (long temporary paths make rich wrap lines)."""
    return " ".join(out.split())


# --- what every test needs: the documents' commands are all covered ------------------------------------------


def test_the_documents_show_commands():
    commands, _ = documented()
    assert "make run" in commands and "make test" in commands, sorted(commands)
    assert any(c.startswith("rtrl ") for c in commands)


def test_the_quickstart_holds_the_two_commands():
    """The README's Quickstart shows exactly two fenced commands: the main job, then the whole suite (every
    other command lives in later sections)."""
    quick = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```\w*\n(.*?)^```", quick, flags=re.S | re.M)
    assert [b.strip() for b in blocks] == ["make run", "make test"], blocks


def test_every_documented_command_is_covered():
    """Each command a document shows is run by a test (named by a rule), and that test exists."""
    commands, env_only = documented()
    uncovered = {c: [str(d.relative_to(ROOT)) for d in docs] for c, docs in commands.items() if not _rules_for(c)}
    assert not uncovered, f"commands shown in the documents that no test runs: {uncovered}"
    spans = {" ".join(e) for e in env_only}
    bare = sorted(e for e in spans if not any(re.fullmatch(r.pattern, e) for r in ENV_RULES))
    assert not bare, f"setting variants shown in the documents that no test runs: {bare}"
    missing = sorted({r.test for r in RULES + ENV_RULES if not _test_exists(r.test)})
    assert not missing, f"rules name tests that do not exist: {missing}"


def test_the_extractor_finds_blocks_spans_and_settings():
    """The extraction itself: fenced shell lines (continuations joined, prompts and comments dropped),
    inline commands, environment-only spans; prose and non-shell blocks ignored."""
    text = (
        "Run `make run` or `RTRL_X__Y=1 rtrl run`; with `RTRL_A__B=2 RTRL_C__D=3` as well. Not `make` alone,\n"
        "not `rtrl.events`.\n```bash\n$ rtrl topics \\\n    --config f.toml\n# a comment\n```\n"
        "```toml\nrtrl = 1\n```\n"
    )
    commands, env = extract(text)
    assert commands == ["rtrl topics --config f.toml", "make run", "RTRL_X__Y=1 rtrl run"]
    assert env == [["RTRL_A__B=2", "RTRL_C__D=3"]]


def test_shown_sessions_print_what_the_documents_show(tmp_path):
    """A document that shows a command with its output (``$ command`` then the lines it prints) shows what the
    command prints today."""
    shown = transcripts()
    assert shown, "no document shows a session any more: drop this test's rule"
    for command, output in shown:
        proc = sh(command, {"RTRL_DATA_DIR": str(tmp_path)})
        assert output and _flat(output) in _flat(proc.stdout + proc.stderr), (command, output, _out(proc))


def test_every_documented_setting_is_accepted(tmp_path):
    """Each RTRL_* assignment the documents show names a real setting with a valid value, together with the
    assignments beside it (so `RTRL_REWARDS__TRAIN_VERSION=v1...` shows with the versions it needs)."""
    commands, env_only = documented()
    groups = [_split_env(c)[0] for c in commands] + env_only
    checked = 0
    for group in groups:
        env = dict(a.split("=", 1) for a in group if a.startswith("RTRL_") and not a.startswith("RTRL_TEST_"))
        env = {k: v for k, v in env.items() if "…" not in v and "..." not in v}
        if not env:
            continue
        try:
            load_settings(env=env | {"RTRL_DATA_DIR": str(tmp_path)})
        except ConfigError as e:
            pytest.fail(f"the documents show {' '.join(group)}, which the settings refuse: {e}")
        checked += 1
    assert checked >= 3


def test_version_config_and_a_refused_reward_version(tmp_path):
    """`rtrl --version`, `rtrl config` (every setting with its help), `rtrl config --example` (valid TOML of
    every default); and training on a reward version the flow does not compute is refused in one line
    naming the setting (the README's v1 command sets both for that reason)."""
    env = {"RTRL_DATA_DIR": str(tmp_path)}
    version = sh(doc_command(r"rtrl --version"), env)
    assert version.returncode == 0 and re.fullmatch(r"rtrl \d+\.\d+\.\d+\S*\n", version.stdout), _out(version)
    config = sh("rtrl config", env)
    assert config.returncode == 0 and "loop.cycles = 24" in config.stdout, _out(config)
    example = sh("rtrl config --example", env)
    assert example.returncode == 0, _out(example)
    assert {"kafka", "clickhouse", "rewards", "loop", "model"} <= set(tomllib.loads(example.stdout)), _out(example)
    refused = sh("rtrl config", env | {"RTRL_REWARDS__TRAIN_VERSION": "v1-discard-broken"})
    assert refused.returncode == 2, _out(refused)
    assert "rewards.versions" in refused.stdout and "Traceback" not in refused.stdout + refused.stderr
    assert len(refused.stdout.strip().splitlines()) <= 3, _out(refused)


@pytest.mark.slow  # make setup, lint (mypy) and a nested pytest
def test_make_targets():
    """`make test` (dry: it is this suite) runs lint and types before pytest and turns "no tests collected"
    into a failure; `make test-fast` really runs (one file), and fails loudly when nothing is collected;
    `make lint` passes; `make bench` (dry: minutes) runs scripts that exist."""
    dry = sh("make -n test", {})
    assert dry.returncode == 0, _out(dry)
    order = [dry.stdout.find(w) for w in ("ruff check", "ruff format --check", "mypy", "pytest")]
    assert -1 not in order and order == sorted(order), dry.stdout
    assert "collected no tests" in dry.stdout
    fast = sh(doc_command(r"make test-fast") + " PYTEST_ARGS=tests/test_quiet.py", {})
    assert fast.returncode == 0 and re.search(r"\d+ passed", fast.stdout), _out(fast)
    empty = sh("make test-fast PYTEST_ARGS='-k no_test_is_called_this'", {})
    assert empty.returncode != 0 and "collected no tests" in empty.stderr, _out(empty)
    setup = sh(doc_command(r"make setup"), {})  # idempotent: installed already, so a no-op
    assert setup.returncode == 0, _out(setup)
    lint = sh(doc_command(r"make lint"), {})
    assert lint.returncode == 0, _out(lint)
    bench = sh("make -n bench", {})
    scripts = re.findall(r"(bench/\w+\.py)", bench.stdout)
    assert len(scripts) >= 4 and all((ROOT / s).is_file() for s in scripts), bench.stdout
    for s in scripts:
        assert (ROOT / s).read_text().startswith('"""'), f"{s} has no docstring saying what it measures"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clickhouse_counts(data_dir: Path) -> dict[str, int]:
    """Row counts of the run's ClickHouse tables, read in a child (chdb: one folder per process)."""
    code = (
        "import json, sys\nfrom rtrl import clickhouse\n"
        "ch = clickhouse.connect(sys.argv[1])\n"
        "print(json.dumps({t: ch.query(f'SELECT count() FROM rtrl.{t} FINAL').result_rows[0][0] "
        "for t in ('events', 'rewards', 'trajectories', 'dead_letters', 'train_metrics', 'checkpoints')}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, f"chdb://{data_dir}/clickhouse"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class _Front:
    proc: subprocess.Popen
    first_line: str

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, "the ClickHouse front did not stop cleanly on SIGTERM"


def _start_front(data: Path, port: int, env: dict[str, str] | None = None) -> _Front:
    """`rtrl clickhouse serve --port P` on ``data`` as a user starts it, once it answers /ping."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | (env or {"RTRL_DATA_DIR": str(data)})
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec rtrl clickhouse serve --port {port}"],
        cwd=ROOT,
        env=base,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("serving "), first
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                assert r.read().strip() == b"Ok."
                return _Front(proc, first)
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, f"the front did not answer: {first}"
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_service_commands_in_order(tmp_path):
    """The commands table on one data folder, in the order a user meets them: the broker, topics, migrations,
    simulated traffic, each flow to the end of its topics (also through `python -m bytewax.run`), a part, the
    trainer with nothing to train, the ClickHouse front, `rtrl ab`, and the broker stopped."""
    data = tmp_path / "data"
    env = {
        "RTRL_DATA_DIR": str(data),
        "RTRL_SIMULATOR__TRAJECTORIES": "40",
        "RTRL_FLOW__TAIL": "false",
        "RTRL_BATCHING__TAIL": "false",
    }
    up = sh("rtrl broker up", env)
    assert up.returncode == 0 and re.fullmatch(r"127\.0\.0\.1:\d+\n", up.stdout), _out(up)
    address = up.stdout.strip()
    try:
        status = sh("rtrl broker status", env)
        assert status.returncode == 0 and status.stdout.strip() == address, _out(status)
        topics = sh("rtrl topics", env)
        assert topics.returncode == 0 and "rtrl.events" in topics.stdout, _out(topics)
        again = sh("rtrl topics", env)
        assert again.returncode == 0 and "nothing (all exist)" in again.stdout, _out(again)
        migrate = sh("rtrl migrate", env)
        assert migrate.returncode == 0 and "schema verified" in migrate.stdout, _out(migrate)

        simulate = sh("rtrl simulate", env)
        assert simulate.returncode == 0, _out(simulate)
        delivered = int(re.search(r"delivered ([\d,]+)", simulate.stdout)[1].replace(",", ""))
        assert delivered > 0 and "failed 0" in simulate.stdout and "dropped 0" in simulate.stdout

        flow = sh("rtrl flow rewards", env)
        assert flow.returncode == 0, _out(flow)
        summary = re.search(
            r"reward flow: ([\d,]+) events, .*?([\d,]+) rewards \(v2\), ([\d,]+) dead letters", flow.stdout
        )
        assert summary, _out(flow)
        read, rewarded, dead = (int(summary[i].replace(",", "")) for i in (1, 2, 3))
        counts = _clickhouse_counts(data)
        assert rewarded == counts["rewards"] and dead == counts["dead_letters"] and read == delivered, (
            summary[0],
            counts,
        )
        assert counts["rewards"] == counts["trajectories"] == 40, counts  # one reward (v2) per trajectory
        assert counts["events"] + counts["dead_letters"] == delivered, counts  # stored once or dead-lettered

        # the same flow as a plain Bytewax program (no recovery: it replays the topic; ClickHouse replaces)
        plain = sh(
            doc_command(r"python -m bytewax\.run flows\.reward_flow:flow"), env | {"RTRL_KAFKA__BOOTSTRAP": address}
        )
        assert plain.returncode == 0, _out(plain)
        assert _clickhouse_counts(data)["rewards"] == 40

        parts = {k: v for k, v in env.items() if not k.endswith("__TAIL")}  # a part follows, or ends with --to-end
        part = sh("rtrl part rewards --to-end", parts)
        assert part.returncode == 0, _out(part)
        batches = sh("rtrl flow batches", env)  # no rollouts were sent: nothing to join, and it ends
        assert batches.returncode == 0, _out(batches)
        part_batches = sh("rtrl part batches --to-end", parts)
        assert part_batches.returncode == 0, _out(part_batches)

        train = sh("rtrl train", env | {"RTRL_TRAIN__IDLE_TIMEOUT_S": "3"})
        assert train.returncode in (0, 1), _out(train)
        assert "trained nothing: no micro-batch on" in train.stdout, _out(train)
        assert "start what feeds it: rtrl flow rewards, rtrl flow batches" in train.stdout
        assert "Traceback" not in train.stdout + train.stderr

        front = _start_front(data, _free_port(), env)
        try:  # the front serves the run's folder to many processes: the analyst's DSN reads the rewards
            analyst = re.search(r"(http://rtrl_analyst@\S+)", front.proc.stdout.readline() if front.proc.stdout else "")
            assert analyst, "the front did not print the analysts' DSN"
            ch = clickhouse.connect(analyst[1])
            assert ch.query("SELECT count() FROM rtrl.rewards FINAL").result_rows[0][0] == 40
        finally:
            front.stop()
    finally:
        down = sh("rtrl broker down", env)
    assert down.returncode == 0, _out(down)
    assert sh("rtrl broker status", env).stdout.strip() == "not running"

    ab = sh("rtrl ab", {"RTRL_DATA_DIR": str(tmp_path / "ab"), "RTRL_SIMULATOR__TRAJECTORIES": "60"})
    assert ab.returncode == 0, _out(ab)
    assert (tmp_path / "ab" / "reports" / "behaviour.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clickhouse_tests_run_against_a_server_dsn(tmp_path):
    """`RTRL_TEST_CLICKHOUSE_DSN=http://...` runs the ClickHouse tests against a server: here the embedded
    engine behind its HTTP front (`rtrl clickhouse serve`), reached with the writer's DSN it prints."""
    port = _free_port()
    front = _start_front(tmp_path, port)
    try:
        dsn = re.search(r"at (http://rtrl_writer@\S+)", front.first_line)[1]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/test_clickhouse.py", "-q", "-p", "no:cacheprovider"],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"RTRL_TEST_CLICKHOUSE_DSN": dsn},
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert proc.returncode == 0 and re.search(r"\d+ passed", proc.stdout), _out(proc)
    finally:
        front.stop()


def test_the_gpu_extra_is_declared():
    """`pip install -e '.[gpu]'` needs a GPU machine (Transformer Engine must never be installed on a CPU one:
    its broken import breaks `import megatron.core`), so here: the extra exists and brings Transformer Engine
    with PyTorch support; and the CPU install works without it (this suite runs without it)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"transformer[-_]engine\[pytorch\](==|>=)\d", d) for d in extras["gpu"]), extras["gpu"]
    import importlib.util

    assert importlib.util.find_spec("transformer_engine") is None


def test_commands_quoted_in_the_documents_parse_as_shell():
    """Every extracted command is valid shell words (an unbalanced quote in a document fails here)."""
    for command in documented()[0]:
        shlex.split(command)
