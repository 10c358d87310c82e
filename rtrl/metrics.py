"""Operator metrics (issue 18): what each part exposes for Prometheus, and the endpoint that serves them.

Every part (the reward flow, the batch flow, the trainer, the main job) records into this process's
metrics, defined once here so that names, labels and help texts are the same whichever part records them and
the dashboards and alert rules in ``deploy/`` can rely on them. They live in ``prometheus_client``'s default
registry (one per process, the library's own convention), so a library's metrics (``process_*``,
``python_gc_*``) come with them.

:func:`serve` starts the endpoint when ``metrics.port`` is set (0, the default, serves nothing): on
``metrics.host:metrics.port``, ``/metrics`` in Prometheus' text format, ``/healthz`` (200 while the process
runs) and ``/readyz`` (200 once the part said it is ready with :meth:`Endpoint.ready`, else 503) for a
Kubernetes liveness and readiness probe. It runs on a daemon thread and never stops a part: a port already in
use is reported as a :class:`rtrl.errors.ConfigError` naming the setting.

What is recorded where (rates are for Prometheus to take: ``rate(rtrl_events_total[1m])`` is events/s):

========================================  =========================================================================
``rtrl_events_total{flow}``                 events (reward flow) or rollouts and rewards (batch flow) read
``rtrl_dead_letters_total{flow,kind}``      inputs dead-lettered, by kind (duplicate, too_late, invalid, ...)
``rtrl_consumer_lag{flow,topic,partition}`` messages behind the partition's end, per partition read
``rtrl_consumer_last_poll_timestamp_seconds`` when that reader last polled (a stuck flow stops refreshing its lag)
``rtrl_open_windows{partition}``            trajectory windows open in the reward flow's memory
``rtrl_window_state_bytes{partition}``      estimated bytes of the reward flow's windows in memory
``rtrl_event_to_reward_seconds``            wall time from a trajectory's last event to its reward (histogram)
``rtrl_rewards_total{reward_version}``      rewards emitted
``rtrl_trajectories_total``                 trajectories closed
``rtrl_trajectory_behaviour_total{what}``   tool_calls, broken_tool_calls, edited, clarified, dissatisfied: the
                                            behaviour view's rates live, for alert rules that mirror the monitors
``rtrl_batch_samples_total{lag}``           samples packed into micro-batches, by policy lag (staleness);
``rtrl_batch_samples_dropped_total{lag}``   those dropped as too stale
``rtrl_batches_total``                      micro-batches sent
``rtrl_data_use_excluded_total{reason}``    trajectories the batch flow kept from training by their data-use class
                                            (monitor_only, none, adapter_only_without_adapter)
``rtrl_sdk_withheld_total{data_use}``       events and rollouts the SDK kept in the product's process by their class
``rtrl_trainer_*``                          per optimizer step: tokens/s, loss, KL, gradient norm, mismatch, on-policy
                                            fraction, steps, the last step's time
``rtrl_gate_decisions_total{status,org}``   decisions announced (promoted, rejected, rolled_back; org '' = shared)
``rtrl_serving_version{part}``              the policy version serving now, as the trainer part (its decisions) and
                                            the policy server (what it follows on ``rtrl.deployments``) know it
========================================  =========================================================================
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, Info, generate_latest

from rtrl.errors import ConfigError
from rtrl.settings import Settings

log = logging.getLogger("rtrl.metrics")

EVENTS = Counter("rtrl_events", "Inputs read by a flow (events; rollouts and rewards).", ["flow"])
DEAD_LETTERS = Counter("rtrl_dead_letters", "Inputs dead-lettered, by kind.", ["flow", "kind"])
CONSUMER_LAG = Gauge(
    "rtrl_consumer_lag", "Messages behind the end of a partition a flow reads.", ["flow", "topic", "partition"]
)
CONSUMER_POLLED = Gauge(
    "rtrl_consumer_last_poll_timestamp_seconds",
    "When a flow's reader of a partition last polled (at most every half second): its lag is that old.",
    ["flow", "topic", "partition"],
)
OPEN_WINDOWS = Gauge("rtrl_open_windows", "Trajectory windows open in the reward flow's memory.", ["partition"])
WINDOW_STATE_BYTES = Gauge(
    "rtrl_window_state_bytes", "Estimated bytes of the reward flow's windows in memory.", ["partition"]
)
EVENT_TO_REWARD = Histogram(
    "rtrl_event_to_reward_seconds",
    "Wall time from a trajectory's last event (its producer's clock) to its first reward (the flow's clock): the "
    "grace, or the window's deadline for a trajectory that never ended, plus the flow's own delay.",
    buckets=(0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30, 60, 300, 1800, 3600, 6 * 3600, 24 * 3600),
)
REWARDS = Counter("rtrl_rewards", "Rewards the reward flow emitted.", ["reward_version"])
TRAJECTORIES = Counter("rtrl_trajectories", "Trajectories closed (first close only).")
#: what rtrl_trajectory_behaviour counts (the behaviour view's inputs; app.deploy.LIVE_RATES makes rates of them)
BEHAVIOUR_COUNTS = ("tool_calls", "broken_tool_calls", "edited", "clarified", "dissatisfied")
BEHAVIOUR = Counter(
    "rtrl_trajectory_behaviour",
    "What closed trajectories did, summed (first close only): tool_calls, broken_tool_calls, and trajectories that "
    "edited, clarified, or had a dissatisfied follow-up: the behaviour view's rates, live.",
    ["what"],
)
BATCH_SAMPLES = Counter("rtrl_batch_samples", "Samples packed into micro-batches, by policy lag.", ["lag"])
BATCH_DROPPED = Counter("rtrl_batch_samples_dropped", "Samples dropped as too stale, by policy lag.", ["lag"])
BATCHES = Counter("rtrl_batches", "Micro-batches the batch flow sent.")
DATA_USE_EXCLUDED = Counter(
    "rtrl_data_use_excluded", "Trajectories the batch flow kept from training by their data-use class.", ["reason"]
)
SDK_WITHHELD = Counter(
    "rtrl_sdk_withheld", "Events and rollouts the SDK kept in the product's process by their class.", ["data_use"]
)
SECRETS_FOUND = Counter(
    "rtrl_secrets_found", "Secrets the SDK found in rollouts, which it kept back (client/screening.py).", ["detector"]
)
ERASED_SKIPPED = Counter(
    "rtrl_erased_skipped",
    "Records a consumer skipped because their user or organisation was erased (`rtrl erase`).",
    ["consumer"],
)
ERASURES = Counter("rtrl_erasures", "Runs of `rtrl erase` that finished, by subject kind.", ["subject_kind"])
TRAINER_STEPS = Counter("rtrl_trainer_steps", "Optimizer steps trained.", ["adapter"])
TRAINER_TOKENS_PER_S = Gauge("rtrl_trainer_tokens_per_second", "Trained tokens/s of the last step.", ["adapter"])
TRAINER_LOSS = Gauge("rtrl_trainer_loss", "Loss of the last step.", ["adapter"])
TRAINER_KL = Gauge("rtrl_trainer_kl", "Mean k3 KL to the reference per trained token, last step.", ["adapter"])
TRAINER_GRAD_NORM = Gauge("rtrl_trainer_grad_norm", "Gradient norm before clipping, last step.", ["adapter"])
TRAINER_MISMATCH = Gauge(
    "rtrl_trainer_mismatch_k3", "Training-inference mismatch (k3 KL behaviour||trainer), last step.", ["adapter"]
)
TRAINER_MISMATCH_MAX = Gauge(
    "rtrl_trainer_mismatch_max_abs_log_ratio",
    "Training-inference mismatch: largest |trainer - behaviour log-prob|, last step.",
    ["adapter"],
)
TRAINER_ON_POLICY = Gauge(
    "rtrl_trainer_on_policy_fraction", "Share of the last step's tokens of policy lag 0.", ["adapter"]
)
TRAINER_LAST_STEP = Gauge("rtrl_trainer_last_step_timestamp_seconds", "When the last step finished.", ["adapter"])
GATE_DECISIONS = Counter(
    "rtrl_gate_decisions",
    "Eval-gate decisions announced, by status and org ('' = the shared policy).",
    ["status", "org"],
)
SERVING_VERSION = Gauge(
    "rtrl_serving_version", "The policy version serving now, as this part knows it (-1: not known here).", ["part"]
)
PART = Info("rtrl_part", "Which rtrl part this process runs.")
#: the decisions an operator alerts on (a candidate's own announcement is not one)
DECISIONS = ("promoted", "rejected", "rolled_back")
for _status in DECISIONS:  # present at 0 from the start, so increase() sees the first one
    GATE_DECISIONS.labels(status=_status, org="")
for _what in BEHAVIOUR_COUNTS:
    BEHAVIOUR.labels(what=_what)
TRAINER_STEPS.labels(adapter="")


def count_flow(flow: str, read: int, dead_kinds: Iterable[str]) -> None:
    """A flow's batch: ``read`` inputs, one dead letter per kind listed."""
    if read:
        EVENTS.labels(flow=flow).inc(read)
    for kind in dead_kinds:
        DEAD_LETTERS.labels(flow=flow, kind=kind).inc()


