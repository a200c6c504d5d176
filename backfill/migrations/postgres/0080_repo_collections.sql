-- Which accounts have records in which collection (com.atproto.sync.listReposByCollection).
-- One row per (collection, did) with at least one record; written by the sequencer in its batch
-- transaction (backfill.collections), rebuilt from whole repositories by resyncs and Spark jobs.
-- Keyed collection first: a listing is one index range scan in did order.

CREATE TABLE IF NOT EXISTS repo_collections (
    collection text   NOT NULL,
    did        text   NOT NULL,
    records    bigint NOT NULL,
    PRIMARY KEY (collection, did)
);
CREATE INDEX IF NOT EXISTS repo_collections_did_idx ON repo_collections (did);
