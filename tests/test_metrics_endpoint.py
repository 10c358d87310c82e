"""Operator metrics (issue 18, rtrl/metrics.py): each part's Prometheus endpoint, scraped over HTTP while it runs.

The endpoint alone (``/metrics``, ``/healthz``, ``/readyz``, a port in use); then the real reward flow
(`rtrl flow rewards`, tailing a local broker over TCP) and the real trainer (`rtrl train`) as an operator runs
them with ``metrics.port`` set: their figures are read with Prometheus' own text parser and change as data flows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from devservices.broker import free_port
from rtrl import metrics
from rtrl.errors import ConfigError
from rtrl.kafka import ensure_topics, producer_config

Samples = dict[tuple[str, frozenset], float]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, parsed by prometheus_client's parser: (name, labels) -> value."""
    code, text = _get(port, "/metrics")
    assert code == 200, text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(check: Callable[[], bool], timeout: float, what: str, proc: Child | None = None) -> None:
    """Until ``check()``; fails at once, with the child's output, when the part under test has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the part exited ({proc.poll()}) while waiting for {what}:\n{proc.output()}")
        try:
            if check():
                return
        except (urllib.error.URLError, ConnectionError, AssertionError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f":\n{proc.output()}" if proc else ""))


class Child(subprocess.Popen):
    """A part as a process of its own, its output in a file (a pipe nobody reads would block it once full)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            super().__init__(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def test_the_endpoint_serves_metrics_health_and_readiness():
    port = free_port()
    endpoint = metrics.serve(port, part="test-part")
    try:
        assert endpoint.port == port
        metrics.count_flow("test-flow", 3, ["duplicate", "duplicate", "too_late"])
        got = scrape(port)
        assert total(got, "rtrl_events_total", flow="test-flow") == 3
        assert total(got, "rtrl_dead_letters_total", flow="test-flow", kind="duplicate") == 2
        assert total(got, "rtrl_part_info", part="test-part") == 1
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz")[0] == 503  # until the part says it is ready
        endpoint.ready()
        assert _get(port, "/readyz") == (200, "ready\n")
        endpoint.ready(False)
        assert _get(port, "/readyz")[0] == 503
        assert _get(port, "/nothing")[0] == 404
        with pytest.raises(ConfigError, match=r"metrics\.port .*\(RTRL_METRICS__PORT\)"):
            metrics.serve(port)  # in use
    finally:
        endpoint.close()
    assert metrics.serve(0).port == 0  # metrics.port 0: no endpoint


#: a torchrun rank's variables, should an earlier test have left them here: the trainer would serve on port + rank
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_") and k not in _RANK_VARS}
    return keep | extra


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_running_reward_flow_reports_what_flows_through_it(broker, tmp_path):
    """`rtrl flow rewards` with metrics.port: ready once it reads; events, dead letters by kind, rewards, the
    event-to-reward latency, open windows and the consumer lag per partition move as events arrive."""
    from tests.test_reward_flow import SALT, VERSIONS, _payloads, _produce

    prefix = f"metrics{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 2)
    port = free_port()
    env = _env(
        RTRL_KAFKA__BOOTSTRAP=broker.bootstrap,
        RTRL_KAFKA__TOPIC_PREFIX=prefix,
        RTRL_DATA_DIR=str(tmp_path),
        RTRL_FLOW__TAIL="true",
        RTRL_SDK__SALT=SALT,
        RTRL_REWARDS__VERSIONS=VERSIONS,
        RTRL_METRICS__PORT=str(port),
    )
    proc = Child([sys.executable, "-m", "app.cli", "flow", "rewards"], env, tmp_path / "flow.log")
    try:
        wait_for(lambda: _get(port, "/readyz")[0] == 200, 120, "the flow's readiness", proc)
        before = scrape(port)
        assert total(before, "rtrl_events_total", flow="rewards") == 0
        first = _payloads(300, seed=41, duplicate_rate=0.05)
        _produce(broker.bootstrap, prefix + "events", first)
        wait_for(
            lambda: total(scrape(port), "rtrl_events_total", flow="rewards") == len(first),
            120,
            f"{len(first)} events counted",
            proc,
        )
        wait_for(lambda: total(scrape(port), "rtrl_rewards_total") > 0, 60, "rewards", proc)
        mid = scrape(port)
        assert total(mid, "rtrl_dead_letters_total", flow="rewards", kind="duplicate") > 0
        assert total(mid, "rtrl_event_to_reward_seconds_count") > 0
        # the behaviour view's counts, live: as many first closes as trajectories, calls at least the broken ones
        closed = total(mid, "rtrl_trajectories_total")
        assert 0 < closed <= 300
        calls = total(mid, "rtrl_trajectory_behaviour_total", what="tool_calls")
        assert calls >= total(mid, "rtrl_trajectory_behaviour_total", what="broken_tool_calls") and calls > 0
        assert 0 < total(mid, "rtrl_trajectory_behaviour_total", what="edited") <= closed
        assert total(mid, "rtrl_event_to_reward_seconds_sum") >= 0
        lags = {dict(ls)["partition"] for (n, ls) in mid if n == "rtrl_consumer_lag"}
        assert lags == {"0", "1"}, lags  # one gauge per partition read
        assert any(n == "rtrl_open_windows" for n, _ in mid) and any(n == "rtrl_window_state_bytes" for n, _ in mid)
        # more data: the counters move on
        second = _payloads(200, seed=42, start_ms=1_767_226_400_000)
        _produce(broker.bootstrap, prefix + "events", second)
        wait_for(
            lambda: total(scrape(port), "rtrl_events_total", flow="rewards") == len(first) + len(second),
            120,
            "the second batch of events counted",
            proc,
        )
        after = scrape(port)
        assert total(after, "rtrl_rewards_total") > total(mid, "rtrl_rewards_total")
        # caught up: every partition's lag back to 0 (the gauge is refreshed at most every half second)
        caught_up = lambda: all(v == 0 for (n, _), v in scrape(port).items() if n == "rtrl_consumer_lag")  # noqa: E731
        wait_for(caught_up, 30, "lag 0", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_running_trainer_reports_each_step(broker, topic_prefix, tmp_path):
    """`rtrl train` with metrics.port: ready once its model is built; after each step the step counter, tokens/s,
    loss, KL, gradient norm, mismatch and on-policy fraction are the step's (train_metrics has the same)."""
    from schemas.codec import encode_batch
    from tests.test_trainer_train import _to_micro, synthetic_batches

    port = free_port()
    env = _env(
        RTRL_KAFKA__BOOTSTRAP=broker.bootstrap,
        RTRL_KAFKA__TOPIC_PREFIX=topic_prefix,
        RTRL_DATA_DIR=str(tmp_path),
        RTRL_TRAIN__STEPS="3",
        RTRL_TRAIN__IDLE_TIMEOUT_S="120",
        RTRL_TRAIN__RUN_ID="metrics-run",
        RTRL_METRICS__PORT=str(port),
    )
    batches = synthetic_batches(6)
    producer = Producer(producer_config(broker.bootstrap))

    def send(bs) -> None:
        for b in bs:
            producer.produce(
                topic_prefix + "batches", value=encode_batch(_to_micro(b)), key=b.batch_id.encode(), partition=0
            )
        assert producer.flush(10) == 0

    proc = Child([sys.executable, "-m", "app.cli", "train"], env, tmp_path / "train.log")
    try:
        wait_for(lambda: _get(port, "/readyz")[0] == 200, 180, "the trainer's readiness", proc)
        assert total(scrape(port), "rtrl_trainer_steps_total") == 0
        seen = []
        for step in (1, 2):
            send(batches[2 * (step - 1) : 2 * step])  # one step's micro-batches (train.micro_batches_per_step 2)
            wait_for(lambda s=step: total(scrape(port), "rtrl_trainer_steps_total") == s, 120, f"step {step}", proc)
            got = scrape(port)
            seen.append(got)
            assert total(got, "rtrl_trainer_tokens_per_second", adapter="") > 0
            assert total(got, "rtrl_trainer_grad_norm", adapter="") > 0
            assert 0 < total(got, "rtrl_trainer_on_policy_fraction", adapter="") <= 1
            assert total(got, "rtrl_trainer_last_step_timestamp_seconds", adapter="") > time.time() - 300
        # the gauges are each step's own: the second step's loss is not the first's
        assert total(seen[0], "rtrl_trainer_loss") != total(seen[1], "rtrl_trainer_loss")
        send(batches[4:])
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, proc.output()
    assert "trained 3 steps" in proc.output()


def test_the_consumer_lag_is_what_a_partition_reader_has_left_to_read(broker, topic_prefix):
    """``rtrl_consumer_lag`` of a flow's partition reader (flows.kafka_io) over a real topic: 10 messages, 3 read,
    7 left; all read, 0."""
    from prometheus_client import REGISTRY

    from flows.kafka_io import PacedKafkaSource

    topic = topic_prefix + "events"
    producer = Producer(producer_config(broker.bootstrap))
    for i in range(10):
        producer.produce(topic, value=b"{}", key=str(i).encode(), partition=0)
    assert producer.flush(10) == 0
    source = PacedKafkaSource([broker.bootstrap], [topic], tail=True, batch_size=3)
    part = source.build_part("rtrl_lagtest.events_in", f"0-{topic}", None)  # a flow's step id
    labels = {"flow": "lagtest", "topic": topic, "partition": "0"}  # named as the flow's other metrics
    try:
        read: list = []
        deadline = time.monotonic() + 30
        while not read and time.monotonic() < deadline:
            read = part.next_batch()
        assert len(read) == 3
        time.sleep(0.6)  # the gauge is refreshed at most every half second, before each fetch
        read += part.next_batch()
        assert REGISTRY.get_sample_value("rtrl_consumer_lag", labels) == 7  # measured before this fetch
        while len(read) < 10 and time.monotonic() < deadline:
            read += part.next_batch()
        time.sleep(0.6)
        part.next_batch()
        assert len(read) == 10 and REGISTRY.get_sample_value("rtrl_consumer_lag", labels) == 0
    finally:
        part.close()
