-- Spark repairs applied by the relay's single writer with a compare-and-set (backfill/outbox.py).
-- See migrations/postgres/0075_repair_cas.sql.
ALTER TABLE spark_repair_outbox ADD COLUMN base_rev TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN base_commit_cid TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN base_status TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN observed_at REAL;
ALTER TABLE spark_repair_outbox ADD COLUMN outcome TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN collections TEXT;
