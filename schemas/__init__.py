"""Records of rtrl (single source of truth) and what is derived from them.

- ``schemas.records``: the typed records, a docstring on every field.
- ``schemas.types``: Arrow schemas, ClickHouse column types, Arrow <-> record conversion.
- ``schemas.codec``: Kafka payload codecs (JSON for events/rows, Arrow IPC for micro-batches).
- ``schemas.topics``: Kafka topic specs.
- ``schemas/migrations``: ClickHouse DDL, applied by ``rtrl.clickhouse.migrate``.
"""

from schemas.records import (  # noqa: F401
    EVENT_BY_TYPE,
    EVENT_TYPES,
    RECORDS,
    Checkpoint,
    ClarifyingQuestion,
    DeadLetter,
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    Event,
    EventBase,
    Followup,
    Latency,
    MicroBatch,
    Reward,
    Rollout,
    TaskCheckin,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
    event_type,
)
