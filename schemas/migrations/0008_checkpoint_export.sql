-- Promoted checkpoints go where the fleet can load them (issue 13): each decision names the version's Hugging Face
-- export in the model registry and its content hash (empty when there is none).
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS export_path String AFTER path;
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS export_sha256 String AFTER export_path;
