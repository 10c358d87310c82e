-- Secret screening (issue 38, client/screening.py): the SDK keeps back a rollout whose decoded prompt or completion
-- holds a secret, and records a secret_found event that says which detector matched and where, never the secret.
-- secret_findings is what the analyst reads of them: no user hash, no token.
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS detector LowCardinality(Nullable(String));
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS location LowCardinality(Nullable(String));
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS char_offset Nullable(UInt32);

CREATE VIEW IF NOT EXISTS {db}.secret_findings AS
SELECT ts, trajectory_id, org_id, policy_version, detector, location, char_offset
FROM {db}.events
WHERE type = 'secret_found';