def observe_rewards(rewards: Iterable[Any], now_ms: int) -> None:
    """Rewards emitted now: counted per version (one call per version a batch); the delay since its last event of
    each trajectory's first reward, once per trajectory (whichever version came first)."""
    per_version: Tally[str] = Tally()
    timed: set[str] = set()
    for r in rewards:
        per_version[r.reward_version] += 1
        if r.revision == 0 and r.trajectory_id not in timed:
            timed.add(r.trajectory_id)
            EVENT_TO_REWARD.observe(max(0.0, (now_ms - r.last_event_ts) / 1000))
    for version, n in per_version.items():
        REWARDS.labels(reward_version=version).inc(n)


def observe_trajectories(summaries: Iterable[Any]) -> None:
    """Closed trajectories (:class:`schemas.records.TrajectorySummary`; re-closes by late events not counted
    again): per policy version, the counts the behaviour view's rates are made of."""
    closed, calls, broken, edited, clarified, dissatisfied = 0, 0, 0, 0, 0, 0
    for t in summaries:  # summed first: one counter call per figure a batch (the flow's hot path)
        if t.revision:
            continue
        closed += 1
        calls += t.tool_calls
        broken += t.broken_tool_calls
        edited += t.edits_proposed > 0
        clarified += t.clarifying_questions > 0
        dissatisfied += t.dissatisfied_followups > 0
    if not closed:
        return
    TRAJECTORIES.inc(closed)
    for what, n in zip(BEHAVIOUR_COUNTS, (calls, broken, edited, clarified, dissatisfied), strict=True):
        if n:
            BEHAVIOUR.labels(what=what).inc(n)


