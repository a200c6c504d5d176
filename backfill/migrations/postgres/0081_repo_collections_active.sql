-- listReposByCollection without a per-row account lookup: repo_collections.active mirrors
-- "the account's upstream and local status are both 'active'", kept by the triggers below (no
-- code writes it), and a partial index over the active rows makes a page one index-only range
-- scan. Measured at 100,000 accounts (bench/repos_by_collection.py, generic plan): p99 of a
-- 2,000-row page 9.4 ms with the correlated status lookup per row, 2.3 ms from this index.
--
-- Owner of the status stays `accounts`; the column is derived data, like an index:
-- * a row inserted into repo_collections takes its account's current status (an account not
--   known yet counts as active, as every new account is);
-- * a change of either status column of an account (insert or update) is copied to all of its
--   rows (a handful per account; status changes are rare).
-- The functions keep the migration's search_path (the relay's schema), so a session with another
-- search_path (an operator's psql, a bulk COPY) that writes these tables still reaches the right ones.

ALTER TABLE repo_collections ADD COLUMN IF NOT EXISTS active boolean NOT NULL DEFAULT true;

UPDATE repo_collections r SET active = false
FROM accounts a
WHERE a.did = r.did AND NOT (a.upstream_status = 'active' AND a.local_status = 'active');

CREATE INDEX IF NOT EXISTS repo_collections_active_idx ON repo_collections (collection, did) WHERE active;

CREATE OR REPLACE FUNCTION repo_collections_take_status() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    NEW.active := COALESCE(
        (SELECT a.upstream_status = 'active' AND a.local_status = 'active' FROM accounts a WHERE a.did = NEW.did),
        true);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE FUNCTION accounts_copy_status_to_collections() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    UPDATE repo_collections SET active = (NEW.upstream_status = 'active' AND NEW.local_status = 'active')
    WHERE did = NEW.did AND active IS DISTINCT FROM (NEW.upstream_status = 'active' AND NEW.local_status = 'active');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS repo_collections_status ON repo_collections;
CREATE TRIGGER repo_collections_status BEFORE INSERT OR UPDATE OF did ON repo_collections
    FOR EACH ROW EXECUTE FUNCTION repo_collections_take_status();

DROP TRIGGER IF EXISTS accounts_status_insert ON accounts;
CREATE TRIGGER accounts_status_insert AFTER INSERT ON accounts
    FOR EACH ROW WHEN (NEW.upstream_status <> 'active' OR NEW.local_status <> 'active')
    EXECUTE FUNCTION accounts_copy_status_to_collections();

DROP TRIGGER IF EXISTS accounts_status_update ON accounts;
CREATE TRIGGER accounts_status_update AFTER UPDATE OF upstream_status, local_status ON accounts
    FOR EACH ROW WHEN (OLD.upstream_status IS DISTINCT FROM NEW.upstream_status
                       OR OLD.local_status IS DISTINCT FROM NEW.local_status)
    EXECUTE FUNCTION accounts_copy_status_to_collections();
