"""A minimal rtrl SDK integration in a coding agent's product backend.

The backend below is what a real one does around each user request: it calls the model, runs the tool
calls the model asks for, shows edits, and later learns whether the user kept them. Each of those moments
is one line of SDK code, and nothing in the request path waits on Kafka: ``record()`` validates the event
and appends it to a bounded queue that one background thread produces (an idempotent producer keyed by
``trajectory_id``). User ids are hashed with the keyed ``sdk.salt`` before they leave the process.

Run it against a broker (``rtrl broker up`` starts a local one and prints its address)::

    export RTRL_KAFKA__BOOTSTRAP=$(rtrl broker up)
    python examples/sdk_integration.py --sessions 3

Outside local mode (a broker that is not on loopback) set ``RTRL_SDK__SALT`` to your own secret: rtrl
refuses the public default there. The reward flow (``rtrl flow rewards``) turns these events into rewards.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

from client import RtrlClient, Trajectory
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.kafka import check_broker, connection
from rtrl.settings import load_settings


@dataclass
class ModelReply:
    """What the (here: pretend) coding model returned for one request."""

    tool_calls: list[tuple[str, bool]]  # (tool, whether the call was well-formed)
    edit_lines: int  # 0 = no edit proposed
    asks_question: bool
    ttft_ms: float
    total_ms: float


def pretend_model(prompt: str, rng: random.Random) -> ModelReply:
    """Stands in for your inference call (an HTTP request to your serving fleet)."""
    return ModelReply(
        tool_calls=[("read_file", True), ("grep", rng.random() > 0.1)],
        edit_lines=rng.randint(1, 40) if rng.random() > 0.2 else 0,
        asks_question=rng.random() < 0.15,
        ttft_ms=rng.uniform(150, 600),
        total_ms=rng.uniform(800, 4000),
    )


@dataclass
class AgentBackend:
    """The product backend: one ``Trajectory`` per user session, events recorded where they happen."""

    rtrl: RtrlClient
    policy_version: int  # the model version serving this request (your deployment knows it)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    sessions: dict[str, Trajectory] = field(default_factory=dict)
    pending_edits: list[tuple[Trajectory, str]] = field(default_factory=list)

    def start_session(self, org_id: str, user_id: str, task_kind: str) -> str:
        t = self.rtrl.start_trajectory(
            org_id=org_id, user_id=user_id, task_kind=task_kind, policy_version=self.policy_version
        )
        self.sessions[t.trajectory_id] = t
        return t.trajectory_id

    def handle_request(self, session: str, prompt: str) -> None:
        t = self.sessions[session]
        reply = pretend_model(prompt, self.rng)
        for tool, valid in reply.tool_calls:  # broken calls are recorded too: the reward penalises them
            t.tool_call(tool, valid=valid, error=None if valid else "arguments did not parse")
        if reply.asks_question:
            t.clarifying_question()
        if reply.edit_lines:
            edit = t.edit_proposed(lines=reply.edit_lines)
            (t.edit_accepted if self.rng.random() > 0.25 else t.edit_rejected)(edit)
            self.pending_edits.append((t, edit))
        t.latency(ttft_ms=reply.ttft_ms, total_ms=reply.total_ms)

    def user_follows_up(self, session: str, unhappy: bool) -> None:
        self.sessions[session].followup("dissatisfied" if unhappy else "satisfied")

    def end_session(self, session: str) -> None:
        self.sessions.pop(session).end("completed")

    def check_persistence(self) -> None:
        """A periodic job: how much of each shown edit is still in the user's code (git blame, file hashes)."""
        for t, edit in self.pending_edits:
            t.edit_persisted(edit, fraction=round(self.rng.uniform(0, 1), 2), checked_after_s=600)
        self.pending_edits.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3, help="user sessions to play through the backend")
    ap.add_argument("--policy-version", type=int, default=0, help="the serving model version to record")
    args = ap.parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not settings.kafka.bootstrap:
        print(
            "error: set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP), e.g. the address `rtrl broker up` prints",
            file=sys.stderr,
        )
        return 2
    try:  # a wrong address is one line now, not undelivered events and librdkafka's retries later
        check_broker(connection(settings.kafka), settings.kafka.timeout_s)  # with the cluster's TLS/SASL
    except (ServiceUnavailable, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with RtrlClient.from_settings(settings) as rtrl:
        backend = AgentBackend(rtrl, policy_version=args.policy_version)
        for i in range(args.sessions):
            s = backend.start_session(org_id=f"org-{i % 2}", user_id=f"user-{i}", task_kind="bugfix")
            backend.handle_request(s, "fix the failing test")
            backend.user_follows_up(s, unhappy=i % 3 == 0)
            backend.end_session(s)
        time.sleep(0.01)
        backend.check_persistence()
        stats = rtrl.close()  # flushes: waits for the broker's acknowledgements
    print(
        f"recorded {stats.accepted} events for {args.sessions} sessions: delivered {stats.delivered}, "
        f"failed {stats.failed}, dropped {stats.dropped}"
    )
    return 0 if stats.delivered == stats.accepted and not stats.dropped else 1


if __name__ == "__main__":
    sys.exit(main())
