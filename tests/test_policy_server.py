"""The policy server on the real broker: it follows rtrl.deployments (newest promotion wins, a rejected
or rolled-back version is never served), publishes one rollout per sample, and throttles itself to
about one cycle's samples per decision (backpressure), starting a new quota at each decision."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from app.loop import SEQ_LEN
from client.sdk import RtrlClient
from rtrl.kafka import producer_config, read_topic
from rtrl.settings import load_settings
from schemas.codec import JsonCodec
from schemas.records import Checkpoint, Rollout
from simulator.serve import PolicyServer
from simulator.tasks import VOCAB
from trainer.config import ModelConfig
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


def test_follows_deployments_and_serves_a_quota_per_decision(broker, topic_prefix):
    settings = load_settings(env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix})
    cfg = ModelConfig.tiny(vocab_size=VOCAB, seq_length=SEQ_LEN)
    init_parallel(cfg)
    loads: list[str] = []

    def load(model, path):  # the weights themselves are tested elsewhere (tests/test_tasks_policy.py)
        loads.append(path)

    deployments = topic_prefix + "deployments"
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

    rollouts = [JsonCodec(Rollout).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rollouts")]
    assert len(rollouts) == quota and {r.policy_version for r in rollouts} == {0}
    groups = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    assert all(
        len(g) == 4 and len({(r.org_id, r.task_kind, tuple(r.prompt_ids)) for r in g}) == 1 for g in groups.values()
    )
