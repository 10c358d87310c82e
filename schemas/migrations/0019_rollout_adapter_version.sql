-- Per-organisation LoRA adapters (issue 17): a rollout records which adapter version of its org answered (0 = the
-- shared policy alone), so the trainers know the real behaviour policy of each sample. Rows written before this
-- migration hold 0.
ALTER TABLE {db}.rollouts ADD COLUMN IF NOT EXISTS adapter_version Int64 DEFAULT 0 AFTER created_at;
