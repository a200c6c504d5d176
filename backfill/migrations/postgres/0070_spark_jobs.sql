-- Spark batch jobs (spark/): job runs, per-repository results, and the repair outbox that the
-- running relay drains to emit #sync / #account events through its sequencer.

CREATE TABLE IF NOT EXISTS spark_job_runs (
    run_id      TEXT PRIMARY KEY,
    job         TEXT NOT NULL,              -- resync | reconcile | export
    params      TEXT NOT NULL DEFAULT '{}', -- JSON
    summary     TEXT,                       -- JSON, written when the run finishes
    started_at  DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION
);

CREATE TABLE IF NOT EXISTS spark_job_results (
    run_id      TEXT NOT NULL,
    job         TEXT NOT NULL,
    did         TEXT NOT NULL,
    host        TEXT,
    outcome     TEXT NOT NULL,   -- resync/export: ok | repaired | failed; reconcile: see spark/reconcile.py
    reason      TEXT,            -- snake_case label
    records     BIGINT NOT NULL DEFAULT 0,
    bytes       BIGINT NOT NULL DEFAULT 0,
    rev         TEXT,
    finished_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, did)
);
CREATE INDEX IF NOT EXISTS spark_job_results_outcome ON spark_job_results (run_id, outcome);

CREATE TABLE IF NOT EXISTS spark_repair_outbox (
    id          BIGSERIAL PRIMARY KEY,
    dedupe_key  TEXT NOT NULL UNIQUE,   -- kind|did|rev-or-status: reruns insert nothing new
    kind        TEXT NOT NULL,          -- '#sync' | '#account'
    did         TEXT NOT NULL,
    host        TEXT,
    rev         TEXT,                   -- #sync
    commit_cid  TEXT,                   -- #sync
    data_cid    TEXT,                   -- #sync
    blocks      BYTEA,                  -- #sync: CAR holding only the signed commit block
    active      BOOLEAN,                -- #account
    status      TEXT,                   -- #account (NULL when active)
    run_id      TEXT,
    created_at  DOUBLE PRECISION NOT NULL,
    consumed_at DOUBLE PRECISION,
    seq         BIGINT                  -- relay seq assigned when consumed
);
CREATE INDEX IF NOT EXISTS spark_repair_outbox_pending ON spark_repair_outbox (id) WHERE consumed_at IS NULL;
