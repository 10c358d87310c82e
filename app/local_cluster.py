"""The cluster's shape on this machine: every process of a deployment, started as the Kubernetes manifests start them.

    python -m app.local_cluster [--config FILE] [--steps N] [--timeout-s S]

It writes the generated settings (:func:`rtrl.settings.settings_toml` of the effective settings, with
``kafka.bootstrap`` and ``clickhouse.dsn`` naming the local services) to ``<data_dir>/cluster/rtrl.toml`` - what a
ConfigMap holds - and starts, each process in its own process group with ``--config`` that file and nothing else but
its identity, its metrics port and the secrets in its environment (``RTRL_SDK__SALT``, as a Kubernetes Secret gives
it):

===================  ================================================  ============================================
process              command                                           in Kubernetes
===================  ================================================  ============================================
broker, topics       the local broker (:mod:`devservices.broker`)      the Kafka cluster
ClickHouse, schema   the embedded folder behind its HTTP front         the ClickHouse server
                     (:func:`app.services.spawn_embedded_clickhouse`)
                     and the migrations
rewards-0, -1        ``rtrl flow rewards -w 1``, with                  StatefulSet ``rtrl-reward-flow``, 2 replicas,
                     ``BYTEWAX_POD_NAME=rtrl-reward-flow-<i>``,        ``podManagementPolicy: Parallel``, each pod
                     ``BYTEWAX_STATEFULSET_NAME=rtrl-reward-flow``,    its volume (its recovery partition); the
                     ``BYTEWAX_ADDRESSES=host:port;host:port``         addresses the headless Service's pod names
batches              ``rtrl flow batches``                             StatefulSet ``rtrl-batch-flow``, 1 replica
serve                ``rtrl part serve``: the policy server and the    the inference fleet and the users
                     simulated users (rollouts and events)
trainer              ``torchrun --nproc_per_node 2 -m trainer``        the training job (DP=2)
===================  ================================================  ============================================

Each process comes from its part in :data:`app.parts.PART_LIST`: its command line from ``Part.local``, its pods'
names from ``Part.workload``. The parts start in that order, and their metrics ports follow the same order.

The policy server serves a promoted version: this launcher announces the untrained policy as v0 first (its
checkpoint in ``<data_dir>/cluster/v0``), as the loop's trainer does after its warm start. The trainer takes
``--steps`` steps (``train.steps``), from the same initial weights, then exits; everything else is stopped then
(SIGTERM: the policy server first, then the flows with a final snapshot), the ClickHouse front and the broker
last, and no process of the run is left. Before the rewards are counted the flows are drained: each runs again
from its recovery to the end of its topics and closes the windows still open. The last line says what the run did::

    local cluster: 2,147 rewards in ClickHouse (reward flow: 2 processes, 6,236 + 6,170 events windowed), 1 step
    trained by 2 ranks (8 micro-batches a step), every process stopped in 73s

Logs are in ``<data_dir>/logs/<process>.log``. With ``metrics.port`` set each process serves its metrics on a port
of its own on this host (in Kubernetes every pod uses the same port on its own address).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.parts import PART_LIST
from rtrl.errors import RtrlError, ServiceUnavailable
from rtrl.quiet import quiet_known_warnings

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LocalCluster:
    """The started processes (by name) and where their logs are."""

    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = Proc(name, popen, log, args, env)
        return self.procs[name]

    def drain(self, names: list[str], setting: str, timeout_s: float = 300.0) -> None:
        """Run the stopped processes ``names`` (one flow's) again with ``setting`` (its ``tail``) false, together, to
        the end of their topics: they resume from their recovery and close every window still open."""
        from app.supervisor import end_group

        env_name = "RTRL_" + setting.replace(".", "__").upper()
        again = [self.start(n, self.procs[n].args, self.procs[n].env | {env_name: "false"}) for n in names]
        deadline = time.monotonic() + timeout_s
        for p in again:
            try:
                rc = p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            end_group(p.popen.pid, timeout_s=2.0)
            if rc != 0:
                raise ServiceUnavailable(f"draining {p.name} failed (exit code {rc}); see {p.log}")

    def stop(self, names: list[str], timeout_s: float = 60.0) -> None:
        """SIGTERM to each (a clean stop), a bounded wait, then every process group ended."""
        from app.supervisor import end_group

        running = [self.procs[n] for n in names if n in self.procs]
        for p in running:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in running:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(10)
            end_group(p.popen.pid, timeout_s=2.0)  # whatever it forked (torchrun's ranks) goes with it


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (a Bytewax process's or torchrun's rendezvous address); not
    devservices.broker's: production code does not import the dev-only services (tests/test_architecture.py)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def generated_settings(settings: Any, bootstrap: str, dsn: str, steps: int) -> Any:
    """The settings every process is started with: the loop's (its tiny tasks), the local services' addresses
    and the trainer's run (``steps`` steps, its checkpoints under ``<data_dir>/cluster``)."""
    cluster = settings.data_path / "cluster"
    return settings.updated(
        {
            "kafka.bootstrap": str(bootstrap),
            "clickhouse.dsn": dsn,
            "train.steps": steps,
            "train.checkpoint_dir": str(cluster / "checkpoints"),
            "train.run_id": "local-cluster",
            "train.idle_timeout_s": 120.0,
            "train.torch_threads": 1,  # the processes share this machine's cores
        }
    )


def announce_v0(settings: Any, ch: Any) -> None:
    """The untrained policy as the promoted v0 (checkpoint and announcement), for the policy server to serve."""
    from confluent_kafka import Producer

    from app.deployments import announce
    from app.serving import loop_model_config
    from rtrl.kafka import connection, producer_config
    from schemas.records import Checkpoint
    from trainer import checkpoint
    from trainer.factory import build
    from trainer.model import init_parallel

    cfg, precision = loop_model_config(settings)
    init_parallel(cfg)
    path = settings.data_path / "cluster" / "v0"
    checkpoint.save(path, build(cfg, precision), extra={"version": 0})
    ck = Checkpoint(
        version=0,
        parent=None,
        created_at=time.time_ns() // 1_000_000,
        steps=0,
        samples=0,
        tokens=0,
        eval_results={},
        status="promoted",
        reason="local cluster: the initial (untrained) policy",
        kafka_offsets={},
        path=str(path),
    )
    producer = Producer(producer_config(connection(settings.kafka), settings.kafka.compression))
    announce(settings, ch, producer, ck)


def _base_env(secret_env: dict[str, str]) -> dict[str, str]:
    """This process's environment without any rtrl setting, torchrun rank or Bytewax cluster variable (each process
    gets only its own), plus the secrets."""
    drop = ("RTRL_", "BYTEWAX_")
    ranks = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ranks}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env | secret_env


