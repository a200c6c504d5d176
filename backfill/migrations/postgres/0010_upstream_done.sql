-- Frames done above a host's cursor (owner: backfill, the sequencer). PostgreSQL dialect.
-- A host's upstream_cursor is a watermark: every frame up to it is stored or settled as producing
-- nothing, while frames of other accounts above it may be stored already. For the events that a
-- re-read cannot recognise by their rev (#identity, #account), the sequencer records here, in the
-- event's own transaction, the upstream seq of a frame stored above the cursor it carried; a host
-- run skips these when it reads them again after a restart. Rows at or below the cursor are dead.
CREATE TABLE IF NOT EXISTS upstream_done (
    host text NOT NULL,
    upstream_seq bigint NOT NULL,
    PRIMARY KEY (host, upstream_seq)
);
