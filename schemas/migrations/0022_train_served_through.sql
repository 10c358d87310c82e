-- adapters.shared_traffic = "served" (issue 17): a shared-policy step records how many of its trained tokens went
-- through the frozen adapter version that served them, so an analyst sees the base learn through each org's
-- adapter. Rows written before this migration hold 0.
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS served_through_tokens UInt64 DEFAULT 0 AFTER adapter;