def _rows(ch: Any, sql: str) -> list[tuple]:
    try:
        return list(ch.query(sql).result_rows)
    except (ServiceUnavailable, OSError, RuntimeError):
        return []


def run(config: str | None, steps: int, timeout_s: float, out=print) -> int:
    from app.job import fresh_start
    from app.loop_config import loop_settings
    from app.supervisor import Supervisor
    from rtrl.files import write_private
    from rtrl.section import redact_dsn
    from rtrl.settings import load_settings, settings_toml

    settings = loop_settings(load_settings(config), trains=False)
    doomed = fresh_start(settings, trains=False)  # a run of its own: no earlier recovery state, checkpoints or topics
    if (settings.data_path / "cluster").exists():  # this launcher's own: settings file, v0, the trainer's checkpoints
        shutil.rmtree(settings.data_path / "cluster")
        doomed.append(settings.data_path / "cluster")
    out(f"fresh start: deleted {', '.join(map(str, doomed))}" if doomed else f"fresh start in {settings.data_path}")
    sup = Supervisor(settings)
    cluster = LocalCluster(sup.log_dir)
    t0 = time.monotonic()
    try:
        sup.start_services()  # the broker, the topics, the ClickHouse front and the migrations
        gen = generated_settings(sup.settings, sup.bootstrap, sup.dsn, steps)
        conf = settings.data_path / "cluster" / "rtrl.toml"
        conf.parent.mkdir(parents=True, exist_ok=True)
        write_private(conf, settings_toml(gen).encode())
        db = gen.clickhouse.database
        out(
            f"settings: {conf} · broker {sup.bootstrap} · ClickHouse front {redact_dsn(sup.dsn.split('?')[0])} · logs {sup.log_dir}"
        )
        announce_v0(gen, sup.ch)

        env = _base_env({"RTRL_SDK__SALT": secrets.token_hex(16)})  # the Secret's part, never in the file
        port = gen.metrics.port  # this host's ports; in Kubernetes every pod serves on its own address

        def metrics_at(offset: int) -> dict[str, str]:  # the flows add their process id, the trainer its rank
            return {"RTRL_METRICS__PORT": str(port + offset)} if port else {}

        py, cfg = sys.executable, ["--config", str(conf)]
        started, offset, offsets = [], 0, {}  # each part's metrics ports follow the ports of the parts before it
        for part in PART_LIST:
            local, said = part.local, part.title
            args = [py, *local.args, *cfg]
            if local.ranks:  # torchrun on this one node: its ranks and a rendezvous port of their own
                torchrun = [py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(local.ranks)]
                args = [*torchrun, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *local.args, *cfg]
                said += f" (torchrun, {local.ranks} ranks, {steps} step{'s' if steps != 1 else ''})"
            identity: list[dict[str, str]] = [{} for _ in local.names()]
            if local.processes > 1 and part.workload is not None:  # the StatefulSet's pods, as bytewax.run reads them
                addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in range(local.processes))
                sts = part.workload.name
                identity = [
                    {"BYTEWAX_POD_NAME": f"{sts}-{i}", "BYTEWAX_STATEFULSET_NAME": sts, "BYTEWAX_ADDRESSES": addresses}
                    for i in range(local.processes)
                ]
                said += f" as {local.processes} Bytewax processes ({addresses})"
            for name, ident in zip(local.names(), identity, strict=True):
                cluster.start(name, args, env | ident | metrics_at(offset))
            started.append(said)
            offsets[part.name], offset = offset, offset + local.processes
        ends = next(p for p in PART_LIST if p.finishes)  # the trainer: it exits after its steps
        trainer = cluster.procs[ends.local.process]
        out(f"started: {', '.join(started)}")
        shown: tuple[int, int] = (-1, -1)
        deadline = t0 + timeout_s
        while trainer.popen.poll() is None:
            for name, p in cluster.procs.items():
                if p.popen.poll() is not None:
                    raise ServiceUnavailable(
                        f"{name} exited ({p.popen.returncode}); {p.log}:\n{sup.log_tail(name, 20)}"
                    )
            if time.monotonic() > deadline:
                raise ServiceUnavailable(
                    f"the {ends.title} did not finish within {timeout_s:g}s:\n{sup.log_tail(trainer.name, 20)}"
                )
            now = (
                _count(sup.ch, f"SELECT count() FROM {db}.rewards"),
                _count(sup.ch, f"SELECT count() FROM {db}.train_metrics"),
            )
            if now != shown:
                shown = now
                out(f"{time.monotonic() - t0:5.0f}s  rewards {now[0]:,} · trained steps {now[1]}")
            time.sleep(2)
        if trainer.popen.returncode != 0:
            raise ServiceUnavailable(
                f"the {ends.title} exited {trainer.popen.returncode}:\n{sup.log_tail(trainer.name, 20)}"
            )
        # the policy server first: it flushes its rollouts and the users' events
        first = [n for p in PART_LIST if p.stops_first for n in p.local.names()]
        cluster.stop(first)
        # the report is the windowed flow's: each of its processes' Kafka partitions and windowed events, from its
        # metrics (metrics.port + its offset + its id)
        windowed = next(p for p in PART_LIST if p.flow is not None and p.flow.windowed)
        shares = (
            [flow_share(port + offsets[windowed.name] + i, windowed.name) for i in range(windowed.local.processes)]
            if port
            else []
        )
        cluster.stop([n for n in cluster.procs if n not in first])  # the flows: a final snapshot each
        # then to the end of their topics, closing the windows still open: every event served gets its reward
        try:
            for part in PART_LIST:
                if part.flow is not None:
                    cluster.drain(part.local.names(), part.flow.tail)
        except ServiceUnavailable as e:  # the trainer's steps are done: say so, and count what there is
            out(f"warning: {e}; the rewards in ClickHouse may miss the last trajectories")
        rewards = _count(sup.ch, f"SELECT count() FROM {db}.rewards FINAL")
        steps_done = _rows(sup.ch, f"SELECT count(), max(length(batch_ids)) FROM {db}.train_metrics")
        n_steps, per_step = steps_done[0] if steps_done else (0, 0)
        counted = [_windowed(cluster.procs[n].log) for n in windowed.local.names()]
        left = [n for n, p in cluster.procs.items() if p.popen.poll() is None]
        if shares:  # e.g. "process 0 read partitions 0,2 and windowed 0 events; process 1 read 1,3 and ..."
            out(
                f"{windowed.title}: "
                + "; ".join(
                    f"process {i} read partitions {','.join(sorted(parts, key=int)) or 'none'} and windowed "
                    f"{counted[i]:,} events"
                    for i, parts in enumerate(shares)
                )
            )
        out(
            f"local cluster: {rewards:,} rewards in ClickHouse ({windowed.title}: {windowed.local.processes} processes, "
            f"{' + '.join(f'{w:,}' for w in counted)} events windowed), {n_steps} step{'s' if n_steps != 1 else ''} "
            f"trained by {ends.local.ranks} ranks ({per_step} micro-batches a step), "
            + ("every process stopped" if not left else f"still running: {', '.join(left)}")
            + f" in {time.monotonic() - t0:.0f}s"
        )
        return 0 if rewards > 0 and n_steps >= 1 and not left else 1
    finally:
        cluster.stop(list(cluster.procs), timeout_s=30)
        sup.close()  # the ClickHouse front, then the broker


def _count(ch: Any, sql: str) -> int:
    rows = _rows(ch, sql)
    return int(rows[0][0]) if rows else 0


def flow_share(port: int, flow: str) -> set[str]:
    """The Kafka partitions flow ``flow``'s process reads: the partitions of its ``rtrl_consumer_lag`` gauges."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return set()
    return {
        s.labels["partition"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rtrl_consumer_lag" and s.labels.get("flow") == flow
    }


def _windowed(log: Path) -> int:
    """The events a reward flow process windowed, from the lines it printed when it stopped and when it drained."""
    found = re.findall(r"reward flow: ([\d,]+) events", log.read_text(errors="replace")) if log.exists() else []
    return sum(int(n.replace(",", "")) for n in found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m app.local_cluster",
        description="the cluster's shape on this machine: a 2-process reward flow, the batch flow, the policy "
        "server, torchrun DP=2 and the ClickHouse front, all from one generated settings file",
    )
    p.add_argument("--config", help="TOML settings file (default: $RTRL_CONFIG)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps the trainer takes (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up after this long (default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give 1 or more")
    quiet_known_warnings()
    try:
        return run(args.config, args.steps, args.timeout_s, out=lambda line: print(line, flush=True))
    except RtrlError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every process stopped", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
