-- Upstream host settings (owner: relay, issue 16). PostgreSQL dialect.
-- is_relay: the host is another relay (added by an operator), not a PDS: it may carry accounts
--           hosted elsewhere (the trust rule is in ARCHITECTURE.md, "Relay upstreams").
-- lenient_sync: judge this host's sync 1.0 commits leniently (true), strictly (false), or as the
--           relay-wide RELAY_LENIENT_SYNC_VALIDATION says (NULL).
ALTER TABLE hosts ADD COLUMN IF NOT EXISTS is_relay boolean NOT NULL DEFAULT false;
ALTER TABLE hosts ADD COLUMN IF NOT EXISTS lenient_sync boolean;
