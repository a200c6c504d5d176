-- Persisted identities (owner: relay, issue 18): what a DID resolved to, so a restarted relay or
-- a new fan-out replica does not resolve known accounts again. Read through on a cache miss,
-- written behind resolutions (a row lost in a crash only costs a re-resolution).
-- signing_key NULL = purged (an #identity said the document changed, or the DID is gone): a miss.
-- A write lands only if its fetched_at is not older than the row's (see backfill/identities.py).
CREATE TABLE IF NOT EXISTS identities (
    did               TEXT PRIMARY KEY,
    signing_key       TEXT,                        -- did:key:…; NULL = purged
    pds               TEXT,                        -- #atproto_pds endpoint
    handle            TEXT,                        -- first at:// alsoKnownAs, lower case
    handle_verified   BOOLEAN,                     -- NULL = not checked since this document
    handle_checked_at DOUBLE PRECISION,            -- when handle_verified was decided (unix seconds)
    fetched_at        DOUBLE PRECISION NOT NULL    -- when the resolution was sent (or the purge made)
);
