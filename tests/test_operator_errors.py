"""Operator errors are one clear line (issue 11, point 6).

Each mistake an operator makes - a config path that is a folder or not UTF-8, an infinite timeout, a
negative worker count, a bad port, an empty or root data_dir, the public salt outside local mode, a
dead broker or ClickHouse - ends with exit code 2 and one ``error:`` line naming the setting or
address and the fix, never a traceback and never a silent success. Timeouts take the time they name.
Secrets never appear in output; the folders holding local state are owner-only.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from devservices.broker import free_port
from rtrl.errors import ConfigError
from rtrl.files import MARKER, check_cleanable, data_folder, private_dir, write_private
from rtrl.sections.client import DEFAULT_SALT
from rtrl.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent


def _cli(argv: list[str], env: dict[str, str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """``rtrl argv`` in this process with exactly ``env`` as its RTRL_* environment: (exit code, output lines)."""
    for var in [v for v in os.environ if v.startswith("RTRL_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, [line for line in (out.out + out.err).splitlines() if line.strip()]


def _one_error_line(lines: list[str]) -> str:
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    return errors[0]


@pytest.fixture
def blackhole():
    """A TCP port that accepts connections (the kernel's backlog) and never answers a byte."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


# ---------------------------------------------------------------- settings a user typed


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RTRL_KAFKA__TIMEOUT_S": "inf"}, "kafka.timeout_s = 'inf' must be a finite number"),
        ({"RTRL_CLICKHOUSE__TIMEOUT_S": "nan"}, "clickhouse.timeout_s = 'nan' must be a finite number"),
        ({"RTRL_KAFKA__BOOTSTRAP": "localhost:70000"}, "port 70000"),
        ({"RTRL_KAFKA__BOOTSTRAP": "localhost:0"}, "port 0"),
        ({"RTRL_CLICKHOUSE__DSN": "http://rtrl:hunter2@localhost:99999"}, "bad port"),
        ({"RTRL_TRAIN__TORCH_THREADS": "-2"}, "train.torch_threads = '-2' must be >= 0"),
        ({"RTRL_DATA_DIR": ""}, "data_dir = '' must name a folder"),
        ({"RTRL_DATA_DIR": "/"}, "resolves to /"),
        ({"RTRL_DATA_DIR": "~"}, "resolves to"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(env, needle, capsys, monkeypatch):
    rc, lines = _cli(["config"], env, capsys, monkeypatch)
    line = _one_error_line(lines)
    assert rc == 2 and needle in line and "fix:" in line, line
    assert "hunter2" not in "\n".join(lines)


def test_a_config_path_that_is_a_folder_or_not_utf8_is_one_line(tmp_path, capsys, monkeypatch):
    rc, lines = _cli(["--config", str(tmp_path), "config"], {}, capsys, monkeypatch)
    assert rc == 2 and "is a folder" in _one_error_line(lines)
    bad = tmp_path / "rtrl.toml"
    bad.write_bytes(b'data_dir = "caf\xe9"\n')  # latin-1, not UTF-8
    rc, lines = _cli(["--config", str(bad), "config"], {}, capsys, monkeypatch)
    assert rc == 2 and "is not UTF-8" in _one_error_line(lines)
    rc, lines = _cli(["config"], {"RTRL_CONFIG": str(tmp_path / "missing.toml")}, capsys, monkeypatch)
    assert rc == 2 and "does not exist" in _one_error_line(lines)


@pytest.mark.parametrize(
    "argv",
    [
        ["flow", "rewards", "-w", "-1"],
        ["flow", "rewards", "-w", "0"],
        ["broker", "up", "--port", "70000"],
        ["clickhouse", "serve", "--port", "http"],
        ["rollback", "-3"],
        ["simulate", "--policy-version", "-1"],
    ],
)
def test_bad_command_line_numbers_are_one_line(argv, capsys, monkeypatch):
    rc, lines = _cli(argv, {}, capsys, monkeypatch)
    line = _one_error_line(lines)
    assert rc == 2 and "argument" in line, line


def test_the_public_salt_is_refused_outside_local_mode():
    remote = {"RTRL_KAFKA__BOOTSTRAP": "kafka-0.internal:9092"}
    with pytest.raises(ConfigError, match="sdk.salt is the public default.*RTRL_SDK__SALT"):
        load_settings(env=remote)
    with pytest.raises(ConfigError, match="sdk.salt is the public default"):
        load_settings(env={"RTRL_CLICKHOUSE__DSN": "https://ch.internal:8443"})
    assert load_settings(env=remote | {"RTRL_SDK__SALT": "our-own-secret"}).sdk.salt == "our-own-secret"
    for local in (
        {},
        {"RTRL_KAFKA__BOOTSTRAP": "127.0.0.1:9092,localhost:9093"},
        {"RTRL_CLICKHOUSE__DSN": "http://[::1]:8123"},
    ):
        s = load_settings(env=local)
        assert s.local and s.sdk.salt == DEFAULT_SALT


def test_secrets_are_redacted_in_rtrl_config_and_in_errors(capsys, monkeypatch):
    env = {"RTRL_SDK__SALT": "top-secret-salt-42", "RTRL_CLICKHOUSE__DSN": "https://rtrl:hunter2@ch.internal:8443"}
    rc, lines = _cli(["config"], env, capsys, monkeypatch)
    text = "\n".join(lines)
    assert rc == 0 and "sdk.salt = '***'" in text and "https://rtrl:***@ch.internal:8443" in text
    assert "top-secret-salt-42" not in text and "hunter2" not in text
    rc, lines = _cli(
        ["config"], env | {"RTRL_CLICKHOUSE__DSN": "https://rtrl:hunter2@ch.internal:99999"}, capsys, monkeypatch
    )
    assert rc == 2 and "hunter2" not in "\n".join(lines) and "***" in _one_error_line(lines)


# ---------------------------------------------------------------- services that are not there


@pytest.mark.slow
def test_a_dead_broker_is_one_line_naming_it_within_its_timeout(blackhole, capsys, monkeypatch):
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    for address in (dead, f"127.0.0.1:{blackhole}"):
        env = {"RTRL_KAFKA__BOOTSTRAP": address, "RTRL_KAFKA__TIMEOUT_S": "2"}
        for argv in (["simulate"], ["topics"]):
            t0 = time.monotonic()
            rc, lines = _cli(argv, env, capsys, monkeypatch)
            took = time.monotonic() - t0
            line = _one_error_line(lines)
            assert rc == 2 and address in line and "within 2s" in line, line
            assert took < 2 + 5, f"{argv} against {address} took {took:.1f}s with kafka.timeout_s = 2"


@pytest.mark.slow
def test_a_clickhouse_timeout_means_what_it_says(blackhole, capsys, monkeypatch):
    """A server that accepts and never answers: the error comes after clickhouse.timeout_s, not 30 s later."""
    dsn = f"http://127.0.0.1:{blackhole}"
    t0 = time.monotonic()
    rc, lines = _cli(["migrate"], {"RTRL_CLICKHOUSE__DSN": dsn, "RTRL_CLICKHOUSE__TIMEOUT_S": "2"}, capsys, monkeypatch)
    took = time.monotonic() - t0
    line = _one_error_line(lines)
    assert rc == 2 and dsn in line and "within 2s" in line, line
    assert 2 <= took < 2 + 3, f"clickhouse.timeout_s = 2 took {took:.1f}s"
    refused = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    rc, lines = _cli(
        ["migrate"], {"RTRL_CLICKHOUSE__DSN": refused, "RTRL_CLICKHOUSE__TIMEOUT_S": "2"}, capsys, monkeypatch
    )
    assert rc == 2 and refused in _one_error_line(lines)


@pytest.fixture
def stalls_after_ping():
    """An HTTP server that answers ``/ping`` with ``Ok.`` and then never answers a query."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.startswith("/ping"):
                self.send_response(200)
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"Ok.\n")
            else:
                release.wait(30)

        do_POST = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_a_server_that_answers_ping_and_then_stalls_is_reported_within_the_timeout(
    stalls_after_ping, capsys, monkeypatch
):
    t0 = time.monotonic()
    env = {"RTRL_CLICKHOUSE__DSN": stalls_after_ping, "RTRL_CLICKHOUSE__TIMEOUT_S": "2"}
    rc, lines = _cli(["migrate"], env, capsys, monkeypatch)
    took = time.monotonic() - t0
    line = _one_error_line(lines)
    assert rc == 2 and stalls_after_ping in line and "within 2s" in line, line
    assert took < 2 + 3, f"clickhouse.timeout_s = 2 took {took:.1f}s"


def _part(name: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return subprocess.run(
        [sys.executable, "-m", "app.parts", name],
        env=clean | {"RTRL_DATA_DIR": str(tmp_path / "data")} | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_parts_check_their_services_before_the_warm_start(tmp_path, blackhole):
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    for name in ("serve", "train", "rewards"):
        p = _part(name, {"RTRL_KAFKA__BOOTSTRAP": dead, "RTRL_KAFKA__TIMEOUT_S": "2"}, tmp_path)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr[-2000:]  # one line
        assert f"part {name}" in p.stderr and dead in p.stderr and "Traceback" not in p.stderr
    # a broker that answers, a ClickHouse server that does not: named before any training starts
    with _local_broker(tmp_path) as bootstrap:
        dsn = f"http://127.0.0.1:{blackhole}"
        env = {"RTRL_KAFKA__BOOTSTRAP": bootstrap, "RTRL_CLICKHOUSE__DSN": dsn, "RTRL_CLICKHOUSE__TIMEOUT_S": "2"}
        p = _part("train", env, tmp_path)
        assert p.returncode == 2 and dsn in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


class _local_broker:
    def __init__(self, tmp_path: Path):
        from devservices.broker import LocalBroker

        self.broker = LocalBroker(tmp_path / "broker")

    def __enter__(self) -> str:
        return self.broker.up()

    def __exit__(self, *exc) -> None:
        self.broker.down()

    @staticmethod
    def down(tmp_path: Path) -> None:
        from devservices.broker import LocalBroker

        LocalBroker(tmp_path / "broker").down()


@pytest.mark.slow
def test_simulate_exits_non_zero_when_events_were_not_delivered(tmp_path, capsys, monkeypatch):
    """The broker answers the check, then goes away while events are still being sent: the producer gives
    up after sdk.delivery_timeout_s and simulate exits 1 with the count, never 0."""
    import threading

    with _local_broker(tmp_path) as bootstrap:
        env = {
            "RTRL_KAFKA__BOOTSTRAP": bootstrap,
            "RTRL_SDK__DELIVERY_TIMEOUT_S": "2",
            "RTRL_SIMULATOR__TRAJECTORIES": "20",
            "RTRL_SIMULATOR__RATE": "40",  # about 5 s of sending
            "RTRL_DATA_DIR": str(tmp_path / "data"),
        }
        stopper = threading.Timer(1.0, _local_broker.down, args=(tmp_path,))
        stopper.start()
        try:
            rc, lines = _cli(["simulate"], env, capsys, monkeypatch)
        finally:
            stopper.join(timeout=60)
    line = _one_error_line(lines)
    assert rc == 1 and "were not delivered" in line and bootstrap in line, lines


# ---------------------------------------------------------------- local state


def test_data_folders_are_owner_only(tmp_path):
    root = tmp_path / "data"
    data_folder(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and (root / MARKER).exists()
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    private_dir(loose / "a" / "b")
    for p in (loose / "a", loose / "a" / "b"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    private_dir(loose)  # an existing folder of ours is tightened
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    token = write_private(root / "tokens" / "writer", b"s3cret")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_bytes() == b"s3cret"
    with pytest.raises(ConfigError, match="not a folder"):
        private_dir(token)


def test_the_local_broker_folder_and_its_control_token_are_owner_only(tmp_path):
    with _local_broker(tmp_path):
        folder = tmp_path / "broker"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert (folder / "noida.control.json").exists()
        # nobody but the owner can enter the folder, so its files cannot be opened by others whatever their mode
        assert not folder.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def test_rtrl_run_never_cleans_a_folder_it_did_not_create(tmp_path):
    """data_dir pointed at someone's project: its ``logs`` folder is not deleted, the run is refused."""
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "logs" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="was not created by rtrl"):
        check_cleanable(project)
    from app.job import fresh_start

    with pytest.raises(ConfigError, match="was not created by rtrl"):
        fresh_start(load_settings(env={"RTRL_DATA_DIR": str(project)}))
    assert (project / "logs" / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    data_folder(ours)
    (ours / "logs").mkdir()
    fresh_start(load_settings(env={"RTRL_DATA_DIR": str(ours)}))
    assert not (ours / "logs").exists() and (ours / MARKER).exists()
    older = tmp_path / "older"  # a data folder of a run from before the marker: its broker file says whose it is
    (older / "broker").mkdir(parents=True)
    (older / "broker" / "rtrl-broker.json").write_text("{}")
    fresh_start(load_settings(env={"RTRL_DATA_DIR": str(older)}))
    assert not (older / "broker").exists() and (older / MARKER).exists()


def test_a_chdb_folder_held_by_another_process_is_one_line_naming_it(tmp_path):
    """chdb says only "Error initializing EmbeddedServer" when another process holds the folder; rtrl names the
    folder, the holder's pid and the fix (serve it with `rtrl clickhouse serve`)."""
    folder = tmp_path / "clickhouse"
    hold = "import sys, time\nfrom rtrl import clickhouse\nclient = clickhouse.connect(sys.argv[1])\ntime.sleep(120)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, f"chdb://{folder}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60  # the engine writes and locks its status file once it has started
        while not (folder / "status").exists():
            assert time.monotonic() < deadline and holder.poll() is None, os.listdir(folder)
            time.sleep(0.2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
        proc = subprocess.run(
            [sys.executable, "-m", "app.cli", "migrate"],
            env=env | {"RTRL_CLICKHOUSE__DSN": f"chdb://{folder}", "RTRL_DATA_DIR": str(tmp_path / "data")},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stdout
    assert f"held by another process (pid {holder.pid})" in lines[0] and "rtrl clickhouse serve" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
