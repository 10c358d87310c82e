"""The cluster's shape on one machine (issue 18): the reward flow as a two-process Bytewax cluster, the trainer
as torchrun DP=2 and the ClickHouse front, every process started from the generated settings file.

Fast: how a flow process finds its place in a cluster (``-i/-a``, ``bytewax.run``'s environment, a StatefulSet's
pod name) and its recovery partition, and the one-line errors when they do not fit. Slow: the reward flow as two
processes writes the same rewards to ``rtrl.rewards`` as one process (none lost, none twice), across a clean stop
and a restart from the cluster's recovery; and ``python -m app.local_cluster`` end to end: rewards in ClickHouse
from both flow processes and a trained step from both trainer ranks, read back by SQL over the front.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from app.flow_state import Cluster, cluster_from, process_recovery_path, recovery_config
from app.parts import FLOW
from devservices.broker import free_port, free_ports
from rtrl.errors import ConfigError
from rtrl.kafka import ensure_topics, read_topic
from rtrl.settings import load_settings
from schemas.codec import JsonCodec
from schemas.records import Reward
from tests.test_metrics_endpoint import scrape, total

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- fast: the cluster's addressing


def test_a_lone_process_without_cluster_options():
    assert cluster_from(env={}) == Cluster()
    assert Cluster().processes == 1 and "one process" in Cluster().describe(1)


def test_process_id_and_addresses_from_options_or_bytewax_environment(tmp_path):
    two = ("127.0.0.1:2101", "127.0.0.1:2102")
    assert cluster_from(1, "127.0.0.1:2101;127.0.0.1:2102", env={}) == Cluster(1, two)
    env = {"BYTEWAX_PROCESS_ID": "0", "BYTEWAX_ADDRESSES": "127.0.0.1:2101; 127.0.0.1:2102"}
    assert cluster_from(env=env) == Cluster(0, two)
    assert cluster_from(1, env=env) == Cluster(1, two)  # an option wins over the environment
    # a StatefulSet's pod: the ordinal after "<statefulset>-", as bytewax.run derives it
    sts = {"BYTEWAX_POD_NAME": "rtrl-rewards-1", "BYTEWAX_STATEFULSET_NAME": "rtrl-rewards"}
    addresses = "rtrl-rewards-0.rtrl-rewards:9999;rtrl-rewards-1.rtrl-rewards:9999"
    got = cluster_from(env=sts | {"BYTEWAX_ADDRESSES": addresses})
    assert got.process_id == 1 and got.processes == 2
    assert "process 1 of 2 (2 workers each" in got.describe(2)
    hosts = tmp_path / "hosts"
    hosts.write_text("a:1\n\nb:2\n")
    assert cluster_from(env=sts | {"BYTEWAX_HOSTFILE_PATH": str(hosts)}) == Cluster(1, ("a:1", "b:2"))


@pytest.mark.parametrize(
    ("process_id", "addresses", "env", "match"),
    [
        (0, None, {}, r"process id 0 was given without the cluster's addresses; fix: pass -a/--addresses"),
        (None, "a:1;b:2", {}, r"without this process's id; fix: pass -i/--process-id"),
        (2, "a:1;b:2", {}, r"process id 2 is out of range of the 2 cluster addresses .*ids 0\.\.1\); fix"),
        (-1, "a:1", {}, r"process id -1 is negative; fix"),
        (0, "a:1;b", {}, r"cluster address 'b' is not host:port; fix: pass -a/--addresses"),
        (0, "a:1;a:1", {}, r"name a process twice; fix"),
        (None, None, {"BYTEWAX_PROCESS_ID": "one", "BYTEWAX_ADDRESSES": "a:1"}, r"BYTEWAX_PROCESS_ID = 'one'.*fix"),
        (
            None,
            None,
            {"BYTEWAX_POD_NAME": "other-0", "BYTEWAX_STATEFULSET_NAME": "rtrl-rewards", "BYTEWAX_ADDRESSES": "a:1"},
            r"BYTEWAX_POD_NAME = 'other-0' is not a pod of StatefulSet .*fix: set BYTEWAX_POD_NAME from metadata\.name",
        ),
        (1, None, {"BYTEWAX_HOSTFILE_PATH": "/nonexistent/hosts"}, r"BYTEWAX_HOSTFILE_PATH .* cannot be read.*fix"),
    ],
    ids=[
        "id-no-addresses",
        "addresses-no-id",
        "id-out-of-range",
        "negative",
        "no-port",
        "twice",
        "env-id",
        "pod",
        "hostfile",
    ],
)
def test_cluster_mistakes_are_one_line_naming_the_option_and_the_fix(process_id, addresses, env, match):
    with pytest.raises(ConfigError, match=match):
        cluster_from(process_id, addresses, env=env)


def _parts(folder: Path) -> list[tuple[int, int]]:
    found = []
    for f in sorted(folder.glob("part-*.sqlite3")):
        with sqlite3.connect(f) as db:
            found += db.execute("SELECT part_index, part_count FROM parts").fetchall()
    return found


def test_a_flow_process_offsets_its_metrics_port_only_by_processes_on_its_host():
    """Pods of a StatefulSet each have their own address: every one serves on metrics.port (where the probes
    look); processes sharing a host (the local cluster) take the port plus their place among them."""
    pods = ("rtrl-reward-flow-0.rtrl-reward-flow:2101", "rtrl-reward-flow-1.rtrl-reward-flow:2101")
    assert [Cluster(i, pods).local_index for i in (0, 1)] == [0, 0]
    local = ("127.0.0.1:7001", "127.0.0.1:7002", "10.0.0.2:7001", "127.0.0.1:7003")
    assert [Cluster(i, local).local_index for i in range(4)] == [0, 1, 0, 2]
    assert Cluster().local_index == 0


@pytest.mark.parametrize(("partitions", "workers"), [(4, 2), (4, 4), (8, 3), (3, 2), (12, 4)])
def test_the_reward_flows_partition_keys_spread_over_the_workers(partitions, workers):
    """Bytewax itself (a dataflow with that many workers) places the keys: at most ceil(partitions / workers)
    partitions a worker, every partition its own key, the plain key kept wherever it fits."""
    import math

    from flows.routing import balanced_keys, workers_of

    keys = balanced_keys(partitions, workers)
    assert sorted(keys) == list(range(partitions)) and len(set(keys.values())) == partitions
    where = workers_of(tuple(keys.values()), workers)
    load = Counter(where[k] for k in keys.values())
    assert max(load.values()) <= math.ceil(partitions / workers)
    assert len(load) == min(partitions, workers)  # no worker idle while another holds two
    plain = workers_of(tuple(str(p) for p in range(partitions)), workers)
    kept = [p for p in range(partitions) if keys[p] == str(p)]
    assert kept and all(keys[p].startswith(f"{p}~") for p in set(range(partitions)) - set(kept))
    assert all(where[str(p)] == plain[str(p)] for p in kept)
    assert balanced_keys(4, 1) == {p: str(p) for p in range(4)}  # one worker: the keys every snapshot has


def test_each_cluster_process_keeps_its_own_recovery_partition(tmp_path):
    """Process i of N inits partition i of N in its own folder (its own volume in a StatefulSet), once: a restart
    finds it again. A folder made for another cluster size, or a lone process's folder, is refused."""
    settings = load_settings(env={"RTRL_DATA_DIR": str(tmp_path)})
    two = [Cluster(i, ("127.0.0.1:1", "127.0.0.1:2")) for i in range(2)]
    for c in two:
        recovery_config(settings, FLOW["rewards"], c)
        recovery_config(settings, FLOW["rewards"], c)  # a restart: initialised once, found again
    base = tmp_path / "recovery" / "rewards"
    assert process_recovery_path(settings, FLOW["rewards"], two[1]) == base / "process-1"
    assert _parts(base / "process-0") == [(0, 2)] and _parts(base / "process-1") == [(1, 2)]
    assert sorted(p.name for p in base.iterdir()) == ["process-0", "process-1"]  # nothing else left there
    with pytest.raises(ConfigError, match=r"holds partition 1 of 2, not 1 of 3 .*fix: run the cluster with"):
        recovery_config(settings, FLOW["rewards"], Cluster(1, ("a:1", "b:1", "c:1")))
    with pytest.raises(ConfigError, match=r"holds a cluster's state .*this is a lone process; fix"):
        recovery_config(settings, FLOW["rewards"])
    lone = load_settings(env={"RTRL_DATA_DIR": str(tmp_path / "lone")})
    recovery_config(lone, FLOW["batches"])
    assert _parts(tmp_path / "lone" / "recovery" / "batches") == [(0, 1)]
    with pytest.raises(ConfigError, match=r"holds a lone process's state, and this is process 0 of a cluster of 2"):
        recovery_config(lone, FLOW["batches"], two[0])


