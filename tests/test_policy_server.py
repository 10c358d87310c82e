"""The policy server on the real broker: it follows rtrl.deployments (newest promotion wins, a rejected
or rolled-back version is never served), publishes one rollout per sample, and throttles itself to
about one cycle's samples per decision (backpressure), starting a new quota at each decision."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer
from prometheus_client import REGISTRY

from app.deployments import end_running_experiments
from app.loop_config import SEQ_LEN
from client.sdk import RtrlClient
from rtrl.kafka import producer_config, read_topic
from rtrl.sections.trainer import ModelSettings
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, event_codec
from schemas.records import Checkpoint, Experiment, Rollout
from simulator.serve import PolicyServer
from simulator.tasks import VOCAB
from trainer.model import build_model, init_parallel


def _announce(bootstrap: str, topic: str, version: int, status: str, parent: int | None = None) -> None:
    ck = Checkpoint(
        version=version,
        parent=parent,
        created_at=time.time_ns() // 1_000_000,
        steps=0,
        samples=0,
        tokens=0,
        eval_results={},
        status=status,
        reason="test",
        kafka_offsets={},
        path=f"/ckpt/v{version}",
    )
    p = Producer(producer_config(bootstrap))
    p.produce(topic, key=str(version).encode(), value=JsonCodec(Checkpoint).encode(ck))
    assert p.flush(10) == 0


def _refresh(server: PolicyServer, load) -> int | None:
    for _ in range(20):  # until the announcements just produced have been read
        server.refresh(load, timeout_s=0.2)
    return server.version


@pytest.mark.slow
def test_follows_deployments_and_serves_a_quota_per_decision(broker, topic_prefix):
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=SEQ_LEN)
    init_parallel(cfg)
    loads: list[str] = []

    def load(model, path):  # the weights themselves are tested elsewhere (tests/test_tasks_policy.py)
        loads.append(path)

    deployments = topic_prefix + "deployments"

    def decisions(status: str) -> float:  # rtrl_gate_decisions_total as this process's metrics hold it
        return REGISTRY.get_sample_value("rtrl_gate_decisions_total", {"status": status, "org": ""}) or 0.0

    before = {s: decisions(s) for s in ("promoted", "rejected", "rolled_back")}
    with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
        server = PolicyServer(broker.bootstrap, topic_prefix, client, build_model(cfg), ["org-0", "org-1"], seed=3)
        _announce(broker.bootstrap, deployments, 0, "promoted")
        assert _refresh(server, load) == 0 and loads == ["/ckpt/v0"]
        quota = 24
        while server.may_serve(quota):
            server.serve(2, group_size=4)
        assert server.served_by(0) == quota  # 3 rounds of 2 tasks x 4 samples, then throttled
        assert not server.may_serve(quota)

        _announce(broker.bootstrap, deployments, 1, "candidate", parent=0)
        assert _refresh(server, load) == 0 and not server.may_serve(quota)  # a candidate is no decision
        _announce(broker.bootstrap, deployments, 1, "rejected", parent=0)
        assert _refresh(server, load) == 0 and loads == ["/ckpt/v0"]  # rejected: never served
        assert server.may_serve(quota)  # a decision: the same version serves another cycle's worth

        _announce(broker.bootstrap, deployments, 2, "promoted", parent=0)
        _announce(broker.bootstrap, deployments, 2, "rolled_back", parent=0)
        _announce(broker.bootstrap, deployments, 0, "promoted")  # the rollback re-promotes v0
        assert _refresh(server, load) == 0 and loads[-1] == "/ckpt/v0"
        server.close()
    # the metrics: every decision it saw counted once (a candidate is none), and the version it serves now
    seen = {s: decisions(s) - n for s, n in before.items()}
    assert seen == {"promoted": 3, "rejected": 1, "rolled_back": 1}
    assert REGISTRY.get_sample_value("rtrl_serving_version", {"part": "serve"}) == 0

    rollouts = [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]
    assert len(rollouts) == quota and {r.policy_version for r in rollouts} == {0}
    groups = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    assert all(
        len(g) == 4 and len({(r.org_id, r.task_kind, tuple(r.prompt_ids)) for r in g}) == 1 for g in groups.values()
    )


def _experiment(bootstrap: str, topic: str, status: str, serving: int, key: str = "final-ab-test") -> Experiment:
    exp = Experiment(
        key=key,
        status=status,
        created_at=time.time_ns() // 1_000_000,
        share=0.5,
        serving_version=serving,
        serving_arm="ab-final",
        candidate_version=0,
        candidate_path="/ckpt/v0",
        candidate_arm="ab-v0",
    )
    p = Producer(producer_config(bootstrap))
    p.produce(topic, key=exp.key.encode(), value=JsonCodec(Experiment).encode(exp))
    assert p.flush(10) == 0
    return exp


@pytest.mark.slow
def test_serves_an_experiment_announced_on_rtrl_experiments(broker, topic_prefix):
    """The main job's final A/B reaches a policy server in its own process as an announcement on
    rtrl.experiments: it starts once the experiment's serving version is the one loaded (the promotion may be
    read after the experiment), loads the candidate version into the candidate model, splits the users by the
    experiment's key under the experiment's arm labels (no quota meanwhile), and ends with the ``ended``
    announcement. A server restarted mid-experiment resumes it; one without a candidate model serves the
    promoted version only; an A/B candidate announced meanwhile waits for the experiment's end instead of
    overwriting its weights; one left running for another version is not served, and the main job's
    ``end_running_experiments`` ends whatever an earlier run left running."""
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=SEQ_LEN)
    init_parallel(cfg)
    loads: list[tuple[str, str]] = []
    deployments, experiments = topic_prefix + "deployments", topic_prefix + "experiments"
    with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
        policy, candidate = build_model(cfg), build_model(cfg)

        def load(model, path):
            loads.append(("candidate" if model is candidate else "policy", path))

        def server_(**kw) -> PolicyServer:
            return PolicyServer(broker.bootstrap, topic_prefix, client, policy, ["org-0", "org-1"], seed=5, **kw)

        server = server_(candidate_model=candidate)
        _announce(broker.bootstrap, deployments, 0, "promoted")
        _announce(broker.bootstrap, deployments, 1, "promoted", parent=0)
        exp = _experiment(broker.bootstrap, experiments, "running", serving=2)
        assert _refresh(server, load) == 1 and server.experiment is None  # v2 not loaded yet: not started
        _announce(broker.bootstrap, deployments, 2, "promoted", parent=1)
        assert _refresh(server, load) == 2 and server.experiment == exp
        assert loads[-1] == ("candidate", "/ckpt/v0") and ("policy", "/ckpt/v2") in loads
        assert server.may_serve(0)  # no quota while it runs
        for _ in range(6):
            for served in server.serve(8, group_size=2).values():
                assert served.trajectories > 0
        assert {key: t.trajectories > 0 for key, t in server.totals.items()} == {
            (0, "ab-v0"): True,
            (2, "ab-final"): True,
        }
        client.flush()

        restarted = server_(candidate_model=candidate)  # reads both topics from the start: resumes it
        assert _refresh(restarted, load) == 2 and restarted.experiment == exp
        restarted.close()
        plain = server_()  # no candidate model: cannot serve two versions, serves the promoted one
        assert _refresh(plain, load) == 2 and plain.experiment is None
        assert set(plain.serve(4, group_size=2)) == {"control"}
        plain.close()

        _announce(broker.bootstrap, deployments, 3, "candidate", parent=2)
        _experiment(broker.bootstrap, experiments, "running", serving=1, key="left-over")  # for v1: not served
        assert _refresh(server, load) == 2 and server.experiment == exp and server.candidate == (3, "rtrl-candidate")
        assert ("candidate", "/ckpt/v3") not in loads  # the experiment's v0 stays in the candidate model

        producer = Producer(producer_config(broker.bootstrap))
        assert sorted(end_running_experiments(settings, broker.bootstrap, producer)) == ["final-ab-test", "left-over"]
        assert _refresh(server, load) == 2 and server.experiment is None
        assert loads[-1] == ("candidate", "/ckpt/v3")  # ended: the waiting A/B candidate gets the model
        assert set(server.serve(4, group_size=2)) == {"control"}
        assert end_running_experiments(settings, broker.bootstrap, producer) == []  # nothing left running
        server.close()

    rollouts = [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]
    assert {r.policy_version for r in rollouts} == {0, 2}
    users: dict[str, set[str]] = {}
    for m in read_topic(broker.bootstrap, topic_prefix + "events"):
        e = event_codec().decode(m.value())
        users.setdefault(e.arm, set()).add(e.user_hash)
    assert users["ab-v0"] and users["ab-final"] and not users["ab-v0"] & users["ab-final"]  # a user sees one arm
    assert users["control"]
