"""Kafka topics of rtrl: names, keys, partitions and retention (created idempotently by rtrl.kafka)."""

from __future__ import annotations

from dataclasses import dataclass

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """One topic. ``partitions=None`` means the ``kafka.partitions`` setting."""

    name: str
    record: str
    key: str
    retention_ms: int
    partitions: int | None = None
    cleanup_policy: str = "delete"
    encoding: str = "json"
    #: whose clock stamps a record: "CreateTime" (the producer's) or "LogAppendTime" (the broker's)
    timestamp_type: str = "CreateTime"

    def configs(self) -> dict[str, str]:
        return {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": self.cleanup_policy,
            "message.timestamp.type": self.timestamp_type,
        }


TOPICS: tuple[TopicSpec, ...] = (
    # The broker stamps each event's record: the reward flow bounds event time by that clock, which no producer
    # can forge (flows.windowing).
    TopicSpec("events", "Event", "trajectory_id", 7 * DAY_MS, timestamp_type="LogAppendTime"),
    TopicSpec("rollouts", "Rollout", "trajectory_id", 7 * DAY_MS),
    TopicSpec("rewards", "Reward", "trajectory_id", 30 * DAY_MS),
    TopicSpec("batches", "MicroBatch", "batch_id", 1 * DAY_MS, encoding="arrow-ipc"),
    # Per-org adapters (issue 17): the micro-batches of orgs past adapters.min_samples, each for the adapter of its
    # org (MicroBatch.adapter); keyed by org, so one org's batches stay in order on one partition.
    TopicSpec("adapter-batches", "MicroBatch", "adapter", 1 * DAY_MS, encoding="arrow-ipc"),
    # One partition: promotions and rollbacks must be read in order.
    TopicSpec("deployments", "Checkpoint", "version", -1, partitions=1),
    # Live A/Bs outside the deployment protocol (the main job's final A/B); one partition, in order.
    TopicSpec("experiments", "Experiment", "key", -1, partitions=1),
    TopicSpec("dead_letters", "DeadLetter", "source", 30 * DAY_MS, partitions=1),
)
