-- Rollouts say how many completions their group has, so the batch flow knows when a group is complete.
ALTER TABLE {db}.rollouts ADD COLUMN IF NOT EXISTS group_size UInt32 DEFAULT 1 AFTER group_id;
