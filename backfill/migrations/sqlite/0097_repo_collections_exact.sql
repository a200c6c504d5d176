-- Accounts whose repo_collections counts are exact: installed from a walk of the whole verified
-- repository (a resync's #sync, a Spark resync/export/reconcile rebuild) and kept by every op
-- sequenced since. The counts of any other account are lower bounds (records older than the relay
-- were never seen), so a delete never removes such an account's collection (backfill.collections).

CREATE TABLE IF NOT EXISTS repo_collections_exact (
    did TEXT NOT NULL PRIMARY KEY
) WITHOUT ROWID;
