-- Which accounts have records in which collection (com.atproto.sync.listReposByCollection).
-- One row per (collection, did) with at least one record; written by the sequencer in its batch
-- transaction (backfill.collections), rebuilt from whole repositories by resyncs and Spark jobs.

CREATE TABLE IF NOT EXISTS repo_collections (
    collection TEXT    NOT NULL,
    did        TEXT    NOT NULL,
    records    INTEGER NOT NULL,
    PRIMARY KEY (collection, did)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS repo_collections_did_idx ON repo_collections (did);
