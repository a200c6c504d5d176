-- Persisted identities (owner: relay, issue 18). See migrations/postgres/0090_identities.sql.
CREATE TABLE IF NOT EXISTS identities (
    did               TEXT PRIMARY KEY,
    signing_key       TEXT,
    pds               TEXT,
    handle            TEXT,
    handle_verified   INTEGER,
    handle_checked_at REAL,
    fetched_at        REAL NOT NULL
);
