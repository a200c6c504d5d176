-- listReposByCollection without a per-row account lookup: repo_collections.active mirrors
-- "the account's upstream and local status are both 'active'", kept by the triggers below (no
-- code writes it), so a page is one range scan of the primary key (a WITHOUT ROWID table: the
-- rows live in it, `active` included) with no account lookup per row; a partial index would not
-- be chosen over it by SQLite's planner, so there is none.
-- See the PostgreSQL twin of this migration for the figures. The owner of the status stays
-- `accounts`; the column is derived data, like an index:
-- * a row inserted into repo_collections takes its account's current status (an account not
--   known yet counts as active, as every new account is);
-- * a change of either status column of an account (insert or update, upserts included) is
--   copied to all of its rows.

ALTER TABLE repo_collections ADD COLUMN active INTEGER NOT NULL DEFAULT 1;

UPDATE repo_collections SET active = 0
WHERE did IN (SELECT did FROM accounts WHERE NOT (upstream_status = 'active' AND local_status = 'active'));

CREATE TRIGGER repo_collections_status AFTER INSERT ON repo_collections
BEGIN
    UPDATE repo_collections SET active = 0
    WHERE collection = NEW.collection AND did = NEW.did
      AND EXISTS (SELECT 1 FROM accounts a WHERE a.did = NEW.did
                  AND NOT (a.upstream_status = 'active' AND a.local_status = 'active'));
END;

CREATE TRIGGER accounts_status_insert AFTER INSERT ON accounts
WHEN NEW.upstream_status <> 'active' OR NEW.local_status <> 'active'
BEGIN
    UPDATE repo_collections SET active = 0 WHERE did = NEW.did AND active;
END;

CREATE TRIGGER accounts_status_update AFTER UPDATE OF upstream_status, local_status ON accounts
WHEN OLD.upstream_status IS NOT NEW.upstream_status OR OLD.local_status IS NOT NEW.local_status
BEGIN
    UPDATE repo_collections SET active = (NEW.upstream_status = 'active' AND NEW.local_status = 'active')
    WHERE did = NEW.did;
END;
