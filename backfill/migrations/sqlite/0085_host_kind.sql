-- Upstream host settings (owner: relay, issue 16). SQLite dialect.
-- is_relay: the host is another relay (added by an operator), not a PDS: it may carry accounts
--           hosted elsewhere (the trust rule is in ARCHITECTURE.md, "Relay upstreams").
-- lenient_sync: judge this host's sync 1.0 commits leniently (1), strictly (0), or as the
--           relay-wide RELAY_LENIENT_SYNC_VALIDATION says (NULL).
ALTER TABLE hosts ADD COLUMN is_relay INTEGER NOT NULL DEFAULT 0;
ALTER TABLE hosts ADD COLUMN lenient_sync INTEGER;
