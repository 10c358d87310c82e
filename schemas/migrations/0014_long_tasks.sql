-- Long-loop feedback (issue 16): background tasks send interim check-ins and end with the user's verdict
-- on the whole outcome, hours or days later. Events gain the two new types' payload columns; a reward
-- records whether it is provisional (a long task still awaiting its verdict). Rows written before this
-- migration hold NULL / false.
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS progress Nullable(Float64) AFTER status;
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS verdict LowCardinality(Nullable(String)) AFTER progress;
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS verdict_after_s Nullable(Float64) AFTER verdict;
ALTER TABLE {db}.rewards ADD COLUMN IF NOT EXISTS provisional Bool DEFAULT false AFTER emitted_at;
