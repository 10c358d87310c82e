-- Numerically safe training (issue 11): the pre-clip gradient norm, how often the loss guards bound, and the
-- training-inference mismatch on on-policy tokens, per step.
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS grad_norm Float64 AFTER sample_ids;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS dual_clip_fraction Float64 AFTER grad_norm;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS seq_guarded_tokens UInt64 AFTER dual_clip_fraction;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS mismatch_k3 Float64 AFTER seq_guarded_tokens;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS mismatch_max_abs_log_ratio Float64 AFTER mismatch_k3;
