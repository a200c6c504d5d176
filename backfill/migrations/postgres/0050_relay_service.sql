-- Relay service tables (owner: relay, numbers 0050-0069).
-- relay_settings: operator switches that survive restarts (e.g. public crawling on/off).
-- crawl_requests: every public requestCrawl and its outcome (drives the new-hosts-per-day limit).
-- admin_audit: every state-changing admin API call.

CREATE TABLE IF NOT EXISTS relay_settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS crawl_requests (
    id           BIGSERIAL PRIMARY KEY,
    hostname     TEXT NOT NULL,
    result       TEXT NOT NULL,            -- accepted | known | <snake_case rejection reason>
    requested_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS crawl_requests_time_idx ON crawl_requests (requested_at);

CREATE TABLE IF NOT EXISTS admin_audit (
    id     BIGSERIAL PRIMARY KEY,
    time   DOUBLE PRECISION NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'       -- JSON
);
