-- Spark repairs applied by the relay's single writer with a compare-and-set (backfill/outbox.py).
-- The jobs no longer write `accounts`; each outbox row carries what the job saw (base_*) and when
-- it looked at the host (observed_at); the relay records what it did with the row (outcome).
-- New kinds besides '#sync' and '#account': 'desync' (head diverged: resync it) and 'add' (an
-- account the relay did not know).
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS base_rev TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS base_commit_cid TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS base_status TEXT;
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS observed_at DOUBLE PRECISION;
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS outcome TEXT;
-- #sync: the verified repository's record counts per collection (JSON), installed with it
ALTER TABLE spark_repair_outbox ADD COLUMN IF NOT EXISTS collections TEXT;
