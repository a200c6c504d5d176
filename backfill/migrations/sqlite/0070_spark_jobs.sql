-- Spark batch jobs (spark/): job runs, per-repository results, and the repair outbox that the
-- running relay drains to emit #sync / #account events through its sequencer.

CREATE TABLE IF NOT EXISTS spark_job_runs (
    run_id      TEXT PRIMARY KEY,
    job         TEXT NOT NULL,
    params      TEXT NOT NULL DEFAULT '{}',
    summary     TEXT,
    started_at  REAL NOT NULL,
    finished_at REAL
);

CREATE TABLE IF NOT EXISTS spark_job_results (
    run_id      TEXT NOT NULL,
    job         TEXT NOT NULL,
    did         TEXT NOT NULL,
    host        TEXT,
    outcome     TEXT NOT NULL,
    reason      TEXT,
    records     INTEGER NOT NULL DEFAULT 0,
    bytes       INTEGER NOT NULL DEFAULT 0,
    rev         TEXT,
    finished_at REAL NOT NULL,
    PRIMARY KEY (run_id, did)
);
CREATE INDEX IF NOT EXISTS spark_job_results_outcome ON spark_job_results (run_id, outcome);

CREATE TABLE IF NOT EXISTS spark_repair_outbox (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    dedupe_key  TEXT NOT NULL UNIQUE,
    kind        TEXT NOT NULL,
    did         TEXT NOT NULL,
    host        TEXT,
    rev         TEXT,
    commit_cid  TEXT,
    data_cid    TEXT,
    blocks      BLOB,
    active      INTEGER,
    status      TEXT,
    run_id      TEXT,
    created_at  REAL NOT NULL,
    consumed_at REAL,
    seq         INTEGER
);
CREATE INDEX IF NOT EXISTS spark_repair_outbox_pending ON spark_repair_outbox (id) WHERE consumed_at IS NULL;