def observe_step(step: Any) -> None:
    """A :class:`schemas.records.TrainStep`'s figures as the trainer gauges."""
    a = step.adapter
    TRAINER_STEPS.labels(adapter=a).inc()
    TRAINER_TOKENS_PER_S.labels(adapter=a).set(step.tokens_per_s)
    TRAINER_LOSS.labels(adapter=a).set(step.loss)
    TRAINER_KL.labels(adapter=a).set(step.kl)
    TRAINER_GRAD_NORM.labels(adapter=a).set(step.grad_norm)
    TRAINER_MISMATCH.labels(adapter=a).set(step.mismatch_k3)
    TRAINER_MISMATCH_MAX.labels(adapter=a).set(step.mismatch_max_abs_log_ratio)
    TRAINER_ON_POLICY.labels(adapter=a).set(step.on_policy_fraction)
    TRAINER_LAST_STEP.labels(adapter=a).set(step.at / 1000)


def observe_lags(lags: Mapping[str, int], dropped: Mapping[str, int] | None = None) -> None:
    """Samples packed per policy lag (``{"0": 12, "1": 3}``), and those dropped as too stale."""
    for counter, counts in ((BATCH_SAMPLES, lags), (BATCH_DROPPED, dropped or {})):
        for lag, n in counts.items():
            if n:
                counter.labels(lag=lag).inc(n)


def observe_decision(status: str, org: str, version: int, part: str) -> None:
    """A decision announced or seen on ``rtrl.deployments``: counted (:data:`DECISIONS` only), and a promotion of
    the shared policy is the serving version ``part`` reports."""
    if status in DECISIONS:
        GATE_DECISIONS.labels(status=status, org=org).inc()
    if status == "promoted" and not org:
        SERVING_VERSION.labels(part=part).set(version)


class Endpoint:
    """A running metrics endpoint (:func:`serve`): its address, and the readiness it reports."""

    def __init__(self, server: ThreadingHTTPServer | None):
        self.server = server
        self._ready = threading.Event()

    @property
    def port(self) -> int:
        return self.server.server_address[1] if self.server is not None else 0

    def ready(self, ready: bool = True) -> None:
        """Say whether the part is ready (``/readyz`` 200) or not (503)."""
        if ready:
            self._ready.set()
        else:
            self._ready.clear()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def serve(port: int, host: str = "127.0.0.1", part: str = "") -> Endpoint:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` from a daemon thread (port 0: an endpoint
    that serves nothing). ``part`` names the part in the log line and in ``rtrl_part_info``."""
    if port == 0:
        return Endpoint(None)
    endpoint: Endpoint

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n")
            elif path == "/readyz":
                ok = endpoint.is_ready
                self._send(200 if ok else 503, b"ready\n" if ok else b"starting\n")
            else:
                self._send(404, b"not found: /metrics, /healthz, /readyz\n")

        def _send(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise ConfigError(
            f"metrics.port {port} on {host} cannot be served ({e.strerror}); fix: set metrics.port "
            "(RTRL_METRICS__PORT) to a free port, or 0 for no metrics endpoint"
        ) from None
    server.daemon_threads = True
    PART.info({"part": part or "rtrl"})
    endpoint = Endpoint(server)
    threading.Thread(target=server.serve_forever, name="rtrl-metrics", daemon=True).start()
    log.info("%s metrics on http://%s:%d/metrics", part or "rtrl", host, endpoint.port)
    return endpoint


def serve_part(settings: Settings, part: str, rank: int = 0) -> Endpoint:
    """:func:`serve` on ``metrics.port`` (+ ``rank``, for several processes of one part on a host) and
    ``metrics.host``; an endpoint that serves nothing when ``metrics.port`` is 0."""
    m = settings.metrics
    return serve(m.port + rank if m.port else 0, m.host, part)