def test_the_cluster_options_reach_rtrl_flow(tmp_path):
    """`rtrl flow rewards -i 2 -a ...` refuses a process id outside the addresses before it touches anything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "BYTEWAX_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "flow", "rewards", "-i", "2", "-a", "127.0.0.1:1;127.0.0.1:2"],
        env=env | {"RTRL_DATA_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "process id 2 is out of range of the 2 cluster addresses" in proc.stdout
    assert not (tmp_path / "recovery").exists()


# ---------------------------------------------------------------- slow: two reward flow processes


def _flow_env(tmp: Path, bootstrap: str, prefix: str, tail: bool, metrics_port: int = 0) -> dict[str, str]:
    from tests.test_reward_flow import SALT, VERSIONS

    keep = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "BYTEWAX_"))}
    return keep | {
        "PYTHONPATH": str(ROOT),
        "RTRL_DATA_DIR": str(tmp),
        "RTRL_KAFKA__BOOTSTRAP": bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": prefix,
        "RTRL_CLICKHOUSE__DSN": f"chdb://{tmp / 'clickhouse'}",  # one writer: the ClickHouse sink's one partition
        "RTRL_FLOW__TAIL": "true" if tail else "false",
        "RTRL_FLOW__SNAPSHOT_S": "1",
        "RTRL_SDK__SALT": SALT,
        "RTRL_REWARDS__VERSIONS": VERSIONS,
        "RTRL_METRICS__PORT": str(metrics_port),
    }


def _flows(env: dict[str, str], tmp: Path, cluster: list[str] | None, tag: str) -> list[subprocess.Popen]:
    """`rtrl flow rewards` as a lone process (``cluster`` None) or one process per address."""
    procs = []
    tmp.mkdir(parents=True, exist_ok=True)
    for i in range(len(cluster) if cluster else 1):
        args = ["-i", str(i), "-a", ";".join(cluster)] if cluster else []
        with open(tmp / f"{tag}-{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "app.cli", "flow", "rewards", *args],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def _wait(procs: list[subprocess.Popen], tmp: Path, tag: str, timeout: float = 180) -> list[str]:
    logs = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        logs.append((tmp / f"{tag}-{i}.log").read_text(errors="replace"))
        assert p.returncode == 0, logs[-1][-3000:]
    return logs


def _rewards(bootstrap: str, topic: str) -> list[tuple]:
    """Every reward on ``topic`` without its wall-clock field: what a run computed."""
    codec: JsonCodec[Reward] = JsonCodec(Reward)
    return [
        msgspec.to_builtins(msgspec.structs.replace(codec.decode(v), emitted_at=0))
        for _, v in _values(bootstrap, topic)
    ]


def _values(bootstrap: str, topic: str) -> list[tuple[bytes | None, bytes]]:
    return [(m.key(), m.value()) for m in read_topic(bootstrap, topic)]


def _windowed(port: int) -> float:
    """The events a flow process has windowed so far (0 before its endpoint is up)."""
    try:
        return total(scrape(port), "rtrl_events_total", flow="rewards")
    except OSError:
        return 0


def _events_read(log: str) -> int:
    m = re.search(r"process \d of 2: reward flow: ([\d,]+) events", log)
    assert m, log[-3000:]
    return int(m.group(1).replace(",", ""))


def test_a_recovery_folder_keeps_the_partition_keys_its_windows_were_made_under(broker, tmp_path):
    """The first run records its keys; the same workers resume; another number of workers is refused (its windows
    under the old keys would never close); a folder from before the record resumes only where the keys are plain."""
    from bytewax.recovery import init_db_dir

    from app.flow_state import KEYS_FILE, partition_keys

    prefix = f"keys{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 4)
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": prefix, "RTRL_DATA_DIR": str(tmp_path)})
    folder = tmp_path / "recovery"
    folder.mkdir()
    keys = partition_keys(settings, broker.bootstrap, 2, folder, fresh=True)
    assert (folder / KEYS_FILE).exists() and len(set(keys.values())) == 4
    assert partition_keys(settings, broker.bootstrap, 2, folder, fresh=False) == keys  # a restart: the same keys
    with pytest.raises(ConfigError, match=r"keys differ.*Fix: run with the workers"):
        partition_keys(settings, broker.bootstrap, 1, folder, fresh=False)
    legacy = tmp_path / "legacy"  # state from before the record: its windows are under the plain keys
    legacy.mkdir()
    init_db_dir(legacy, 1)
    assert partition_keys(settings, broker.bootstrap, 1, legacy, fresh=False) == {p: str(p) for p in range(4)}
    (legacy / KEYS_FILE).unlink()
    if keys != {p: str(p) for p in range(4)}:  # two workers re-key some partitions: refused
        with pytest.raises(ConfigError, match="keys differ"):
            partition_keys(settings, broker.bootstrap, 2, legacy, fresh=False)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_reward_flow_processes_write_what_one_does(broker, tmp_path):
    """The same events through one process and through a two-process cluster (its Kafka partitions split between
    the processes, windows keyed by partition exchanged to their owner, one ClickHouse and one Kafka writer): the
    same rewards on rtrl.rewards, none lost and none twice - with the cluster stopped cleanly mid-stream (SIGTERM
    to both: a final snapshot holds its open windows) and restarted from each process's recovery partition."""
    from tests.test_reward_flow import _payloads, _produce

    events = _payloads(240, seed=51, duplicate_rate=0.05)
    one, two = f"one{free_port()}.", f"two{free_port()}."
    for prefix in (one, two):
        ensure_topics(broker.bootstrap, prefix, 4)
    _produce(broker.bootstrap, one + "events", events)
    half = len(events) // 2  # the cluster gets the first half, is stopped, then gets the rest
    _produce(broker.bootstrap, two + "events", events[:half])

    lone = tmp_path / "one"
    _wait(_flows(_flow_env(lone, broker.bootstrap, one, tail=False), lone, None, "one"), lone, "one")
    expected = _rewards(broker.bootstrap, one + "rewards")
    assert expected and len({(r["trajectory_id"], r["reward_version"], r["revision"]) for r in expected}) == len(
        expected
    )

    cluster, tmp = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], tmp_path / "two"
    port = free_ports(2)  # each process its endpoint: metrics.port + its process id, both free
    procs = _flows(_flow_env(tmp, broker.bootstrap, two, tail=True, metrics_port=port), tmp, cluster, "tail")
    try:  # following the topic: every event read, some windows still open (no newer event moves their clock)
        deadline = time.monotonic() + 180
        while sum(_windowed(port + i) for i in (0, 1)) < half:
            assert all(p.poll() is None for p in procs), [(tmp / f"tail-{i}.log").read_text() for i in range(2)]
            assert time.monotonic() < deadline, "the cluster did not read the events within 180 s"
            time.sleep(1)
        # the Kafka partitions are split between the processes: each reads its own (its lag gauges), none both
        owned = [{dict(ls)["partition"] for (n, ls) in scrape(port + i) if n == "rtrl_consumer_lag"} for i in (0, 1)]
        assert owned[0] and owned[1] and not owned[0] & owned[1] and owned[0] | owned[1] == {"0", "1", "2", "3"}
        # and the partitions' windows are spread over the two workers: two a process (flows.routing), whichever
        # process reads them (rtrl_open_windows is set by the worker that holds a partition's windows)
        held = [{dict(ls)["partition"] for (n, ls) in scrape(port + i) if n == "rtrl_open_windows"} for i in (0, 1)]
        assert [len(h) for h in held] == [2, 2] and held[0] | held[1] == {"0", "1", "2", "3"}, held
    finally:
        for p in procs:  # a clean stop of the cluster: every process
            p.send_signal(signal.SIGTERM)
    first = _wait(procs, tmp, "tail")
    # every event windowed once, on the processes that own the partitions' keys; the keys spread the partitions
    # over both workers (flows.routing: the plain keys "0".."3" would all land on one)
    assert sum(_events_read(log) for log in first) == half, first
    assert all(_events_read(log) > 0 for log in first), first
    assert len(_values(broker.bootstrap, two + "rewards")) < len(expected)  # some windows were open at the stop
    assert sorted(p.name for p in (tmp / "recovery" / "rewards").iterdir()) == ["process-0", "process-1"]
    # the restart: each process resumes from its partition with what was open, and reads on where it stopped
    _produce(broker.bootstrap, two + "events", events[half:])
    _wait(_flows(_flow_env(tmp, broker.bootstrap, two, tail=False), tmp, cluster, "end"), tmp, "end")
    got = _rewards(broker.bootstrap, two + "rewards")
    key = lambda r: (r["trajectory_id"], r["reward_version"], r["revision"])  # noqa: E731
    assert not [k for k, n in Counter(map(key, got)).items() if n > 1], "a reward written twice"
    assert sorted(got, key=key) == sorted(expected, key=key)


