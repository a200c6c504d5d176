-- Durable backfill window (owner: backfill, numbers 0001-0049). SQLite dialect.
-- relay_meta holds the seq high-water mark: it survives deleting every event, so seq is never reused.

CREATE TABLE relay_meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO relay_meta (key, value) VALUES ('seq_high_water', 0), ('events_bytes', 0);

-- One row per sequenced event; frame is the complete wire frame (header + body with seq).
CREATE TABLE events (
    seq   INTEGER PRIMARY KEY CHECK (seq >= 1 AND seq < 9007199254740992),
    did   TEXT NOT NULL,
    kind  TEXT NOT NULL,
    time  REAL NOT NULL,
    frame BLOB NOT NULL
);

CREATE TABLE accounts (
    did             TEXT PRIMARY KEY,
    host            TEXT,
    upstream_status TEXT NOT NULL DEFAULT 'active',
    local_status    TEXT NOT NULL DEFAULT 'active',
    rev             TEXT,
    commit_cid      TEXT,
    data_cid        TEXT,
    sync_state      TEXT NOT NULL DEFAULT 'synced',
    updated_at      REAL NOT NULL DEFAULT 0
);
CREATE INDEX accounts_host_idx ON accounts (host, did);
CREATE INDEX accounts_sync_state_idx ON accounts (sync_state, did) WHERE sync_state <> 'synced';

CREATE TABLE hosts (
    hostname              TEXT PRIMARY KEY,
    status                TEXT NOT NULL DEFAULT 'active',
    upstream_cursor       INTEGER NOT NULL DEFAULT 0,
    account_limit         INTEGER,
    trusted               INTEGER NOT NULL DEFAULT 0,
    rate_limit_per_second INTEGER,
    rate_limit_per_hour   INTEGER,
    rate_limit_per_day    INTEGER,
    last_seen             REAL,
    account_count         INTEGER NOT NULL DEFAULT 0,
    created_at            REAL NOT NULL DEFAULT 0
);

CREATE TABLE domain_bans (
    domain     TEXT PRIMARY KEY,
    created_at REAL NOT NULL DEFAULT 0
);
