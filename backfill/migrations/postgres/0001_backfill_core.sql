-- Durable backfill window (owner: backfill, numbers 0001-0049).
-- relay_meta holds the seq high-water mark: it survives TRUNCATE events, so seq is never reused.

CREATE TABLE relay_meta (
    key   text PRIMARY KEY,
    value bigint NOT NULL
);
INSERT INTO relay_meta (key, value) VALUES ('seq_high_water', 0), ('events_bytes', 0);

-- One row per sequenced event; frame is the complete wire frame (header + body with seq).
CREATE TABLE events (
    seq   bigint PRIMARY KEY CHECK (seq >= 1 AND seq < 9007199254740992),
    did   text NOT NULL,
    kind  text NOT NULL,
    time  double precision NOT NULL,
    frame bytea NOT NULL
) WITH (toast_tuple_target = 8160);
-- Frames are mostly CAR bytes: compressing them costs CPU and gains nothing (EXTERNAL), and
-- frames up to ~8 KB stay inline in the heap (toast_tuple_target) instead of costing a TOAST
-- table insert plus a TOAST index insert each; replay then reads them sequentially.
ALTER TABLE events ALTER COLUMN frame SET STORAGE EXTERNAL;

CREATE TABLE accounts (
    did             text PRIMARY KEY,
    host            text,
    upstream_status text NOT NULL DEFAULT 'active',
    local_status    text NOT NULL DEFAULT 'active',
    rev             text,
    commit_cid      text,
    data_cid        text,
    sync_state      text NOT NULL DEFAULT 'synced',
    updated_at      double precision NOT NULL DEFAULT 0
) WITH (fillfactor = 70);  -- room for HOT updates: every event rewrites its account row
CREATE INDEX accounts_host_idx ON accounts (host, did);
-- Only accounts that need attention are indexed by state (most are 'synced'), which keeps the
-- per-event state update HOT-eligible and cheap.
CREATE INDEX accounts_sync_state_idx ON accounts (sync_state, did) WHERE sync_state <> 'synced';

CREATE TABLE hosts (
    hostname              text PRIMARY KEY,
    status                text NOT NULL DEFAULT 'active',
    upstream_cursor       bigint NOT NULL DEFAULT 0,
    account_limit         bigint,
    trusted               boolean NOT NULL DEFAULT false,
    rate_limit_per_second integer,
    rate_limit_per_hour   integer,
    rate_limit_per_day    integer,
    last_seen             double precision,
    account_count         bigint NOT NULL DEFAULT 0,
    created_at            double precision NOT NULL DEFAULT 0
);

CREATE TABLE domain_bans (
    domain     text PRIMARY KEY,
    created_at double precision NOT NULL DEFAULT 0
);
