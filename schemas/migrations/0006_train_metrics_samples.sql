-- Each step lists the samples it trained, so ClickHouse can show that none was trained twice.
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS sample_ids Array(String) AFTER at;
