-- Erasure (issue 38, app/erasure.py): `rtrl erase` appends one row per run to erasures, an audit log that the
-- writer role may insert into but never alter (deploy/clickhouse/security.sql). Every subject in it is on the deny
-- list that the flows and the trainer honour. erased_trajectories names the subject's trajectories, for the
-- consumers whose records carry no user: rewards, rollouts and micro-batches.
CREATE TABLE IF NOT EXISTS {db}.erasures
(
    erasure_id LowCardinality(String),
    subject_kind LowCardinality(String),
    subject LowCardinality(String),
    status LowCardinality(String),
    counts Map(LowCardinality(String), UInt64),
    lineage Array(LowCardinality(String)),
    at DateTime64(3, 'UTC')
)
ENGINE = MergeTree
ORDER BY (erasure_id, at);

CREATE TABLE IF NOT EXISTS {db}.erased_trajectories
(
    erasure_id LowCardinality(String),
    trajectory_id String
)
ENGINE = ReplacingMergeTree
ORDER BY (erasure_id, trajectory_id);
