-- Per-organisation LoRA adapters (issue 17): a micro-batch records, per sample, the org adapter version that
-- sampled it (Rollout.adapter_version), so a trainer can compare against the real behaviour policy. Rows written
-- before this migration hold [] (every sample served by the shared policy alone).
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS adapter_versions Array(Int64) AFTER adapter;
