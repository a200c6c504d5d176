-- Relay service tables (owner: relay, numbers 0050-0069). SQLite dialect.
-- relay_settings: operator switches that survive restarts (e.g. public crawling on/off).
-- crawl_requests: every public requestCrawl and its outcome (drives the new-hosts-per-day limit).
-- admin_audit: every state-changing admin API call.

CREATE TABLE IF NOT EXISTS relay_settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS crawl_requests (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    hostname     TEXT NOT NULL,
    result       TEXT NOT NULL,
    requested_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS crawl_requests_time_idx ON crawl_requests (requested_at);

CREATE TABLE IF NOT EXISTS admin_audit (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    time   REAL NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
