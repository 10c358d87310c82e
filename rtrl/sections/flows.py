"""The flows' sections: the reward flow's windows, the batch flow, the Beam backfill."""

from __future__ import annotations

from pydantic import Field

from rtrl.section import Section, setting


class TaskKindSettings(Section):
    """Window rules of one task kind (``flow.task_kinds.NAME``); unset times fall back to the flow's."""

    deadline_s: float | None = setting(
        None, "event time from the first event to a forced close; unset = flow.deadline_s", gt=0
    )
    allowed_lateness_s: float | None = setting(
        None, "how long after its deadline a late event still revises the reward; unset = flow.allowed_lateness_s", ge=0
    )
    awaits_verdict: bool = setting(
        False,
        "the kind ends with the user's verdict (task_verdict): its reward stays provisional until the verdict "
        "arrives, and the revision carrying it is final",
    )


def _default_task_kinds() -> dict[str, TaskKindSettings]:
    # background tasks run for hours and are judged as a whole, hours or days after they end
    return {"background": TaskKindSettings(deadline_s=86_400.0, allowed_lateness_s=7 * 86_400.0, awaits_verdict=True)}


class FlowSettings(Section):
    """The reward flow's windows; the sinks and snapshots of both flows."""

    deadline_s: float = setting(3600.0, "event time from a trajectory's first event to a forced close", gt=0)
    grace_s: float = setting(10.0, "event time to wait after a trajectory ends for overtaken events", ge=0)
    allowed_lateness_s: float = setting(
        86400.0, "how long after its deadline a late event still revises a reward", ge=0
    )
    max_clock_skew_s: float = setting(
        600.0,
        "events further ahead of their Kafka record's timestamp (the broker's or producer's clock) are rejected; "
        "one within it cannot move the partition's clock past that timestamp",
        gt=0,
    )
    max_future_s: float = setting(
        86400.0,
        "for input without record timestamps: events further ahead of the partition watermark are rejected",
        gt=0,
    )
    task_kinds: dict[str, TaskKindSettings] = Field(
        default_factory=_default_task_kinds,
        description="window rules per task kind [flow.task_kinds.NAME] (deadline, allowed lateness, whether a "
        "verdict ends it), from minutes to days; kinds not listed use the flow's",
    )
    batch_rows: int = setting(20_000, "rows buffered per ClickHouse table / archive before a write (both flows)", gt=0)
    batch_seconds: float = setting(1.0, "longest a row waits in a sink buffer before a write (both flows)", gt=0)
    archive_dir: str = setting("", "Parquet archive of raw events; empty = <data_dir>/archive/events")
    recovery_dir: str = setting("", "Bytewax recovery folder; empty = <data_dir>/recovery/rewards")
    state_memory_mb: float = setting(
        0.0,
        "memory (MB, estimated) the reward flow's windows may use per Kafka partition; beyond it the least recently "
        "touched open, closed and expired windows move to a SQLite file per partition in state_dir and come back "
        "when an event needs them (same results); 0 = no limit, all in memory (the default: set it, e.g. 512, for "
        "hours-long tasks with many open windows)",
        ge=0,
    )
    state_dir: str = setting(
        "",
        "folder of the reward flow's spilled window state (state_memory_mb); empty = <data_dir>/state/rewards. "
        "Recovery snapshots refer to it: keep it on the recovery folder's volume and move, back up or delete both "
        "together",
    )
    snapshot_s: float = setting(
        2.0, "Bytewax snapshot (epoch) interval of both flows: the most work replayed after a crash", gt=0
    )
    tail: bool = setting(True, "keep waiting for new events at the end of the topic (false = stop at the end)")


class BackfillSettings(Section):
    """``rtrl backfill``: a reward version over the Parquet archive with Apache Beam (flows.backfill)."""

    workers: int = setting(2, "worker processes of the local FnApiRunner (1 = in the calling process)", ge=1, le=64)
    out_dir: str = setting(
        "", "where the backfill writes its Parquet rewards and dead letters; empty = <data_dir>/backfill"
    )
    pipeline_options: str = setting(
        "",
        "file of Beam pipeline options (--runner=FlinkRunner ..., one or more per line, # comments): another "
        "runner than the local FnApiRunner; examples in deploy/beam/",
    )


class BatchingSettings(Section):
    """The batch flow: join, staleness, advantages, packing."""

    join_wait_s: float = setting(60.0, "how long a rollout waits for its reward, and a reward for its rollout", ge=0)
    group_wait_s: float = setting(10.0, "how long a group waits for all its samples before it is used as it is", ge=0)
    seq_len: int = setting(128, "tokens per packed row; longer samples are dropped and counted", gt=0)
    rows: int = setting(8, "rows per micro-batch (token budget = rows x seq_len)", gt=0)
    flush_s: float = setting(2.0, "longest a sample waits for a full micro-batch before a partial one is sent", ge=0)
    idle_flush_s: float = setting(2.0, "wall-clock quiet time after which a cohort's clock moves on by itself", gt=0)
    baseline_alpha: float = setting(
        0.2, "step of the per-cohort running reward mean used for groups of one", gt=0, le=1
    )
    recovery_dir: str = setting("", "Bytewax recovery folder; empty = <data_dir>/recovery/batches")
    tail: bool = setting(True, "keep waiting at the end of the topics (false = stop at the end)")