# ---------------------------------------------------------------- slow: the whole cluster's shape


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line names ``text``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(p.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_local_cluster_ends_with_rewards_and_a_trained_step(tmp_path):
    """`python -m app.local_cluster`: every process from the generated settings file, the reward flow as two Bytewax
    processes (each reading its own Kafka partitions), the trainer as torchrun DP=2; afterwards ClickHouse, read by
    SQL over its front, holds rewards (none twice) and a step whose micro-batches came from both ranks; no process
    of the run is left."""
    from app.services import spawn_embedded_clickhouse
    from rtrl import clickhouse

    data, port = tmp_path / "data", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "BYTEWAX_"))}
    env |= {"PYTHONPATH": str(ROOT), "RTRL_DATA_DIR": str(data), "RTRL_METRICS__PORT": str(port)}
    log = tmp_path / "local_cluster.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.local_cluster", "--steps", "1", "--timeout-s", "480"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        proc.wait(540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-5000:]

    conf = data / "cluster" / "rtrl.toml"
    generated = load_settings(conf, env={})  # the file alone: the services' addresses, no secret
    assert (
        generated.kafka.bootstrap and generated.clickhouse.dsn.startswith("http://") and "salt" not in conf.read_text()
    )
    assert not _processes_naming(str(conf)), "a process of the run is still running"
    # both reward flow processes read Kafka partitions of their own, all of them between them
    shares = re.search(r"process 0 read partitions ([\d,]+) .*; process 1 read partitions ([\d,]+) ", text)
    assert shares, text[-3000:]
    p0, p1 = (set(g.split(",")) for g in shares.groups())
    assert p0 and p1 and not p0 & p1 and p0 | p1 == {str(i) for i in range(generated.kafka.partitions)}
    # and both compute rewards: the partitions' keys are spread over the two workers (flows.routing)
    windowed = [
        int(w.replace(",", "")) for w in re.findall(r"read partitions [\d,]+ and windowed ([\d,]+) events", text)
    ]
    assert len(windowed) == 2 and all(w > 0 for w in windowed), text[-3000:]
    logs = data / "logs"
    for i in (0, 1):
        assert f"rewards flow, process {i} of 2" in (logs / f"rewards-{i}.log").read_text()
    assert sorted(p.name for p in (data / "recovery" / "rewards").iterdir()) == ["process-0", "process-1"]
    assert "dp 2" in (logs / "trainer.log").read_text()  # torchrun's two ranks, one data-parallel replica each
    assert re.search(r"local cluster: [\d,]+ rewards in ClickHouse .* 1 step trained by 2 ranks", text), text[-2000:]

    front, dsn = spawn_embedded_clickhouse(str(data / "clickhouse"), log=tmp_path / "front.log")
    try:
        ch, db = clickhouse.connect(dsn), generated.clickhouse.database
        rewards = ch.query(f"SELECT count(), uniqExact(trajectory_id, reward_version, revision) FROM {db}.rewards")
        n, distinct = rewards.result_rows[0]
        assert n > 0 and n == distinct, (n, distinct)  # rewards written, none twice
        # the end drained the flows: every trajectory the reward flow read has its reward, none left in a window
        unrewarded = ch.query(
            f"SELECT count() FROM (SELECT DISTINCT trajectory_id FROM {db}.events) "
            f"WHERE trajectory_id NOT IN (SELECT trajectory_id FROM {db}.rewards)"
        ).result_rows[0][0]
        assert unrewarded == 0, unrewarded
        steps = ch.query(f"SELECT step, length(batch_ids), tokens FROM {db}.train_metrics ORDER BY step").result_rows
        per_rank = generated.train.micro_batches_per_step
        # a step of two ranks: each trained micro_batches_per_step micro-batches, gathered into the step's row
        assert [(s, b) for s, b, _ in steps] == [(1, 2 * per_rank)] and steps[0][2] > 0, steps
    finally:
        front.terminate()
        front.wait(30)
