-- Reward versions as data (issue 15): every version a flow, backfill or trainer uses is registered here with the
-- checksum of its weights. The newest registration of a name wins; a name that has scored anything is never
-- registered again with other weights (rewards.versions refuses it).
CREATE TABLE IF NOT EXISTS {db}.reward_versions
(
    name LowCardinality(String),
    checksum String,
    weights String,
    parent String,
    reason String,
    author String,
    builtin Bool,
    registered_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(registered_at)
ORDER BY name;
